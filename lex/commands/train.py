"""`lex train`: train or fine-tune a LEX model with the HF Trainer, in the shape of run_clm.py.

    lex train --output_dir runs/kjv --config_overrides "hidden_size=256,num_hidden_layers=4" --block_size 256
    accelerate launch --config_file lex/accelerate_configs/ddp_cpu.yaml -m lex.cli train ... --use_cpu   # DDP

Model, data and tokenizer arguments follow examples/pytorch/language-modeling/run_clm.py; every
TrainingArguments flag passes through (`lex train --help`), and a single JSON file may hold them all.
Inputs are checked before anything is written to --output_dir.
"""

import json
import logging
import sys

from transformers import HfArgumentParser, TrainingArguments

from lex.data import DataError
from lex.training import DataArguments, ModelArguments, process_log_levels, train


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments), prog="lex train",
                              description=__doc__)
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 1 and args[0].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=args[0])
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=args)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S")
    try:
        with process_log_levels(training_args):
            metrics = train(model_args, data_args, training_args)
    except DataError as error:
        print(f"lex train: {error}", file=sys.stderr)
        return 2
    if training_args.process_index == 0:
        print(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, indent=2))
    return 0
