"""This checkout against an earlier commit on the real checkpoint: did a change keep the speed?

Runs benchmarks/real_checkpoint_speed.py from this checkout and from --base (a git worktree made for the run, removed
after), taking turns (--rounds, each round in its own order), so that a machine that is busier at one moment than
another slows both alike. Each run times LEX against transformers' Llama in the same process; the comparison is of
those in-process ratios, so the Llama anchors each run. Printed per reading: the median over rounds of prefill and
decoding against Llama at --context tokens, for the base and for this checkout, and their quotient (this / base;
1.00 is the same speed). Then the sliding + sinks reading at --long-context tokens, each tree in its own process, its
decoding tokens/s and its decoding against itself at 2,048 tokens measured side by side in that process.

    python benchmarks/commit_speed.py [--base HEAD~1] [--rounds 2] [--repeats 3] [--long-context 32768]
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, write_output

BENCHMARK = Path("benchmarks") / "real_checkpoint_speed.py"


def run(tree: Path, arguments: list[str]) -> str:
    """real_checkpoint_speed.py of `tree` (it puts its own tree first on sys.path), its standard output."""
    result = subprocess.run([sys.executable, str(tree / BENCHMARK), *arguments], cwd=tree, check=True,
                            stdout=subprocess.PIPE, text=True)
    return result.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD~1", help="the commit to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="real_checkpoint_speed.py's rounds within each run")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--long-context", type=int, default=32768, help="0: no long-context run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    common = [f"--repeats={args.repeats}", f"--threads={args.threads}"]
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
        try:
            trees = {"base": base, "this": ROOT}
            side: dict[str, list[dict]] = {"base": [], "this": []}
            for round_ in range(args.rounds):
                for name in random.Random(round_).sample(list(trees), 2):
                    output = Path(scratch) / f"{name}-{round_}.json"
                    run(trees[name], [*common, f"--context={args.context}", "--long=", f"--output={output}"])
                    side[name].append(json.loads(output.read_text())["side_by_side"])
                    print(f"  round {round_ + 1}: {name} done", flush=True)
            long = {}
            if args.long_context:
                for name in random.Random(args.rounds).sample(list(trees), 2):
                    lines = run(trees[name], [*common, f"--long=2048,{args.long_context}",
                                              f"--one-context={args.long_context}", "--one-reading=sliding+sinks"])
                    long[name] = json.loads(lines.strip().splitlines()[-1])
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    print(f"\n{args.context}-token prompt, against Llama in the same process (median over {args.rounds} rounds); "
          f"this checkout against {args.base}")
    print(f"{'reading':<18}{'prefill base':>13}{'this':>8}{'this/base':>11}{'decode base':>13}{'this':>8}"
          f"{'this/base':>11}")
    table = {}
    for reading in side["this"][0]:
        if reading == "llama":
            continue
        row = {f"{what}_{name}": statistics.median(run_[reading][f"{what}_vs_llama"] for run_ in side[name])
               for what in ("prefill", "decode") for name in ("base", "this")}
        row |= {f"{what}_this_over_base": row[f"{what}_this"] / row[f"{what}_base"] for what in ("prefill", "decode")}
        table[reading] = row
        print(f"{reading:<18}{row['prefill_base']:>13.3f}{row['prefill_this']:>8.3f}"
              f"{row['prefill_this_over_base']:>11.3f}{row['decode_base']:>13.3f}{row['decode_this']:>8.3f}"
              f"{row['decode_this_over_base']:>11.3f}")
    if long:
        print(f"\nsliding + sinks at {args.long_context} tokens, each tree in its own process")
        for name, row in long.items():
            side_by_side = row["side_by_side"]
            print(f"{name:<6} decode {row['decode_tokens_per_s']:.2f} tokens/s, side by side "
                  f"{side_by_side['decode_tokens_per_s']['this']:.2f} tokens/s, "
                  f"{side_by_side['decode_vs_own_first']:.3f}x its own decoding at 2,048 tokens")
        quotient = long["this"]["decode_tokens_per_s"] / long["base"]["decode_tokens_per_s"]
        print(f"this/base decode at {args.long_context}: {quotient:.3f}")
    write_output(args, {"side_by_side": table, "long_context": long, "runs": side})
    return 0


if __name__ == "__main__":
    sys.exit(main())
