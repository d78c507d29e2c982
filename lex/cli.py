"""`lex COMMAND ...`: one entry point; each command's main lives in lex/commands/ and is imported on demand.

One contract for every command (lex/commands/__init__.py says how a command keeps it): a user error (a
LexError, a bad command line, an OSError on the user's files) is one line `lex COMMAND: message` on stderr
and exit status 2, without a traceback; SIGTERM (a scheduler's preemption, `timeout`) unwinds like Ctrl-C, so
staging folders are removed, and exits with status 143; any other exception is a bug and keeps its traceback.
"""

import importlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from lex.commands import UsageError
from lex_base.errors import LexError

COMMANDS = {
    "demo": ("lex.commands.demo", "main", "train xpos/rope/alibi at a short length and compare them far beyond it"),
    "train": ("lex.commands.train", "main", "train or fine-tune with the HF Trainer (run_clm-style arguments)"),
    "eval-length": ("lex.commands.eval_length", "main", "perplexity by evaluation length, resolution, passkey"),
    "generate": ("lex.commands.generate", "main", "generate from a long prompt with the bounded cache"),
    "serve": ("lex.commands.serve", "main", "an OpenAI-compatible server decoding concurrent requests together"),
    "convert-torchscale": ("lex.commands.convert", "main_from_torchscale", "TorchScale checkpoint -> HF folder"),
    "convert-to-torchscale": ("lex.commands.convert", "main_to_torchscale", "HF folder -> TorchScale state dict"),
    "convert-hf": ("lex.commands.convert_hf", "main_convert_hf", "Llama-family / Qwen3 / Phi-3 / SmolLM3 / Gemma 2-3 -> LEX"),
    "convert-to-hf": ("lex.commands.convert_hf", "main_convert_to_hf", "LEX folder (rope) -> its HF family"),
    "export": ("lex.commands.export", "main", "a Hub-ready folder loadable with trust_remote_code"),
}
# torchao 0.18 (the cpu-quant extra), which transformers 5.23-5.25 import whenever it is installed, logs as it is
# imported that its CUDA kernels do not load on a CPU build of torch and, under torch 2.13, that its enums need no
# pytree registration: noise on stderr, where a command prints one line per error. Their errors still show.
QUIET_AT_IMPORT = ("torchao", "torch.utils._pytree")
TERMINATED = 128 + signal.SIGTERM  # the status a shell reports for a process ended by SIGTERM


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM: like KeyboardInterrupt, it unwinds every `finally` (the staging
    folders of lex_base.staging) and is not caught by `except Exception`."""


def usage() -> str:
    lines = ["usage: lex COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<22} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "lex COMMAND --help shows a command's arguments."]
    return "\n".join(lines)


def close_progress_bars() -> None:
    """End the line of a progress bar that an error interrupted, so that the error starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    else:
        text = str(error) or type(error).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While a command runs: SIGTERM raises Terminated in the main thread (elsewhere signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for logger in QUIET_AT_IMPORT:
        logging.getLogger(logger).setLevel(logging.ERROR)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lex: unknown command {name!r}; one of {', '.join(COMMANDS)} (lex --help)", file=sys.stderr)
        return 2
    module_name, function_name, _ = COMMANDS[name]
    with sigterm_unwinds():
        function = getattr(importlib.import_module(module_name), function_name)
        try:
            return function(rest) or 0
        except UsageError as error:
            close_progress_bars()
            print(f"lex {name}: {one_line(error)} (lex {name} --help lists the arguments)", file=sys.stderr)
            return 2
        except (LexError, OSError) as error:
            close_progress_bars()
            print(f"lex {name}: {one_line(error)}", file=sys.stderr)
            return 2
        except Terminated:
            close_progress_bars()
            print(f"lex {name}: terminated (SIGTERM)", file=sys.stderr)
            return TERMINATED


if __name__ == "__main__":
    sys.exit(main())
