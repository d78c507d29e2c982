"""A LEX folder read by one process and sharded over N (tensor parallel, `from_pretrained(..., tp_plan="auto")`
under torchrun; gloo on CPU, nccl on CUDA), in the same run: greedy tokens after a long prompt, equal or not, and
the speed of each (prefill tokens/s: generate() start to its first new token; decode tokens/s: the new tokens
after the first over their seconds).

The prompt is the King James Bible's first --prompt_tokens tokens. Each reading runs in a process of its own
(--threads threads each: N processes use N times the threads of one), first one process, then torchrun.

    python benchmarks/tensor_parallel.py --model smollm2-lex --processes 3 [--prompt_tokens 8192] [--new 32]
        [--output tensor_parallel.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import Clock, write_output

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def read(args: argparse.Namespace, out: Path) -> None:
    """One reading (this process, or one rank of torchrun's): greedy tokens and the speed, written by rank 0."""
    from real_checkpoint_speed import prompt_ids  # noqa: E402  (the benchmarks share their prompt)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modeling_lex  # noqa: F401  (registers the Auto classes)

    torch.set_num_threads(args.threads)
    sharded = "WORLD_SIZE" in os.environ
    model = AutoModelForCausalLM.from_pretrained(args.model, **({"tp_plan": "auto"} if sharded else {})).eval()
    ids = prompt_ids(AutoTokenizer.from_pretrained(args.model), args.prompt_tokens)
    clock = Clock()
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False,
                                streamer=clock, pad_token_id=0)[0, ids.shape[1]:]
    first, steps = clock.stamps[1] - start, clock.steps()
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps({"processes": int(os.environ.get("WORLD_SIZE", "1")), "tokens": tokens.tolist(),
                                   "prefill_tokens_per_s": args.prompt_tokens / first,
                                   "decode_tokens_per_s": len(steps) / sum(steps)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a LEX folder with its tokenizer")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--prompt_tokens", type=int, default=8192)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="threads per process")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a reading, written to this file
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if args.worker is not None:
        return read(args, args.worker)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    common = [__file__, "--model", str(args.model), "--prompt_tokens", str(args.prompt_tokens), "--new",
              str(args.new), "--threads", str(args.threads), "--worker"]
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, launcher in (("one process", [sys.executable]),
                               (f"{args.processes} processes", [sys.executable, "-m", "torch.distributed.run",
                                                                "--nproc_per_node", str(args.processes)])):
            out = Path(folder) / "reading.json"
            subprocess.run([*launcher, *common, str(out)], env=env, check=True)
            results[name] = json.loads(out.read_text())
    one, many = results.values()
    equal = one["tokens"] == many["tokens"]
    print(f"{args.model}, a prompt of {args.prompt_tokens} tokens, {args.new} greedy tokens, {args.threads} "
          f"thread(s) a process:")
    for name, result in results.items():
        print(f"  {name:12} prefill {result['prefill_tokens_per_s']:8.1f} tokens/s, decode "
              f"{result['decode_tokens_per_s']:6.2f} tokens/s")
    print(f"  greedy tokens equal: {equal}")
    write_output(args, {"model": str(args.model), "prompt_tokens": args.prompt_tokens, "new": args.new,
                        "threads": args.threads, "readings": results, "tokens_equal": equal})


if __name__ == "__main__":
    main()
