"""Training and fine-tuning LEX models with the HF Trainer, in the shape of run_clm.py (`lex train`'s library).

Model, data and tokenizer arguments follow examples/pytorch/language-modeling/run_clm.py; every
TrainingArguments flag passes through. A Llama, Mistral or Qwen2 --model_name_or_path (a folder or a .gguf file) is
converted in memory with `lex convert-hf`'s arguments and trained, and saved, as a LEX model. LoRA (peft) takes
TRL's flag names (--use_peft, --lora_r, ...); the adapter is saved, or merged into a plain LEX folder
(--merge_adapter). Inputs are checked before anything is written to --output_dir, and the
final model is written by every rank together (`save_full_model`), whatever the parallelism. As in run_clm, an
--output_dir holding checkpoint-* folders resumes from the last complete one (so a preempted job is resumed by
running the same command again), and a non-empty one without checkpoints is refused unless
--overwrite_output_dir. A distributed run ends by destroying its process group after a final barrier.

The finished folder is ready for the Hub: a model card (lex.model_card: the source as base_model, its license,
the reading settings, the run's figures), and for a LoRA adapter trained from a converted checkpoint or a new
model, the model it was trained on saved beside it (OUT/base) and named by adapter_config.json, so that
`AutoPeftModelForCausalLM.from_pretrained(OUT)` loads it offline. --push_to_hub (with --hub_model_id,
--hub_token, --hub_private_repo) uploads that folder once, at the end of training, as run_clm's Trainer.push_to_hub
does (checkpoint-* left out); the Trainer itself is never given the flag, so nothing is pushed while training.
"""

import copy
import logging
import math
import os
import re
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
import transformers
from accelerate.utils import extract_model_from_parallel
from huggingface_hub.errors import StrictDataclassError
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

import modeling_lex  # noqa: F401  (registers the Auto classes)
from configuration_lex import ATTENTION_MODES, SINK_POSITIONS, LexConfig
from convert.hf import RETROFITS, SOURCE_TYPES
from lex_base.staging import atomic_directory, atomic_files, is_staging

from .data import DataError, Packing, load_documents, pack, split_tail, tokenize_documents, train_tokenizer
from .model_card import Origin, gguf_origin, model_card, source_origin, write_card
from .models import has_tokenizer, load_for_training, model_config, saved_for_generation, source_gguf
from .models import load_tokenizer as load_model_tokenizer
from .report import plot_losses

logger = logging.getLogger(__name__)
# The folder beside a LoRA adapter that holds the model it was trained on, when no other folder does.
BASE_FOLDER = "base"
# The figures of a run that its model card reports, where the run measured them.
CARD_FIGURES = ("train_loss", "eval_loss", "perplexity", "epoch", "train_runtime")
# What lex train's upload leaves out of --output_dir, as Trainer.push_to_hub does.
UPLOAD_EXCLUDED = ("checkpoint-*", "_*")
# What LoRA adapts by default: every projection of a Llama-family (and Llama-shaped LEX) layer.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "a LEX folder or Hub id, or a Llama, Mistral or Qwen2 folder or .gguf file (converted to "
                          "LEX in memory, as lex convert-hf does) to fine-tune; omit to train from scratch"},
    )
    attention_mode: str | None = field(
        default=None, metadata={"choices": ATTENTION_MODES, "help": "as lex convert-hf's (default: the model's)"}
    )
    attention_window: int | None = field(default=None, metadata={"help": "as lex convert-hf's"})
    attention_sinks: int | None = field(default=None, metadata={"help": "as lex convert-hf's"})
    attention_sink_positions: str | None = field(
        default=None, metadata={"choices": SINK_POSITIONS, "help": "as lex convert-hf's"}
    )
    position_embedding_type: str | None = field(
        default=None,
        metadata={"choices": RETROFITS, "help": "a converted checkpoint's positions, as lex convert-hf's: rope (its "
                                                "own) or the xpos retrofit"},
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": 'LexConfig fields for a new model, e.g. "hidden_size=256,num_hidden_layers=4"'}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "a tokenizer folder; default: the model's, else a byte-level BPE trained here"}
    )
    vocab_size: int = field(default=8192, metadata={"help": "vocabulary of the BPE trained when there is no tokenizer"})


@dataclass
class DataArguments:
    train_files: str | None = field(default=None, metadata={"help": "comma-separated globs of .txt or .jsonl files"})
    validation_files: str | None = field(default=None, metadata={"help": "globs; default: held-out documents"})
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "a folder written by save_to_disk, a folder or Hub name load_dataset reads; 'text' column"},
    )
    dataset_config_name: str | None = field(default=None)
    block_size: int = field(default=256, metadata={"help": "the training length l (max_position_embeddings)"})
    validation_split_percentage: float = field(
        default=5.0,
        metadata={"help": "percent of the documents held out when there is no validation split; with a single "
                          "document (one .txt), percent of its token stream taken from the end"},
    )
    preprocessing_num_workers: int | None = field(default=None)
    packing: Packing = field(
        default="concatenate",
        metadata={"help": "concatenate (run_clm's blocks) or documents: blocks whose documents do not attend to "
                          "each other (position_ids restart at each document)"},
    )


@dataclass
class PeftArguments:
    """LoRA through peft, with TRL's flag names (trl.ModelConfig)."""

    use_peft: bool = field(default=False, metadata={"help": "train a LoRA adapter instead of every weight"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scale numerator (the update is alpha/r * B A)"})
    lora_dropout: float = field(default=0.05, metadata={"help": "dropout on the LoRA input"})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(LORA_TARGETS), metadata={"help": "module names LoRA adapts"}
    )
    merge_adapter: bool = field(
        default=False,
        metadata={"help": "save the model with the adapter merged into its weights (a plain LEX folder) instead of "
                          "the adapter"},
    )


@dataclass
class OutputArguments:
    """run_clm's --overwrite_output_dir, which TrainingArguments no longer has (transformers 5)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "train into a non-empty --output_dir, ignoring its checkpoint-* folders (default: resume "
                          "from the last checkpoint, refuse a non-empty folder without one)"},
    )


def parse_overrides(text: str | None) -> dict:
    """"a=1,b=x" -> typed values checked against LexConfig's fields and `rope_theta` (unknown keys are named)."""
    if not text:
        return {}
    known = dict(LexConfig.__dataclass_fields__)
    known["rope_theta"] = known["rope_parameters"]  # a keyword LexConfig takes into rope_parameters, as before
    overrides = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise DataError(f"--config_overrides: {item!r} is not key=value")
        if key not in known:
            raise DataError(f"--config_overrides: unknown LexConfig field {key!r}")
        value = value.strip()
        lowered = value.lower()
        if lowered in ("true", "false"):
            overrides[key] = lowered == "true"
        elif lowered in ("none", "null") and known[key].default is None:
            overrides[key] = None
        else:
            try:
                overrides[key] = int(value)
            except ValueError:
                try:
                    overrides[key] = float(value)
                except ValueError:
                    overrides[key] = value
    return overrides


def check_model_arguments(model_args: ModelArguments, block_size: int) -> None:
    """What can be refused from the flags alone, before any data is read."""
    if model_args.model_name_or_path and model_args.config_overrides:
        raise DataError("--config_overrides builds a new model and cannot be combined with --model_name_or_path "
                        "(run_clm refuses the pair too): drop one")
    if block_size < 2:
        raise DataError(f"--block_size must be >= 2, got {block_size}")
    conversion = [name for name, value in conversion_arguments(model_args).items() if value is not None]
    if conversion and not model_args.model_name_or_path:
        raise DataError(f"--{conversion[0]} applies to a --model_name_or_path; a new model takes it in "
                        "--config_overrides")
    if model_args.attention_sinks is not None and model_args.attention_sinks < 0:
        raise DataError(f"--attention_sinks must be >= 0, got {model_args.attention_sinks}")
    if model_args.model_name_or_path:
        model_config(model_args.model_name_or_path, "--model_name_or_path", gguf=True)
    elif block_size % 2 and "attention_window" not in parse_overrides(model_args.config_overrides):
        raise DataError(f"--block_size {block_size} must be even: a new model's attention window is the training "
                        "length, cut into blocks of half of it (or set attention_window in --config_overrides)")


def conversion_arguments(model_args: ModelArguments) -> dict:
    """The arguments of `lex convert-hf` that --model_name_or_path is loaded with (None: the model's own)."""
    names = ("attention_mode", "attention_window", "attention_sinks", "attention_sink_positions",
             "position_embedding_type")
    return {name: getattr(model_args, name) for name in names}


def check_peft_arguments(peft_args: PeftArguments) -> None:
    if not peft_args.use_peft:
        if peft_args.merge_adapter:
            raise DataError("--merge_adapter merges a LoRA adapter: it needs --use_peft")
        return
    if peft_args.lora_r < 1:
        raise DataError(f"--lora_r must be >= 1, got {peft_args.lora_r}")
    if peft_args.lora_alpha <= 0:
        raise DataError(f"--lora_alpha must be > 0, got {peft_args.lora_alpha}")
    if not 0 <= peft_args.lora_dropout < 1:
        raise DataError(f"--lora_dropout must be in [0, 1), got {peft_args.lora_dropout}")


def with_adapter(model, peft_args: PeftArguments):
    """`model` under a new LoRA adapter (peft) on --lora_target_modules, or a DataError naming the modules that
    are not in it and those that are."""
    from peft import LoraConfig, get_peft_model

    names = {name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    missing = [name for name in peft_args.lora_target_modules if name not in names]
    if missing:
        raise DataError(f"--lora_target_modules: {', '.join(missing)} not in the model; its linear modules: "
                        f"{', '.join(sorted(names))}")
    config = LoraConfig(r=peft_args.lora_r, lora_alpha=peft_args.lora_alpha, lora_dropout=peft_args.lora_dropout,
                        target_modules=list(peft_args.lora_target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def build_model(model_args: ModelArguments, block_size: int, tokenizer):
    """Fine-tune a folder or a converted checkpoint, or build a new LexConfig at the training length from the
    overrides."""
    if model_args.model_name_or_path:
        model = load_for_training(model_args.model_name_or_path, **conversion_arguments(model_args))
        log_window(model.config, block_size)
        if len(tokenizer) > model.config.vocab_size:
            model.resize_token_embeddings(len(tokenizer))
        return model
    overrides = parse_overrides(model_args.config_overrides)
    overrides.setdefault("max_position_embeddings", block_size)
    overrides.setdefault("vocab_size", len(tokenizer))
    overrides.setdefault("bos_token_id", tokenizer.bos_token_id)
    overrides.setdefault("eos_token_id", tokenizer.eos_token_id)
    overrides.setdefault("pad_token_id", tokenizer.pad_token_id)
    try:
        config = LexConfig(**overrides)
    except (StrictDataclassError, ValueError) as error:  # a field's type or choice, or a class validator
        raise DataError(f"--config_overrides: {error}") from None
    log_window(config, block_size)
    return AutoModelForCausalLM.from_config(config)


def log_window(config: LexConfig, block_size: int) -> None:
    """Blocks longer than a blockwise or sliding window train the model to read through that window, as it will
    at inference (a window of 1,024 fine-tuned at 2,048 tokens); say so, since each token then sees at most w."""
    if config.attention_mode != "full" and block_size > config.attention_window:
        logger.warning("--block_size %d is longer than the %s attention window %d: every token is trained on at most "
                       "the %d tokens its window shows", block_size, config.attention_mode, config.attention_window,
                       config.attention_window)


def named_tokenizer(source: str, flag: str):
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as error:  # OSError, ValueError, or the tokenizers library's own for a broken tokenizer.json
        raise DataError(f"{flag} {source}: cannot load a tokenizer ({error})") from None


def load_tokenizer(model_args: ModelArguments, documents, checkpoint: str | None = None):
    """The named tokenizer, else that of the checkpoint training resumes from, else the fine-tuned model's, else a
    byte-level BPE trained on the training documents.

    A tokenizer that is there but does not load is an error, never a silent switch to a new BPE; only a model
    folder without any tokenizer file (a converted checkpoint) gets a new one, with a warning.
    """
    if model_args.tokenizer_name:
        return named_tokenizer(model_args.tokenizer_name, "--tokenizer_name")
    if checkpoint and has_tokenizer(checkpoint):
        return named_tokenizer(checkpoint, "the checkpoint")
    source = model_args.model_name_or_path
    if source:
        if source_gguf(source, "--model_name_or_path") is not None:
            return load_model_tokenizer(source, "--model_name_or_path")
        if not Path(source).is_dir() or has_tokenizer(source):
            return named_tokenizer(source, "--model_name_or_path")
        logger.warning(
            "--model_name_or_path %s holds no tokenizer: training a byte-level BPE of %d tokens on the training "
            "documents (the embeddings are resized to it); pass --tokenizer_name to use the model's own",
            source, model_args.vocab_size,
        )
    return train_tokenizer((text for text in documents["train"]["text"]), model_args.vocab_size)


def stages(training_args: TrainingArguments) -> tuple[bool, bool]:
    """(train, evaluate) as run_clm's --do_train/--do_eval; with neither flag `lex train` does both.

    An --eval_strategy other than "no" sets do_eval in TrainingArguments and implies training.
    """
    do_train = training_args.do_train or not training_args.do_eval or training_args.eval_strategy != "no"
    do_eval = training_args.do_eval or not training_args.do_train
    return do_train, do_eval


def check_launch(training_args: TrainingArguments) -> None:
    """Processes started by a launcher must form one group; on CPU they only do with --use_cpu.

    Without it accelerate leaves each process alone: N copies train the same model and overwrite one folder.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > training_args.world_size:
        raise DataError(
            f"{launched} processes were launched but each trains alone (world size {training_args.world_size}); "
            "on a machine without GPUs pass --use_cpu so that they join one gloo process group"
        )


def last_complete_checkpoint(output_dir: str | Path) -> str | None:
    """transformers' get_last_checkpoint, passing over a checkpoint that a kill cut short: the Trainer writes
    trainer_state.json last, so a checkpoint without it is incomplete and the one before it is used."""
    last = get_last_checkpoint(str(output_dir))
    if last is None or (Path(last) / "trainer_state.json").is_file():
        return last
    complete = [p for p in Path(output_dir).iterdir() if re.fullmatch(r"checkpoint-\d+", p.name) and p.is_dir()
                and (p / "trainer_state.json").is_file()]
    logger.warning("%s has no trainer_state.json (the run was killed while saving it): not resuming from it", last)
    return str(max(complete, key=lambda p: int(p.name.split("-")[1]))) if complete else None


def resume_checkpoint(training_args: TrainingArguments, output_args: OutputArguments, do_train: bool) -> str | None:
    """The checkpoint training resumes from, as run_clm decides it; refuses what it would overwrite.

    --resume_from_checkpoint names one; otherwise, when training into an existing --output_dir: its last complete
    checkpoint-*, or, if it has none, an error unless it is empty or --overwrite_output_dir is given. Staging
    folders (lex_base.staging) do not count: they are never part of an output.
    """
    if not do_train:
        return None
    named = training_args.resume_from_checkpoint
    if named:
        if not Path(named).is_dir():
            raise DataError(f"--resume_from_checkpoint {named}: no such checkpoint folder")
        return named
    output_dir = Path(training_args.output_dir)
    if output_args.overwrite_output_dir or not output_dir.is_dir():
        return None
    last = last_complete_checkpoint(output_dir)
    if last is not None:
        return last
    found = sorted(p.name for p in output_dir.iterdir() if not is_staging(p.name))
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise DataError(f"--output_dir {output_dir} is not empty ({shown}) and holds no checkpoint-* to resume "
                        "from; pass --overwrite_output_dir to train into it anyway, or name a new folder")
    return None


def save_full_model(model: torch.nn.Module, output_dir: str | Path, processing_class=None,
                    merge_adapter: bool = False) -> None:
    """Write config, model.safetensors and tokenizer to `output_dir` from a plain, DDP or FSDP2 model.

    Every rank must call it: under FSDP the full state dict is gathered collectively (a rank-0-only save hangs
    on NCCL and dies on gloo), whatever state-dict type the checkpoints used. Rank 0 writes the files into a
    staging folder and moves them in with config.json last, so a crash never leaves a folder that looks
    loadable but holds a partial model. The config says use_cache=True (the Trainer turned it off for training).
    A peft model writes its adapter (adapter_config.json, adapter_model.safetensors: PeftModel.from_pretrained
    reloads it onto its base model), or with `merge_adapter` the base model with the adapter merged into its
    weights, a plain folder (every rank merges its own replica).
    """
    if merge_adapter:
        model = extract_model_from_parallel(model).merge_and_unload()
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        unwrapped = extract_model_from_parallel(model)
        with atomic_files(output_dir) as staging, saved_for_generation(unwrapped.config):
            unwrapped.save_pretrained(staging, state_dict=state_dict)
            if processing_class is not None:
                processing_class.save_pretrained(staging)
    if distributed:
        dist.barrier()


def adapter_base(model_args: ModelArguments, output_dir: str | Path) -> tuple[str, bool]:
    """The base_model_name_or_path a LoRA adapter records, and whether `save_base` must write it: a LEX (or other
    non-converted) folder's absolute path or Hub id as given; for a converted checkpoint or a new model, OUT/base.

    Absolute, because peft opens the path as given, relative to the working directory of whoever loads the
    adapter: `AutoPeftModelForCausalLM.from_pretrained(OUT)` then works from any directory of this machine. Moving
    the folder breaks it (as it would a relative path seen from elsewhere); the card says how to load the base
    then."""
    source = model_args.model_name_or_path
    if source and model_config(source, "--model_name_or_path", gguf=True).model_type not in SOURCE_TYPES:
        return (str(Path(source).resolve()) if Path(source).exists() else source), False
    return str((Path(output_dir) / BASE_FOLDER).resolve()), True


def run_origin(model_args: ModelArguments, how: str, scratch: str) -> Origin:
    """Where the trained weights come from, for the cards: the .gguf file's metadata, the folder or Hub id (`how`
    they were read, e.g. "fine-tuned by lex train"), or nothing (`scratch` says so)."""
    source = model_args.model_name_or_path
    if not source:
        return Origin(description=scratch)
    gguf = source_gguf(source, "--model_name_or_path")
    return gguf_origin(gguf, how) if gguf is not None else source_origin(source, how)


def save_base(model_args: ModelArguments, data_args: DataArguments, tokenizer, seed: int, folder: str) -> None:
    """Write the model a LoRA adapter was trained on into `folder`, with its tokenizer and card: rebuilt as
    `prepare` built it, after the same seed (the conversion of the checkpoint, or a new model's initial weights;
    LoRA leaves them untouched)."""
    set_seed(seed)
    base = build_model(model_args, data_args.block_size, tokenizer)
    card = model_card(base.config, sum(p.numel() for p in base.parameters()), folder,
                      origin=run_origin(model_args, "converted by lex train",
                                        "the initial weights of a model trained from scratch by lex train"),
                      notes="The base model of the LoRA adapter in the folder above it.")
    with atomic_directory(folder, force=True) as staging, saved_for_generation(base.config):
        base.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_card(staging, card)


def run_card(model, model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments,
             peft_args: PeftArguments, metrics: dict, steps: int) -> str:
    """The model card of a training run's --output_dir: the model (or adapter) `model`, its source and what the run
    measured."""
    adapter = peft_args.use_peft and not peft_args.merge_adapter
    name = training_args.hub_model_id if training_args.push_to_hub and training_args.hub_model_id else str(
        training_args.output_dir)
    if adapter:
        trainable, total = model.get_nb_trainable_parameters()
        base = model.peft_config[model.active_adapter].base_model_name_or_path
        notes = (f"LoRA rank {peft_args.lora_r}, alpha {peft_args.lora_alpha}, on "
                 f"{', '.join(peft_args.lora_target_modules)}: {trainable:,} trained parameters. Its base is `{base}` "
                 "(adapter_config.json's base_model_name_or_path, an absolute path so that it loads from any "
                 "directory); where the folder has moved, load that base yourself and put the adapter on it: "
                 "`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), ADAPTER)`.")
        config = model.get_base_model().config
    else:
        total, config = sum(p.numel() for p in model.parameters()), model.config
        notes = ""
    notes = f"Trained on blocks of {data_args.block_size} tokens. {notes}".strip()
    data = data_args.train_files or data_args.dataset_name
    figures = {"steps": steps} | {key: metrics[key] for key in CARD_FIGURES if key in metrics}
    origin = run_origin(model_args, "fine-tuned by lex train", "trained from scratch by lex train")
    return model_card(config, total, name, origin=origin,
                      adapter=adapter, extra_tags=("peft", "lora") if adapter else (), notes=notes, figures=figures,
                      figures_source=f"`lex train` on {data}, where measured: train_loss (the mean over the "
                                     "training steps), eval_loss and perplexity (the held-out validation blocks).")


class CheckpointCards(TrainerCallback):
    """Gives each checkpoint-N folder the run's card so far (peft's save_pretrained writes its blank template
    there); `card(model, steps)` builds it."""

    def __init__(self, card: Callable[[torch.nn.Module, int], str]):
        self.card = card

    def on_save(self, args, state, control, model=None, **kwargs):
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            write_card(folder, self.card(model, state.global_step))


def check_repo_id(repo_id: str) -> None:
    """--push_to_hub's repository (--hub_model_id, else --output_dir's name) is a valid Hub id, checked before
    training rather than after it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise DataError(f"--hub_model_id {repo_id!r} (the repository --push_to_hub uploads to): {error}") from None


def upload(training_args: TrainingArguments) -> str:
    """Upload the finished --output_dir to --hub_model_id (default: the folder's name, in the token's namespace),
    as run_clm's --push_to_hub does at the end of training: one commit, checkpoint-* folders left out."""
    from .export import push_to_hub

    repo_id = training_args.hub_model_id or Path(training_args.output_dir).absolute().name
    return push_to_hub(training_args.output_dir, repo_id, private=bool(training_args.hub_private_repo),
                       token=training_args.hub_token, commit_message="End of training", exclude=UPLOAD_EXCLUDED)


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


def prepare(
    model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments, do_train: bool,
    do_eval: bool, checkpoint: str | None = None, peft_args: PeftArguments | None = None,
):
    """Everything before training, with every input error raised before --output_dir is touched."""
    documents = load_documents(
        data_args.train_files,
        data_args.validation_files,
        data_args.dataset_name,
        data_args.dataset_config_name,
        validation_fraction=data_args.validation_split_percentage / 100,
        seed=training_args.seed,
    )
    tokenizer = load_tokenizer(model_args, documents, checkpoint)
    model = build_model(model_args, data_args.block_size, tokenizer)
    if peft_args is not None and peft_args.use_peft:
        model = with_adapter(model, peft_args)
    workers = data_args.preprocessing_num_workers
    with training_args.main_process_first(desc="tokenize and pack"):
        tokenized = {split: tokenize_documents(documents[split], tokenizer, workers) for split in documents}
        if "validation" not in tokenized:
            tokenized = split_tail(tokenized["train"], data_args.validation_split_percentage / 100)
        blocks = {split: pack(tokenized[split], data_args.block_size, workers, data_args.packing) for split in tokenized}
    needed = [split for split, wanted in (("train", do_train), ("validation", do_eval)) if wanted]
    for split in needed:
        if len(blocks[split]) == 0:
            raise DataError(
                f"the {split} documents hold fewer tokens than one block of --block_size {data_args.block_size}"
            )
    return model, tokenizer, blocks


def check_arguments(model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments,
                    output_args: OutputArguments | None = None, peft_args: PeftArguments | None = None) -> str | None:
    """Every refusal that the arguments alone decide, in a moment, before any data is read; returns the
    checkpoint training will resume from (`resume_checkpoint`)."""
    check_launch(training_args)
    check_model_arguments(model_args, data_args.block_size)
    check_peft_arguments(peft_args or PeftArguments())
    if not 0 < data_args.validation_split_percentage < 100:
        raise DataError(f"--validation_split_percentage must be between 0 and 100, got "
                        f"{data_args.validation_split_percentage:g}")
    if training_args.push_to_hub:
        check_repo_id(training_args.hub_model_id or Path(training_args.output_dir).absolute().name)
    return resume_checkpoint(training_args, output_args or OutputArguments(), stages(training_args)[0])


def train(model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments,
          output_args: OutputArguments | None = None, peft_args: PeftArguments | None = None) -> dict:
    """Train and/or evaluate; a training run leaves a complete folder: model (or LoRA adapter), tokenizer, state,
    metrics, curve.

    Resumes from the last checkpoint in --output_dir (see `resume_checkpoint`).
    """
    peft_args = peft_args or PeftArguments()
    do_train, do_eval = stages(training_args)
    checkpoint = check_arguments(model_args, data_args, training_args, output_args, peft_args)
    if checkpoint and not training_args.resume_from_checkpoint:
        logger.warning("resuming from %s, the last checkpoint in --output_dir (pass --overwrite_output_dir to start "
                       "again)", checkpoint)
    set_seed(training_args.seed)
    model, tokenizer, blocks = prepare(model_args, data_args, training_args, do_train, do_eval, checkpoint,
                                       peft_args)
    adapter = peft_args.use_peft and not peft_args.merge_adapter
    base, rebuilt = adapter_base(model_args, training_args.output_dir) if adapter else (None, False)
    if adapter:  # named by the checkpoints' adapters as by the final one
        model.peft_config[model.active_adapter].base_model_name_or_path = base
    trainer_args = copy.copy(training_args)
    trainer_args.push_to_hub = False  # the finished folder is uploaded once, at the end (`upload`)
    trainer = Trainer(
        model=model,
        args=trainer_args,
        train_dataset=blocks["train"] if do_train else None,
        eval_dataset=blocks["validation"] if do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=[CheckpointCards(lambda trained, steps: run_card(trained, model_args, data_args, training_args,
                                                                   peft_args, {}, steps))],
    )
    metrics = {}
    if do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint)
        if rebuilt and trainer.is_world_process_zero():
            save_base(model_args, data_args, tokenizer, training_args.seed, base)
        save_full_model(trainer.model_wrapped, training_args.output_dir, tokenizer, peft_args.merge_adapter)
        metrics.update(result.metrics)
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
        if trainer.is_world_process_zero():
            plot_losses({"train": trainer.state.log_history}, Path(training_args.output_dir) / "loss_curve.png")
    if do_eval:
        evaluation = trainer.evaluate()
        evaluation["perplexity"] = perplexity(evaluation["eval_loss"])
        metrics.update(evaluation)
        trainer.log_metrics("eval", evaluation)
        trainer.save_metrics("eval", evaluation)
    if do_train and trainer.is_world_process_zero():
        card = run_card(trainer.model, model_args, data_args, training_args, peft_args, metrics,
                        trainer.state.global_step)
        with atomic_files(training_args.output_dir) as staging:
            write_card(staging, card)  # over the blank template peft's save_pretrained writes
        if training_args.push_to_hub:
            logger.warning(upload(training_args))
    if trainer.accelerator.num_processes > 1:
        # Every process reaches this line before any leaves, then the process group is destroyed: a process that
        # exits with its gloo/NCCL threads still alive may abort in their destructors (SIGABRT, "terminate
        # called without an active exception"), and the launcher then fails the whole run.
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.end_training()
        logger.info("all %d processes finished; the process group is destroyed (distributed: %s)",
                    trainer.accelerator.num_processes, dist.is_initialized())
    return metrics


@contextmanager
def process_log_levels(training_args: TrainingArguments):
    """run_clm's logging: --log_level on the main process, --log_level_replica on the others; restored after,
    since `lex train` also runs inside other Python programs (notebooks, tests)."""
    saved = transformers.utils.logging.get_verbosity(), datasets.utils.logging.get_verbosity(), logger.level
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()  # the default --log_level "passive" keeps this
    level = training_args.get_process_log_level()
    logger.setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning(
        "Process rank: %d of world size %d, device: %s, bf16: %s, fp16: %s",
        training_args.process_index, training_args.world_size, training_args.device, training_args.bf16,
        training_args.fp16,
    )
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(saved[0])
        transformers.utils.logging.reset_format()
        datasets.utils.logging.set_verbosity(saved[1])
        logger.setLevel(saved[2])
