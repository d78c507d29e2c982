"""`lex train`: train or fine-tune a LEX model with the HF Trainer, in the shape of run_clm.py.

    lex train --output_dir runs/kjv --config_overrides "hidden_size=256,num_hidden_layers=4" --block_size 256
    lex train --output_dir runs/smol --model_name_or_path smol.gguf --attention_mode blockwise --use_peft ...
    accelerate launch --config_file lex/accelerate_configs/ddp_cpu.yaml -m lex.cli train ... --use_cpu   # DDP

Model, data and tokenizer arguments follow examples/pytorch/language-modeling/run_clm.py; every
TrainingArguments flag passes through (`lex train --help`), and a single JSON file may hold them all.
Inputs are checked before anything is written to --output_dir. Run again into an --output_dir that holds
checkpoint-* folders, the same command resumes from the last one; a non-empty --output_dir without
checkpoints is refused unless --overwrite_output_dir. The finished folder carries a model card (README.md);
--push_to_hub [--hub_model_id ID] uploads it at the end, as run_clm does.
"""

import argparse
import dataclasses
import json
import logging
import sys

from transformers import HfArgumentParser, TrainingArguments

from lex.commands import ALIAS_NOTE, OneSpellingHelp, Spellings, UsageError
from lex.training import (
    DataArguments,
    ModelArguments,
    OutputArguments,
    PeftArguments,
    check_arguments,
    process_log_levels,
    train,
)

DATACLASSES = (ModelArguments, DataArguments, OutputArguments, PeftArguments, TrainingArguments)


class TrainHelp(OneSpellingHelp, argparse.ArgumentDefaultsHelpFormatter):
    """One spelling per flag, and the defaults (as HfArgumentParser shows them)."""


class TrainArgumentParser(Spellings, HfArgumentParser):
    """HfArgumentParser (every dataclass field a flag) with the contract of lex.commands."""

    def __init__(self):
        super().__init__(DATACLASSES, prog="lex train", description=__doc__, formatter_class=TrainHelp,
                         epilog=ALIAS_NOTE)

    def dataclasses_from(self, namespace_or_dict: dict) -> tuple:
        """The argument dataclasses; a value their own checks refuse (TrainingArguments.__post_init__:
        incompatible strategies, an unknown optimizer, ...) is a UsageError, not a traceback."""
        values, outputs = dict(namespace_or_dict), []
        for dtype in DATACLASSES:
            names = {f.name for f in dataclasses.fields(dtype) if f.init}
            try:
                outputs.append(dtype(**{k: values.pop(k) for k in list(values) if k in names}))
            except (ValueError, TypeError) as error:
                self.error(str(error))
        if values:
            self.error(f"unknown arguments {', '.join(sorted(values))}")
        return tuple(outputs)

    def parse(self, argv: list[str]) -> tuple:
        if len(argv) == 1 and argv[0].endswith(".json"):
            try:
                with open(argv[0], encoding="utf-8") as handle:
                    data = json.load(handle)
            except (OSError, ValueError) as error:
                raise UsageError(f"{argv[0]}: cannot read the arguments from it ({error})") from None
            if not isinstance(data, dict):
                raise UsageError(f"{argv[0]}: must hold one JSON object of arguments")
            return self.dataclasses_from(data)
        return self.dataclasses_from(vars(self.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    parser = TrainArgumentParser()
    model_args, data_args, output_args, peft_args, training_args = parser.parse(
        list(sys.argv[1:] if argv is None else argv))
    check_arguments(model_args, data_args, training_args, output_args, peft_args)  # refusals before any log line
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S")
    with process_log_levels(training_args):
        metrics = train(model_args, data_args, training_args, output_args, peft_args)
    if training_args.process_index == 0:
        print(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, indent=2))
    return 0
