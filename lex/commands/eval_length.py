"""`lex eval-length MODEL... --files GLOB --lengths 256,512 --attention_modes full,blockwise --output_dir DIR`

Perplexity by evaluation length (lex.perplexity: the paper's "segments" protocol and a "strided" one) for LEX
folders in any attention mode, or any causal LM. Prints the tables and writes results.csv, results.json and
ppl_vs_length.png; with --resolution the attention resolution per layer (resolution.json, resolution.png), with
--passkey the passkey probe (passkey.json).
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from configuration_lex import ATTENTION_MODES
from convert.staging import atomic_files
from lex.commands import LexArgumentParser, comma_list, positive_int, positive_ints
from lex.data import DataError, evaluation_texts
from lex.models import load_model, model_config
from lex.passkey import passkey_rows
from lex.perplexity import PROTOCOLS, evaluate_model
from lex.report import passkey_table, plot_resolution, protocol_table, resolution_table, write_results
from lex.resolution import analytic_curves, resolution_rows


def build_parser() -> LexArgumentParser:
    parser = LexArgumentParser("eval-length", description=__doc__)
    parser.add_argument("model", nargs="+", help="model folders (a LEX folder, or any causal LM)")
    parser.add_argument("--files", help="globs of evaluation text files; default: the held-out KJV books")
    parser.add_argument("--lengths", default="256,512,1024,2048", type=positive_ints,
                        help="comma-separated evaluation lengths")
    parser.add_argument("--attention_modes", default="full,blockwise",
                        type=comma_list(ATTENTION_MODES),
                        help=f"comma-separated: {','.join(ATTENTION_MODES)}")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS), type=comma_list(PROTOCOLS),
                        help=f"comma-separated: {','.join(PROTOCOLS)}")
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--batch_size", type=positive_int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resolution", action="store_true", help="attention resolution per layer (paper eq. 3)")
    parser.add_argument("--passkey", action="store_true", help="passkey retrieval at several distances")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"{parser.flag('device')} {args.device}: no CUDA device is available")
    if args.output_dir.exists() and not args.output_dir.is_dir():
        parser.error(f"{parser.flag('output_dir')} {args.output_dir}: a file, not a folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for path in args.model:
        config = model_config(path, "MODEL", tokenizer=True)
        if args.resolution and config.model_type != "lex":
            raise DataError(f"--resolution reads a LEX model's attention scores; {path} holds a "
                            f"{config.model_type!r} model")
    texts = evaluation_texts(args.files)
    rows, resolution, curves, passkey = [], [], {}, []
    for path in args.model:
        rows += evaluate_model(path, texts, args.lengths, list(args.attention_modes), device=args.device,
                               batch_size=args.batch_size, protocols=args.protocols)
        if args.resolution or args.passkey:
            model, tokenizer = load_model(path, None, args.device), AutoTokenizer.from_pretrained(path)
            name = Path(path).name
            if args.resolution:
                row, curves[name] = resolution_rows(model, tokenizer, name, texts)
                resolution.append(row)
            if args.passkey:
                passkey += passkey_rows(model, tokenizer, name)
    with atomic_files(args.output_dir) as staging:
        write_results(rows, staging)
        if args.resolution:
            (staging / "resolution.json").write_text(json.dumps(resolution, indent=2))
            plot_resolution(curves, analytic_curves(), staging / "resolution.png")
        if args.passkey:
            (staging / "passkey.json").write_text(json.dumps(passkey, indent=2))
        written = sorted(p.name for p in staging.iterdir())
    for protocol in args.protocols:
        print(f"\nperplexity by evaluation length (protocol: {protocol})\n{protocol_table(rows, protocol)}")
    if args.resolution:
        print("\nattention resolution (paper eq. 3), mean over layers\n" + resolution_table(resolution))
    if args.passkey:
        print("\npasskey retrieval\n" + passkey_table(passkey))
    print(f"\nwrote {', '.join(written)} in {args.output_dir}")
    return 0
