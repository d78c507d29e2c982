"""`lex convert-hf` and `lex convert-to-hf`: the command lines of convert.hf."""

import tempfile
from pathlib import Path

import torch

from convert import hf
from lex.commands import LexArgumentParser, add_quantize_argument, add_reading_arguments, check_reading_arguments
from lex.model_card import write_conversion_card
from lex.models import DTYPES, reading_settings
from lex.quantization import quantize_folder
from lex_base.errors import OutputExistsError


def convert_hf_parser() -> LexArgumentParser:
    parser = LexArgumentParser("convert-hf", description=hf.__doc__)
    parser.add_argument("src", type=Path, help="a Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 or "
                                                "Gemma 3 folder, or a .gguf file of one but SmolLM3 (or a folder "
                                                "of one)")
    parser.add_argument("out", type=Path, help="the LEX folder to write")
    add_reading_arguments(parser, attention_sinks=0, attention_sink_positions="cache", attention_memory_blocks=0)
    parser.add_argument("--position_embedding_type", choices=hf.RETROFITS, default="rope",
                        help="rope (the source's) or xpos: the same rotation plus xPos's scale, "
                             "xpos_scale_base = max_position_embeddings / 2 (needs fine-tuning)")
    parser.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: the source's; bfloat16 with --quantize)")
    add_quantize_argument(parser)
    parser.add_argument("--force", action="store_true", help="replace an existing OUT")
    return parser


def main_convert_hf(argv: list[str] | None = None) -> int:
    parser = convert_hf_parser()
    args = parser.parse_args(argv)
    check_reading_arguments(parser, args)
    convert = dict(attention_sinks=args.attention_sinks, attention_sink_positions=args.attention_sink_positions,
                   position_embedding_type=args.position_embedding_type,
                   attention_memory_blocks=args.attention_memory_blocks,
                   attention_memory_block_size=args.attention_memory_block_size)
    if args.quantize is None:
        config = hf.convert_hf(args.src, args.out, args.attention_mode, args.attention_window, args.dtype,
                               args.force, **convert, card=write_conversion_card)
    else:  # converted unquantized into a scratch folder beside OUT, then quantized into OUT
        if args.out.exists() and not args.force:
            raise OutputExistsError(f"{args.out.absolute()} exists; pass --force to replace it")
        args.out.absolute().parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=args.out.absolute().parent, prefix=f".{args.out.name}.lex-") as scratch:
            config = hf.convert_hf(args.src, Path(scratch) / "lex", args.attention_mode, args.attention_window,
                                   args.dtype, **convert, card=write_conversion_card)
            dtype = getattr(torch, args.dtype or "bfloat16")
            quantize_folder(Path(scratch) / "lex", args.out, args.quantize, dtype, args.force)
    print(f"{args.src} -> {args.out}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_attention_heads} heads / {config.num_key_value_heads} key-value heads, "
          f"{config.position_embedding_type} (rope_type {config.rope_parameters['rope_type']}), "
          f"{reading_settings(config)}" + local_layers(config)
          + (f"; {args.quantize} weights" if args.quantize else ""))
    return 0


def local_layers(config) -> str:
    """What a summary adds for local layers (Gemma's): how many, and the window they keep."""
    count = sum(config.local_layers or ())
    if not count:
        return ""
    return (f"; {count} of the layers local, sliding over their own window {config.local_attention_window}"
            f"{' with their own rope' if config.local_rope_parameters else ''}")


def convert_to_hf_parser() -> LexArgumentParser:
    parser = LexArgumentParser("convert-to-hf", description=hf.__doc__)
    parser.add_argument("src", type=Path, help="a LEX folder with rope positions, full or sliding attention")
    parser.add_argument("out", type=Path, help="the Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 or Gemma 3 "
                                                "folder to write")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT")
    return parser


def main_convert_to_hf(argv: list[str] | None = None) -> int:
    args = convert_to_hf_parser().parse_args(argv)
    config = hf.convert_to_hf(args.src, args.out, args.force)
    window = f", sliding window {config.sliding_window}" if getattr(config, "sliding_window", None) else ""
    print(f"{args.src} -> {args.out}: {config.architectures[0]}{window}")
    return 0
