"""Qwen3, Phi-3, SmolLM3, Gemma 2 and Gemma 3 checkpoints <-> LEX models (convert/hf.py): Qwen3's per-head q/k norms
(`qk_norm`), Phi-3's fused qkv_proj and gate_up_proj (split on the way in, fused on the way out), SmolLM3's layers
without rotary (`rope_layers`), Gemma's norms, embeddings, soft-capping and local layers (`local_layers`: their own
sliding window and rope beside global layers that take the LEX mode).

References are transformers' own classes, tiny and with every parameter perturbed: a converted model computes what
its source computes (full mode, past the source's max_position_embeddings), and in blockwise and sliding modes
what the source computes under an explicit window mask, or with its sinks re-rotated to their places in the
cache (tests/reference.py); Gemma's local layers keep their own window in both. A Qwen3, a Phi-3, a Gemma 2 and a
Gemma 3 `.gguf` written here with the gguf package's writer convert as transformers' GGUF loader reads them, and
`lex eval-length` reads a Qwen3 and a Gemma 3 folder in full and sliding modes with and without sinks; `lex generate`
continues a SmolLM3 folder through a window with sinks, and `lex export` of a converted folder loads by remote code
without this package. Everything runs in float32 on the CPU and nothing is downloaded.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from configuration_lex import LexConfig
from convert.checkpoint import ConversionError
from convert.hf import convert_hf, convert_to_hf, lex_config_from_hf, lex_from_hf
from lex.cli import main as lex
from tests import reference
from tests.helpers import perturb, perturbed_model, word_tokenizer

pytestmark = pytest.mark.oldest  # also run on the oldest transformers we declare

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, LENGTH, LONG = 97, 32, 50  # LENGTH: the sources' max_position_embeddings; LONG inputs are longer
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=LENGTH, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             attn_implementation="eager")
SOURCES = {  # name -> (config class, model class, fields on top of SIZES)
    "qwen3_gqa_untied": (Qwen3Config, Qwen3ForCausalLM,
                         dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    "qwen3_biases_tied_head_dim": (Qwen3Config, Qwen3ForCausalLM,
                                   dict(num_key_value_heads=1, head_dim=8, attention_bias=True,
                                        tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})),
    "phi3_gqa_untied": (Phi3Config, Phi3ForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "phi3_window_tied": (Phi3Config, Phi3ForCausalLM, dict(sliding_window=8, tie_word_embeddings=True)),
    "smollm3_no_rope_gqa_tied": (SmolLM3Config, SmolLM3ForCausalLM,
                                 dict(num_hidden_layers=4, num_key_value_heads=2, no_rope_layers=[1, 0, 1, 0],
                                      tie_word_embeddings=True)),
    "smollm3_biases_untied": (SmolLM3Config, SmolLM3ForCausalLM,
                              dict(num_hidden_layers=3, no_rope_layers=[0, 1, 1], attention_bias=True, mlp_bias=True,
                                   tie_word_embeddings=False)),
    # Gemma 2: local and global layers alternating (local window 6, under the LEX window of the windowed tests),
    # attention scores and logits soft-capped (caps small enough to bite at these logits' size).
    "gemma2_gqa_tied": (Gemma2Config, Gemma2ForCausalLM,
                        dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                             sliding_window=6, attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                             tie_word_embeddings=True)),
    "gemma2_biases_untied": (Gemma2Config, Gemma2ForCausalLM,
                             dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=16, attention_bias=True,
                                  sliding_window=8, final_logit_softcapping=None, tie_word_embeddings=False)),
    # Gemma 3: 3 local layers (window 12, over the LEX window of the windowed tests, rope theta 1e4) around a global
    # one (linear-scaled rope theta 1e6), q/k norms.
    "gemma3_local_global_gqa_untied": (
        Gemma3TextConfig, Gemma3ForCausalLM,
        dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
             tie_word_embeddings=False)),
    "gemma3_mqa_tied_capped": (Gemma3TextConfig, Gemma3ForCausalLM,
                               dict(num_hidden_layers=2, num_key_value_heads=1, sliding_window=4,
                                    final_logit_softcapping=4.0, tie_word_embeddings=True)),
}
WINDOWED = ["qwen3_gqa_untied", "phi3_gqa_untied", "smollm3_no_rope_gqa_tied", "gemma2_gqa_tied",
            "gemma3_local_global_gqa_untied"]
GEMMA = ("gemma2", "gemma3_text")


def source_model(name: str, seed: int = 0, **overrides):
    config_class, model_class, fields = SOURCES[name]
    torch.manual_seed(seed)
    return perturb(model_class(config_class(**{**SIZES, **fields, **overrides})), seed)


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, tokens, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, **kwargs).logits


def greedy(model, tokens, new: int = 16) -> torch.Tensor:
    return model.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-5 of the largest logit (logits here reach ~7). Both sides round their rotary factors to float32 by
    different formulas (transformers: float32 inverse frequencies times positions; LEX: float64 angles): ~1e-7
    relative apart, which a few perturbed layers bring to a few 1e-5 absolute on the largest logits."""
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= 1e-5 * max(scale, 1.0), (actual - expected).abs().max()


def window_mask(mode: str, length: int, window: int) -> torch.Tensor:
    """DESIGN §3 as an additive (1, 1, n, n) mask: blockwise = blocks of w/2, a query sees its own block and the
    previous one (causally); sliding = a query at p sees p-w+1 ... p."""
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    if mode == "blockwise":
        allowed = (key <= query) & (key // (window // 2) >= query // (window // 2) - 1)
    else:
        allowed = (key <= query) & (key > query - window)
    return torch.zeros(length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def source_window_mask(source, mode: str, length: int, window: int, batch: int = 2):
    """The explicit window mask of `source` in `mode`: one (batch, 1, n, n) mask, or for Gemma one per layer type
    (its model takes a mapping), its local (sliding_attention) layers keeping their own sliding window."""
    mask = window_mask(mode, length, window).expand(batch, 1, -1, -1)
    if source.config.model_type not in GEMMA:
        return mask
    local = window_mask("sliding", length, source.config.sliding_window).expand(batch, 1, -1, -1)
    return {"full_attention": mask, "sliding_attention": local}


def comparable(config) -> dict:
    """A config's fields as saved, less what says only where and how it was saved."""
    fields = config.to_dict()
    for key in ("architectures", "dtype", "transformers_version", "_name_or_path"):
        fields.pop(key, None)
    return fields


# ---------------------------------------------------------------- the same computation as the source


@pytest.mark.parametrize("name", SOURCES)
def test_converted_model_equals_its_source_past_its_length(name):
    source = source_model(name)
    model = lex_from_hf(source)
    assert model.config.hf_model_type == source.config.model_type
    gemma = source.config.model_type in GEMMA
    assert model.config.qk_norm == (source.config.model_type in ("qwen3", "gemma3_text"))
    window = None if gemma else source.config.to_dict().get("sliding_window")
    assert (model.config.attention_mode, model.config.attention_window) == (
        ("sliding", window) if window else ("full", LENGTH))
    if gemma:  # its sliding layers: local layers over their own window
        assert model.config.local_layers == [kind == "sliding_attention" for kind in source.config.layer_types]
        assert model.config.local_attention_window == source.config.sliding_window
    tokens = ids(2, LONG)
    assert_same_logits(logits(model, tokens), logits(source, tokens))
    prompt = tokens[:1, :40]
    assert torch.equal(greedy(model, prompt), greedy(source, prompt))


def test_smollm3_layers_without_rotary_are_kept_per_layer():
    model = lex_from_hf(source_model("smollm3_no_rope_gqa_tied"))
    assert model.config.rope_layers == [True, False, True, False]
    every_layer = lex_from_hf(source_model("smollm3_no_rope_gqa_tied", no_rope_layers=[1, 1, 1, 1]))
    assert every_layer.config.rope_layers is None and every_layer.config.hf_model_type == "smollm3"


def test_gemma_soft_capping_local_windows_and_local_rope_each_matter():
    """The equalities above are no accident of tiny configs: without Gemma 2's caps, or with Gemma 3's local layers
    given the global window or rope, the converted model computes something else."""
    tokens = ids(2, LONG)
    capped = lex_from_hf(source_model("gemma2_gqa_tied"))
    expected = logits(capped, tokens)
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        uncapped = lex_from_hf(source_model("gemma2_gqa_tied", **{field: None}))
        assert (logits(uncapped, tokens) - expected).abs().max() > 1e-2, field
    local = source_model("gemma3_local_global_gqa_untied")
    expected = logits(lex_from_hf(local), tokens)
    same_rope = {kind: {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}
                 for kind in ("full_attention", "sliding_attention")}
    for overrides in (dict(sliding_window=None, layer_types=["full_attention"] * 4), dict(rope_parameters=same_rope)):
        other = lex_from_hf(source_model("gemma3_local_global_gqa_untied", **overrides))
        assert (logits(other, tokens) - expected).abs().max() > 1e-2, overrides


def test_gemma_embeddings_are_scaled_in_their_dtype_as_gemma_scales_them():
    """In bfloat16 Gemma multiplies by sqrt(hidden) rounded to bfloat16 (sqrt(96) = 9.798 becomes 9.8125): a converted
    model's embeddings are the same bits, which the product by the float scale is not."""
    source = source_model("gemma3_mqa_tied_capped", hidden_size=96, num_attention_heads=4).to(torch.bfloat16)
    model = lex_from_hf(source)
    tokens = ids(2, 20)
    with torch.no_grad():
        expected = source.model.embed_tokens(tokens)
        assert torch.equal(model.model.embed(tokens, None, tokens), expected)
        assert not torch.equal(model.model.embed_tokens.weight[tokens] * 96**0.5, expected)  # the float product


@pytest.mark.parametrize("name", ["gemma2_gqa_tied", "gemma3_mqa_tied_capped"])
def test_gemma_input_embeddings_are_what_the_ids_read(name):
    """`get_input_embeddings()(ids)` is Gemma's scaled lookup, as in the source class: given as `inputs_embeds`
    (PEFT's prompt tuning, transformers' common tests) it reads as the ids do."""
    source = source_model(name)
    model = lex_from_hf(source)
    tokens = ids(2, 20)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(tokens)
        torch.testing.assert_close(embeds, source.get_input_embeddings()(tokens), rtol=0, atol=0)
        torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(tokens).logits, rtol=0, atol=0)


def test_phi3_in_memory_conversion_slices_the_fused_tensors_without_copies():
    source = source_model("phi3_gqa_untied")
    model = lex_from_hf(source)
    fused = source.model.layers[0].self_attn.qkv_proj.weight
    value = model.model.layers[0].self_attn.v_proj.weight
    assert value.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    gate_up = source.model.layers[0].mlp.gate_up_proj.weight
    assert model.model.layers[0].mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()


@pytest.mark.parametrize("sinks", [0, 4])
@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_conversion_equals_the_source_under_its_window(name, mode, sinks):
    window, length = 8, 40
    source = source_model(name)
    model = lex_from_hf(source, attention_mode=mode, attention_window=window, attention_sinks=sinks)
    tokens = ids(2, length)
    if sinks:  # the source with its sinks placed where a converted model sees them: within the cache
        expected = logits(reference.use_window_attention(source_model(name), mode, window, sinks), tokens)
    else:
        expected = logits(source, tokens, attention_mask=source_window_mask(source, mode, length, window))
    assert_same_logits(logits(model, tokens), expected)
    assert (logits(source, tokens) - expected).abs().max() > 1e-2  # the window matters at this length


@pytest.mark.parametrize("name", ["smollm3_no_rope_gqa_tied", "qwen3_gqa_untied", "gemma2_gqa_tied",
                                  "gemma3_local_global_gqa_untied"])
def test_decoding_through_the_bounded_cache_with_sinks_equals_the_reference(name):
    """generate() through LEX's bounded caches (sliding w = 8, 4 sinks in the cache's frame): each step picks what
    the source picks in one full forward under the same window, sinks re-rotated only in layers with rotary."""
    model = lex_from_hf(source_model(name), attention_mode="sliding", attention_window=8, attention_sinks=4)
    reference_model = reference.use_window_attention(source_model(name), "sliding", 8, 4)
    prompt = ids(1, 20)
    tokens = prompt
    with torch.no_grad():
        for _ in range(12):
            step = reference_model(tokens, use_cache=False).logits[:, -1]
            tokens = torch.cat([tokens, step.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy(model, prompt, new=12), tokens)
    static = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                            pad_token_id=0, eos_token_id=None, cache_implementation="static")
    assert torch.equal(static, tokens)  # LexStaticCache too


# ---------------------------------------------------------------- folders, both ways


@pytest.mark.parametrize("name", SOURCES)
def test_folder_round_trip_gives_the_source_class_config_and_weights_back(name, tmp_path, capsys):
    source = source_model(name)
    source.save_pretrained(tmp_path / "src")
    assert lex(["convert-hf", str(tmp_path / "src"), str(tmp_path / "lex")]) == 0
    if name == "gemma3_local_global_gqa_untied":  # the summary names the local layers
        summary = capsys.readouterr().out
        assert "; 3 of the layers local, sliding over their own window 12 with their own rope" in summary
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "lex")
    assert converted.config.model_type == "lex"
    tokens = ids(2, LONG)
    assert_same_logits(logits(converted, tokens), logits(source, tokens))

    assert lex(["convert-to-hf", str(tmp_path / "lex"), str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(back) is type(source)
    assert comparable(back.config) == comparable(source.config)
    state, expected = back.state_dict(), source.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[key], expected[key]) for key in expected)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [type(source).__name__]


@pytest.mark.parametrize("name, fields", [
    ("qwen3_gqa_untied", dict(attention_mode="sliding", attention_window=8)),
    ("phi3_gqa_untied", dict(attention_mode="sliding", attention_window=8)),
    ("smollm3_no_rope_gqa_tied", dict(attention_mode="sliding", attention_window=8)),
])
def test_a_sliding_reading_goes_back_to_its_family_with_that_window(name, fields, tmp_path):
    model = lex_from_hf(source_model(name), **fields)
    model.save_pretrained(tmp_path / "lex")
    convert_to_hf(tmp_path / "lex", tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert back.config.model_type == name.split("_")[0]
    tokens = ids(2, 40)
    assert_same_logits(logits(back, tokens), logits(model, tokens))


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("name, overrides, message", [
    ("phi3_gqa_untied", dict(resid_pdrop=0.1), "phi3 resid_pdrop=0.1: no LexConfig field keeps"),
    ("phi3_gqa_untied", dict(embd_pdrop=0.1), "phi3 embd_pdrop=0.1"),
    ("phi3_window_tied", dict(sliding_window=7), "phi3 sliding_window=7"),
    ("phi3_gqa_untied", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.5}), "partial_rotary_factor']=0.5"),
    ("qwen3_gqa_untied", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
     "per-layer windows that differ"),
    ("smollm3_no_rope_gqa_tied", dict(use_sliding_window=True, sliding_window=8), "per-layer windows that differ"),
    ("gemma2_gqa_tied", dict(use_bidirectional_attention=True), "gemma2 use_bidirectional_attention=True: LEX models "
                                                                "are causal"),
    ("gemma3_mqa_tied_capped", dict(attn_logit_softcapping=5.0), "gemma3_text attn_logit_softcapping=5.0: "
                                                                  "transformers' Gemma 3 never applies it"),
    ("gemma3_mqa_tied_capped", dict(hidden_activation="gelu_new"), "hidden_activation='gelu_new': convertible"),
    ("gemma2_gqa_tied", dict(sliding_window=7), "LexConfig.local_attention_window=7 must be an even integer"),
    ("gemma3_mqa_tied_capped", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                     "sliding_attention": {"rope_type": "dynamic", "rope_theta": 1e4,
                                                                           "factor": 2.0}}),
     "local_rope_parameters['rope_type']='dynamic' is not supported"),
])
def test_what_a_family_computes_that_lex_cannot_is_refused_by_name(name, overrides, message):
    with pytest.raises(ConversionError, match="^[^\n]*$") as error:
        lex_config_from_hf(source_model(name, **overrides).config)
    assert message in str(error.value)


LEX_BACKBONE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                    position_embedding_type="rope", norm_type="rmsnorm", mlp_type="gated", hidden_act="silu",
                    attention_mode="full", attention_bias=False, mlp_bias=False, tie_word_embeddings=False)


@pytest.mark.parametrize("fields, field", [
    (dict(hf_model_type="phi3", qk_norm=True), "qk_norm"),
    (dict(hf_model_type="qwen3"), "qk_norm"),
    (dict(qk_norm=True, rope_layers=[True, False]), "rope_layers"),
    (dict(hf_model_type="phi3", attention_bias=True), "attention_bias"),
    (dict(qk_norm=True, attention_bias=True, attention_output_bias=False), "attention_output_bias"),
    (dict(qk_norm=True, mlp_bias=True), "mlp_bias"),
], ids=lambda value: value if isinstance(value, str) else "-".join(f"{k}={v}" for k, v in value.items()))
def test_what_the_family_does_not_compute_is_refused_on_the_way_back(fields, field, tmp_path):
    perturbed_model(LexConfig(**{**LEX_BACKBONE, **fields})).save_pretrained(tmp_path / "lex")
    with pytest.raises(ConversionError, match="^[^\n]*$") as error:
        convert_to_hf(tmp_path / "lex", tmp_path / "hf")
    assert str(error.value).startswith(f"LexConfig.{field}=")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("name, change, field", [
    ("gemma3_local_global_gqa_untied", dict(attention_mode="sliding", attention_window=8), "attention_mode"),
    ("gemma2_gqa_tied", dict(local_rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
     "local_rope_parameters"),
    ("gemma3_mqa_tied_capped", dict(attn_logit_softcapping=5.0), "attn_logit_softcapping"),
    ("gemma2_gqa_tied", dict(embedding_scale=2.0), "embedding_scale"),
    ("gemma2_gqa_tied", dict(sublayer_output_norms=False), "sublayer_output_norms"),
    ("gemma3_mqa_tied_capped", dict(hf_model_type=None), "norm_type"),
])
def test_what_gemma_does_not_compute_is_refused_on_the_way_back(name, change, field, tmp_path):
    """A converted Gemma read through a LEX window, or changed where Gemma has no such option, goes back nowhere:
    the refusal names the field; a Gemma config without its hf_model_type is no Llama either."""
    model = lex_from_hf(source_model(name), **{k: v for k, v in change.items() if k.startswith("attention_")})
    for key, value in change.items():
        if not key.startswith("attention_"):
            setattr(model.config, key, value)
    model.save_pretrained(tmp_path / "lex")
    with pytest.raises(ConversionError, match="^[^\n]*$") as error:
        convert_to_hf(tmp_path / "lex", tmp_path / "hf")
    assert str(error.value).startswith(f"LexConfig.{field}=")
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- a .gguf file and lex eval-length


def write_gguf(path: Path, model) -> None:
    """`model` (a Qwen3, a Phi-3, a Gemma 2 or a Gemma 3) as a float32 .gguf file under llama.cpp's names, written
    with the gguf package's writer, with a tokenizer of its family's kind: Qwen3 a byte-level BPE of 97 tokens (95
    characters and the merges "ab" and "cd"), the others a sentencepiece vocabulary of 97 words. Gemma's norm
    weights are stored as llama.cpp stores them, 1 + w, with its head size and sliding window."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    config, architecture = model.config, model.config.model_type.removesuffix("_text")  # llama.cpp's "gemma3"
    gemma = config.model_type in GEMMA
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)  # Gemma 3's: per layer type
    writer.add_rope_freq_base(rope["rope_theta"])
    if gemma:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if architecture == "qwen3":
        chars = list(bytes_to_unicode().values())[:95]
        tokens = chars + [chars[64] + chars[65], chars[66] + chars[67]]  # "ab", "cd"
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges([f"{chars[64]} {chars[65]}", f"{chars[66]} {chars[67]}"])
        writer.add_token_types([1] * len(tokens))
    else:
        tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(94)]
        writer.add_tokenizer_model("llama")
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(94)])
        writer.add_token_types([2, 3, 3] + [1] * 94)
    writer.add_token_list(tokens)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if gemma:  # GemmaTokenizer needs its unknown token named
        writer.add_unk_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[architecture.upper()], config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the embedding (llama.cpp's Gemma 2 has no output tensor)
        module, kind = name.rsplit(".", 1)
        if gemma and module.endswith("norm"):
            tensor = tensor + 1
        writer.add_tensor(f"{names.get_name(module)}.{kind}", tensor.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name, overrides", [
    # transformers' GGUF key map has no head_dim for Qwen3: 128, its default and every published Qwen3's
    ("qwen3_gqa_untied", dict(head_dim=128, num_attention_heads=2, num_key_value_heads=1)),
    ("phi3_gqa_untied", {}),
    ("gemma2_gqa_tied", {}),
    ("gemma3_local_global_gqa_untied", {}),
])
def test_a_gguf_converts_as_transformers_loader_reads_it(name, overrides, tmp_path):
    """`lex convert-hf FILE.gguf` computes what the model transformers' GGUF loader reads computes (Phi-3's fused
    tensors included) and keeps the file's tokenizer."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    source = source_model(name, **overrides)
    path = tmp_path / "gguf" / "tiny.gguf"
    path.parent.mkdir()
    write_gguf(path, source)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert type(loaded) is type(source)
    assert lex(["convert-hf", str(path), str(tmp_path / "lex")]) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "lex")
    assert converted.config.hf_model_type == source.config.model_type
    tokens = ids(2, LONG)
    assert_same_logits(logits(converted, tokens), logits(loaded, tokens))
    text = "abcd dcba w3 w17"
    expected = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)(text).input_ids
    assert AutoTokenizer.from_pretrained(tmp_path / "lex")(text).input_ids == expected
    assert {95, 96} <= set(expected) or source.config.model_type != "qwen3"  # Qwen3's merges came along


def reference_ppl(model, documents: list[torch.Tensor], mask: torch.Tensor | None) -> float:
    """Perplexity of the documents read in one window each by transformers' class (under `mask`, if given)."""
    nll, count = 0.0, 0
    for document in documents:
        with torch.no_grad():
            scores = model(document[None], attention_mask=mask).logits[0, :-1]
        nll += torch.nn.functional.cross_entropy(scores, document[1:], reduction="sum").item()
        count += len(document) - 1
    return math.exp(nll / count)


@pytest.mark.parametrize("name", ["qwen3_gqa_untied", "gemma3_local_global_gqa_untied"])
def test_eval_length_on_a_qwen3_or_gemma3_folder_reads_full_and_sliding_with_and_without_sinks(name, tmp_path, capsys):
    """Full attention is the checkpoint as published; sliding (w = 8) with 0 and 4 sinks is the checkpoint converted
    in memory, equal to transformers' Qwen3 or Gemma 3 under the window's mask (with sinks: re-rotated within the
    cache; Gemma 3's local layers under their own window of 12)."""
    folder = tmp_path / name
    source_model(name).save_pretrained(folder)
    tokenizer, words = word_tokenizer()
    tokenizer.save_pretrained(folder)
    (tmp_path / "docs").mkdir()
    generator = torch.Generator().manual_seed(3)
    texts = [" ".join(words[i] for i in torch.randint(0, 96, (60,), generator=generator)) for _ in range(2)]
    for i, text in enumerate(texts):
        (tmp_path / "docs" / f"doc{i}.txt").write_text(text)
    out = tmp_path / "eval"
    assert lex(["eval-length", str(folder), "--files", f"{tmp_path / 'docs'}/*.txt", "--lengths", "48",
                "--attention_modes", "full,sliding", "--attention_sinks", "0,4", "--attention_window", "8",
                "--protocols", "strided", "--output_dir", str(out)]) == 0
    assert "| sliding + 4 sinks |" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    rows = {(r["attention_mode"], r["attention_sinks"]): r["ppl"] for r in results}
    assert set(rows) == {("full", 0), ("sliding", 0), ("sliding", 4)}
    documents = [torch.tensor(tokenizer(text, add_special_tokens=False).input_ids[:48]) for text in texts]
    source = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert rows["full", 0] == pytest.approx(reference_ppl(source, documents, None), rel=1e-5)
    windowed = source_window_mask(source, "sliding", 48, 8, batch=1)
    assert rows["sliding", 0] == pytest.approx(reference_ppl(source, documents, windowed), rel=1e-5)
    reference.use_window_attention(source, "sliding", 8, 4)
    assert rows["sliding", 4] == pytest.approx(reference_ppl(source, documents, None), rel=1e-5)
    assert len({round(ppl, 6) for ppl in rows.values()}) == 3


@pytest.mark.parametrize("name", ["smollm3_no_rope_gqa_tied", "gemma2_gqa_tied"])
def test_lex_generate_continues_a_smollm3_or_gemma2_folder_through_a_window_with_sinks(name, tmp_path, capsys):
    """`lex generate FOLDER --attention_mode sliding --attention_window 8 --attention_sinks 4` (converted in
    memory): the continuation is transformers' SmolLM3 or Gemma 2 decoding greedily under the naive window attention
    with its sinks within the cache, re-rotated only in the layers with rotary (Gemma 2's local layers under their
    own window, its scores capped)."""
    folder = tmp_path / name
    source_model(name, bos_token_id=None, eos_token_id=None).save_pretrained(folder)
    tokenizer, words = word_tokenizer()
    tokenizer.save_pretrained(folder)
    text = " ".join(words[(7 * i) % 96] for i in range(40))
    (tmp_path / "prompt.txt").write_text(text)
    prompt = tokenizer(text, return_tensors="pt").input_ids
    sequence = prompt
    windowed = reference.use_window_attention(AutoModelForCausalLM.from_pretrained(folder).eval(), "sliding", 8, 4)
    for _ in range(12):
        with torch.no_grad():
            sequence = torch.cat([sequence, windowed(sequence).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert lex(["generate", str(folder), "--prompt_file", str(tmp_path / "prompt.txt"), "--max_new_tokens", "12",
                "--attention_mode", "sliding", "--attention_window", "8", "--attention_sinks", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == tokenizer.decode(sequence[0, prompt.shape[1] :]).split()
    assert "sliding attention, window 8, 4 attention sinks" in captured.err


@pytest.mark.parametrize("name", ["qwen3_gqa_untied", "smollm3_no_rope_gqa_tied", "gemma2_gqa_tied",
                                  "gemma3_local_global_gqa_untied"])
def test_lex_export_of_a_converted_folder_loads_by_remote_code_without_this_package(name, tmp_path):
    """A converted Qwen3 (q/k norms), SmolLM3 (layers without rotary) or Gemma (caps, local layers), read through a
    window with sinks, exported with `lex export`: transformers loads it from the folder's own code, in a process
    where this package cannot be imported, and computes what the converted model computes."""
    model = lex_from_hf(source_model(name), attention_mode="sliding", attention_window=8, attention_sinks=4)
    model.save_pretrained(tmp_path / "lex")
    word_tokenizer()[0].save_pretrained(tmp_path / "lex")
    assert lex(["export", str(tmp_path / "lex"), str(tmp_path / "exported")]) == 0
    tokens = ids(1, 40)
    torch.save({"ids": tokens, "logits": logits(model, tokens)}, tmp_path / "expected.pt")
    script = (
        "import sys\n"
        "for name in ('configuration_lex', 'modeling_lex', 'convert', 'lex', 'lex_base', 'tests'):\n"
        "    sys.modules[name] = None\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'exported')!r}, trust_remote_code=True)\n"
        "assert type(model).__module__.startswith('transformers_modules.'), type(model).__module__\n"
        f"expected = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(model(expected['ids']).logits, expected['logits'], atol=1e-5, rtol=1e-5)\n"
        "print('remote code ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "HF_HOME": str(tmp_path / "hf")})
    assert run.returncode == 0 and "remote code ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("fields, message", [
    (dict(rope_layers=[True]), "LexConfig.rope_layers has 1 entries: one per layer (num_hidden_layers=2)"),
    (dict(rope_layers=[True, False], position_embedding_type="xpos"), "supported with 'rope' only"),
    (dict(hf_model_type="gemma"), "hf_model_type"),
])
def test_family_fields_are_validated(fields, message):
    with pytest.raises(Exception, match="rope_layers|hf_model_type") as error:
        LexConfig(**{**LEX_BACKBONE, **fields})
    assert message in " ".join(str(error.value).split())


def test_convert_hf_refuses_a_family_it_does_not_know_naming_the_convertible_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path / "src")
    with pytest.raises(ConversionError, match="convertible: llama, mistral, qwen2, qwen3, phi3, smollm3"):
        convert_hf(tmp_path / "src", tmp_path / "out")
