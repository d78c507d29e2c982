"""Every benchmark of the project in one run, collected into one JSON file.

    python benchmarks/run_all.py [--output benchmarks.json] [--full]

Without --full the scripts run with small settings (a few minutes in all); --full uses each script's
defaults (the figures quoted in the issues' closing notes). gpu_check.py runs too when CUDA is present.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMALL = {
    "model_speed.py": ["--steps", "2", "--lengths", "1024,8192"],
    "generate_speed.py": ["--contexts", "1000,10000", "--llama-contexts", "1000", "--new", "32"],
    "train_speed.py": ["--steps", "10"],
    "eval_speed.py": ["--lengths", "1024,8192"],
    "compile_speed.py": ["--contexts", "1000,10000", "--layers", "2", "--new", "32", "--steps", "2"],
    "llama_speed.py": ["--layers", "2", "--repeats", "3", "--new", "16"],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("benchmarks.json"))
    parser.add_argument("--full", action="store_true", help="each script's default (larger) settings")
    args = parser.parse_args(argv)
    scripts = list(SMALL)
    try:
        import torch

        if torch.cuda.is_available():
            scripts.append("gpu_check.py")
    except ImportError:
        pass
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for script in scripts:
            out = Path(workdir) / f"{script}.json"
            extra = [] if args.full else SMALL.get(script, [])
            print(f"== {script} {' '.join(extra)}", flush=True)
            subprocess.run([sys.executable, str(HERE / script), *extra, "--output", str(out)], check=True)
            results[script.removesuffix(".py")] = json.loads(out.read_text())
    args.output.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
