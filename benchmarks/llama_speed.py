"""A converted Llama against the Llama itself: the same weights, side by side in one run.

1. Forward tokens/s at l (= max_position_embeddings), one sequence, every position's logits: the LEX model
   (convert.hf.lex_from_hf, full attention) against HF LlamaForCausalLM (SDPA). Runs are interleaved and the
   table keeps each model's median.
2. Decode tokens/s at a 1k context: greedy generate(), --new tokens after a --context-token prompt; one over the
   median time between tokens (a streamer stamps each), prefill excluded. Interleaved, median of the runs.
3. KV cache bytes after that generate(): the LEX model at --kv-heads key/value heads against the same model with
   one key/value head per query head (expected ratio kv-heads / heads), HF Llama's DynamicCache beside.

    python benchmarks/llama_speed.py [--layers 6] [--hidden 512] [--heads 16] [--kv-heads 4] [--output x.json]

--convert-rss instead measures `convert_hf` on a Llama folder of about --rss-gb GB (random weights, built with
transformers' classes and saved under --rss-dir, once as one file and once in --rss-shard shards), with convert_hf's
default output shard size and a smaller one: the source's size and the conversion's peak RSS (VmHWM of a fresh
process doing only the conversion, which counts the source's pages mapped by safetensors too), against the size of
the weights. A conversion holding at most one copy stays at or below source size + the process's baseline.

    python benchmarks/llama_speed.py --convert-rss [--rss-gb 2] [--output rss.json]
"""

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common import Clock, peak_rss_mb, write_output

from convert.hf import DEFAULT_MAX_SHARD_SIZE, convert_hf, lex_from_hf
from modeling_lex.generation import CACHE_NAME


def llama(args, kv_heads: int, **sizes) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=kv_heads,
        max_position_embeddings=args.length, tie_word_embeddings=False, attn_implementation="sdpa", **sizes,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@torch.no_grad()
def forward_seconds(model, ids) -> float:
    start = time.perf_counter()
    model(ids)
    return time.perf_counter() - start


@torch.no_grad()
def decode(model, prompt, new: int) -> tuple[float, int]:
    """(tokens/s between new tokens, KV cache bytes at the end)."""
    clock = Clock()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, eos_token_id=None, streamer=clock,
                         return_dict_in_generate=True)
    steps = clock.steps()
    return 1 / statistics.median(steps), cache_bytes(getattr(out, CACHE_NAME))


def speed(args) -> dict:
    source = llama(args, args.kv_heads)
    models = {"llama_sdpa": source, "lex_full": lex_from_hf(source)}  # the same tensors (q/k rows permuted)
    ids = torch.randint(1, args.vocab, (1, args.length), generator=torch.Generator().manual_seed(0))
    prompt = ids[:, : args.context] if args.context <= args.length else torch.randint(1, args.vocab, (1, args.context))
    for model in models.values():  # warm-up (the first long runs of a process are slower: allocations)
        forward_seconds(model, ids)
        decode(model, prompt, 4)
    forward = {name: [] for name in models}
    decoding = {name: [] for name in models}
    caches = {}
    for _ in range(args.repeats):  # interleaved, so a busy spell of the machine hits both alike
        for name, model in models.items():
            forward[name].append(args.length / forward_seconds(model, ids))
            rate, caches[name] = decode(model, prompt, args.new)
            decoding[name].append(rate)
    rows = {name: {"forward_tokens_per_s": statistics.median(forward[name]),
                   "decode_tokens_per_s": statistics.median(decoding[name]),
                   "forward_all": forward[name], "decode_all": decoding[name], "kv_cache_bytes": caches[name]}
            for name in models}
    for row in rows.values():
        row["forward_vs_llama"] = row["forward_tokens_per_s"] / rows["llama_sdpa"]["forward_tokens_per_s"]
        row["decode_vs_llama"] = row["decode_tokens_per_s"] / rows["llama_sdpa"]["decode_tokens_per_s"]
    full_heads = lex_from_hf(llama(args, args.heads))
    _, mha_bytes = decode(full_heads, prompt, args.new)
    cache = {"kv_heads": args.kv_heads, "bytes": caches["lex_full"], "heads": args.heads, "bytes_mha": mha_bytes,
             "ratio": caches["lex_full"] / mha_bytes, "expected": args.kv_heads / args.heads,
             "llama_bytes": caches["llama_sdpa"]}
    params = sum(p.numel() for p in source.parameters())
    print(f"converted Llama (LEX, full attention) vs HF LlamaForCausalLM (sdpa), same weights: {args.layers} layers, "
          f"hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads, intermediate {args.intermediate}, "
          f"vocab {args.vocab}, {params / 1e6:.1f}M parameters, {torch.get_num_threads()} threads; median of "
          f"{args.repeats} interleaved runs")
    print(f"{'model':<12}{f'fwd tok/s @{args.length}':>18}{'vs llama':>10}"
          f"{f'decode tok/s @{args.context}':>22}{'vs llama':>10}{'KV cache MB':>13}")
    for name, row in rows.items():
        print(f"{name:<12}{row['forward_tokens_per_s']:>18.0f}{row['forward_vs_llama']:>10.3f}"
              f"{row['decode_tokens_per_s']:>22.1f}{row['decode_vs_llama']:>10.3f}"
              f"{row['kv_cache_bytes'] / 2**20:>13.2f}")
    print(f"KV cache after {args.context}+{args.new} tokens: {args.kv_heads} KV heads {cache['bytes']} B, "
          f"{args.heads} KV heads {cache['bytes_mha']} B, ratio {cache['ratio']:.4f} "
          f"(expected {cache['expected']:.4f})")
    return {"models": rows, "kv_cache": cache, "parameters": params}


def child_convert(src: Path, out: Path, max_shard_size: str) -> dict:
    """Run in a fresh process: only the conversion, so VmHWM is its own."""
    before = peak_rss_mb()
    start = time.perf_counter()
    convert_hf(src, out, force=True, max_shard_size=max_shard_size)
    return {"seconds": time.perf_counter() - start, "rss_before_mb": before, "peak_rss_mb": peak_rss_mb()}


def folder_mb(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors")) / 2**20


def convert_rss(args) -> dict:
    hidden, inner = 2048, 5632
    per_layer = hidden * hidden * (2 + 2 * 4 / 16) + 3 * hidden * inner  # q, o, k, v at 4 of 16 KV heads; the MLP
    layers = max(1, round((args.rss_gb * 2**30 / 4 - 2 * args.vocab * hidden) / per_layer))
    sources = {"one_file": args.rss_dir / "llama-one-file", "sharded": args.rss_dir / "llama-sharded"}
    model = llama(argparse.Namespace(**{**vars(args), "hidden": hidden, "intermediate": inner, "layers": layers,
                                        "heads": 16}), kv_heads=4)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(sources["one_file"], max_shard_size="100GB")
    model.save_pretrained(sources["sharded"], max_shard_size=args.rss_shard)
    del model
    rows = []
    for (name, src), out_shard in itertools.product(sources.items(), args.rss_out_shards.split(",")):
        out = args.rss_dir / f"{src.name}-lex"
        run = subprocess.run([sys.executable, __file__, f"--child-convert={src}:{out}:{out_shard}"],
                             capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"converting {src} failed:\n{run.stderr[-3000:]}")
        row = json.loads(run.stdout.strip().splitlines()[-1])
        row.update(source=name, source_mb=folder_mb(src), source_files=len(list(src.glob("*.safetensors"))),
                   output_shard=out_shard, output_files=len(list(out.glob("*.safetensors"))),
                   output_mb=folder_mb(out))
        row["peak_net_mb"] = row["peak_rss_mb"] - row["rss_before_mb"]
        row["peak_net_vs_source"] = row["peak_net_mb"] / row["source_mb"]
        rows.append(row)
        shutil.rmtree(out)
    print(f"convert_hf peak RSS: a Llama of {params / 1e6:.0f}M parameters (float32, {layers} layers, hidden "
          f"{hidden}), each conversion in a fresh process")
    print(f"{'source':<10}{'files':>7}{'source MB':>11}{'out shard':>11}{'files':>7}{'RSS before MB':>15}"
          f"{'peak RSS MB':>13}{'peak - before':>15}{'vs source':>11}{'seconds':>9}")
    for row in rows:
        print(f"{row['source']:<10}{row['source_files']:>7}{row['source_mb']:>11.0f}{row['output_shard']:>11}"
              f"{row['output_files']:>7}{row['rss_before_mb']:>15.0f}{row['peak_rss_mb']:>13.0f}"
              f"{row['peak_net_mb']:>15.0f}{row['peak_net_vs_source']:>11.3f}{row['seconds']:>9.1f}")
    if not args.keep:
        for src in sources.values():
            shutil.rmtree(src)
    return {"convert_rss": rows, "parameters": params}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--length", type=int, default=1024, help="l = max_position_embeddings")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens before decoding")
    parser.add_argument("--new", type=int, default=32, help="tokens generated; all but the first are timed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--convert-rss", action="store_true", help="measure convert_hf's peak RSS instead")
    parser.add_argument("--rss-gb", type=float, default=2.0, help="size of the float32 source model")
    parser.add_argument("--rss-shard", default="500MB", help="shard size of the sharded source")
    parser.add_argument("--rss-out-shards", default=f"{DEFAULT_MAX_SHARD_SIZE},500MB",
                        help="convert_hf's max_shard_size values to measure (comma-separated)")
    parser.add_argument("--rss-dir", type=Path, default=Path("/tmp/lex-llama-rss"))
    parser.add_argument("--keep", action="store_true", help="keep the source folders of --convert-rss")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child-convert", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child_convert:
        src, out, out_shard = args.child_convert.split(":")
        print(json.dumps(child_convert(Path(src), Path(out), out_shard)))
        return 0
    write_output(args, convert_rss(args) if args.convert_rss else speed(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
