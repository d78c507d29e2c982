"""LexConfig, registered with AutoConfig under model_type "lex", and the allowed values of its choice fields."""

from transformers import AutoConfig

from .configuration_lex import (
    ABSOLUTE_POSITION_EMBEDDINGS,
    ATTENTION_MODES,
    HF_MODEL_TYPES,
    HIDDEN_ACTS,
    MLP_TYPES,
    NORM_TYPES,
    POSITION_EMBEDDING_TYPES,
    ROPE_TYPES,
    SINK_POSITIONS,
    LexConfig,
)

AutoConfig.register("lex", LexConfig, exist_ok=True)

__all__ = [
    "ABSOLUTE_POSITION_EMBEDDINGS", "ATTENTION_MODES", "HF_MODEL_TYPES", "HIDDEN_ACTS", "MLP_TYPES", "NORM_TYPES",
    "POSITION_EMBEDDING_TYPES", "ROPE_TYPES", "SINK_POSITIONS", "LexConfig",
]
