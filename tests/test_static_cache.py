"""The static cache (`generate(cache_implementation="static")`) and compiled decoding with it.

Fixed slots written in place: the tokens and logits of the default LexCache (left-padded batches, beams, sinks), the
number of slots, and with a compiled forward no new graph on a second generate() (dynamo's own graph counter).
"""

import pytest
import torch
from torch._dynamo.utils import counters

import modeling_lex  # noqa: F401
from configuration_lex import SINK_POSITIONS
from modeling_lex import LexStaticCache
from tests.helpers import (
    PAD,
    W,
    greedy,
    greedy_tokens,
    left_padded,
    load_weights,
    markov_batch,
    perturbed_model,
    prompt,
    tiny_config,
    trained_model,
)

S = 4

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.oldest]


@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
def test_static_cache_generates_what_the_default_cache_does(mode):
    """cache_implementation="static": fixed slots written in place; the tokens and logits of the default
    LexCache for a left-padded batch over several blocks, and with 2 beams."""
    model = perturbed_model(tiny_config(attention_mode=mode))
    _, ids, mask = left_padded([5, 2 * W + 3, W])
    default = greedy(model, ids, attention_mask=mask, max_new_tokens=2 * W)
    static = greedy(model, ids, attention_mask=mask, max_new_tokens=2 * W, cache_implementation="static")
    assert type(static.past_key_values).__name__ == "LexStaticCache"
    assert torch.equal(static.sequences, default.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(default.logits), atol=1e-4, rtol=1e-4)
    if mode != "full":
        assert static.past_key_values.layers[0].keys.shape[2] == W - 1
    beams = dict(num_beams=2, max_new_tokens=W + 3, attention_mask=mask)
    assert torch.equal(greedy(model, ids, cache_implementation="static", **beams).sequences,
                       greedy(model, ids, **beams).sequences)


@pytest.mark.parametrize("rule", SINK_POSITIONS)
@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
def test_static_cache_slots_and_tokens(mode, rule):
    """min(w - 1 + S, max_cache_len) slots (full mode: max_cache_len); the tokens of the default cache."""
    model = perturbed_model(tiny_config(attention_mode=mode, attention_sinks=S, attention_sink_positions=rule))
    for short in (10, W + 1):  # a stream that never outgrows the slots: no sink slots needed
        assert LexStaticCache(model.config, max_cache_len=short).layers[0].get_max_length() == short
    long = LexStaticCache(model.config, max_cache_len=200).layers[0].get_max_length()
    assert long == (200 if mode == "full" else W - 1 + S)
    _, ids, mask = left_padded([2 * W + 3, 9])
    for new in (3, 3 * W):  # a generation shorter than the window (fewer slots) and one past it
        default = greedy(model, ids, attention_mask=mask, max_new_tokens=new)
        static = greedy(model, ids, attention_mask=mask, max_new_tokens=new, cache_implementation="static")
        assert torch.equal(static.sequences, default.sequences)
        torch.testing.assert_close(torch.stack(static.logits), torch.stack(default.logits), atol=1e-4, rtol=1e-4)
    fresh = perturbed_model(tiny_config(attention_mode=mode, attention_sinks=S))
    short = greedy(fresh, ids[:, -9:], attention_mask=mask[:, -9:], max_new_tokens=3, cache_implementation="static")
    assert short.past_key_values.layers[0].keys.shape[2] == 11  # generate() asks for max_length - 1 = 11 < w - 1 + S
    # a model that generated longer keeps its static shapes for a shorter call, as transformers' static caches do
    again = greedy(model, ids[:, -9:], attention_mask=mask[:, -9:], max_new_tokens=3, cache_implementation="static")
    longest = ids.shape[1] + 3 * W - 1
    assert again.past_key_values.layers[0].keys.shape[2] == (longest if mode == "full" else W - 1 + S)
    assert torch.equal(again.sequences, short.sequences)


@pytest.mark.parametrize("rule", SINK_POSITIONS)
def test_rope_sinks_turned_in_what_the_static_cache_lends_leave_its_slots_raw(rule):
    """RoPE sinks seen in the cache's frame are turned in the keys the static cache lends attention; its slots keep
    the raw keys, so decoding far past the window gives the default cache's logits."""
    model = perturbed_model(tiny_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=S,
                                        attention_sink_positions=rule))
    for length in (W + 1, 2 * W + 3):
        ids = prompt(1, length, seed=length)
        default = greedy(model, ids, max_new_tokens=3 * W)
        static = greedy(model, ids, max_new_tokens=3 * W, cache_implementation="static")
        assert torch.equal(static.sequences, default.sequences)
        torch.testing.assert_close(torch.stack(static.logits), torch.stack(default.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rule", SINK_POSITIONS)
@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
def test_a_prompt_read_through_the_default_cache_continues_in_the_static_one(mode, rule):
    """lex.compiled_decoding.read_prompt reads the prompt through a LexCache and hands it to a LexStaticCache
    (`load`; blockwise: straight into the static cache): uncompiled, the static cache then decodes the default
    cache's tokens and logits, for prompts around block boundaries and past the window, with and without sinks."""
    from lex.compiled_decoding import read_prompt
    from modeling_lex.generation import CACHE_NAME

    for sinks in (0, S):
        model = perturbed_model(tiny_config(attention_mode=mode, attention_sinks=sinks,
                                            attention_sink_positions=rule))
        for length in (2, W - 1, W, W + 1, 2 * W + 3, 5 * W):
            ids = prompt(1, length, seed=length)
            max_cache_len = length + 2 * W if mode == "full" else None
            default = greedy(model, ids, max_new_tokens=2 * W)
            cache = read_prompt(model, ids, max_cache_len=max_cache_len)
            assert int(cache.stream.seen) == length - 1
            static = greedy(model, ids, max_new_tokens=2 * W, **{CACHE_NAME: cache})
            assert torch.equal(static.sequences, default.sequences), (sinks, length)
            torch.testing.assert_close(torch.stack(static.logits), torch.stack(default.logits), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- compiled decoding


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
def test_static_cache_decoding_compiles_once(mode):
    """With a compiled forward and cache_implementation="static", a second generate() of the same shapes
    compiles no new graph (dynamo's own graph counter), and the tokens are those of the eager default cache."""
    model = perturbed_model(tiny_config(num_hidden_layers=1, attention_mode=mode))
    _, ids, mask = left_padded([5, 2 * W + 3])
    options = dict(attention_mask=mask, max_new_tokens=W + 5, do_sample=False, pad_token_id=PAD)
    eager = model.generate(ids, **options)
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    first = model.generate(ids, cache_implementation="static", **options)
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 2  # the prompt and the decoding step: not one graph per step
    second = model.generate(ids, cache_implementation="static", **options)
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(first, eager) and torch.equal(second, eager)


@pytest.mark.parametrize("sinks, rule, kind", [(0, "true", "xpos"),
                                               pytest.param(2, "true", "xpos", marks=pytest.mark.slow),
                                               pytest.param(2, "cache", "rope", marks=pytest.mark.slow)])
def test_compiled_static_cache_reads_a_padded_batch_past_the_window(sinks, rule, kind):
    """Prompts of 100 and 60 tokens, left-padded, window 16: the compiled (fullgraph) prefill and decoding give
    eager's tokens, and a second generate() of the same shapes compiles no new graph (with sink slots too, at
    either position rule; RoPE with sinks in the cache's frame is what a converted checkpoint decodes with)."""
    torch._dynamo.reset()
    counters.clear()
    trained = trained_model(tiny_config(max_position_embeddings=16, num_hidden_layers=1), steps=20)
    model = load_weights(trained.state_dict(), max_position_embeddings=64, num_hidden_layers=1,
                         attention_mode="blockwise", attention_window=16, attention_sinks=sinks,
                         attention_sink_positions=rule, position_embedding_type=kind)
    _, ids, mask = left_padded([100, 60])
    options = dict(attention_mask=mask, cache_implementation="static")
    eager = greedy_tokens(model, ids, 20, **options)
    assert torch.equal(eager, greedy_tokens(model, ids, 20, attention_mask=mask))
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    first = greedy_tokens(model, ids, 20, **options)
    graphs = counters["stats"]["unique_graphs"]
    second = greedy_tokens(model, ids, 20, **options)
    assert 0 < graphs == counters["stats"]["unique_graphs"]
    assert torch.equal(first, eager) and torch.equal(second, eager)
    torch._dynamo.reset()


def test_a_shorter_compiled_generation_reuses_the_static_shapes():
    """Prompt 7 and window 64: the static cache holds min(w - 1 + S, max_cache_len) slots, so a second generate()
    with fewer new tokens would shrink it and recompile; sized for the largest length asked so far (as
    transformers' static caches are), it compiles no new graph and gives eager's tokens."""
    torch._dynamo.reset()
    counters.clear()
    trained = trained_model(tiny_config(max_position_embeddings=16, num_hidden_layers=1), steps=20)
    model = load_weights(trained.state_dict(), max_position_embeddings=64, num_hidden_layers=1,
                         attention_mode="sliding", attention_window=64)
    ids = markov_batch(2, 7, seed=5)
    eager = greedy_tokens(model, ids, 2, cache_implementation="static")
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    greedy_tokens(model, ids, 5, cache_implementation="static")
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(greedy_tokens(model, ids, 2, cache_implementation="static"), eager)
    assert 0 < graphs == counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
