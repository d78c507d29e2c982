"""Decoding speed and memory with long contexts: LEX (blockwise, bounded LexCache) beside HF Llama (DynamicCache).

Each (model, context) runs `generate()` in a fresh process, so its peak RSS (VmHWM) is its own; the jobs
run --repeats times, interleaved, and the table keeps each job's fastest run. A streamer stamps the time of
every token: the prompt's prefill (LEX: window by window through the bounded cache) is the time to the first
new token, decoding the median time between the next ones. Peak RSS is also shown net of the process before
generate() (model and libraries loaded): that is what a context costs.

    python benchmarks/generate_speed.py [--contexts 1000,10000,100000] [--llama-contexts 1000,10000] [--output x.json]
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from common import Clock, peak_rss_mb, write_output

from configuration_lex import ATTENTION_MODES
from modeling_lex.generation import CACHE_NAME


def build(kind: str, args):
    if kind == "lex":
        import modeling_lex  # noqa: F401
        from configuration_lex import LexConfig
        from modeling_lex import LexForCausalLM

        config = LexConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           max_position_embeddings=args.window, attention_mode=args.mode)
        return LexForCausalLM(config).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=(8 * args.hidden) // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         max_position_embeddings=131072, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def child(kind: str, context: int, args) -> dict:
    torch.manual_seed(0)
    model = build(kind, args).to(args.device)
    ids = torch.randint(1, args.vocab, (1, context), device=args.device)
    mask = torch.ones_like(ids)
    before = peak_rss_mb()
    clock = Clock()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                         do_sample=False, pad_token_id=0, eos_token_id=None, streamer=clock,
                         return_dict_in_generate=True)
    peak = peak_rss_mb()
    device_peak = torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda") else None
    prompt_at, first_at, *_ = clock.stamps
    steps = clock.steps()
    prompt_mb = 2 * ids.numel() * ids.element_size() / 2**20  # the prompt's ids and mask
    return {
        "model": kind, "context": context, "new_tokens": out.sequences.shape[1] - context,
        "decode_tokens_per_s": 1 / statistics.median(steps),
        "decode_tokens_per_s_mean": len(steps) / sum(steps),
        "prefill_tokens_per_s": context / (first_at - prompt_at),
        "peak_rss_mb": peak, "rss_before_generate_mb": before, "prompt_ids_mb": prompt_mb,
        "peak_rss_net_mb": peak - prompt_mb, "rss_growth_mb": peak - before, "peak_cuda_mb": device_peak,
        "cache_positions_per_layer": getattr(out, CACHE_NAME).layers[0].keys.shape[2],
    }


def run_child(kind: str, context: int, args) -> dict:
    shared = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "heads", "vocab", "window", "mode", "new",
                                                     "threads", "device")]
    out = subprocess.run([sys.executable, __file__, *shared, f"--child={kind}:{context}"], capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"{kind} at {context} tokens failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256, help="LEX attention_window (= its training length)")
    parser.add_argument("--mode", default="blockwise", choices=ATTENTION_MODES)
    parser.add_argument("--new", type=int, default=128, help="tokens generated; all but the first are timed")
    parser.add_argument("--contexts", default="1000,10000,100000")
    parser.add_argument("--llama-contexts", default="1000,10000")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: a tiny model's decoding is latency-bound; steadier on a shared box)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each job; the table keeps each job's fastest (least disturbed) run")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (then peak CUDA memory is shown too)")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        kind, context = args.child.split(":")
        print(json.dumps(child(kind, int(context), args)))
        return 0
    jobs = [("lex", int(c)) for c in args.contexts.split(",") if c]
    jobs += [("llama", int(c)) for c in args.llama_contexts.split(",") if c]
    runs = {job: [] for job in jobs}
    for _ in range(args.repeats):  # interleaved, so a busy spell of the machine hits every job alike
        for kind, context in jobs:
            runs[kind, context].append(run_child(kind, context, args))
    rows = []
    for job in jobs:
        best = max(runs[job], key=lambda r: r["decode_tokens_per_s"])
        rows.append({**best, "decode_tokens_per_s_all": [r["decode_tokens_per_s"] for r in runs[job]]})
    for kind in ("lex", "llama"):
        mine = [r for r in rows if r["model"] == kind]
        for row in mine:
            row["speed_vs_first"] = row["decode_tokens_per_s"] / mine[0]["decode_tokens_per_s"]
            row["rss_vs_first"] = row["peak_rss_net_mb"] / mine[0]["peak_rss_net_mb"]
    print(f"generate(): {args.new} new tokens after a context; {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads, vocab {args.vocab}; LEX window {args.window} ({args.mode}); {args.device}, "
          f"{args.threads} thread(s)")
    print(f"best of {args.repeats} runs; decode tok/s = 1 / median time per token; RSS net = peak RSS - prompt ids "
          "and mask; growth = peak RSS - RSS before generate()")
    header = ("model", "context", "prefill tok/s", "decode tok/s", "vs first", "RSS net MB", "vs first",
              "growth MB", "cache/layer") + (("CUDA peak MB",) if args.device.startswith("cuda") else ())
    print("".join(f"{h:>14}" for h in header))
    for r in rows:
        cells = (r["model"], r["context"], f"{r['prefill_tokens_per_s']:.0f}", f"{r['decode_tokens_per_s']:.1f}",
                 f"{r['speed_vs_first']:.3f}", f"{r['peak_rss_net_mb']:.0f}", f"{r['rss_vs_first']:.3f}",
                 f"{r['rss_growth_mb']:.1f}", r["cache_positions_per_layer"])
        if r["peak_cuda_mb"] is not None:
            cells += (f"{r['peak_cuda_mb']:.1f}",)
        print("".join(f"{c:>14}" for c in cells))
    lex_rows = [r for r in rows if r["model"] == "lex"]
    if len(lex_rows) > 1:
        last = lex_rows[-1]
        print(f"goals at {last['context']} vs {lex_rows[0]['context']} tokens: speed {last['speed_vs_first']:.3f} "
              f"(>= 0.9: {last['speed_vs_first'] >= 0.9}), RSS {last['rss_vs_first']:.3f} "
              f"(<= 1.1: {last['rss_vs_first'] <= 1.1})")
    write_output(args, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
