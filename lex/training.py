"""Training and fine-tuning LEX models with the HF Trainer, in the shape of run_clm.py (`lex train`'s library).

Model, data and tokenizer arguments follow examples/pytorch/language-modeling/run_clm.py; every
TrainingArguments flag passes through. Inputs are checked before anything is written to --output_dir, and the
final model is written by every rank together (`save_full_model`), whatever the parallelism.
"""

import logging
import math
import os
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
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import modeling_lex  # noqa: F401  (registers the Auto classes)
from configuration_lex import LexConfig
from convert.staging import atomic_files

from .data import DataError, load_documents, pack, split_tail, tokenize_documents, train_tokenizer
from .models import has_tokenizer
from .report import plot_losses

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "a LEX folder or Hub id to fine-tune; omit to train from scratch"}
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
    packing: str = field(
        default="concatenate",
        metadata={"help": "concatenate (run_clm's blocks) or documents: blocks whose documents do not attend to "
                          "each other (position_ids restart at each document)"},
    )


def parse_overrides(text: str | None) -> dict:
    """"a=1,b=x" -> typed values checked against LexConfig's fields (unknown keys are named)."""
    if not text:
        return {}
    known = LexConfig.__dataclass_fields__
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


def build_model(model_args: ModelArguments, block_size: int, tokenizer):
    """Fine-tune a folder, or build a new LexConfig at the training length from the overrides."""
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
        window = getattr(config, "attention_window", None) or config.max_position_embeddings
        if block_size > window:
            raise DataError(
                f"--block_size {block_size} exceeds the model's attention_window {window}: training beyond the "
                "window would silently drop context; pass a smaller --block_size"
            )
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
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
    except StrictDataclassError as error:
        raise DataError(f"--config_overrides: {error}") from None
    if block_size > config.attention_window:
        raise DataError(f"--block_size {block_size} exceeds attention_window {config.attention_window}")
    return AutoModelForCausalLM.from_config(config)


def named_tokenizer(source: str, flag: str):
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as error:  # OSError, ValueError, or the tokenizers library's own for a broken tokenizer.json
        raise DataError(f"{flag} {source}: cannot load a tokenizer ({error})") from None


def load_tokenizer(model_args: ModelArguments, documents):
    """The named tokenizer, else the fine-tuned model's, else a byte-level BPE trained on the training documents.

    A tokenizer that is there but does not load is an error, never a silent switch to a new BPE; only a model
    folder without any tokenizer file (a converted checkpoint) gets a new one, with a warning.
    """
    if model_args.tokenizer_name:
        return named_tokenizer(model_args.tokenizer_name, "--tokenizer_name")
    source = model_args.model_name_or_path
    if source:
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


def save_full_model(model: torch.nn.Module, output_dir: str | Path, processing_class=None) -> None:
    """Write config, model.safetensors and tokenizer to `output_dir` from a plain, DDP or FSDP2 model.

    Every rank must call it: under FSDP the full state dict is gathered collectively (a rank-0-only save hangs
    on NCCL and dies on gloo), whatever state-dict type the checkpoints used. Rank 0 writes the files into a
    staging folder and moves them in with config.json last, so a crash never leaves a folder that looks
    loadable but holds a partial model.
    """
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        with atomic_files(output_dir) as staging:
            extract_model_from_parallel(model).save_pretrained(staging, state_dict=state_dict)
            if processing_class is not None:
                processing_class.save_pretrained(staging)
    if distributed:
        dist.barrier()


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


def prepare(
    model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments, do_train: bool,
    do_eval: bool,
):
    """Everything before training, with every input error raised before --output_dir is touched."""
    check_launch(training_args)
    if data_args.block_size < 2:
        raise DataError(f"--block_size must be >= 2, got {data_args.block_size}")
    documents = load_documents(
        data_args.train_files,
        data_args.validation_files,
        data_args.dataset_name,
        data_args.dataset_config_name,
        validation_fraction=data_args.validation_split_percentage / 100,
        seed=training_args.seed,
    )
    tokenizer = load_tokenizer(model_args, documents)
    model = build_model(model_args, data_args.block_size, tokenizer)
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


def train(model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments) -> dict:
    """Train and/or evaluate; a training run leaves a complete folder: model, tokenizer, state, metrics, curve."""
    do_train, do_eval = stages(training_args)
    set_seed(training_args.seed)
    model, tokenizer, blocks = prepare(model_args, data_args, training_args, do_train, do_eval)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=blocks["train"] if do_train else None,
        eval_dataset=blocks["validation"] if do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    metrics = {}
    if do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        save_full_model(trainer.model_wrapped, training_args.output_dir, tokenizer)
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
