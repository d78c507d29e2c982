"""`lex generate MODEL --prompt-file FILE --max-new-tokens N`: continue a long document with the bounded cache.

generate() reads the prompt window by window (a progress bar counts it), then streams the continuation to
stdout. In blockwise and sliding modes memory stays O(window) however long the prompt is.
"""

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, TextStreamer

from configuration_lex import ATTENTION_MODES
from lex.models import DTYPES, load_model
from modeling_lex import LexCache


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lex generate", description=__doc__)
    parser.add_argument("model", help="a LEX model folder (or Hub id) with its tokenizer")
    parser.add_argument("--prompt-file", type=Path, required=True, help="UTF-8 text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-mode", choices=ATTENTION_MODES,
                        help="override the model's attention_mode")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while reading the prompt")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt_file.is_file():
        parser.error(f"--prompt-file {args.prompt_file} does not exist")
    return args


@contextmanager
def prompt_progress(model, length: int, enabled: bool) -> Iterator[None]:
    """A bar over the prompt tokens as generate() reads them (a window per forward); new tokens are not counted."""
    bar = tqdm(total=length, desc="prompt", unit="tok", disable=not enabled, file=sys.stderr)

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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = load_model(args.model, args.attention_mode, args.device, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = args.prompt_file.read_text(encoding="utf-8")
    input_ids = tokenizer(text, return_tensors="pt").input_ids.to(args.device)
    if input_ids.shape[1] == 0:
        print(f"lex generate: {args.prompt_file} holds no tokens", file=sys.stderr)
        return 2
    config = model.config
    print(f"prompt: {input_ids.shape[1]} tokens; {config.attention_mode} attention, window "
          f"{config.attention_window}; training length {config.max_position_embeddings}", file=sys.stderr)
    cache = LexCache(config)
    long_prompt = input_ids.shape[1] >= 2 * config.attention_window
    start = time.perf_counter()
    with prompt_progress(model, input_ids.shape[1], enabled=long_prompt and not args.no_progress):
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),  # the prompt has no padding, even if it holds the pad token
            past_key_values=cache,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            streamer=TextStreamer(tokenizer, skip_prompt=True),
        )
    seconds = time.perf_counter() - start
    new = output.shape[1] - input_ids.shape[1]
    print(f"read the prompt and generated {new} tokens in {seconds:.1f} s; the cache holds "
          f"{cache.layers[0].keys.shape[2]} positions per layer", file=sys.stderr)
    return 0
