"""Model-core speed and memory, side by side in one run.

1. Training step (forward + backward) tokens/s at the training length l: LEX-xpos, LEX-rope and HF
   LlamaForCausalLM (SDPA) of the same width and depth, with Llama's MLP sized to the same parameter count.
   Reported as ratios to Llama.
2. Blockwise forward tokens/s and peak RSS at n = 1k, 8k, 64k (each n in a fresh process, so peak RSS is
   that n's own).

    python benchmarks/model_speed.py [--output model_speed.json] [--lengths 1024,8192,65536]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import peak_rss_mb, write_output
from transformers import LlamaConfig, LlamaForCausalLM

import modeling_lex  # noqa: F401
from configuration_lex import LexConfig
from modeling_lex import LexForCausalLM


def lex_model(args, kind: str, mode: str = "blockwise") -> LexForCausalLM:
    config = LexConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=args.length,
        position_embedding_type=kind,
        attention_mode=mode,
    )
    return LexForCausalLM(config)


def llama_model(args) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=(8 * args.hidden) // 3,  # 3 matrices of 8/3 h = LEX's 2 of 4 h
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=args.length,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def train_step_rate(model, args) -> float:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.length))
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return args.steps * args.batch * args.length / (time.perf_counter() - start)


def forward_rate(args, n: int) -> dict:
    """Run in a child process: blockwise forward tokens/s and this process's peak RSS at length n."""
    model = lex_model(args, "xpos").eval()
    ids = torch.randint(0, args.vocab, (1, n))
    with torch.no_grad():
        model(ids, logits_to_keep=1)
        start = time.perf_counter()
        for _ in range(args.repeats):
            model(ids, logits_to_keep=1)
        seconds = (time.perf_counter() - start) / args.repeats
    return {"n": n, "tokens_per_s": n / seconds, "peak_rss_mb": peak_rss_mb()}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--length", type=int, default=1024, help="training length l (= window)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lengths", default="1024,8192,65536")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child-n", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.child_n:
        print(json.dumps(forward_rate(args, args.child_n)))
        return 0

    passthrough = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "heads", "vocab", "length", "repeats", "threads")]
    lengths = []
    for n in (int(x) for x in args.lengths.split(",")):
        out = subprocess.run([sys.executable, __file__, *passthrough, f"--child-n={n}"], capture_output=True, text=True, check=True)
        lengths.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = lengths[0]
    for row in lengths:
        row["rate_vs_first"] = row["tokens_per_s"] / base["tokens_per_s"]

    rates = {}
    for name, build in [("llama_sdpa", lambda: llama_model(args)), ("lex_xpos", lambda: lex_model(args, "xpos")),
                        ("lex_rope", lambda: lex_model(args, "rope"))]:
        model = build()
        rates[name] = {"params": sum(p.numel() for p in model.parameters()), "tokens_per_s": train_step_rate(model, args)}
    for name in rates:
        rates[name]["ratio_to_llama"] = rates[name]["tokens_per_s"] / rates["llama_sdpa"]["tokens_per_s"]

    print(f"train step (fwd+bwd), {args.layers} layers, hidden {args.hidden}, l={args.length}, batch {args.batch}, "
          f"{args.threads} threads")
    print(f"{'model':<12}{'params':>10}{'tokens/s':>12}{'vs llama':>10}")
    for name, row in rates.items():
        print(f"{name:<12}{row['params']:>10}{row['tokens_per_s']:>12.0f}{row['ratio_to_llama']:>10.3f}")
    print(f"\nblockwise forward (xpos, w={args.length}), one process per n")
    print(f"{'n':>8}{'tokens/s':>12}{'vs first':>10}{'peak RSS MB':>13}")
    for row in lengths:
        print(f"{row['n']:>8}{row['tokens_per_s']:>12.0f}{row['rate_vs_first']:>10.3f}{row['peak_rss_mb']:>13.0f}")
    write_output(args, {"train_step": rates, "blockwise_forward": lengths})
    return 0


if __name__ == "__main__":
    sys.exit(main())
