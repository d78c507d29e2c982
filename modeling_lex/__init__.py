"""LEX Transformer models, registered with AutoModel and AutoModelForCausalLM on import."""

import configuration_lex  # noqa: F401  (registers AutoConfig "lex")

from .cache import LexCache, LexRows, LexStaticCache
from .modeling_lex import LexForCausalLM, LexModel, LexPreTrainedModel

__all__ = ["LexCache", "LexForCausalLM", "LexRows", "LexModel", "LexPreTrainedModel", "LexStaticCache"]
