"""`lex eval-length MODEL... --files GLOB --lengths 256,512 --attention_modes full,blockwise --attention_sinks 0,4
[--attention_sink_positions cache,true] [--attention_memory_blocks 0,64 [--attention_memory_block_size B]]
--output_dir DIR`

Perplexity by evaluation length (lex.perplexity: the paper's "segments" protocol and a "strided" one) for LEX
folders and Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 or Gemma 3 folders or .gguf files (full attention
as published; the other modes converted in memory) in every attention mode with each number of attention sinks (and
each sink position rule asked for, and each number of block-memory blocks asked for: blockwise and sliding readings
only, rows labelled attention_memory_blocks and attention_memory_block_size), and for any other causal LM as
published. Prints the tables and writes results.csv,
results.json and ppl_vs_length.png; with --resolution the attention resolution per layer (resolution.json,
resolution.png), with --passkey the passkey probe for every mode (passkey.json).
"""

import argparse
import json
from pathlib import Path

import torch

from convert.hf import SOURCE_TYPES, lex_from_hf
from lex.commands import (
    LexArgumentParser, add_quantize_argument, add_reading_arguments, add_tp_argument, check_quantize,
    check_reading_arguments, check_tp, comma_list, only_rank_zero_speaks, positive_int, positive_ints,
    require_device,
)
from lex.data import DataError, evaluation_texts, tokenized_documents
from lex.models import attention_modes, attention_variants, load_tokenizer, model_config
from lex.passkey import passkey_rows
from lex.perplexity import PROTOCOLS, score_rows
from lex.report import passkey_table, plot_resolution, protocol_table, resolution_table, write_results
from lex.resolution import analytic_curves, resolution_rows
from lex_base.staging import atomic_files


def build_parser() -> LexArgumentParser:
    parser = LexArgumentParser("eval-length", description=__doc__)
    parser.add_argument("model", nargs="+",
                        help="model folders (a LEX folder, or any causal LM) or .gguf files (Llama, Mistral, "
                             "Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3)")
    parser.add_argument("--files", help="globs of evaluation text files; default: the held-out KJV books")
    parser.add_argument("--lengths", default="256,512,1024,2048", type=positive_ints,
                        help="comma-separated evaluation lengths")
    add_reading_arguments(parser, sweep=True)
    parser.add_argument("--document_tokens", type=positive_int,
                        help="score each document's first N tokens at every length (default: the longest length); "
                             "with more, lengths read by different runs are scored on the same tokens")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS), type=comma_list(PROTOCOLS),
                        help=f"comma-separated: {','.join(PROTOCOLS)}")
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--batch_size", type=positive_int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resolution", action="store_true", help="attention resolution per layer (paper eq. 3)")
    parser.add_argument("--passkey", action="store_true", help="passkey retrieval at several distances")
    add_quantize_argument(parser)
    add_tp_argument(parser)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    require_device(parser, args.device)
    check_quantize(parser, args.quantize, args.device)
    check_tp(parser, args)
    if args.document_tokens is not None and args.document_tokens < max(args.lengths):
        parser.error(f"{parser.flag('document_tokens')} {args.document_tokens} is shorter than the longest of "
                     f"{parser.flag('lengths')}, {max(args.lengths)}")
    check_reading_arguments(parser, args)
    if args.output_dir.exists() and not args.output_dir.is_dir():
        parser.error(f"{parser.flag('output_dir')} {args.output_dir}: a file, not a folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    speaks = args.tp_plan is None or only_rank_zero_speaks()  # under torchrun: rank 0 prints and writes
    notes = {}
    for path in args.model:
        config = model_config(path, "MODEL", tokenizer=True, gguf=True)
        if args.resolution and config.model_type not in ("lex", *SOURCE_TYPES):
            raise DataError(f"--resolution reads a LEX model's attention scores (or a converted "
                            f"{'/'.join(SOURCE_TYPES)} one's); {path} holds a {config.model_type!r} model")
        _, notes[path] = attention_modes(config, list(args.attention_modes))
    texts = evaluation_texts(args.files)
    memory = args.attention_memory_blocks
    rows, resolution, curves, passkey = [], [], {}, []
    for path in args.model:
        name, tokenizer = Path(path).name, load_tokenizer(path)
        if notes[path]:
            print(f"{name}: {notes[path]}")
        documents = tokenized_documents(tokenizer, texts)
        for labels, model in attention_variants(path, list(args.attention_modes), list(args.attention_sinks),
                                                args.device, attention_window=args.attention_window,
                                                sink_positions=args.attention_sink_positions,
                                                memory_blocks=None if memory is None else list(memory),
                                                memory_block_size=args.attention_memory_block_size,
                                                quantize=args.quantize, tp_plan=args.tp_plan):
            for _, scored in score_rows(model, documents, args.lengths, args.protocols, args.batch_size, True,
                                        {"model": name, **labels}, args.document_tokens):
                rows += scored
            if args.passkey:
                passkey += passkey_rows(model, tokenizer, name, **labels)
            if args.resolution and name not in curves:  # windows of w tokens: one dense tile in every mode
                scored_model = model if model.config.model_type == "lex" else lex_from_hf(model)
                row, curves[name] = resolution_rows(scored_model, tokenizer, name, texts)
                resolution.append(row)
    if not speaks:
        return 0
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
