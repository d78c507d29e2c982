"""`lex generate MODEL --prompt_file FILE --max_new_tokens N`: continue a long document with the bounded cache.

generate() reads the prompt window by window (a progress bar counts it), then streams the continuation to
stdout. In blockwise and sliding modes memory stays O(window + sinks) however long the prompt is. MODEL is a LEX
folder, or a Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 or Gemma 3 folder or .gguf file (dequantized,
with its tokenizer): as published by default (its own cache, which grows with the document), converted in memory to a
LEX model by --attention_mode / --attention_window / --attention_sinks (/ --attention_sink_positions) /
--attention_memory_blocks.

With a block memory past the window (--attention_memory_blocks K > 0, blocks of --attention_memory_block_size
tokens; blockwise and sliding modes), the evicted keys and values are kept and the K best blocks are read by
every prompt chunk and decoded token: the prompt is read as the model's long forward reads it (w tokens at a
time, the last w in forwards of b, the last token alone), the bar showing the store's size, which grows with the
prompt (in RAM, or memory-mapped in --memory_directory).

Read once, ask many (a LEX model): --save_state FOLDER saves the state of the read prompt (lex.document_state:
the window, sinks, block memory and tokens; atomically) and stops there unless --max_new_tokens is given; --state
FOLDER continues a saved state, reading only the new text (--prompt or --prompt_file, required: generate() reads at
least one new token; it is tokenized without the tokenizer's special tokens, as the document's continuation). A
state is refused by name when MODEL, its reading settings or its --dtype differ from the ones that saved it.
"""

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import TextStreamer

from convert.hf import SOURCE_TYPES
from lex.commands import (
    LexArgumentParser, add_quantize_argument, add_reading_arguments, add_tp_argument, check_quantize,
    check_reading_arguments, check_tp, only_rank_zero_speaks,
)
from lex.compiled_decoding import compile_decoding, read_prompt
from lex.data import DataError, check_text_file
from lex.document_state import DocumentState, disk_bytes, identity, read_steps
from lex.models import DTYPES, ModelError, load_model, load_tokenizer, model_config, reading_settings
from lex.quantization import weights_of
from modeling_lex import LexCache
from modeling_lex.generation import CACHE_NAME


def build_parser() -> LexArgumentParser:
    parser = LexArgumentParser("generate", description=__doc__)
    parser.add_argument("model", help="a LEX, Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 or Gemma 3 "
                                       "model folder (or Hub id) with its tokenizer, or such a .gguf file")
    parser.add_argument("--prompt_file", type=Path, help="UTF-8 text to continue (or --prompt)")
    parser.add_argument("--prompt", help="the text to continue, on the command line (or --prompt_file)")
    parser.add_argument("--state", type=Path,
                        help="continue the document state saved in this folder by --save_state: only the new text "
                             "(--prompt or --prompt_file) is read")
    parser.add_argument("--save_state", type=Path,
                        help="save the state of the read document (the prompt, after --state's if given) to this "
                             "folder, then stop, unless --max_new_tokens is given")
    parser.add_argument("--force", action="store_true", help="replace an existing --save_state folder")
    parser.add_argument("--max_new_tokens", type=int,
                        help="tokens to generate (default 200; with --save_state, none unless given)")
    parser.add_argument("--do_sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    add_reading_arguments(parser)
    parser.add_argument("--memory_directory", type=Path,
                        help="keep the block memory's keys and values in memory-mapped files in this folder instead "
                             "of RAM (its representatives, a ninth of it, stay in RAM)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="weights and activations (default: float32; quantized Linears multiply in bfloat16)")
    add_quantize_argument(parser)
    add_tp_argument(parser)
    parser.add_argument("--compile", action="store_true",
                        help="decode with one compiled step (torch.compile, fullgraph, on the static bounded cache; "
                             "the prompt is read first, uncompiled): no Python per layer; the first step compiles, "
                             "tens of seconds on a CPU. Not with the block memory, nor with --tp_plan")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar while reading the prompt")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 0 if args.save_state is not None else 200
    elif args.max_new_tokens < 1:
        parser.error(f"{parser.flag('max_new_tokens')} must be >= 1, got {args.max_new_tokens}")
    if not args.temperature > 0:
        parser.error(f"{parser.flag('temperature')} must be > 0, got {args.temperature}")
    check_reading_arguments(parser, args)
    if args.memory_directory is not None and not args.memory_directory.is_dir():
        parser.error(f"{parser.flag('memory_directory')} {args.memory_directory}: no such folder")
    if args.top_k < 0:
        parser.error(f"{parser.flag('top_k')} must be >= 0, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        parser.error(f"{parser.flag('top_p')} must be in (0, 1], got {args.top_p}")
    if (args.prompt is None) == (args.prompt_file is None):
        given = "both" if args.prompt is not None else "neither"
        parser.error(f"give the text as {parser.flag('prompt')} TEXT or {parser.flag('prompt_file')} FILE, exactly "
                     f"one of the two ({given} given; with {parser.flag('state')}, the new text to read after the "
                     "saved document)")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        parser.error(f"{parser.flag('prompt_file')} {args.prompt_file} does not exist")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"{parser.flag('device')} {args.device}: no CUDA device is available")
    check_quantize(parser, args.quantize, args.device)
    check_tp(parser, args)
    check_states(parser, args)
    if args.prompt_file is not None:
        flag = parser.flag("prompt_file")
        check_text_file(args.prompt_file, flag)
        args.text = args.prompt_file.read_text(encoding="utf-8")
        if not args.text.strip():
            raise DataError(f"{flag} {args.prompt_file}: the file holds no text")
    else:
        args.text = args.prompt
        if not args.text.strip():
            parser.error(f"{parser.flag('prompt')}: the text is empty")
    config = model_config(args.model, "MODEL", tokenizer=True, gguf=True)
    if config.model_type not in ("lex", *SOURCE_TYPES):
        raise ModelError(f"MODEL {args.model} holds a {config.model_type!r} model; lex generate runs LEX models and "
                         f"{', '.join(SOURCE_TYPES)} checkpoints")
    if args.compile:
        check_compile(parser, args, config)
    if (args.state or args.save_state) and config.model_type != "lex" and args.attention_mode is None:
        parser.error(f"{parser.flag('state' if args.state else 'save_state')} keeps the state of a LEX model's "
                     f"bounded cache; MODEL {args.model} is a {config.model_type!r} checkpoint: give "
                     f"{parser.flag('attention_mode')} (blockwise, sliding or full) to convert it")
    return args


def check_states(parser: LexArgumentParser, args: argparse.Namespace) -> None:
    """--state and --save_state: an existing state folder to read, a new one to write (or --force), in one eager
    process (a state holds a LexCache: neither the compiled step's static cache nor a sharded model's)."""
    for name in ("state", "save_state"):
        if getattr(args, name) is None:
            continue
        if args.compile:
            parser.error(f"{parser.flag('compile')} with {parser.flag(name)}: a document state is a LexCache, which "
                         "the compiled step's static cache does not hold (allowed: one of the two)")
        if args.tp_plan is not None:
            parser.error(f"{parser.flag(name)} with {parser.flag('tp_plan')} {args.tp_plan}: a document state is "
                         "kept by one process (allowed: one of the two)")
    if args.state is not None and not args.state.is_dir():
        parser.error(f"{parser.flag('state')} {args.state}: no such folder (a state saved by "
                     f"{parser.flag('save_state')})")
    if args.save_state is not None and args.save_state.exists() and not args.force:
        parser.error(f"{parser.flag('save_state')} {args.save_state} exists; pass {parser.flag('force')} to replace "
                     "it")


def check_compile(parser: LexArgumentParser, args: argparse.Namespace, config) -> None:
    """--compile decodes a LEX model (a checkpoint converted in memory by --attention_mode) on the static cache,
    which holds no block memory, in one process."""
    if args.tp_plan is not None:
        parser.error(f"{parser.flag('compile')} with {parser.flag('tp_plan')} {args.tp_plan}: the compiled step runs "
                     "in one process (allowed: one of the two)")
    if config.model_type != "lex" and args.attention_mode is None:
        parser.error(f"{parser.flag('compile')} decodes LEX models; MODEL {args.model} is a {config.model_type!r} "
                     f"checkpoint: give {parser.flag('attention_mode')} (blockwise, sliding or full) to convert it")
    blocks = args.attention_memory_blocks
    if blocks is None and config.model_type == "lex":
        blocks = config.attention_memory_blocks
    if blocks:
        parser.error(f"{parser.flag('compile')} with a block memory (attention_memory_blocks={blocks}): it chooses "
                     "blocks as the document grows, which one compiled step cannot hold (allowed: "
                     f"{parser.flag('attention_memory_blocks')} 0, or no {parser.flag('compile')})")


@contextmanager
def prompt_progress(model, length: int, enabled: bool) -> Iterator[None]:
    """A bar over the prompt tokens as generate() reads them (a window per forward); new tokens are not counted.
    Disabled, nothing is hooked (a compiled step holds no hook)."""
    if not enabled:
        yield
        return
    bar = tqdm(total=length, desc="prompt", unit="tok", file=sys.stderr)

    def count(module, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        if ids is not None and bar.n < length:
            bar.update(min(ids.shape[1], length - bar.n))

    handle = model.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        bar.close()


def read_and_save(model, input_ids: torch.Tensor, state: DocumentState | None, args: argparse.Namespace,
                  directory: str | None) -> LexCache | None:
    """Read `input_ids` after `state` (into a copy of it) or into a new LexCache, as generate()'s prefill reads a
    prompt, under a bar; save the state to --save_state. Answering (--max_new_tokens), returns a copy of the cache
    taken before its last forward, from which generate() reads that forward again (it reads at least one new token):
    the answer continues what was saved, exactly; else None."""
    source = identity(model)
    document = state.copy() if state is not None else DocumentState(
        LexCache(model.config, directory), torch.zeros(0, dtype=torch.long), None, source)
    spans = model.reading_spans(input_ids.shape[1])
    answering = bool(args.max_new_tokens)
    before_last = document.copy() if answering and len(spans) == 1 else None
    with tqdm(total=input_ids.shape[1], desc="prompt", unit="tok", disable=args.no_progress, file=sys.stderr) as bar:
        for index, ((begin, end), logits) in enumerate(zip(spans, read_steps(model, document.cache, input_ids))):
            if document.cache.policy.memory_tokens:
                bar.set_postfix_str(f"memory {document.cache.memory_bytes / 1e6:.1f} MB", refresh=False)
            bar.update(end - begin)
            if answering and index == len(spans) - 2:
                before_last = document.copy()
    saved = DocumentState(document.cache, torch.cat([document.tokens, input_ids[0].cpu()]), logits, source)
    saved.save(args.save_state, force=args.force)
    print(f"saved the state of {saved.tokens.shape[0]} tokens to {args.save_state} "
          f"({disk_bytes(args.save_state) / 1e6:.1f} MB on disk)", file=sys.stderr)
    return None if before_last is None else before_last.cache


@torch.no_grad()
def read_into_memory(model, input_ids: torch.Tensor, memory_directory: Path | None, enabled: bool) -> LexCache:
    """A LexCache (its block memory in RAM, or memory-mapped in `memory_directory`) that has read all but the last
    token of `input_ids` in the forwards the model's own long forward runs (`read_steps`, stopped before its last:
    the last token alone, which generate() reads), under a bar whose postfix is the store's size."""
    cache = LexCache(model.config, None if memory_directory is None else str(memory_directory))
    spans = model.reading_spans(input_ids.shape[1])[:-1]
    with tqdm(total=input_ids.shape[1] - 1, desc="prompt", unit="tok", disable=not enabled, file=sys.stderr) as bar:
        for (start, stop), _ in zip(spans, read_steps(model, cache, input_ids)):  # (zip asks no step past the spans)
            bar.set_postfix_str(f"memory {cache.memory_bytes / 1e6:.1f} MB", refresh=False)
            bar.update(stop - start)
    return cache


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tp_plan is not None:
        only_rank_zero_speaks()
    torch.manual_seed(args.seed)
    model = load_model(args.model, args.attention_mode, args.device, args.dtype, args.attention_window,
                       args.attention_sinks, args.attention_sink_positions, args.attention_memory_blocks,
                       args.attention_memory_block_size, args.quantize, args.tp_plan)
    tokenizer = load_tokenizer(args.model)
    directory = None if args.memory_directory is None else str(args.memory_directory)
    state = None if args.state is None else DocumentState.load(args.state, model, directory)
    # (after a state, the text continues the document: no special tokens in front of it)
    input_ids = tokenizer(args.text, add_special_tokens=state is None, return_tensors="pt").input_ids.to(args.device)
    if input_ids.shape[1] == 0:
        source = args.prompt_file if args.prompt_file is not None else "--prompt"
        raise DataError(f"{source} holds no tokens of the model's tokenizer")
    config = model.config
    reading = reading_settings(config)
    if config.model_type != "lex":
        reading += "; its cache grows with the document (--attention_mode sliding or blockwise bounds it)"
    weights = weights_of(model) if getattr(config, "quantization_config", None) is not None else None
    weights = f"; {weights} weights, {model.dtype} activations" if weights else ""
    after = "" if state is None else f" after the {state.tokens.shape[0]} of the state in {args.state}"
    print(f"prompt: {input_ids.shape[1]} tokens{after}; {reading}; training length {config.max_position_embeddings}"
          f"{weights}", file=sys.stderr)
    memory = config.model_type == "lex" and bool(config.attention_memory_blocks)
    if args.memory_directory is not None and not memory:
        raise DataError(f"--memory_directory {args.memory_directory}: the model has no block memory to keep there "
                        "(give --attention_memory_blocks K > 0 with --attention_mode blockwise or sliding)")
    long_prompt = config.model_type == "lex" and input_ids.shape[1] >= 2 * config.attention_window  # read by windows
    start = time.perf_counter()
    cache = {}
    if args.save_state is not None:  # the prompt read here into a state, saved before generating
        before_last = read_and_save(model, input_ids, state, args, directory)
        if before_last is None:
            print(f"read {input_ids.shape[1]} tokens and saved the state in {time.perf_counter() - start:.1f} s",
                  file=sys.stderr)
            return 0
        cache = {CACHE_NAME: before_last}
        long_prompt = False
    elif state is not None:  # generate() reads the new tokens after the state's
        cache = {CACHE_NAME: state.cache}
    elif args.compile:  # the prompt read uncompiled into the static cache, then one compiled step for every token
        slots = input_ids.shape[1] + args.max_new_tokens if config.attention_mode == "full" else None
        cache = {CACHE_NAME: read_prompt(model, input_ids, slots)}
        compile_decoding(model)
        print("compiling the decoding step", file=sys.stderr)
        long_prompt = False
    elif memory:  # the prompt read here (all but its last token), the store's size shown once it passes the window
        enabled = input_ids.shape[1] > config.attention_window and not args.no_progress
        cache = {CACHE_NAME: read_into_memory(model, input_ids, args.memory_directory, enabled)}
        long_prompt = False
    new_text = input_ids.shape[1]
    if state is not None:
        input_ids = torch.cat([state.tokens.to(input_ids.device)[None], input_ids], dim=1)
    with prompt_progress(model, new_text, enabled=long_prompt and not args.no_progress):
        output = model.generate(
            input_ids,
            **cache,  # (generate feeds it only the tokens it has not seen: the prompt's last)
            attention_mask=torch.ones_like(input_ids),  # the prompt has no padding, even if it holds the pad token
            return_dict_in_generate=True,  # for the cache generate() made: LexCache for a LEX model
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            streamer=TextStreamer(tokenizer, skip_prompt=True),
        )
    seconds = time.perf_counter() - start
    new = output.sequences.shape[1] - input_ids.shape[1]
    held = getattr(output, CACHE_NAME)
    store = (f"; the block memory holds {held.memory_bytes / 1e6:.1f} MB"
             + (f" in {args.memory_directory}" if args.memory_directory is not None else "")) if memory else ""
    print(f"read the prompt and generated {new} tokens in {seconds:.1f} s; the cache holds "
          f"{held.layers[0].keys.shape[2]} positions per layer{store}", file=sys.stderr)
    return 0
