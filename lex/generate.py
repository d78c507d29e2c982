"""`lex generate MODEL --prompt-file FILE --max-new-tokens N`: continue a long document with the bounded cache.

The prompt is prefilled window by window (with a progress bar), then generate() streams the continuation.
Memory stays O(window) however long the prompt is.
"""

import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

import modeling_lex  # noqa: F401  (registers the Auto classes)
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
    parser.add_argument("--attention-mode", choices=["blockwise", "sliding", "full"],
                        help="override the model's attention_mode")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.prompt_file.is_file():
        parser.error(f"--prompt-file {args.prompt_file} does not exist")
    return args


def prefill(model, input_ids: torch.Tensor, cache: LexCache, progress: bool = True) -> None:
    """Feed all but the last prompt token through the cache, one window at a time."""
    window = model.config.attention_window
    chunks = range(0, input_ids.shape[1] - 1, window)
    with torch.no_grad():
        for start in tqdm(chunks, desc="prefill", unit="window", disable=not progress or len(chunks) < 2):
            stop = min(start + window, input_ids.shape[1] - 1)
            model(input_ids[:, start:stop], past_key_values=cache, use_cache=True, logits_to_keep=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    overrides = {"attention_mode": args.attention_mode} if args.attention_mode else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype), **overrides)
    model.to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = args.prompt_file.read_text(encoding="utf-8")
    input_ids = tokenizer(text, return_tensors="pt").input_ids.to(args.device)
    if input_ids.shape[1] == 0:
        print(f"lex generate: {args.prompt_file} holds no tokens", file=sys.stderr)
        return 2
    print(f"prompt: {input_ids.shape[1]} tokens; window {model.config.attention_window} "
          f"({model.config.attention_mode}); training length {model.config.max_position_embeddings}", file=sys.stderr)
    cache = LexCache(model.config)
    prefill(model, input_ids, cache)
    model.generate(
        input_ids,
        past_key_values=cache,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        streamer=TextStreamer(tokenizer, skip_prompt=True),
    )
    return 0
