"""A passage read twice, far apart: does the block memory let the real checkpoint use its first reading?

A 256-token passage of the King James Bible is read, then --gap tokens of other text (by default 4·l = 32,768),
then the passage again; its second appearance is scored (NLL per token). The readings: SmolLM2-135M-Instruct
converted to sliding attention (w = --window, --sinks sinks at cache positions) with and without the block memory,
the whole document in one call (`model(ids)`: read through a LexCache w tokens a forward); and the reference, the
checkpoint as published (full attention) with the same passage, after the 1,024 tokens before it, repeated
--reference_gap (2,000) tokens later, inside its training length. Each passage also gets its first-reading NLL (what nothing remembered would give).
Printed per passage and on average: the four NLLs and memory / reference.

    python benchmarks/memory_reread.py [--passages 3] [--gap 32768] [--device cuda] [--output memory_reread.json]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

from common import real_checkpoint, write_output

from convert.hf import lex_from_hf
from lex.data import kjv_books
from lex.models import load_model, load_tokenizer

PASSAGE = 256


@torch.no_grad()
def passage_nll(model, ids: torch.Tensor) -> float:
    """Mean NLL of the last PASSAGE tokens of `ids` (1, n), each given everything before it."""
    ids = ids.to(model.device)
    logits = model(ids, logits_to_keep=PASSAGE + 1).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[0, -PASSAGE:]).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--passages", type=int, default=3)
    parser.add_argument("--gap", type=int, default=32768)
    parser.add_argument("--reference_gap", type=int, default=2000)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--memory_blocks", type=int, default=64)
    parser.add_argument("--memory_block_size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = str(real_checkpoint(args.model))
    published, tokenizer = load_model(path, device=args.device).eval(), load_tokenizer(path)
    window = lex_from_hf(published, "sliding", args.window, args.sinks, "cache").eval()
    memory = lex_from_hf(published, "sliding", args.window, args.sinks, "cache",
                         attention_memory_blocks=args.memory_blocks,
                         attention_memory_block_size=args.memory_block_size).eval()
    text = "\n\n".join(book["text"] for book in kjv_books())
    tokens = torch.tensor(tokenizer(text[: 12 * (args.gap + 4096 * args.passages)], add_special_tokens=False
                                    ).input_ids)
    rows = []
    print(f"{'passage at':>10}{'first':>8}{'window':>8}{'memory':>8}{'full@' + str(args.reference_gap):>10}"
          f"{'m/full':>8}", flush=True)
    for index in range(args.passages):
        start = 1024 + index * 4096
        passage = tokens[start : start + PASSAGE]
        before = tokens[:start]
        far = torch.cat([before, passage, tokens[start + PASSAGE + 4096 :][: args.gap - PASSAGE], passage])[None]
        near = torch.cat([before[-1024:], passage, tokens[start + PASSAGE + 4096 :][: args.reference_gap - PASSAGE],
                          passage])[None]  # inside l whatever the passage's place (1,024 tokens before it)
        row = {"passage_start": start,
               "first_nll": passage_nll(published, torch.cat([before, passage])[None]),
               "window_nll": passage_nll(window, far),
               "memory_nll": passage_nll(memory, far),
               "full_nll": passage_nll(published, near)}
        row["memory_over_full"] = row["memory_nll"] / row["full_nll"]
        rows.append(row)
        print(f"{start:>10}{row['first_nll']:>8.3f}{row['window_nll']:>8.3f}{row['memory_nll']:>8.3f}"
              f"{row['full_nll']:>10.3f}{row['memory_over_full']:>8.2f}", flush=True)
    mean = {key: statistics.mean(row[key] for row in rows) for key in ("first_nll", "window_nll", "memory_nll",
                                                                       "full_nll")}
    print(f"{'mean':>10}{mean['first_nll']:>8.3f}{mean['window_nll']:>8.3f}{mean['memory_nll']:>8.3f}"
          f"{mean['full_nll']:>10.3f}{mean['memory_nll'] / mean['full_nll']:>8.2f}", flush=True)
    write_output(args, {"rows": rows, "mean": mean})
    return 0


if __name__ == "__main__":
    sys.exit(main())
