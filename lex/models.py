"""Model folders: checking and loading one (or a Hub id) for evaluation and generation, with attention
overrides; the config a trained or exported model is saved with.

Three kinds of causal LM take part: a LEX model (any attention mode, window and sinks, set on its config), a
Llama, Mistral or Qwen2 checkpoint (as published, or converted in memory to a LEX model for another attention
mode: convert.hf.lex_from_hf), and any other causal LM (as published only). A Llama, Mistral or Qwen2 checkpoint
may also be a `.gguf` file, or a folder holding exactly one: model_config, load_model and load_tokenizer read it
through transformers' GGUF loader (convert.hf.gguf_file), dequantized, with the tokenizer it carries.

Every loader takes the block memory past the window (`attention_memory_blocks` k, `attention_memory_block_size`
b) as it takes the other attention fields: over a LEX folder's config, or converted in memory for a Llama-family
checkpoint (k > 0 asks for the conversion). It applies to blockwise and sliding modes; with full attention it is
refused, naming attention_memory_blocks.
"""

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, get_args

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.distributed import DistributedConfig

import modeling_lex  # noqa: F401  (registers the Auto classes)
from convert.checkpoint import ConversionError
from convert.hf import SOURCE_TYPES, gguf_config, gguf_file, gguf_tokenizer, lex_from_hf, load_gguf
from lex_base.errors import LexError

from .quantization import QuantizationError, for_cpu, stored_kind
from .quantization import quantize as quantize_weights

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(Dtype)
# Files a tokenizer folder holds; a model folder with none of them (a converted checkpoint) has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class ModelError(LexError):
    """A model a command cannot load, or cannot read as asked: a folder that is no model (or has no tokenizer where
    one is needed), reading flags or a tensor-parallel plan its checkpoint cannot take; raised before any weight
    is loaded or anything written."""


def reading_settings(config) -> str:
    """How a model reads, in the one phrase every command prints: a LEX config's attention mode, window, sinks
    (with their position rule) and block memory; any other config as published."""
    if config.model_type != "lex":
        return f"{config.model_type} as published (full attention)"
    text = f"{config.attention_mode} attention, window {config.attention_window}"
    if config.attention_mode != "full" and config.attention_sinks:
        text += f", {config.attention_sinks} attention sinks at {config.attention_sink_positions} positions"
    if config.attention_memory_blocks:
        text += (f", a memory of {config.attention_memory_blocks} blocks of {config.attention_memory_block_size} "
                 "tokens")
    return text


def model_config(path: str | Path, what: str, tokenizer: bool = False, gguf: bool = False):
    """The config of the model folder (or Hub id) `path`, or a ModelError naming `what` (the flag or argument)
    and the problem: no such folder, a folder without config.json, a config that does not load, and with
    `tokenizer`, a local folder without tokenizer files. With `gguf`, a .gguf file (or a folder of one) gives the
    config it holds, once its architecture is checked. Cheap: no weights are read."""
    source = source_gguf(path, what) if gguf else None
    if source is not None:
        try:
            return gguf_config(source)
        except ConversionError as error:
            raise ModelError(f"{what} {error}") from None
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ModelError(f"{what} {path}: a file, not a model folder{' nor a .gguf file' if gguf else ''}")
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise ModelError(f"{what} {path}: not a model folder (it has no config.json)"
                        f"{' and holds no .gguf file' if gguf else ''}")
    if not folder.exists() and (folder.is_absolute() or str(path).startswith(".") or str(path).count("/") > 1):
        raise ModelError(f"{what} {path}: no such model folder")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as error:  # a Hub id that cannot be reached, a broken config.json, a bad field
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelError(f"{what} {path}: cannot load a model config from it ({first})") from None
    if tokenizer and folder.is_dir() and not has_tokenizer(folder):
        raise ModelError(f"{what} {path}: the model folder has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return config


def source_gguf(path: str | Path, what: str = "MODEL") -> Path | None:
    """The .gguf file `path` names (itself, or a folder's one), None for a model folder or Hub id; a folder with
    several .gguf files is a ModelError naming them."""
    try:
        return gguf_file(path)
    except ConversionError as error:
        raise ModelError(f"{what} {error}") from None


def load_tokenizer(path: str | Path, what: str = "MODEL"):
    """The tokenizer of a model folder, Hub id or .gguf file (`what`: the flag or argument named in errors)."""
    gguf = source_gguf(path, what)
    if gguf is None:
        return AutoTokenizer.from_pretrained(str(path))
    try:
        return gguf_tokenizer(gguf)
    except ConversionError as error:
        raise ModelError(f"{what} {error}") from None


def attention_modes(config, modes: list[str]) -> tuple[list[str], str | None]:
    """The attention modes of `modes` that a model of `config` can be run in, and a line saying which do not
    apply and why (None when all do): a LEX or Llama-family model takes every mode, another causal LM only its
    own full attention."""
    if config.model_type == "lex" or config.model_type in SOURCE_TYPES:
        return list(modes), None
    kept, dropped = [m for m in modes if m == "full"], [m for m in modes if m != "full"]
    if not dropped:
        return kept, None
    return kept, (f"a {config.model_type!r} model is scored as published (full attention); "
                  f"{', '.join(dropped)} do not apply: only LEX models and {', '.join(SOURCE_TYPES)} checkpoints "
                  "(converted in memory) take an attention mode")


def load_model(
    path: str, attention_mode: str | None = None, device: str = "cpu", dtype: Dtype | None = None,
    attention_window: int | None = None, attention_sinks: int | None = None,
    attention_sink_positions: str | None = None, attention_memory_blocks: int | None = None,
    attention_memory_block_size: int | None = None, quantize: str | None = None, tp_plan: str | None = None,
):
    """A causal LM in eval mode on `device`, with `quantize` weights (lex.quantization: "int8" or "int4",
    converted in memory) where asked; a folder saved quantized loads so, in the CPU kernels' layouts. `dtype`
    (None: float32) is the weights' and the activations' dtype (quantized Linears multiply in bfloat16, which
    the CPU kernels read fastest). For a LEX folder the arguments override its config (None: the
    folder's). A Llama, Mistral or Qwen2 folder loads as published unless a windowed mode, a window or sinks
    (or a block memory) are asked for: then it is converted in memory (`convert.hf.lex_from_hf`, no second copy of the weights; its
    sinks within the cache unless `attention_sink_positions` says otherwise). Another causal LM loads as
    published and refuses the overrides. A .gguf file loads dequantized to `dtype`.

    `tp_plan` ("auto"): sharded over the processes torchrun started (tensor parallel, transformers'
    `from_pretrained(..., tp_plan=...)`): a LEX folder, or a checkpoint as published; one converted in memory or a
    .gguf file is refused (convert it with `lex convert-hf` first), and so are heads that do not divide by the
    number of processes."""
    attention = dict(attention_mode=attention_mode, attention_window=attention_window,
                     attention_sinks=attention_sinks, attention_sink_positions=attention_sink_positions,
                     attention_memory_blocks=attention_memory_blocks,
                     attention_memory_block_size=attention_memory_block_size)
    gguf = source_gguf(path)
    try:
        stored = None if gguf is not None or not Path(path).is_dir() else stored_kind(path)
    except QuantizationError as error:
        raise ModelError(f"MODEL {error}") from None
    dtype = dtype or "float32"
    if tp_plan is not None:
        check_shardable(path, gguf, attention)
    if gguf is not None:
        try:
            model = load_gguf(gguf, getattr(torch, dtype))
        except ConversionError as error:
            raise ModelError(f"MODEL {error}") from None
        return quantized(with_attention(model.to(device).eval(), **attention, name=str(path)), quantize, dtype)
    config = model_config(path, "MODEL")
    if config.model_type == "lex":
        overrides = {k: v for k, v in attention.items() if v is not None}
        try:  # from_pretrained sets overrides after the config is built: validate them as construction would
            config = AutoConfig.from_pretrained(path, **overrides)
            config.validate()
        except (StrictDataclassError, ValueError) as error:
            raise ModelError(" ".join(str(error).split())) from None
        if stored is not None and quantize not in (None, stored):
            raise ModelError(f"--quantize {quantize}: MODEL {path} is saved with {stored} weights (allowed: "
                            f"{stored}, or no --quantize)")
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=getattr(torch, dtype),
                                                     **sharded(tp_plan))
        if tp_plan is not None:  # (placed on each rank's device by transformers)
            return model.eval()
        if stored is not None:
            return for_cpu(model.to(device).eval(), stored)
        return quantized(model.to(device).eval(), quantize, dtype)
    if tp_plan is not None:  # as published: transformers' own plan for its family
        return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **sharded(tp_plan)).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    return quantized(with_attention(model, **attention, name=str(path)), quantize, dtype)


def sharded(tp_plan: str | None) -> dict:
    """from_pretrained's arguments for `tp_plan` (transformers' DistributedConfig), none without one."""
    return {} if tp_plan is None else {"distributed_config": DistributedConfig(tp_plan=tp_plan)}


def check_shardable(path: str, gguf, attention: dict) -> None:
    """What tensor parallel (--tp_plan) cannot take, refused by name before anything loads: a .gguf file, a
    checkpoint converted in memory, and heads that do not divide by the number of processes (WORLD_SIZE)."""
    if gguf is not None:
        raise ModelError(f"--tp_plan with MODEL {path}, a .gguf file: it is dequantized whole in one process; convert "
                        "it with `lex convert-hf` and shard the folder (allowed: a LEX folder, or a checkpoint folder "
                        "as published)")
    config = model_config(path, "MODEL")
    asked = {key: value for key, value in attention.items() if value is not None}
    if config.model_type != "lex" and asked:
        raise ModelError(f"--tp_plan with a {config.model_type} checkpoint converted in memory "
                        f"(--{next(iter(asked))}): convert it once with `lex convert-hf` and shard the LEX folder "
                        "(allowed: a LEX folder, or the checkpoint as published)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    if heads % world or kv_heads % world:
        allowed = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise ModelError(f"--tp_plan over {world} processes: MODEL {path} has {heads} query and {kv_heads} key/value "
                        f"heads, which {world} does not divide (allowed numbers of processes: "
                        f"{', '.join(map(str, allowed))})")


def quantized(model, kind: str | None, dtype: Dtype | None = None):
    """`model` with `kind` weights (lex.quantization) computing in `dtype` (None: float32), or as it is for
    None."""
    if kind is None:
        return model
    try:
        return quantize_weights(model, kind, getattr(torch, dtype or "float32"))
    except QuantizationError as error:
        raise ModelError(f"--quantize {kind}: {error}") from None


def with_attention(model, attention_mode: str | None = None, attention_window: int | None = None,
                   attention_sinks: int | None = None, attention_sink_positions: str | None = None,
                   name: str = "MODEL", attention_memory_blocks: int | None = None,
                   attention_memory_block_size: int | None = None):
    """A loaded non-LEX causal LM as published (no override, or plain full attention), or a Llama-family one
    converted in memory to a LEX model in `attention_mode` with `attention_window` and `attention_sinks` (seen
    from `attention_sink_positions`, by default within the cache) and a block memory of
    `attention_memory_blocks` blocks of `attention_memory_block_size` tokens (None: LexConfig's default)."""
    if attention_memory_blocks and attention_mode == "full":
        raise ModelError(f"{name}: attention_memory_blocks={attention_memory_blocks} with attention_mode 'full': full "
                        "attention sees every key, a memory of evicted ones has nothing to add (allowed: "
                        "attention_mode blockwise or sliding, or attention_memory_blocks 0)")
    if (attention_mode in (None, "full") and attention_window is None and not attention_sinks
            and not attention_memory_blocks):
        return model
    if model.config.model_type not in SOURCE_TYPES:
        raise ModelError(f"{name}: a {model.config.model_type!r} model runs as published; attention_mode, "
                        f"attention_window, attention_sinks and attention_memory_blocks apply to LEX models and to "
                        f"{', '.join(SOURCE_TYPES)} checkpoints (converted in memory)")
    try:
        return lex_from_hf(model, attention_mode, attention_window, attention_sinks or 0,
                           attention_sink_positions or "cache", attention_memory_blocks=attention_memory_blocks or 0,
                           attention_memory_block_size=attention_memory_block_size).eval()
    except ConversionError as error:
        raise ModelError(f"{name}: {error}") from None


def load_for_training(
    path: str, attention_mode: str | None = None, attention_window: int | None = None,
    attention_sinks: int | None = None, attention_sink_positions: str | None = None,
    position_embedding_type: str | None = None, attention_memory_blocks: int | None = None,
    attention_memory_block_size: int | None = None,
):
    """The model `lex train` fine-tunes, in float32: a Llama, Mistral or Qwen2 folder or .gguf file always as a LEX
    model, converted in memory as `lex convert-hf` converts it (`convert.hf.lex_from_hf`, the same arguments; its
    sinks within the cache unless `attention_sink_positions` says otherwise); a LEX folder with the attention
    arguments over its config, and any other causal LM as published (`load_model`). `position_embedding_type`
    ("rope" or the "xpos" retrofit) applies to a checkpoint being converted only."""
    config = model_config(path, "--model_name_or_path", gguf=True)
    if config.model_type not in SOURCE_TYPES:
        if position_embedding_type is not None:
            raise ModelError(f"--position_embedding_type {position_embedding_type}: it converts a "
                            f"{', '.join(SOURCE_TYPES)} checkpoint; --model_name_or_path {path} is a "
                            f"{config.model_type!r} model, which keeps its own positions")
        return load_model(path, attention_mode, attention_window=attention_window, attention_sinks=attention_sinks,
                          attention_sink_positions=attention_sink_positions,
                          attention_memory_blocks=attention_memory_blocks,
                          attention_memory_block_size=attention_memory_block_size)
    gguf = source_gguf(path, "--model_name_or_path")
    try:
        source = (load_gguf(gguf) if gguf is not None
                  else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
        return lex_from_hf(source, attention_mode, attention_window, attention_sinks or 0,
                           attention_sink_positions or "cache", position_embedding_type or "rope",
                           attention_memory_blocks or 0, attention_memory_block_size)
    except ConversionError as error:
        raise ModelError(f"--model_name_or_path {path}: {error}") from None


def attention_variants(
    path: str, modes: list[str], sinks: list[int], device: str = "cpu", dtype: Dtype | None = None,
    attention_window: int | None = None, sink_positions: list[str] | None = None,
    memory_blocks: list[int] | None = None, memory_block_size: int | None = None, quantize: str | None = None,
    tp_plan: str | None = None,
) -> Iterator[tuple[dict, torch.nn.Module]]:
    """(labels, model) for each mode of `modes` with each of `sinks` and, where a reading has sinks, each rule of
    `sink_positions` (None: the model's own), and each of `memory_blocks` (None: the model's own memory, unlabelled)
    with `memory_block_size` (None: the model's own); one model alive at a time. The labels are the reading's
    attention_mode and attention_sinks, attention_sink_positions where a rule was asked for, and with
    `memory_blocks`, attention_memory_blocks (and attention_memory_block_size, the model's, where it is > 0). Full
    attention comes once (sinks change nothing there; without memory), and a non-LEX, non-Llama-family model in
    full attention only (`attention_modes` says so). A Llama-family folder (or .gguf file) is read once and
    converted per reading; with `quantize`, each reading's model gets its own quantized copy of the weights
    (labelled `quantize`). With `tp_plan`, each model is sharded over torchrun's processes (`load_model`)."""
    config = model_config(path, "MODEL", gguf=True)
    modes, _ = attention_modes(config, modes)
    readings = []
    for mode in modes:
        memories = [None] if memory_blocks is None else [0] if mode == "full" else memory_blocks
        for s in sinks if mode != "full" else [0]:
            rules = sink_positions if s and sink_positions else [None]
            readings += [{"attention_mode": mode, "attention_sinks": s}
                         | ({"attention_sink_positions": rule} if rule else {})
                         | ({"attention_memory_blocks": k} if k is not None else {})
                         for rule in rules for k in memories]
    if tp_plan is not None and config.model_type != "lex" and modes != ["full"]:
        check_shardable(path, None, {"attention_mode": "/".join(modes)})  # (refused: converted in memory)
    source = None if config.model_type == "lex" else load_model(path, None, device, dtype, tp_plan=tp_plan)
    for labels in readings:
        size = memory_block_size if labels.get("attention_memory_blocks") else None
        if source is None:  # (full attention: without the folder's memory, if it has one)
            memory = {"attention_memory_blocks": 0} if labels["attention_mode"] == "full" else {}
            model = load_model(path, device=device, dtype=dtype, attention_window=attention_window,
                               attention_memory_block_size=size, quantize=quantize, tp_plan=tp_plan,
                               **memory | labels)
        else:
            window = None if labels["attention_mode"] == "full" else attention_window
            model = with_attention(source, attention_window=window, **labels, name=str(path),
                                   attention_memory_block_size=size)
            if quantize is not None:  # (the reading shares the source's tensors: quantize a copy)
                model = quantized(copy.deepcopy(model), quantize, dtype)
        if quantize is not None:
            labels = {**labels, "quantize": quantize}
        memory = getattr(model.config, "attention_memory_blocks", 0)
        if memory_blocks is not None and memory:
            labels = {**labels, "attention_memory_block_size": model.config.attention_memory_block_size}
        yield labels, model


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
