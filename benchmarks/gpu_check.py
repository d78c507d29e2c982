"""CUDA checks and timings (run where a GPU is present; CI has none).

Numbers: CUDA fp32 logits against CPU fp32 in every mode, eager vs sdpa on CUDA; windowed decoding through a
LexCache (sinks at cache positions, with and without a block memory, each position method) against CPU; bf16/fp16 finiteness at
position 10^6 and agreement with fp32. Speed (bf16): training-step tokens/s of LEX-xpos and LEX-rope against
HF Llama (SDPA) of the same size; blockwise forward tokens/s and peak CUDA memory from 1k to 512k tokens.

    python benchmarks/gpu_check.py [--output gpu.json]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import modeling_lex  # noqa: E402,F401
from configuration_lex import ATTENTION_MODES, LexConfig  # noqa: E402
from modeling_lex import LexCache, LexForCausalLM  # noqa: E402
from modeling_lex.generation import CACHE_NAME  # noqa: E402


def lex(hidden, layers, heads, window, **kw) -> LexForCausalLM:
    config = LexConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, max_position_embeddings=window, **kw)
    return LexForCausalLM(config)


def numerics(report: dict) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 32000, (2, 3000))
    mask = torch.ones_like(ids)
    mask[1, :77] = 0
    for mode in ATTENTION_MODES:
        model = lex(256, 2, 4, 256, attention_mode=mode).eval()
        with torch.no_grad():
            cpu = model(ids, attention_mask=mask).logits
            model.cuda()
            gpu = model(ids.cuda(), attention_mask=mask.cuda()).logits.cpu()
            model.set_attn_implementation("eager")
            eager = model(ids.cuda(), attention_mask=mask.cuda()).logits.cpu()
            far = model(ids.cuda(), position_ids=torch.arange(3000, device="cuda")[None] + 10**6).logits.cpu()
            near = model(ids.cuda()).logits.cpu()
            model.set_attn_implementation("sdpa")
            half = {}
            for dtype in (torch.bfloat16, torch.float16):
                model.to(dtype)
                logits = model(ids.cuda(), position_ids=torch.arange(3000, device="cuda")[None] + 10**6).logits.float().cpu()
                half[str(dtype)] = {"finite": bool(torch.isfinite(logits).all()),
                                    "max_abs_diff_vs_fp32": (logits - near).abs().max().item()}
                model.float()
        report[f"numerics_{mode}"] = {
            "cuda_vs_cpu_max_abs": (gpu - cpu).abs().max().item(),
            "eager_vs_sdpa_max_abs": (eager - gpu).abs().max().item(),
            "pos_1e6_vs_0_max_abs": (far - near).abs().max().item(),
            "half": half,
        }
        print(mode, report[f"numerics_{mode}"], flush=True)


def windowed_decoding(report: dict) -> None:
    """Sliding and blockwise windows with 4 sinks at cache positions, without and with a block memory: a prompt read
    8 tokens a forward through a LexCache, then greedy generate(), on CUDA against CPU (fp32). Decoding with the
    sinks in their slots once compared a CUDA tensor with a CPU one."""
    rows = {}
    for mode in ("sliding", "blockwise"):
        for method in ("rope", "xpos", "alibi"):
            for blocks in (0, 3):
                torch.manual_seed(0)
                model = lex(64, 2, 4, 32, attention_mode=mode, position_embedding_type=method, attention_sinks=4,
                            attention_sink_positions="cache", attention_memory_blocks=blocks,
                            attention_memory_block_size=5).eval()
                ids = torch.randint(1, 32000, (1, 120))
                out = {}
                for device in ("cpu", "cuda"):
                    model.to(device)
                    cache = LexCache(model.config)
                    with torch.no_grad():
                        logits = torch.cat([model(ids[:, s : s + 8].to(device), cache=cache).logits[0].cpu()
                                            for s in range(0, ids.shape[1], 8)])
                        tokens = model.generate(ids.to(device), max_new_tokens=20, do_sample=False, pad_token_id=0,
                                                **{CACHE_NAME: LexCache(model.config)}).cpu()
                    out[device] = logits, tokens
                rows[f"{mode}_{method}_memory{blocks}"] = {
                    "cuda_vs_cpu_max_abs": (out["cuda"][0] - out["cpu"][0]).abs().max().item(),
                    "same_tokens": torch.equal(out["cuda"][1], out["cpu"][1])}
    report["windowed_decoding"] = rows
    print(rows, flush=True)


def generation(report: dict) -> None:
    """Cached generate() on CUDA: the no-cache contract in fp32, finiteness and decode speed in bf16."""
    torch.manual_seed(0)
    model = lex(256, 4, 4, 256).cuda().eval()
    ids = torch.randint(1, 32000, (2, 900), device="cuda")
    out = model.generate(ids, max_new_tokens=300, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    with torch.no_grad():
        reference = model(out.sequences).logits[:, 899:-1]
    steps = torch.stack(out.logits, 1)
    model.to(torch.bfloat16)
    long_prompt = torch.randint(1, 32000, (1, 40 * 256), device="cuda")
    start = time.perf_counter()
    bf16 = model.generate(long_prompt, max_new_tokens=256, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    torch.cuda.synchronize()
    report["generation"] = {
        "fp32_cached_vs_nocache_max_abs": (steps - reference).abs().max().item(),
        "bf16_40w_prompt_finite": all(bool(torch.isfinite(x).all()) for x in bf16.logits),
        "bf16_cache_positions_per_layer": getattr(bf16, CACHE_NAME).layers[0].keys.shape[2],
        "bf16_prompt_plus_256_new_seconds": time.perf_counter() - start,
    }
    print(report["generation"], flush=True)


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def speed(report: dict, hidden=768, layers=12, heads=12, length=1024, batch=8) -> None:
    rates = {}
    llama_config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=(8 * hidden) // 3,
                               num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=length,
                               tie_word_embeddings=True, attn_implementation="sdpa")
    builds = {"llama_sdpa": lambda: LlamaForCausalLM(llama_config),
              "lex_xpos": lambda: lex(hidden, layers, heads, length),
              "lex_rope": lambda: lex(hidden, layers, heads, length, position_embedding_type="rope")}
    ids = torch.randint(0, 32000, (batch, length), device="cuda")
    for name, build in builds.items():
        model = build().cuda().to(torch.bfloat16).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        rates[name] = batch * length / timed(step, 10)
        del model, optimizer
        torch.cuda.empty_cache()
    report["train_step_tokens_per_s"] = {k: {"tokens_per_s": v, "ratio_to_llama": v / rates["llama_sdpa"]}
                                         for k, v in rates.items()}
    print(report["train_step_tokens_per_s"], flush=True)

    model = lex(hidden, layers, heads, length).cuda().to(torch.bfloat16).eval()
    rows = []
    for n in (1024, 8192, 65536, 131072, 524288):
        x = torch.randint(0, 32000, (1, n), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            seconds = timed(lambda: model(x, logits_to_keep=1), 3)
        rows.append({"n": n, "tokens_per_s": n / seconds, "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20})
        print(rows[-1], flush=True)
    for row in rows:
        row["rate_vs_1k"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    report["blockwise_forward_bf16"] = rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args(argv)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    numerics(report)
    windowed_decoding(report)
    generation(report)
    if not args.skip_speed:
        speed(report)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
