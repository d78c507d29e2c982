"""Model folders: loading one (or a Hub id) for evaluation and generation, with LEX config overrides."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import modeling_lex  # noqa: F401  (registers the Auto classes)

DTYPES = ("float32", "bfloat16", "float16")
# Files a tokenizer folder holds; a model folder with none of them (a converted checkpoint) has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_model(path: str, attention_mode: str | None = None, device: str = "cpu", dtype: str = "float32"):
    """A causal LM in eval mode on `device`; `attention_mode` overrides a LEX model's (None: the folder's)."""
    overrides = {"attention_mode": attention_mode} if attention_mode else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **overrides)
    return model.to(device).eval()


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)
