"""LexConfig, registered with AutoConfig under model_type "lex", and the allowed values of its choice fields.

Importing it (and so modeling_lex) with a torch below OLDEST_TORCH fails at once with one line naming the range:
transformers 5.23-5.25 turn PyTorch off below 2.6 (`utils/import_utils.py`), and the model classes would then fail
deep inside transformers instead.
"""

import torch
from packaging.version import Version

OLDEST_TORCH = "2.6"  # setup.cfg's floor (tests/test_transformers_range.py keeps the two equal)
if Version(torch.__version__).release < Version(OLDEST_TORCH).release:
    raise ImportError(f"lex-transformer needs torch>={OLDEST_TORCH} (transformers 5.23-5.25 turn PyTorch off below "
                      f"it); torch {torch.__version__} is installed: pip install 'torch>={OLDEST_TORCH}'")

from transformers import AutoConfig  # after the check: transformers would turn an older torch off silently

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
    WINDOW_RULE,
    LexConfig,
    is_window,
)

AutoConfig.register("lex", LexConfig, exist_ok=True)

__all__ = [
    "ABSOLUTE_POSITION_EMBEDDINGS", "ATTENTION_MODES", "HF_MODEL_TYPES", "HIDDEN_ACTS", "MLP_TYPES", "NORM_TYPES",
    "OLDEST_TORCH", "POSITION_EMBEDDING_TYPES", "ROPE_TYPES", "SINK_POSITIONS", "WINDOW_RULE", "LexConfig",
    "is_window",
]
