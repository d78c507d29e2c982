"""`lex convert-hf` and `lex convert-to-hf`: the command lines of convert.hf.

Every flag has both spellings (`--attention_mode` and `--attention-mode`). Every error, a bad argument included,
is one line `lex COMMAND: ...` on stderr with exit status 2, and nothing is written.
"""

import argparse
import sys
from pathlib import Path

from configuration_lex import ATTENTION_MODES
from convert import hf
from convert.checkpoint import ConversionError
from lex.models import DTYPES


class UsageError(Exception):
    """A bad command line, reported as one line like every other error."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def parser_for(prog: str) -> Parser:
    return Parser(prog=prog, description=hf.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)


def run(prog: str, parser: Parser, argv: list[str] | None, convert) -> int:
    """Parse, convert, and turn every refusal into one line on stderr with exit status 2."""
    try:
        args = parser.parse_args(argv)
        message = convert(args)
    except (UsageError, ConversionError, OSError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    print(message)
    return 0


def main_convert_hf(argv: list[str] | None = None) -> int:
    parser = parser_for("lex convert-hf")
    parser.add_argument("src", type=Path, help="a LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM folder")
    parser.add_argument("out", type=Path, help="the LEX folder to write")
    parser.add_argument("--attention_mode", "--attention-mode", dest="attention_mode", choices=ATTENTION_MODES,
                        help="default: what the source computes (full, or sliding for a sliding window)")
    parser.add_argument("--attention_window", "--attention-window", dest="attention_window", type=int,
                        help="w (even, >= 4); default: the source's sliding window, else max_position_embeddings")
    parser.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: the source's)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT")

    def convert(args) -> str:
        config = hf.convert_hf(args.src, args.out, args.attention_mode, args.attention_window, args.dtype, args.force)
        return (f"{args.src} -> {args.out}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                f"{config.num_attention_heads} heads / {config.num_key_value_heads} key-value heads, rope "
                f"{config.rope_parameters['rope_type']}, {config.attention_mode} attention (window "
                f"{config.attention_window})")

    return run("lex convert-hf", parser, argv, convert)


def main_convert_to_hf(argv: list[str] | None = None) -> int:
    parser = parser_for("lex convert-to-hf")
    parser.add_argument("src", type=Path, help="a LEX folder with rope positions, full or sliding attention")
    parser.add_argument("out", type=Path, help="the Llama, Mistral or Qwen2 folder to write")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT")

    def convert(args) -> str:
        config = hf.convert_to_hf(args.src, args.out, args.force)
        window = f", sliding window {config.sliding_window}" if getattr(config, "sliding_window", None) else ""
        return f"{args.src} -> {args.out}: {config.architectures[0]}{window}"

    return run("lex convert-to-hf", parser, argv, convert)
