"""`lex serve MODEL`: an OpenAI-compatible HTTP server (/v1/models, /v1/completions, /v1/chat/completions) that
decodes every request in flight together.

MODEL is what `lex generate` takes: a LEX folder, or a Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 or
Gemma 3 folder or .gguf file, converted in memory to a LEX model by the --attention_* flags (without them, to full
attention: the checkpoint as published). Each request's prompt is read alone, a window at a time between the
decoding steps of the others; /v1/models lists the model under the name MODEL was given as. With
--state_cache_bytes, read documents are kept (in RAM, least recently used first out; spilled to --state_dir,
which a restarted server finds again) and a request whose prompt begins with one starts from it. Needs the
`serve` extra: pip install "lex-transformer[serve]".
"""

import argparse
import sys
from pathlib import Path

import torch

from convert.hf import SOURCE_TYPES
from lex.commands import (
    LexArgumentParser, add_quantize_argument, add_reading_arguments, check_quantize, check_reading_arguments,
    positive_int,
)
from lex.data import DataError
from lex.models import DTYPES, ModelError, load_model, load_tokenizer, model_config, reading_settings


def build_parser() -> LexArgumentParser:
    parser = LexArgumentParser("serve", description=__doc__)
    parser.add_argument("model", help="a LEX, Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 or Gemma 3 "
                                       "model folder with its tokenizer, or such a .gguf file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_reading_arguments(parser)
    parser.add_argument("--dtype", choices=DTYPES,
                        help="weights and activations (default: float32; quantized Linears multiply in bfloat16)")
    add_quantize_argument(parser)
    parser.add_argument("--threads", type=positive_int, help="CPU threads torch computes with (default: torch's)")
    parser.add_argument("--max_batch_size", type=positive_int, default=16,
                        help="requests decoded together at most (more wait for a row)")
    parser.add_argument("--max_new_tokens_limit", type=positive_int, default=4096,
                        help="the largest max_tokens a request may ask for")
    parser.add_argument("--default_max_tokens", type=positive_int,
                        help="new tokens for a request that gives no max_tokens (default: 256, or the limit if less)")
    parser.add_argument("--max_prompt_tokens", type=positive_int, default=1 << 20,
                        help="the longest prompt a request may send, in tokens")
    parser.add_argument("--state_cache_bytes", type=int, default=0,
                        help="bytes of read documents' states kept in RAM for later requests (0: none kept)")
    parser.add_argument("--state_dir", type=Path,
                        help="a folder where kept states pushed out of RAM (and all of them at shutdown) are saved, "
                             "and found again after a restart")
    parser.add_argument("--tp_plan", choices=("auto",),
                        help="refused: lex serve runs in one process (serve a sharded model behind transformers "
                             "serve, or run one lex serve per device: docs/guides/serving.md)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_reading_arguments(parser, args)
    check_quantize(parser, args.quantize, "cpu")
    if args.tp_plan is not None:
        parser.error(f"{parser.flag('tp_plan')} {args.tp_plan}: lex serve decodes in one process, whose engine "
                     "batches every request (allowed: no --tp_plan; several replicas behind a load balancer, "
                     "docs/guides/serving.md)")
    if not 0 < args.port < 65536:
        parser.error(f"{parser.flag('port')} must be in 1..65535, got {args.port}")
    if args.state_cache_bytes < 0:
        parser.error(f"{parser.flag('state_cache_bytes')} must be >= 0 (0: no states kept), got "
                     f"{args.state_cache_bytes}")
    if args.state_dir is not None and args.state_cache_bytes == 0:
        parser.error(f"{parser.flag('state_dir')} keeps states pushed out of RAM: give "
                     f"{parser.flag('state_cache_bytes')} > 0 too")
    if args.state_dir is not None and args.state_dir.exists() and not args.state_dir.is_dir():
        parser.error(f"{parser.flag('state_dir')} {args.state_dir}: a file, not a folder")
    if args.default_max_tokens is None:
        args.default_max_tokens = min(256, args.max_new_tokens_limit)
    if args.default_max_tokens > args.max_new_tokens_limit:
        parser.error(f"{parser.flag('default_max_tokens')} {args.default_max_tokens} is past "
                     f"{parser.flag('max_new_tokens_limit')} {args.max_new_tokens_limit}")
    config = model_config(args.model, "MODEL", tokenizer=True, gguf=True)
    if config.model_type not in ("lex", *SOURCE_TYPES):
        raise ModelError(f"MODEL {args.model} holds a {config.model_type!r} model; lex serve runs LEX models and "
                         f"{', '.join(SOURCE_TYPES)} checkpoints")
    if config.model_type != "lex" and args.attention_mode is None:
        args.attention_mode = "full"  # as published, read through LEX's caches
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvicorn

        from lex.serving.api import Limits, build_app
    except ImportError as error:
        raise DataError(f"lex serve needs the serve extra ({error.name} is missing): "
                        'pip install "lex-transformer[serve]"') from None
    from lex.serving.engine import Engine
    from lex.serving.states import StateStore

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, args.attention_mode, "cpu", args.dtype, args.attention_window,
                       args.attention_sinks, args.attention_sink_positions, args.attention_memory_blocks,
                       args.attention_memory_block_size, args.quantize)
    tokenizer = load_tokenizer(args.model)
    config = model.config
    states = StateStore(model, args.state_cache_bytes, args.state_dir)
    engine = Engine(model, tokenizer, args.max_batch_size, states)
    limits = Limits(max_new_tokens=args.max_new_tokens_limit, max_prompt_tokens=args.max_prompt_tokens,
                    default_max_tokens=args.default_max_tokens)
    print(f"lex serve: {args.model} ({reading_settings(config)}; {torch.get_num_threads()} threads) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        uvicorn.run(build_app(engine, args.model, limits), host=args.host, port=args.port, log_level="warning")
    finally:
        states.close()
    return 0
