"""Decoding speed and memory with long contexts: LEX (blockwise, bounded cache) beside HF Llama (DynamicCache).

Each (model, context) runs in a fresh process so its peak RSS (VmHWM) is its own. The context is prefilled
(LEX: window by window through the bounded cache), then --new tokens are decoded greedily and timed.

    python benchmarks/generate_speed.py [--contexts 1000,10000,100000] [--llama-contexts 1000,10000] [--output x.json]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build(kind: str, args):
    if kind == "lex":
        import modeling_lex  # noqa: F401
        from configuration_lex import LexConfig
        from modeling_lex import LexForCausalLM

        config = LexConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           max_position_embeddings=args.window, attention_mode="blockwise")
        return LexForCausalLM(config).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=(8 * args.hidden) // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         max_position_embeddings=max(args.window, 131072), attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def child(kind: str, context: int, args) -> dict:
    torch.manual_seed(0)
    model = build(kind, args)
    ids = torch.randint(0, args.vocab, (1, context))
    baseline = peak_rss_mb()
    if kind == "lex":
        from modeling_lex import LexCache

        cache = LexCache(model.config)
    else:
        from transformers import DynamicCache

        cache = DynamicCache()
    start = time.perf_counter()
    logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    prefill_seconds = time.perf_counter() - start
    token = logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(args.new):
        token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    seconds = time.perf_counter() - start
    held = cache.layers[0].keys.shape[2]
    return {"model": kind, "context": context, "decode_tokens_per_s": args.new / seconds,
            "prefill_tokens_per_s": context / prefill_seconds, "peak_rss_mb": peak_rss_mb(),
            "rss_before_prefill_mb": baseline, "prompt_ids_mb": ids.numel() * ids.element_size() / 2**20,
            "cache_positions_per_layer": held}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--new", type=int, default=128, help="tokens decoded and timed")
    parser.add_argument("--contexts", default="1000,10000,100000")
    parser.add_argument("--llama-contexts", default="1000,10000")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        kind, context = args.child.split(":")
        print(json.dumps(child(kind, int(context), args)))
        return 0
    shared = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "heads", "vocab", "window", "new", "threads")]
    jobs = [("lex", int(c)) for c in args.contexts.split(",")] + [("llama", int(c)) for c in args.llama_contexts.split(",") if c]
    rows = []
    for kind, context in jobs:
        out = subprocess.run([sys.executable, __file__, *shared, f"--child={kind}:{context}"], capture_output=True,
                             text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for kind in ("lex", "llama"):
        first = next((r for r in rows if r["model"] == kind), None)
        for row in (r for r in rows if r["model"] == kind):
            row["speed_vs_first"] = row["decode_tokens_per_s"] / first["decode_tokens_per_s"]
            row["rss_vs_first"] = (row["peak_rss_mb"] - row["prompt_ids_mb"]) / (first["peak_rss_mb"] - first["prompt_ids_mb"])
    print(f"decode {args.new} tokens after a context; {args.layers} layers, hidden {args.hidden}, "
          f"LEX window {args.window} (blockwise), {args.threads} threads")
    print(f"{'model':<7}{'context':>9}{'decode tok/s':>14}{'vs first':>10}{'peak RSS MB':>13}{'vs first':>10}"
          f"{'cache/layer':>13}")
    for r in rows:
        print(f"{r['model']:<7}{r['context']:>9}{r['decode_tokens_per_s']:>14.1f}{r['speed_vs_first']:>10.3f}"
              f"{r['peak_rss_mb']:>13.0f}{r['rss_vs_first']:>10.3f}{r['cache_positions_per_layer']:>13}")
    if args.output:
        args.output.write_text(json.dumps({"rows": rows, "settings": vars(args)}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
