"""LexConfig, registered with AutoConfig under model_type "lex"."""

from transformers import AutoConfig

from .configuration_lex import LexConfig

AutoConfig.register("lex", LexConfig, exist_ok=True)

__all__ = ["LexConfig"]
