"""`lex demo`: the LEX paper's length-extrapolation study (lex.study), small enough for a laptop CPU."""

import argparse
import sys
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from lex import study
from lex.commands import comma_list
from lex.data import DataError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lex demo", description=study.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float,
                        help="fit the training steps to this budget on this machine (not reproducible elsewhere); "
                             "default: a fixed number of steps")
    parser.add_argument("--quick", action="store_true", help="a smaller, faster smoke test")
    parser.add_argument("--corpus", type=Path, help="a folder of text files, one document per file")
    parser.add_argument("--variants", default=",".join(study.DEFAULT_VARIANTS),
                        type=comma_list(study.VARIANTS),
                        help=f"position types to compare: {','.join(study.VARIANTS)}")
    parser.add_argument("--training_length", type=int, help="l (default 128; 64 with --quick)")
    parser.add_argument("--output_dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    if args.minutes is not None and args.minutes <= 0:
        parser.error(f"--minutes must be a positive number of minutes, got {args.minutes:g}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    try:
        study.run_study(args.output_dir, args.variants, args.quick, args.training_length, args.corpus, args.minutes,
                        args.device, args.seed)
    except DataError as error:
        print(f"lex demo: {error}", file=sys.stderr)
        return 2
    return 0
