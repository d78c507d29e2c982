"""`lex convert-torchscale` and `lex convert-to-torchscale`: the command lines of convert.torchscale."""

from pathlib import Path
from typing import Literal, get_args

from configuration_lex import ATTENTION_MODES
from convert import torchscale
from convert.checkpoint import ConversionError
from lex.commands import LexArgumentParser
from lex.models import DTYPES

# What `lex convert-to-torchscale --format` writes (convert.torchscale.convert_to_torchscale's `fmt`).
TorchScaleFormat = Literal["auto", "decoder", "fairseq"]
FORMATS: tuple[str, ...] = get_args(TorchScaleFormat)


def from_torchscale_parser() -> LexArgumentParser:
    parser = LexArgumentParser("convert-torchscale", description=torchscale.__doc__)
    parser.add_argument("checkpoint", type=Path, help="a Decoder state dict (.pt) or a fairseq checkpoint")
    parser.add_argument("out_dir", type=Path, help="the HF folder to write")
    parser.add_argument("--config", type=Path, help="JSON of the DecoderConfig keyword arguments (plain state dicts)")
    parser.add_argument("--tokenizer", type=Path, help="a local tokenizer folder to save with the model")
    parser.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: the checkpoint's)")
    parser.add_argument("--attention_mode", choices=ATTENTION_MODES,
                        help="default blockwise (LEX's BCA; the same as TorchScale up to the window)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    return parser


def to_torchscale_parser() -> LexArgumentParser:
    parser = LexArgumentParser("convert-to-torchscale", description=torchscale.__doc__)
    parser.add_argument("hf_dir", type=Path, help="a LEX model folder")
    parser.add_argument("out", type=Path, help="OUT.pt (a Decoder state dict also gets OUT.json, its config)")
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="auto: fairseq if the model has fairseq's sinusoidal positions, else decoder")
    parser.add_argument("--force", action="store_true", help="replace existing outputs")
    return parser


def main_from_torchscale(argv: list[str] | None = None) -> int:
    args = from_torchscale_parser().parse_args(argv)
    if args.checkpoint.is_file() and args.checkpoint.stat().st_size < 64:  # a torch.save file is a zip or a pickle
        raise ConversionError(f"CHECKPOINT {args.checkpoint}: not a checkpoint (the file holds "
                              f"{args.checkpoint.stat().st_size} bytes)")
    config = torchscale.convert_from_torchscale(args.checkpoint, args.out_dir, args.config, args.tokenizer,
                                                args.dtype, args.attention_mode, args.force)
    positions = config.position_embedding_type + (" + sinusoidal" if config.absolute_position_embedding else "")
    print(f"{args.checkpoint} -> {args.out_dir}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"positions {positions}, {config.attention_mode} attention (window {config.attention_window})")
    return 0


def main_to_torchscale(argv: list[str] | None = None) -> int:
    args = to_torchscale_parser().parse_args(argv)
    written = torchscale.convert_to_torchscale(args.hf_dir, args.out, args.format, args.force)
    print(f"{args.hf_dir} -> {' + '.join(map(str, written))}")
    return 0
