"""Perplexity of one long document: tokens/s and peak RSS of `lex.perplexity.perplexity_by_length` by length.

A random LEX model (default 4 layers, hidden 256, l = w = 1024, vocab 32,000, blockwise), or with --source llama a
random transformers LlamaForCausalLM of the same sizes (GQA with --kv_heads) converted in memory
(convert.hf.lex_from_hf) to --mode with --sinks attention sinks, reads the first N
tokens of one long document, the whole embedded KJV concatenated, its UTF-8 bytes taken as token ids (0-255,
inside the vocabulary; no tokenizer needed), in the strided protocol at length N (one window: one pass over
the document), batch 1. Each length runs in a fresh process, so its peak RSS (VmHWM) is its own; tokens/s
is N over the wall time of the evaluation call alone (model built, document cut and one w-token evaluation run
before: first-touch allocations are no per-token cost; at N = l they were a third of a cold call's CPU time).
The CPU is shared: each run also records the 1-minute load average and N per CPU second of the process (less
sensitive to the other users of the machine than wall time).

    python benchmarks/eval_speed.py [--lengths 1024,65536,1048576] [--threads 1] [--output eval_speed.json]
    python benchmarks/eval_speed.py --source llama --mode sliding --sinks 4   # issue 22's benchmark
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import peak_rss_mb, write_output

from configuration_lex import ATTENTION_MODES


def document(tokens: int) -> torch.Tensor:
    from lex.data import kjv_books

    text = " ".join(book["text"] for book in kjv_books()).encode("utf-8")
    if len(text) < tokens:
        raise ValueError(f"the concatenated KJV has {len(text)} bytes, fewer than {tokens} tokens")
    return torch.frombuffer(bytearray(text[:tokens]), dtype=torch.uint8).long()


def one(args) -> dict:
    """Evaluate one length in this process."""
    from configuration_lex import LexConfig
    from lex.perplexity import perplexity_by_length
    from modeling_lex import LexForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.source == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from convert.hf import lex_from_hf

        source = LlamaForCausalLM(LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.window))
        model = lex_from_hf(source, args.mode, args.window, args.sinks).eval()
        del source
    else:
        config = LexConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, max_position_embeddings=args.window,
                           attention_mode=args.mode, attention_sinks=args.sinks)
        model = LexForCausalLM(config).eval()
    ids = document(args.one)
    perplexity_by_length(model, [ids[: args.window]], [args.window], "strided", batch_size=1)
    load_before = os.getloadavg()[0]
    began, cpu_began = time.perf_counter(), time.process_time()
    score = perplexity_by_length(model, [ids], [args.one], "strided", batch_size=1, progress=args.progress)[args.one]
    seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu_began
    return {"tokens": args.one, "seconds": seconds, "tokens_per_s": args.one / seconds,
            "tokens_per_cpu_s": args.one / cpu_seconds, "peak_rss_mb": peak_rss_mb(),
            "ppl": score.ppl, "scored": score.tokens, "load_1min_before": load_before,
            "load_1min_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,65536,1048576")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024, help="l = w")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--mode", default="blockwise", choices=ATTENTION_MODES)
    parser.add_argument("--sinks", type=int, default=0, help="attention sinks")
    parser.add_argument("--kv_heads", type=int, help="key/value heads (default: --heads)")
    parser.add_argument("--source", default="lex", choices=("lex", "llama"),
                        help="a LEX model, or a Llama converted in memory")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (the CPU is shared)")
    parser.add_argument("--progress", action="store_true", help="the evaluation's progress bar, in tokens")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: run one length, print its JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args)))
        return 0
    args.kv_heads = args.kv_heads or args.heads
    settings = [f"--{name}={getattr(args, name)}" for name in ("layers", "hidden", "heads", "kv_heads", "window",
                                                               "vocab", "mode", "sinks", "source", "threads")]
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        command = [sys.executable, __file__, *settings, f"--one={length}"] + (["--progress"] if args.progress else [])
        result = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(f"  {length} tokens: {rows[-1]['tokens_per_s']:.0f} tokens/s, {rows[-1]['peak_rss_mb']:.0f} MB",
              flush=True)
    base = rows[0]
    for row in rows:
        row["tokens_per_s_vs_first"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["tokens_per_cpu_s_vs_first"] = row["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        row["peak_rss_vs_first"] = row["peak_rss_mb"] / base["peak_rss_mb"]
    print(f"\nperplexity of one document, {args.source} model, {args.mode} + {args.sinks} sinks, {args.layers} "
          f"layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads, l = w = {args.window}, vocab "
          f"{args.vocab}, {args.threads} thread(s); ratios vs {base['tokens']} tokens")
    print("| tokens | seconds | tokens/s | vs first | tokens/CPU s | vs first | peak RSS MB | vs first "
          "| load 1 min (before/after) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['tokens']} | {row['seconds']:.1f} | {row['tokens_per_s']:.0f} "
              f"| {row['tokens_per_s_vs_first']:.2f} | {row['tokens_per_cpu_s']:.0f} "
              f"| {row['tokens_per_cpu_s_vs_first']:.2f} | {row['peak_rss_mb']:.0f} | {row['peak_rss_vs_first']:.2f} "
              f"| {row['load_1min_before']:.2f}/{row['load_1min_after']:.2f} |")
    write_output(args, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
