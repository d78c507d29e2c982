"""`lex train`: train or fine-tune a LEX model with the HF Trainer, in the shape of run_clm.py.

    lex train --output_dir runs/kjv --config_overrides "hidden_size=256,num_hidden_layers=4" --block_size 256
    accelerate launch --cpu --num_processes 2 -m lex.cli train ...      # DDP, same arguments

Model, data and tokenizer arguments follow examples/pytorch/language-modeling/run_clm.py; every
TrainingArguments flag passes through. Inputs are checked before anything is written to --output_dir.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import modeling_lex  # noqa: F401  (registers the Auto classes)
from configuration_lex import LexConfig

from .data import DataError, load_documents, pack, tokenize_documents, train_tokenizer


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
    dataset_name: str | None = field(default=None, metadata={"help": "a datasets Hub name (needs Hub access)"})
    dataset_config_name: str | None = field(default=None)
    block_size: int = field(default=256, metadata={"help": "the training length l (max_position_embeddings)"})
    validation_split_percentage: float = field(default=5.0, metadata={"help": "documents held out when no validation files"})
    preprocessing_num_workers: int | None = field(default=None)


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
        elif lowered in ("none", "null"):
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
    config = LexConfig(**overrides)
    if block_size > config.attention_window:
        raise DataError(f"--block_size {block_size} exceeds attention_window {config.attention_window}")
    return AutoModelForCausalLM.from_config(config)


def load_tokenizer(model_args: ModelArguments, documents):
    source = model_args.tokenizer_name or model_args.model_name_or_path
    if source:
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):  # a model folder without tokenizer files (e.g. a converted checkpoint)
            if model_args.tokenizer_name:
                raise
    return train_tokenizer((text for text in documents["train"]["text"]), model_args.vocab_size)


def plot_loss(log_history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e]
    evaluation = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if evaluation:
        ax.plot(*zip(*evaluation), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def prepare(model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments):
    """Everything before training, with every input error raised before --output_dir is touched."""
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
    with training_args.main_process_first(desc="tokenize and pack"):
        blocks = {
            split: pack(tokenize_documents(documents[split], tokenizer, data_args.preprocessing_num_workers),
                        data_args.block_size, data_args.preprocessing_num_workers)
            for split in documents
        }
    for split, dataset in blocks.items():
        if len(dataset) == 0:
            raise DataError(
                f"the {split} documents hold fewer tokens than one block of --block_size {data_args.block_size}"
            )
    return model, tokenizer, blocks


def train(model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments) -> dict:
    """Train, evaluate, and leave a complete folder: model, tokenizer, trainer_state, metrics, loss curve."""
    set_seed(training_args.seed)
    model, tokenizer, blocks = prepare(model_args, data_args, training_args)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=blocks["train"],
        eval_dataset=blocks["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = dict(result.metrics)
    metrics.update(trainer.evaluate())
    if trainer.is_world_process_zero():
        trainer.save_model()
        trainer.save_state()
        trainer.log_metrics("all", metrics)
        trainer.save_metrics("all", metrics)
        plot_loss(trainer.state.log_history, Path(training_args.output_dir) / "loss_curve.png")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 1 and args[0].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=args[0])
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=args)
    try:
        metrics = train(model_args, data_args, training_args)
    except DataError as error:
        print(f"lex train: {error}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, indent=2))
    return 0
