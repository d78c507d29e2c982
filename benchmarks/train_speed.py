"""Training tokens/s of `lex train` on this machine: one process, and two under accelerate (DDP, gloo).

Same model (default 4 layers, hidden 256, l=256), same global batch (per-device batch = global / processes),
the KJV corpus, the cores shared out among the processes (OMP_NUM_THREADS); tokens/s counts the tokens of all
processes: steps x global batch x l / train_runtime (the Trainer's own timer).

    python benchmarks/train_speed.py [--steps 30] [--output train_speed.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, write_output


def run(processes: int, args, workdir: Path) -> dict:
    out = workdir / f"p{processes}"
    command = ["train", "--output_dir", str(out), "--config_overrides",
               f"hidden_size={args.hidden},num_hidden_layers={args.layers},num_attention_heads={args.heads},"
               f"intermediate_size={4 * args.hidden}", "--block_size", str(args.length), "--vocab_size",
               str(args.vocab), "--max_steps", str(args.steps),
               "--per_device_train_batch_size", str(args.batch // processes), "--do_train", "--save_strategy", "no",
               "--eval_strategy", "no", "--report_to", "none", "--use_cpu", "--logging_steps", str(args.steps),
               "--disable_tqdm", "true"]
    if processes == 1:
        launch = [sys.executable, "-m", "lex.cli"]
    else:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(ROOT / "lex" / "accelerate_configs" / "ddp_cpu.yaml"), "--num_processes", str(processes),
                  "-m", "lex.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(max(1, args.threads // processes))}
    log = subprocess.run([*launch, *command], check=True, env=env, cwd=ROOT, capture_output=True, text=True)
    if f"of world size {processes}," not in log.stdout + log.stderr:
        raise RuntimeError(f"the run did not train on {processes} process(es)")
    metrics = json.loads((out / "all_results.json").read_text())
    tokens = args.steps * args.batch * args.length
    return {"processes": processes, "train_runtime_s": metrics["train_runtime"],
            "tokens_per_s": tokens / metrics["train_runtime"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        rows = [run(1, args, Path(workdir)), run(2, args, Path(workdir))]
    print(f"training, {args.layers} layers, hidden {args.hidden}, l={args.length}, global batch {args.batch}, "
          f"{args.steps} steps")
    for row in rows:
        print(f"  {row['processes']} process(es): {row['tokens_per_s']:.0f} tokens/s "
              f"({row['train_runtime_s']:.1f} s)")
    write_output(args, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
