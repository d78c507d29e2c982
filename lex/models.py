"""Model folders: checking and loading one (or a Hub id) for evaluation and generation, with LEX config
overrides; the config a trained or exported model is saved with."""

from contextlib import contextmanager
from pathlib import Path
from typing import Literal, get_args

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import modeling_lex  # noqa: F401  (registers the Auto classes)

from .data import DataError

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(Dtype)
# Files a tokenizer folder holds; a model folder with none of them (a converted checkpoint) has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def model_config(path: str | Path, what: str, tokenizer: bool = False):
    """The config of the model folder (or Hub id) `path`, or a DataError naming `what` (the flag or argument)
    and the problem: no such folder, a folder without config.json, a config that does not load, and with
    `tokenizer`, a local folder without tokenizer files. Cheap: no weights are read."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise DataError(f"{what} {path}: a file, not a model folder")
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise DataError(f"{what} {path}: not a model folder (it has no config.json)")
    if not folder.exists() and (folder.is_absolute() or str(path).startswith(".") or str(path).count("/") > 1):
        raise DataError(f"{what} {path}: no such model folder")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as error:  # a Hub id that cannot be reached, a broken config.json, a bad field
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{what} {path}: cannot load a model config from it ({first})") from None
    if tokenizer and folder.is_dir() and not has_tokenizer(folder):
        raise DataError(f"{what} {path}: the model folder has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return config


def load_model(path: str, attention_mode: str | None = None, device: str = "cpu", dtype: Dtype = "float32"):
    """A causal LM in eval mode on `device`; `attention_mode` overrides a LEX model's (None: the folder's)."""
    overrides = {"attention_mode": attention_mode} if attention_mode else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **overrides)
    return model.to(device).eval()


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


@contextmanager
def saved_for_generation(config):
    """While a model is saved: `use_cache = True` in its config. The Trainer sets `use_cache` from
    TrainingArguments (False by default) on the model it trains; a folder saved so would generate without a
    cache and refuse assisted decoding. The live model gets its value back afterwards."""
    previous = getattr(config, "use_cache", True)
    config.use_cache = True
    try:
        yield
    finally:
        config.use_cache = previous
