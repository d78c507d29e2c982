"""`lex demo`: the LEX paper's length-extrapolation study (lex.study), small enough for a laptop CPU."""

import argparse
from pathlib import Path

from transformers.utils import logging as hf_logging

from lex import study
from lex.commands import LexArgumentParser, comma_list, positive_float, positive_int, require_device


def build_parser() -> LexArgumentParser:
    parser = LexArgumentParser("demo", description=study.__doc__)
    parser.add_argument("--minutes", type=positive_float,
                        help="fit the training steps to this budget on this machine (not reproducible elsewhere); "
                             "default: a fixed number of steps")
    parser.add_argument("--quick", action="store_true", help="a smaller, faster smoke test")
    parser.add_argument("--corpus", type=Path, help="a folder of text files, one document per file")
    parser.add_argument("--variants", default=",".join(study.DEFAULT_VARIANTS),
                        type=comma_list(study.VARIANTS),
                        help=f"models to compare: {','.join(study.VARIANTS)} (LEX position types; llama: "
                             "transformers' LlamaForCausalLM trained with full attention, read as published and "
                             "converted to sliding and blockwise windows with 0 and 4 attention sinks)")
    parser.add_argument("--training_length", type=positive_int, help="l (default 128; 64 with --quick)")
    parser.add_argument("--output_dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=42)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    require_device(parser, args.device)
    if args.training_length is not None and (args.training_length < 8 or args.training_length % 4):
        parser.error(f"{parser.flag('training_length')} {args.training_length}: must be a multiple of 4 and >= 8 "
                     "(the study evaluates at l/4 and attends in blocks of l/2)")
    if args.corpus is not None and not args.corpus.is_dir():
        parser.error(f"{parser.flag('corpus')} {args.corpus}: not a folder (one text file per document)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    study.run_study(args.output_dir, args.variants, args.quick, args.training_length, args.corpus, args.minutes,
                    args.device, args.seed)
    return 0
