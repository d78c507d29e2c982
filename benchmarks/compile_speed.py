"""torch.compile beside eager: the training step at l, and decoding with 1k and 100k tokens of context.

Side by side in one run, each job in a fresh process: LEX eager (default LexCache), LEX compiled with the
static bounded cache (`cache_implementation="static"`, generate()'s own compiled decoding step), and HF Llama
of the same size with its StaticCache compiled the same way (1k only: its cache grows with the context).
Decoding tokens/s is the median gap between streamed tokens of a second generate() (the first one compiles).
On CPU generate() compiles only when `compile_config._compile_all_devices` is set, as transformers' own tests do.

    python benchmarks/compile_speed.py [--contexts 1000,100000] [--new 64] [--output compile_speed.json]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import write_output
from generate_speed import Clock, build

from configuration_lex import ATTENTION_MODES


def train_step(args, compiled: bool) -> dict:
    model = build("lex", args).train()
    step_model = torch.compile(model, fullgraph=True) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.window))

    def step() -> None:
        loss = step_model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    began = time.perf_counter()
    step()  # compiles
    first = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - began) / args.steps
    return {"tokens_per_s": args.batch * args.window / seconds, "first_step_s": first}


def decode(args, kind: str, compiled: bool, context: int) -> dict:
    from transformers import CompileConfig

    model = build(kind, args)
    ids = torch.randint(0, args.vocab, (1, context))
    options = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    if compiled:
        config = CompileConfig(fullgraph=True)
        config._compile_all_devices = True  # generate() compiles on CUDA only unless told
        options.update(cache_implementation="static", compile_config=config)
    with torch.no_grad():
        began = time.perf_counter()
        model.generate(ids[:, -min(context, 64):], **options)  # warm-up (compiles)
        warmup = time.perf_counter() - began
        clock = Clock()
        model.generate(ids, streamer=clock, **options)
    gaps = [b - a for a, b in zip(clock.stamps[2:], clock.stamps[3:])]
    return {"decode_tokens_per_s": 1.0 / statistics.median(gaps), "warmup_s": warmup,
            "prefill_s": clock.stamps[1] - clock.stamps[0]}


def child(args) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    job = json.loads(args.job)
    if job["what"] == "train":
        result = train_step(args, job["compiled"])
    else:
        result = decode(args, job["kind"], job["compiled"], job["context"])
    print(json.dumps({**job, **result}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1000,100000")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256, help="l = w")
    parser.add_argument("--mode", default="blockwise", choices=ATTENTION_MODES)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        child(args)
        return 0
    contexts = [int(c) for c in args.contexts.split(",")]
    jobs = [{"what": "train", "compiled": False}, {"what": "train", "compiled": True}]
    for context in contexts:
        jobs += [{"what": "decode", "kind": "lex", "compiled": False, "context": context},
                 {"what": "decode", "kind": "lex", "compiled": True, "context": context}]
    jobs.append({"what": "decode", "kind": "llama", "compiled": True, "context": contexts[0]})
    settings = [f"--{key}={value}" for key, value in vars(args).items() if key not in ("output", "job")]
    rows = []
    for job in jobs:
        run = subprocess.run([sys.executable, __file__, *settings, "--job", json.dumps(job)],
                             capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"{job} failed:\n{run.stderr[-3000:]}")
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)

    train = {row["compiled"]: row for row in rows if row["what"] == "train"}
    print(f"\ntraining step at l={args.window}, batch {args.batch}: eager {train[False]['tokens_per_s']:.0f} "
          f"tokens/s, compiled {train[True]['tokens_per_s']:.0f} ({train[True]['tokens_per_s'] / train[False]['tokens_per_s']:.2f}x)")
    decodes = [row for row in rows if row["what"] == "decode"]
    lex_static_1k = next(r for r in decodes if r["kind"] == "lex" and r["compiled"] and r["context"] == contexts[0])
    print(f"\n{'model':<22}{'context':>9}{'decode tok/s':>14}{'x LEX eager':>13}{'x Llama comp.':>15}")
    llama = next(r for r in decodes if r["kind"] == "llama")
    for row in decodes:
        eager = next(r for r in decodes if r["kind"] == "lex" and not r["compiled"] and r["context"] == row["context"])
        name = f"{row['kind']} {'compiled+static' if row['compiled'] else 'eager'}"
        print(f"{name:<22}{row['context']:>9,}{row['decode_tokens_per_s']:>14.1f}"
              f"{row['decode_tokens_per_s'] / eager['decode_tokens_per_s']:>13.2f}"
              f"{row['decode_tokens_per_s'] / llama['decode_tokens_per_s']:>15.2f}")
    flat = [r for r in decodes if r["kind"] == "lex" and r["compiled"]]
    print(f"\ncompiled LEX decode at {contexts[-1]:,} / at {contexts[0]:,}: "
          f"{flat[-1]['decode_tokens_per_s'] / lex_static_1k['decode_tokens_per_s']:.2f}")
    write_output(args, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
