"""Attention sinks (`attention_sinks` = S): the first S tokens of each document stay visible to every later query of
that document in blockwise and sliding modes, everywhere the window is, seen from where `attention_sink_positions`
places them (their true positions, or within the cache).

References: the naive float64 model of tests/reference.py (which has both rules), transformers' own Llama under a
naive window attention with its sinks re-rotated to their places, each packed document alone, and the model's own
no-cache forward for the cached paths (itself held to the reference here). Sinks with assisted decoding and the
static cache are tested in test_assisted.py and test_static_cache.py.
"""

import pytest
import torch

from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import modeling_lex  # noqa: F401
from configuration_lex import SINK_POSITIONS
from convert.hf import lex_from_hf
from modeling_lex import LexCache
from tests import reference
from tests.helpers import (
    W,
    assert_rows_equal_reference,
    greedy,
    left_pad_mask,
    left_padded,
    packed,
    perturbed_model,
    prompt,
    tiny_config,
)

pytestmark = pytest.mark.oldest  # also run on the oldest transformers we declare

MODES = ["blockwise", "sliding", "full"]
S = 4


@pytest.mark.parametrize("sinks, rule", [(0, "true"), (S, "true"), (S, "cache")])
@pytest.mark.parametrize("kind", ["xpos", "rope", "alibi", "kerple"])
@pytest.mark.parametrize("mode", MODES)
def test_left_padded_rows_equal_the_reference(mode, kind, sinks, rule):
    config = tiny_config(attention_mode=mode, position_embedding_type=kind, attention_sinks=sinks,
                         attention_sink_positions=rule)
    model = perturbed_model(config)
    ids = torch.randint(0, 97, (3, 5 * W + 3), generator=torch.Generator().manual_seed(1))
    pads = [0, 5, 13]
    with torch.no_grad():
        logits = model(ids, attention_mask=left_pad_mask(ids, pads)).logits
    assert_rows_equal_reference(model, ids, logits, pads)


@pytest.mark.parametrize("rule", SINK_POSITIONS)
@pytest.mark.parametrize("kind", ["xpos", "rope", "alibi"])
@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_packed_documents_each_keep_their_own_sinks(mode, kind, rule):
    config = tiny_config(attention_mode=mode, position_embedding_type=kind, attention_sinks=S,
                         attention_sink_positions=rule)
    model = perturbed_model(config)
    docs, ids, positions = packed([3 * W + 5, 7, 2 * W + 1, 40])
    with torch.no_grad():
        logits = model(ids, position_ids=positions).logits[0]
    start = 0
    for doc in docs:
        expected = reference.forward(model.state_dict(), config, doc)
        torch.testing.assert_close(logits[start : start + len(doc)].double(), expected, atol=1e-5, rtol=1e-5)
        start += len(doc)


def test_sinks_change_what_a_window_computes_and_nothing_in_full_mode():
    ids = prompt(1, 4 * W)
    for mode, changes in (("sliding", True), ("blockwise", True), ("full", False)):
        without = perturbed_model(tiny_config(attention_mode=mode))
        with_sinks = perturbed_model(tiny_config(attention_mode=mode, attention_sinks=S))
        with torch.no_grad():
            a, b = without(ids).logits, with_sinks(ids).logits
        torch.testing.assert_close(a[:, :W], b[:, :W])  # inside the first window the sinks are in view anyway
        assert (a - b).abs().max() > 1e-3 if changes else torch.equal(a, b), mode


@pytest.mark.parametrize("kind", ["xpos", "rope", "alibi", "kerple"])
@pytest.mark.parametrize("rule", SINK_POSITIONS)
@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_cached_reading_equals_one_forward_and_holds_at_most_s_plus_w_minus_1(mode, rule, kind):
    """Prefill of a left-padded batch, then one token at a time: every step's logits are the no-cache forward's,
    and no layer ever holds more than S + w - 1 keys."""
    model = perturbed_model(tiny_config(attention_mode=mode, attention_sinks=S, attention_sink_positions=rule,
                                        position_embedding_type=kind))
    _, ids, mask = left_padded([3 * W + 5, W + 2])
    prefix = 2 * W + 1
    cache = LexCache(model.config)
    held = []
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        steps = [model(ids[:, :prefix], attention_mask=mask[:, :prefix], past_key_values=cache).logits]
        held.append(cache.layers[0].keys.shape[2])
        for t in range(prefix, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits)
            held.append(max(layer.keys.shape[2] for layer in cache.layers))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert max(held) <= S + W - 1 and cache.layers[0].keys.shape[2] == S + cache.held


@pytest.mark.parametrize("rule", SINK_POSITIONS)
@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_generate_equals_repeated_full_forwards(mode, rule):
    """Greedy generate() with the bounded cache picks the argmax of a no-cache forward over the whole sequence at
    every step, with logits to match, far past the window."""
    model = perturbed_model(tiny_config(attention_mode=mode, attention_sinks=S, attention_sink_positions=rule))
    ids = prompt(1, 2 * W + 3)
    out = greedy(model, ids, max_new_tokens=4 * W)
    sequence = ids
    with torch.no_grad():
        for step in range(4 * W):
            logits = model(sequence).logits[:, -1]
            torch.testing.assert_close(out.logits[step], logits, atol=1e-4, rtol=1e-4)
            sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, sequence)


@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_attention_maps_show_the_sinks(mode):
    """output_attentions over a long input: (batch, heads, T, T) maps equal to the reference's, sinks included."""
    config = tiny_config(attention_mode=mode, attention_sinks=S)
    model = perturbed_model(config)
    model.set_attn_implementation("eager")
    ids = prompt(1, 3 * W)
    with torch.no_grad():
        maps = model(ids, output_attentions=True).attentions
    for got, expected in zip(maps, reference.attention_maps(model.state_dict(), config, ids[0])):
        torch.testing.assert_close(got[0].double(), expected, atol=1e-5, rtol=1e-5)
    assert (maps[0][0, :, -1, :S] > 0).all()  # the last query, far past the window, still sees the sinks


def test_generation_maps_cover_the_sink_slots():
    model = perturbed_model(tiny_config(attention_mode="sliding", attention_sinks=S))
    model.set_attn_implementation("eager")
    out = greedy(model, prompt(1, 2 * W), max_new_tokens=W, output_attentions=True)
    for maps in out.attentions[1:]:
        for layer_map in maps:  # the sink slots, the held window and the new token
            assert layer_map.shape == (1, 2, 1, S + W)
            torch.testing.assert_close(layer_map.sum(-1), torch.ones(1, 2, 1))
            assert (layer_map[..., :S] > 0).all()


@pytest.mark.parametrize("memory", [0, 3])
def test_a_retained_map_gets_its_gradient(memory):
    """With sinks (and a block memory) a map is rebuilt over the cache's keys, and the output is read from it: a map
    a user retains gets its gradient (transformers' test_retain_grad_hidden_states_attentions), the logits are the
    reading's without maps, and so is the gradient of the weights."""
    config = tiny_config(attention_mode="sliding", attention_sinks=S, attention_sink_positions="cache",
                         attention_memory_blocks=memory, attention_memory_block_size=5)
    ids = prompt(1, 3 * W, seed=4)
    readings = []
    for maps in (False, True):
        model = perturbed_model(config)
        model.set_attn_implementation("eager")
        cache = LexCache(config)
        with torch.no_grad():
            model(ids[:, : 3 * W - 1], cache=cache)
        out = model(ids[:, 3 * W - 1 :], cache=cache, output_attentions=maps)
        if maps:
            out.attentions[0].retain_grad()
        out.logits.square().sum().backward()
        readings.append((out, model.model.layers[0].self_attn.q_proj.weight.grad))
    (plain, plain_grad), (mapped, mapped_grad) = readings
    assert mapped.attentions[0].grad is not None and mapped.attentions[0].grad.abs().sum() > 0
    torch.testing.assert_close(mapped.logits, plain.logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(mapped_grad, plain_grad, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- where sinks are seen from


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * W,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.15)  # attention far from uniform, so sinks matter
    return model


@pytest.mark.parametrize("rule", SINK_POSITIONS)
@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_a_converted_llama_equals_transformers_llama_with_its_sinks_placed_by_the_rule(mode, rule):
    """The independent reference: transformers' own Llama under a naive attention that keeps the window and
    scores the sink keys re-rotated to their positions within the cache (or at their true ones). Read in one
    forward, cached one token at a time, and by generate(), past several windows."""
    llama = tiny_llama()
    lex = lex_from_hf(llama, mode, W, S).eval()
    assert lex.config.attention_sink_positions == "cache"  # what a converted checkpoint gets
    lex.config.attention_sink_positions = rule
    name = f"lex-test-{mode}-{rule}"
    ALL_ATTENTION_FUNCTIONS.register(name, reference.llama_window_attention(llama, mode, W, S, rule))
    llama.set_attn_implementation(name)
    ids = prompt(1, 5 * W + 3)
    with torch.no_grad():
        expected = llama(ids).logits
        torch.testing.assert_close(lex(ids).logits, expected, atol=1e-4, rtol=1e-4)
        cache, steps = LexCache(lex.config), []
        for t in range(ids.shape[1]):
            steps.append(lex(ids[:, t : t + 1], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=1e-4)
    out = greedy(lex, ids[:, : 2 * W + 1], max_new_tokens=2 * W)
    with torch.no_grad():
        whole = llama(out.sequences).logits[0, 2 * W : -1]
    torch.testing.assert_close(torch.stack(out.logits, dim=1)[0], whole, atol=1e-4, rtol=1e-4)


def test_the_two_rules_differ_only_once_a_sink_leaves_the_window():
    llama = tiny_llama(seed=1)
    true, cache = (lex_from_hf(llama, "sliding", W, S).eval() for _ in range(2))
    true.config.attention_sink_positions = "true"
    ids = prompt(1, 3 * W)
    with torch.no_grad():
        a, b = true(ids).logits, cache(ids).logits
    torch.testing.assert_close(a[:, :W], b[:, :W])
    assert (a[:, W + 1 :] - b[:, W + 1 :]).abs().amax(-1).min() > 1e-4  # every query past the window differs


@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_sinks_in_their_frame_keep_sdpa_on_its_fused_kernel(monkeypatch, mode):
    """A converted Llama reads past its window with sinks in the cache's frame through SDPA: a tile of several
    queries meets the sinks with a second copy of each query, so its values are padded to the same width (with
    a narrower value SDPA falls back to its unfused math path), and a decoding step scores its sink keys rotated
    instead (no second copy of the query), reading them where the cache holds them once they sit in its sink slots
    (the keys SDPA gets are a view of the cache's buffer, rotated in its copy of the slots) without a mask. Each
    equals transformers' Llama under the reference attention (test above)."""
    widths = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recorded(query, key, value, **kwargs):
        in_cache = key.untyped_storage().nbytes() > key.numel() * key.element_size()
        widths.append((in_cache and kwargs.get("attn_mask") is None, query.shape[-1], key.shape[-1], value.shape[-1]))
        return original(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    lex = lex_from_hf(tiny_llama(), mode, W, S).eval()
    lex.set_attn_implementation("sdpa")
    head = lex.config.head_dim
    out = greedy(lex, prompt(1, 3 * W + 5), max_new_tokens=W)
    read = 4 * lex.config.num_hidden_layers  # the prompt is read W tokens at a time: 4 forwards
    assert all(q == k == v for _, q, k, v in widths) and len(widths) == read + (W - 1) * lex.config.num_hidden_layers
    assert {q for _, q, _, _ in widths[:read]} == {head, 2 * head}  # the prompt: plain, then in the sinks' frame
    assert {q for _, q, _, _ in widths[read:]} == {head}  # decoding steps: one copy of the query
    assert all(in_place for in_place, _, _, _ in widths[-W // 2 :])  # ... the sinks in place in the cache, no mask
    with torch.no_grad():
        expected = lex(out.sequences).logits[:, 3 * W + 4 : -1]
    torch.testing.assert_close(torch.stack(out.logits, dim=1), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_decoding_steps_with_sinks_in_their_frame_give_the_no_cache_gradients(mode):
    """Under autograd, single-token steps whose sink keys are rotated in the cache's copy of its slots give the
    logits and gradients of one no-cache forward: autograd records the rotation written in place."""
    ids = prompt(1, 3 * W + 2)
    results = []
    for cached in (True, False):
        model = lex_from_hf(tiny_llama(), mode, W, S).train()
        if cached:
            cache = LexCache(model.config)
            logits = torch.cat([model(part, past_key_values=cache).logits
                                for part in (ids[:, :-2], ids[:, -2:-1], ids[:, -1:])], dim=1)
        else:
            logits = model(ids).logits
        logits.pow(2).mean().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for cached, plain in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(cached, plain, atol=1e-5, rtol=1e-4)
