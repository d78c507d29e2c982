"""Model core: xPos numerics, attention modes against a naive reference, long inputs, save/load, config errors."""

import math

import pytest
import torch
from huggingface_hub.errors import (
    StrictDataclassClassValidationError,
    StrictDataclassError,
    StrictDataclassFieldValidationError,
)
from transformers import AutoConfig, AutoModelForCausalLM

import modeling_lex  # noqa: F401  (registers the Auto classes)
from configuration_lex import ATTENTION_MODES, HIDDEN_ACTS, POSITION_EMBEDDING_TYPES, LexConfig
from modeling_lex import LexForCausalLM
from modeling_lex.positions import POSITION_METHODS, position_method
from modeling_lex.kernels import apply_rotary
from modeling_lex.reading import ReadingPolicy
from tests import reference
from tests.helpers import assert_rows_equal_reference, left_pad_mask, packed, perturbed_model, tiny_config


# ---------------------------------------------------------------- xPos against TorchScale 0.3.0


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("length", [1, 7, 1024])
@pytest.mark.parametrize("offset", [0, 37])
def test_xpos_scores_equal_torchscale(head_dim, length, offset):
    """Scores q.k of TorchScale's XPOS (keys at 0.., queries the last `length`, incremental offset) and ours.

    Ours equal TorchScale's to 1e-6 of the score scale where TorchScale's own fp32 angles are exact
    (short lengths). At 1024 TorchScale's fp32 angles (float arange * inv_freq) drift by ~2e-5 of the score
    scale from the exact value, so there we hold ours to 1e-6 of a float64 evaluation of the same formula
    and to TorchScale within its own drift.
    """
    from torchscale.component.xpos_relative_position import XPOS

    torch.manual_seed(head_dim + length)
    xpos = XPOS(head_dim)
    keys_len = length + offset
    q = torch.randn(1, length, head_dim)
    k = torch.randn(1, keys_len, head_dim)
    # Encodings in fp32; the dot products in float64 so that only the encodings are compared.
    torchscale_scores = xpos(q, offset=offset).double() @ xpos(k, offset=0, downscale=True).double().transpose(1, 2)

    anchor = offset  # any anchor: only differences matter
    q_rel = torch.arange(offset, keys_len) - anchor
    k_rel = torch.arange(keys_len) - anchor
    method = position_method(LexConfig(hidden_size=head_dim, num_attention_heads=1, position_embedding_type="xpos"))
    factors_q, factors_k = method.terms(q_rel, k_rel).factors
    ours = apply_rotary(q, factors_q).double() @ apply_rotary(k, factors_k).double().transpose(1, 2)

    positions = torch.arange(keys_len)
    exact = reference.encode(q[0].double(), positions[offset:], "xpos") @ reference.encode(
        k[0].double(), positions, "xpos", downscale=True
    ).T
    scale = exact.abs().max().item()
    assert (ours[0] - exact).abs().max().item() <= 1e-6 * scale
    tolerance = 1e-6 if length < 1024 else 5e-5
    assert (ours - torchscale_scores).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize("compiling", [False, True], ids=["complex-product", "real-form"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_forms_of_the_rotary_product_encode_as_the_float64_reference(monkeypatch, compiling, dtype):
    """apply_rotary multiplies pairs as complex numbers in eager mode and spells the product out in real arithmetic
    where inductor compiles it; both equal the float64 xPos encoding (rotation and decay, queries and keys), on a
    transposed (B, H, T, d) view as the attention layers hand it over."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    torch.manual_seed(0)
    positions = torch.arange(300, 340)
    x = torch.randn(1, 40, 3, 64).transpose(1, 2)  # (B, H, T, d), not contiguous
    method = position_method(LexConfig(hidden_size=64, num_attention_heads=1, position_embedding_type="xpos"))
    factors_q, factors_k = method.terms(positions - 300, positions - 300).factors
    for factors, downscale in ((factors_q, False), (factors_k, True)):
        ours = apply_rotary(x.to(dtype), factors)
        assert ours.dtype == dtype
        exact = torch.stack([reference.encode(x[0, h].to(dtype).double(), positions - 300, "xpos",
                                              downscale=downscale) for h in range(3)])[None]
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ours.double(), exact, atol=tolerance, rtol=tolerance)


def test_xpos_scale_is_torchscale_buffer():
    from torchscale.component.xpos_relative_position import XPOS

    from modeling_lex.positions import xpos_zeta

    torch.testing.assert_close(xpos_zeta(64, 0.4, torch.device("cpu")).float(), XPOS(64).scale)


def test_rope_equals_hf_rotary_up_to_pair_layout():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    from transformers import LlamaConfig

    d, n = 64, 50
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, n, d), torch.randn(1, 1, n, d)
    positions = torch.arange(n)[None]
    llama = LlamaConfig(hidden_size=d, num_attention_heads=1, head_dim=d)
    cos, sin = LlamaRotaryEmbedding(llama)(q, positions)
    # HF pairs dims (i, i + d/2); ours pairs (2i, 2i+1): permute ours into HF's layout.
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    q_hf, k_hf = apply_rotary_pos_emb(q[..., perm], k[..., perm], cos, sin)
    expected = q_hf @ k_hf.transpose(-1, -2)

    method = position_method(LexConfig(hidden_size=d, num_attention_heads=1, position_embedding_type="rope"))
    factors = method.token_factors(positions[0])
    ours = apply_rotary(q, factors) @ apply_rotary(k, factors).transpose(-1, -2)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- attention modes vs the naive reference

MODES = ["blockwise", "sliding", "full"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["xpos", "rope", "decay", "alibi", "kerple", "sandwich", "sinusoidal", "none"])
@pytest.mark.parametrize("n", [5, 16, 27, 88])  # < w, = w, not a multiple of the block, 5.5 w
def test_modes_equal_naive_reference(mode, kind, n):
    config = tiny_config(attention_mode=mode, position_embedding_type=kind, num_attention_heads=4)
    model = perturbed_model(config)
    torch.manual_seed(n)
    ids = torch.randint(0, config.vocab_size, (2, n))
    with torch.no_grad():
        logits = model(ids).logits
    assert_rows_equal_reference(model, ids, logits)


@pytest.mark.parametrize("mode", MODES)
def test_left_padding_equals_reference_and_row_alone(mode):
    config = tiny_config(attention_mode=mode)
    model = perturbed_model(config, seed=1)
    torch.manual_seed(3)
    n, pads = 45, [0, 5, 13]
    ids = torch.randint(0, config.vocab_size, (len(pads), n))
    with torch.no_grad():
        logits = model(ids, attention_mask=left_pad_mask(ids, pads)).logits
        assert_rows_equal_reference(model, ids, logits, pads)
        for row, pad in enumerate(pads):
            alone = model(ids[row : row + 1, pad:]).logits[0]
            torch.testing.assert_close(logits[row, pad:], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [3, 11, 16, 20])  # < b, between b and w, = w (all plain causal); w + 4 (the modes part)
def test_modes_agree_up_to_window(n):
    """Up to n = w every mode is plain causal attention, past w the modes part.

    Each mode is held to the float64 reference (tests/reference.py), not to another mode: the model's plan does
    not look at the mode for n <= w, so mode-against-mode would compare one code path with itself. Unpadded
    rows take the plain causal tile; the left-padded row takes the `visible` mask (blocks counted from the
    first real token). At n = w + 4 blockwise and sliding must differ from full after position w (and only
    there), so the comparison does see the mode.
    """
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (2, n))
    pad = 2
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    logits = {}
    for mode in MODES:
        config = tiny_config(attention_mode=mode)
        model = perturbed_model(config)
        with torch.no_grad():
            plain = model(ids).logits
            padded = model(ids, attention_mask=mask).logits
        state = model.state_dict()
        for row in range(2):
            expected = reference.forward(state, config, ids[row])
            torch.testing.assert_close(plain[row].double(), expected, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{mode}: {m}")
        expected = reference.forward(state, config, ids[1], pad=pad)
        torch.testing.assert_close(padded[1, pad:].double(), expected[pad:], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{mode}, left-padded: {m}")
        logits[mode] = plain
    w = config.attention_window
    assert w == 16
    for mode in ("blockwise", "sliding"):
        torch.testing.assert_close(logits[mode][:, :w], logits["full"][:, :w], atol=1e-5, rtol=1e-5)
        if n > w:
            gap = (logits[mode][:, w:] - logits["full"][:, w:]).abs().amax(dim=-1)
            assert (gap > 1e-3).all(), f"{mode} equals full past the window: {gap}"


@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
@pytest.mark.parametrize("kind", ["xpos", "alibi", "kerple", "sandwich"])
def test_one_layer_window_equals_full_forward_over_visible_keys(mode, kind):
    config = tiny_config(attention_mode=mode, num_hidden_layers=1, position_embedding_type=kind)
    model = perturbed_model(config, seed=2)
    full = perturbed_model(
        tiny_config(attention_mode="full", num_hidden_layers=1, max_position_embeddings=64, position_embedding_type=kind),
        seed=2,
    )
    full.load_state_dict(model.state_dict())
    torch.manual_seed(4)
    ids = torch.randint(0, config.vocab_size, (1, 70))
    b, w = ReadingPolicy.of(config).block, config.attention_window
    with torch.no_grad():
        logits = model(ids).logits[0]
        for p in [0, 7, 8, 15, 16, 23, 40, 69]:
            start = max(0, (p // b - 1) * b) if mode == "blockwise" else max(0, p - w + 1)
            expected = full(ids[:, start : p + 1]).logits[0, -1]
            torch.testing.assert_close(logits[p], expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- long inputs and far positions


def test_one_layer_reads_131072_tokens_blockwise():
    config = tiny_config(num_hidden_layers=1, max_position_embeddings=256, vocab_size=64)
    model = LexForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 131_072))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
    assert hidden.shape == (1, 131_072, 32)
    assert torch.isfinite(hidden).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["xpos", "rope", "alibi", "kerple", "sandwich"])
def test_far_positions_give_the_same_logits(mode, kind):
    config = tiny_config(attention_mode=mode, position_embedding_type=kind)
    model = perturbed_model(config)
    ids = torch.randint(0, 97, (2, 40))
    positions = torch.arange(40)[None].expand(2, -1)
    with torch.no_grad():
        near = model(ids, position_ids=positions).logits
        far = model(ids, position_ids=positions + 1_000_000).logits
    torch.testing.assert_close(far, near, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_far_positions_finite_in_half_precision(dtype, mode):
    model = perturbed_model(tiny_config(attention_mode=mode)).to(dtype)
    ids = torch.randint(0, 97, (1, 40))
    positions = torch.arange(40)[None] + 1_000_000
    with torch.no_grad():
        logits = model(ids, position_ids=positions).logits
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------- HF integration


def test_save_load_roundtrip_safetensors_only(tmp_path):
    config = tiny_config()
    model = perturbed_model(config)
    model.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt")) for f in files)
    loaded_config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded_config, LexConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("n", [12, 40])
def test_eager_equals_sdpa(n):
    config = tiny_config(position_embedding_type="alibi" if n == 40 else "xpos")
    model = perturbed_model(config)
    ids = torch.randint(0, 97, (2, n))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    outputs = {}
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation  # (transformers takes it: the interface is used)
        with torch.no_grad():
            outputs[implementation] = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(outputs["eager"], outputs["sdpa"], atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_same_gradients():
    config = tiny_config()
    ids = torch.randint(0, 97, (2, 40))
    grads = []
    for checkpointing in (False, True):
        model = perturbed_model(config).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


def test_loss_is_shifted_cross_entropy_ignoring_minus_100():
    model = perturbed_model(tiny_config())
    ids = torch.randint(0, 97, (2, 20))
    labels = ids.clone()
    labels[:, :5] = -100
    out = model(ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, expected)


def test_tied_embeddings_resize_and_logits_to_keep():
    model = perturbed_model(tiny_config())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.resize_token_embeddings(120)
    assert model.lm_head.weight.shape[0] == 120 and model.config.vocab_size == 120
    ids = torch.randint(0, 120, (1, 10))
    with torch.no_grad():
        assert model(ids, logits_to_keep=1).logits.shape == (1, 1, 120)
        torch.testing.assert_close(model(ids, logits_to_keep=1).logits[:, 0], model(ids).logits[:, -1])


def test_hidden_states_and_attentions_are_returned():
    model = perturbed_model(tiny_config())
    model.set_attn_implementation("eager")
    out = model(torch.randint(0, 97, (1, 10)), output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    assert out.attentions[0].shape == (1, 2, 10, 10)


@pytest.mark.parametrize("variant", [
    dict(normalize_before=False), dict(subln=True), dict(normalize_before=False, deepnorm=True),
    dict(layernorm_embedding=True, embedding_scale=math.sqrt(32)), dict(hidden_act="relu"),
    dict(hidden_act="swish", tie_word_embeddings=False),
])
def test_architecture_switches_match_reference(variant):
    config = tiny_config(**variant)
    model = perturbed_model(config)
    ids = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        logits = model(ids).logits[0]
    torch.testing.assert_close(logits.double(), reference.forward(model.state_dict(), config, ids[0]), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the modern backbone (Llama, Mistral, Qwen2)

LLAMA_SHAPED = dict(norm_type="rmsnorm", mlp_type="gated", hidden_act="silu", attention_bias=False, mlp_bias=False)
BACKBONES = {
    "llama_gqa_untied": dict(LLAMA_SHAPED, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mqa_head_dim_12": dict(LLAMA_SHAPED, num_attention_heads=4, num_key_value_heads=1, head_dim=12),
    "qwen2_qkv_bias_only": dict(LLAMA_SHAPED, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                attention_output_bias=False),
    "gated_subln_layernorm_embedding": dict(mlp_type="gated", hidden_act="silu", subln=True, norm_type="rmsnorm",
                                            layernorm_embedding=True, num_key_value_heads=1),
}
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8, "rope_theta": 500.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 500.0},
}


def test_position_registry_covers_every_type():
    from modeling_lex.positions import PositionMethod

    assert tuple(POSITION_METHODS) == POSITION_EMBEDDING_TYPES
    assert all(issubclass(method, PositionMethod) for method in POSITION_METHODS.values())
    assert [name for name, method in POSITION_METHODS.items() if method.llama] == ["rope"]
    assert [name for name, method in POSITION_METHODS.items() if method.torchscale] == ["xpos", "sinusoidal", "none"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["xpos", "rope", "alibi", "kerple"])
@pytest.mark.parametrize("backbone", BACKBONES)
def test_modern_backbone_equals_reference(backbone, kind, mode):
    """GQA/MQA, head_dim apart from hidden/heads, RMSNorm, gated SiLU MLP, q/k/v biases without the output's,
    with every position family, in every mode past several windows, against the float64 reference."""
    config = tiny_config(attention_mode=mode, position_embedding_type=kind, **BACKBONES[backbone])
    model = perturbed_model(config)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    assert_rows_equal_reference(model, ids, logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_and_mlp_compute_llamas_numbers_in_place_or_not(dtype):
    """RMSNorm (torch's fused kernel, the weight applied in place) and the gated MLP (the product written over the
    activation) give transformers' LlamaRMSNorm and LlamaMLP bit for bit, with and without autograd, and the
    recorded forward gives Llama's gradients."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    from modeling_lex.modeling_lex import LexMLP, LexRMSNorm

    config = tiny_config(**BACKBONES["llama_gqa_untied"])
    torch.manual_seed(0)
    ours_norm, ours_mlp = LexRMSNorm(32, 1e-5), LexMLP(config)
    llama_norm = LlamaRMSNorm(32, eps=1e-5)
    llama_mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="silu"))
    with torch.no_grad():
        ours_norm.weight.normal_()
        llama_norm.weight.copy_(ours_norm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(llama_mlp, name).weight.copy_(getattr(ours_mlp, name).weight)
    for module in (ours_norm, ours_mlp, llama_norm, llama_mlp):
        module.to(dtype)
    x = torch.randn(2, 7, 32, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(ours_norm(x), llama_norm(x))
        assert torch.equal(ours_mlp(x), llama_mlp(x))
        # A float32 weight on a bfloat16 input (a norm kept in float32): the product is float32, as Llama's.
        ours_norm.float(), llama_norm.float()
        assert torch.equal(ours_norm(x.bfloat16()), llama_norm(x.bfloat16()))
        assert ours_norm(x.bfloat16()).dtype == torch.float32
        ours_norm.to(dtype), llama_norm.to(dtype)
    for ours, llama in ((ours_norm, llama_norm), (ours_mlp, llama_mlp)):
        given = x.clone().requires_grad_()
        out = ours(given)
        expected = llama(x.clone().requires_grad_())
        assert torch.equal(out, expected)
        out.float().square().sum().backward()
        expected.float().square().sum().backward()
        for (name, a), b in zip(ours.named_parameters(), llama.parameters()):
            assert torch.equal(a.grad, b.grad), name


def test_a_forward_writes_over_no_tensor_a_module_returned():
    """The in-place writes (norm weight, MLP product, the sink keys' rotation in the cache's copy) touch only
    tensors made inside a module's forward: what a forward hook kept of any module's output is, after the model's
    forward, what the module returned."""
    config = tiny_config(attention_sinks=2, attention_mode="sliding", **BACKBONES["llama_gqa_untied"])
    model = perturbed_model(config)
    kept = []

    def keep(module, args, output):
        for tensor in output if isinstance(output, tuple) else (output,):
            if isinstance(tensor, torch.Tensor):
                kept.append((tensor, tensor.clone()))

    for module in model.modules():
        module.register_forward_hook(keep)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)
    assert len(kept) > 100
    assert all(torch.equal(tensor, copy) for tensor, copy in kept)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["xpos", "rope", "decay"])
@pytest.mark.parametrize("scaling", ROPE_SCALINGS)
def test_rope_parameters_frequencies_equal_reference(scaling, kind, mode):
    """rope_parameters' frequencies (and yarn's attention factor) come from transformers' ROPE_INIT_FUNCTIONS and
    drive every rotating position type."""
    config = tiny_config(attention_mode=mode, position_embedding_type=kind, rope_parameters=dict(ROPE_SCALINGS[scaling]),
                         **BACKBONES["llama_gqa_untied"])
    model = perturbed_model(config)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids).logits[0]
    torch.testing.assert_close(logits.double(), reference.forward(model.state_dict(), config, ids[0]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scaling", ROPE_SCALINGS)
def test_rope_scaled_model_reloads(tmp_path, scaling):
    """from_pretrained builds models on the meta device: the rope frequencies must still come out real."""
    model = perturbed_model(tiny_config(rope_parameters=dict(ROPE_SCALINGS[scaling])))
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, model(ids).logits)


def test_yarn_attention_factor_is_applied():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_config(rope_parameters=dict(ROPE_SCALINGS["yarn"]))
    _, factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    assert factor > 1.01 and position_method(config).scale == factor


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_types_are_refused_by_name(rope_type):
    with pytest.raises(StrictDataclassClassValidationError, match=rf"'{rope_type}'.*depend on the current length"):
        tiny_config(rope_parameters={"rope_type": rope_type, "factor": 2.0, "short_factor": [1.0] * 8,
                                     "long_factor": [1.0] * 8, "original_max_position_embeddings": 8})
    with pytest.raises(StrictDataclassClassValidationError, match="partial_rotary_factor"):
        tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})


def test_backbone_defaults_are_todays_model(tmp_path):
    """A config.json saved before the backbone fields existed (rope_theta at the top level) loads as the same model:
    no missing or unexpected weights, the same logits, and it saves rope_parameters instead."""
    import json

    config = tiny_config(position_embedding_type="kerple", attention_mode="sliding")
    assert (config.num_key_value_heads, config.head_dim, config.norm_type, config.mlp_type) == (2, 16, "layernorm", "fc")
    assert config.attention_output_bias is True and config.rope_parameters == {"rope_type": "default", "rope_theta": 1e4}
    model = perturbed_model(config)
    model.save_pretrained(tmp_path)
    old = json.loads((tmp_path / "config.json").read_text())
    for field in ("num_key_value_heads", "head_dim", "norm_type", "rms_norm_eps", "mlp_type", "attention_output_bias",
                  "rope_parameters"):
        old.pop(field)
    old["rope_theta"] = 10000.0
    (tmp_path / "config.json").write_text(json.dumps(old))
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert loaded.config.to_dict() == config.to_dict() | {"_name_or_path": str(tmp_path)}


def test_sinusoidal_spellings_are_one_config():
    """"sinusoidal" and "none" + absolute_position_embedding="sinusoidal" are the same configuration."""
    one = tiny_config(position_embedding_type="sinusoidal")
    other = tiny_config(position_embedding_type="none", absolute_position_embedding="sinusoidal")
    assert one.to_dict() == other.to_dict()
    assert (one.position_embedding_type, one.absolute_position_embedding) == ("sinusoidal", "sinusoidal")
    assert tiny_config(position_embedding_type="xpos", absolute_position_embedding="sinusoidal").position_embedding_type == "xpos"


# ---------------------------------------------------------------- configuration errors


@pytest.mark.parametrize("field, value, error", [
    ("hidden_size", 30, StrictDataclassClassValidationError),  # not divisible by 4 heads
    ("num_attention_heads", 32, StrictDataclassClassValidationError),  # 32 / 32 heads: head dim 1, odd
    ("attention_window", 7, StrictDataclassClassValidationError),
    ("attention_window", 2, StrictDataclassClassValidationError),
    ("attention_mode", "dilated", StrictDataclassFieldValidationError),
    ("position_embedding_type", "t5", StrictDataclassFieldValidationError),
    ("xpos_scale_base", 0, StrictDataclassFieldValidationError),
    ("xpos_scale_base", -3, StrictDataclassFieldValidationError),
    ("hidden_act", "tanh", StrictDataclassFieldValidationError),
    ("attention_dropout", 1.5, StrictDataclassFieldValidationError),
    ("attention_dropout", 1.0, StrictDataclassFieldValidationError),
    ("vocab_size", 0, StrictDataclassFieldValidationError),
    ("xpos_gamma", -0.1, StrictDataclassFieldValidationError),
    ("absolute_position_offset", -1, StrictDataclassFieldValidationError),
    ("absolute_position_embedding", "learned", StrictDataclassFieldValidationError),
    # what @strict newly catches: wrong types, bools where numbers are meant
    ("hidden_size", "64", StrictDataclassFieldValidationError),
    ("attention_window", True, StrictDataclassFieldValidationError),
    ("layer_norm_eps", True, StrictDataclassFieldValidationError),
    ("position_embedding_type", None, StrictDataclassFieldValidationError),
    ("subln", "yes", StrictDataclassFieldValidationError),
])
def test_bad_config_values_name_the_field(field, value, error):
    """@strict errors (not ValueError): a field's type or range names the field; a cross-field rule names it too."""
    overrides = {"num_attention_heads": 4, field: value}
    if field == "num_attention_heads":
        field = "hidden_size"  # the cross-field message names both
    with pytest.raises(error, match=rf"\b{field}\b") as caught:
        tiny_config(**overrides)
    assert isinstance(caught.value, StrictDataclassError) and not isinstance(caught.value, ValueError)


@pytest.mark.parametrize("field, value, allowed", [
    ("attention_mode", "dilated", ATTENTION_MODES),
    ("position_embedding_type", "t5", POSITION_EMBEDDING_TYPES),
    ("hidden_act", "tanh", HIDDEN_ACTS),
])
def test_bad_choice_lists_the_allowed_values(field, value, allowed):
    with pytest.raises(StrictDataclassFieldValidationError) as caught:
        tiny_config(**{field: value})
    assert f"field '{field}'" in str(caught.value) and str(tuple(allowed)) in str(caught.value)


def test_allowed_values_come_from_the_literal_types():
    import dataclasses
    import typing

    from configuration_lex import configuration_lex as module

    assert ATTENTION_MODES == ("blockwise", "sliding", "full") == typing.get_args(module.AttentionMode)
    assert POSITION_EMBEDDING_TYPES == typing.get_args(module.PositionEmbeddingType)
    assert HIDDEN_ACTS == typing.get_args(module.HiddenAct)
    hints = {field.name: field.type for field in dataclasses.fields(LexConfig)}
    assert typing.get_args(hints["attention_mode"]) == ATTENTION_MODES
    assert typing.get_args(hints["position_embedding_type"]) == POSITION_EMBEDDING_TYPES
    assert typing.get_args(hints["hidden_act"]) == HIDDEN_ACTS


def test_strict_config_accepts_what_the_project_does(tmp_path):
    """Ints for float fields, assignment of non-fields (auto_map, _attn_implementation), overrides on load,
    from_dict / to_dict / save_pretrained round trips; a bad assignment after construction is refused."""
    config = tiny_config(xpos_scale_base=512, hidden_dropout=0, embedding_scale=1, rope_theta=10000)
    assert config.attention_window == 16 and config.head_dim == 16
    config.auto_map = {"AutoConfig": "configuration_lex.LexConfig"}
    config._attn_implementation = "eager"
    config.attention_mode = "sliding"
    with pytest.raises(StrictDataclassFieldValidationError, match="attention_mode"):
        config.attention_mode = "dilated"
    with pytest.raises(StrictDataclassFieldValidationError, match="hidden_size"):
        config.hidden_size = "64"
    assert config.attention_mode == "sliding" and config.hidden_size == 32
    assert LexConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path, attention_mode="full")
    assert isinstance(loaded, LexConfig) and loaded.attention_mode == "full"
    assert loaded.xpos_scale_base == 512 and loaded.attention_window == 16
    with pytest.raises(StrictDataclassFieldValidationError, match="attention_mode"):
        AutoConfig.from_pretrained(tmp_path, attention_mode="dilated")
    config.attention_window = 7  # class rules run on construction and again before saving
    with pytest.raises(StrictDataclassClassValidationError, match="attention_window=7"):
        config.save_pretrained(tmp_path / "bad")


# ---------------------------------------------------------------- the other position methods of the seed papers


def test_bias_formulas_on_small_inputs():
    from modeling_lex.positions import alibi_bias, kerple_log_bias, sandwich_bias

    distance = torch.tensor([[0, 1, 5], [2, 0, 1]])
    r1, r2 = torch.tensor([0.5, 2.0]), torch.tensor([0.25, 1.0])
    kerple = kerple_log_bias(distance, r1, r2)
    assert kerple.shape == (2, 2, 3)
    assert math.isclose(kerple[1, 0, 2].item(), -2.0 * math.log(1 + 1.0 * 5), rel_tol=1e-6)
    assert math.isclose(kerple[0, 1, 0].item(), -0.5 * math.log(1 + 0.25 * 2), rel_tol=1e-6)
    alibi = alibi_bias(distance, 8)
    assert math.isclose(alibi[0, 0, 2].item(), -0.5 * 5, rel_tol=1e-6)  # slope 2^-1 for head 1 of 8
    assert math.isclose(alibi[7, 0, 2].item(), -(2**-8) * 5, rel_tol=1e-6)
    positions = torch.arange(6)
    direct = reference.sandwich(positions, 4, 16)
    ours = sandwich_bias(positions[:, None] - positions[None, :], 4, 16)
    torch.testing.assert_close(ours.double(), direct, atol=1e-5, rtol=1e-6)
    assert (ours[:, 0, 0] == 0).all() and (ours[:, 5, 0] < 0).all()


def test_sinusoidal_table_is_fairseqs():
    from modeling_lex.positions import sinusoidal_embedding

    positions = torch.tensor([2, 3, 100, 1000])
    for dim in (32, 33):
        torch.testing.assert_close(
            sinusoidal_embedding(positions, dim).double(), reference.fairseq_sinusoidal(positions, dim), atol=1e-6, rtol=0
        )


@pytest.mark.parametrize("spelling", [dict(position_embedding_type="sinusoidal"),
                                      dict(position_embedding_type="none", absolute_position_embedding="sinusoidal"),
                                      dict(position_embedding_type="xpos", absolute_position_embedding="sinusoidal")])
def test_sinusoidal_warns_beyond_training_length(monkeypatch, spelling):
    """Absolute positions keep their meaning in every mode: beyond l they are out of distribution, and we say so."""
    from unittest import mock

    from modeling_lex import modeling_lex as module

    logger = mock.Mock()
    monkeypatch.setattr(module, "logger", logger)
    model = perturbed_model(tiny_config(**spelling))
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 16)))
        assert not logger.warning_once.called
        model(torch.randint(0, 97, (1, 40)))
    assert "never seen in training" in logger.warning_once.call_args[0][0]


def test_kerple_parameters_are_learned_and_initialised_positive(tmp_path):
    model = LexForCausalLM(tiny_config(position_embedding_type="kerple"))
    r1 = model.model.layers[0].self_attn.kerple_r1
    assert r1.requires_grad and (r1 > 0).all() and (r1 < 2).all()
    ids = torch.randint(0, 97, (1, 20))
    model(ids, labels=ids).loss.backward()
    assert r1.grad is not None and r1.grad.abs().sum() > 0
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded.model.layers[0].self_attn.kerple_r1, r1)


# ---------------------------------------------------------------- packed documents, attention maps, 4D masks


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["xpos", "alibi", "kerple"])
def test_packed_documents_equal_each_document_alone(mode, kind):
    """A position_ids restart starts a new document: each is computed exactly as alone, in the O(n*w) path too
    (documents longer than w, blocks counted from each document's start, starts off block boundaries)."""
    model = perturbed_model(tiny_config(attention_mode=mode, position_embedding_type=kind))
    docs, ids, positions = packed([5, 37, 1, 23, 40])  # 106 tokens > w = 16: the unfolded path
    with torch.no_grad():
        logits = model(ids, position_ids=positions).logits[0]
        start = 0
        for doc in docs:
            alone = model(doc[None]).logits[0]
            torch.testing.assert_close(logits[start : start + len(doc)], alone, atol=1e-5, rtol=1e-5)
            start += len(doc)


def test_packed_batch_trains_like_padded_batch():
    """DataCollatorWithFlattening (transformers' padding-free collator) gives the loss and gradients of the
    same documents in a padded batch."""
    from transformers import DataCollatorWithFlattening

    model = perturbed_model(tiny_config(hidden_dropout=0.0))
    docs, _, _ = packed([7, 30, 19], seed=1)
    flat = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    assert "attention_mask" not in flat and flat["position_ids"][0, 7] == 0
    packed_loss = model(**flat).loss
    packed_loss.backward()
    packed_grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()

    longest = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(docs):
        ids[row, : len(doc)], mask[row, : len(doc)] = doc, 1
    labels = ids.masked_fill(mask == 0, -100)
    padded_loss = model(ids, attention_mask=mask, labels=labels).loss
    padded_loss.backward()
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_grad, model.model.embed_tokens.weight.grad, atol=1e-5, rtol=1e-4)


def naive_attention_maps(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's softmax(q k^T) with the mode's window, from tests/reference.py's float64 model."""
    return reference.attention_maps(model.state_dict(), model.config, ids[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [5, 16, 40])
def test_attention_maps_for_any_length(mode, n):
    """output_attentions=True returns (batch, heads, T, T) per layer for any T, zeros where the window hides a
    key, equal to a naive masked attention map; gradients flow through them."""
    model = perturbed_model(tiny_config(attention_mode=mode))
    torch.manual_seed(n)
    ids = torch.randint(0, 97, (1, n))
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        out = model(ids, output_attentions=True)
        assert len(out.attentions) == model.config.num_hidden_layers
        for layer, (got, expected) in enumerate(zip(out.attentions, naive_attention_maps(model, ids))):
            assert got.shape == (1, model.config.num_attention_heads, n, n)
            torch.testing.assert_close(got[0].double(), expected, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(out.logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    out = model(ids, output_attentions=True)
    out.attentions[0].retain_grad()
    out.logits.sum().backward()
    assert out.attentions[0].grad is not None and out.attentions[0].grad.abs().sum() > 0


def test_custom_4d_mask_shares_a_prefix():
    """A caller's (B, 1, T, T) mask: three continuations of one prefix in one row equal three rows."""
    model = perturbed_model(tiny_config())
    prefix, endings = torch.tensor([10, 11, 12]), torch.tensor([13, 14, 15])
    rows = torch.stack([torch.cat([prefix, endings[i : i + 1]]) for i in range(3)])
    shared = torch.cat([prefix, endings])[None]
    allowed = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    allowed[4, 3] = allowed[5, 3] = allowed[5, 4] = False
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        separate = model(rows).logits[:, -1]
        together = model(shared, attention_mask=mask, position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]])).logits[0, 3:]
    torch.testing.assert_close(together, separate, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="4D attention_mask must have shape"):
        model(shared, attention_mask=mask[:, :, :5])
