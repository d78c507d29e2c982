"""What choosing the blocks costs as the document grows: `block_scores` and `choose_blocks` (modeling_lex/memory.py)
timed alone at the block counts of 8k, 32k and 131k tokens, in SmolLM2-135M's shapes.

A decoding step chooses once per completed block (every --memory_block_size steps in sliding mode), in every layer:
one query of --heads heads against the representatives (b / 4 a block, random: the time does not depend on their
values) of --kv_heads key/value heads, then the choice of --memory_blocks slots among the blocks' scores. Printed per
context: the milliseconds of each (mean of --calls calls), a choice over --layers layers, and that spread over the
steps between two choices (what a decoded token pays; memory_speed.py measures the whole step).

    python benchmarks/memory_choice_speed.py [--contexts 8192,32768,131072] [--threads 2] [--output choice.json]
"""

import argparse
import time
from pathlib import Path

import torch

from common import write_output

from modeling_lex.memory import block_scores, choose_blocks
from modeling_lex.reading import ReadingPolicy


def milliseconds(call, calls: int) -> float:
    """Mean milliseconds of `call` over `calls` calls, after five not counted."""
    for _ in range(5):
        call()
    began = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - began) / calls * 1e3


def one_context(args, context: int) -> dict:
    block = args.memory_block_size
    blocks = (context - args.window - args.sinks) // block
    generator = torch.Generator().manual_seed(context)
    policy = ReadingPolicy("sliding", args.window, args.sinks, "cache", args.memory_blocks, block)
    representatives = torch.randn(1, args.kv_heads, policy.representatives, blocks, args.head_dim, generator=generator)
    query = torch.randn(1, args.heads, 1, args.head_dim, generator=generator) * args.head_dim**-0.5
    candidates = torch.ones(1, blocks, dtype=torch.bool)
    scores = block_scores(query, representatives, candidates)
    row = {"context": context, "blocks": blocks,
           "scores_ms": milliseconds(lambda: block_scores(query, representatives, candidates), args.calls),
           "choose_ms": milliseconds(lambda: choose_blocks(scores, args.memory_blocks), args.calls)}
    row["choice_ms"] = args.layers * (row["scores_ms"] + row["choose_ms"])
    row["per_token_ms"] = row["choice_ms"] / block
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--memory_blocks", type=int, default=64)
    parser.add_argument("--memory_block_size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv_heads", type=int, default=3)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{'context':>8}{'blocks':>8}{'scores ms':>11}{'choose ms':>11}{'a choice, ms':>14}{'a token, ms':>13}")
    rows = []
    for context in map(int, args.contexts.split(",")):
        row = one_context(args, context)
        rows.append(row)
        print(f"{context:>8}{row['blocks']:>8}{row['scores_ms']:>11.2f}{row['choose_ms']:>11.2f}"
              f"{row['choice_ms']:>14.1f}{row['per_token_ms']:>13.2f}", flush=True)
    write_output(args, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
