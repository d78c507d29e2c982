"""Each reading rule is written in one place and every consumer asks it: a rule changed there (monkeypatched) is
followed by the tile, the caches, the stream, the block memory and generate(), and the model equals the float64
reference built with the same change (tests/reference.py states the rules on its own). The rules: the window
(`ReadingPolicy.window_reach`), the memory's frame (`reading.memory_places`), which tokens are sinks
(`ReadingPolicy.sink_indices`), the sinks' placement (`ReadingPolicy.sink_frame`) and a position method's factors
(`positions.rotary_factors`). A consumer that restates a
rule instead of asking its owner keeps the old rule and fails here."""

import copy

import pytest
import torch

from modeling_lex import LexCache, LexStaticCache
from modeling_lex import positions, reading
from modeling_lex.reading import ReadingPolicy
from tests import reference
from tests.helpers import PAD, W, perturbed_model, prompt, tiny_config
from tests.test_memory import as_read, distinct_prompt, memory_config, read

@pytest.fixture(params=[-1, 1], ids=["one key narrower", "one key wider"])
def changed_window(monkeypatch, request) -> int:
    """`ReadingPolicy.window_reach` changed in its one place: a sliding window one key narrower or wider than its
    own rule (w - 1 keys before a query); the keys it now shows before a query. Policies made before are dropped,
    and again after the test."""
    own = ReadingPolicy.window_reach
    reach = W - 1 + request.param

    def changed(self, offset):
        return 0 * offset + self.window - 1 + request.param if self.mode == "sliding" else own(self, offset)

    monkeypatch.setattr(ReadingPolicy, "window_reach", changed)
    reading._policy.cache_clear()
    yield reach
    reading._policy.cache_clear()


def reference_config(config, window: int):
    """The config the reference reads, its own window rule changed the same way (the reference's sliding window
    shows window - 1 keys before a query)."""
    changed = copy.deepcopy(config)
    object.__setattr__(changed, "attention_window", window)
    return changed


@pytest.mark.parametrize("sinks,positions", [(0, "true"), (2, "true"), (2, "cache")])
def test_a_changed_window_rule_is_followed_everywhere(changed_window, sinks, positions):
    config = tiny_config(attention_mode="sliding", attention_sinks=sinks, attention_sink_positions=positions,
                         num_attention_heads=4)
    model = perturbed_model(config)
    reach = changed_window
    changed = reference_config(config, reach + 1)
    assert model.model.policy.most_reach == reach
    ids = prompt(1, 3 * W + 5)
    with torch.no_grad():
        # the tile: one forward of the whole input (its chunks reaching as far back as the rule says)
        logits = model(ids).logits[0]
        torch.testing.assert_close(logits.double(), reference.forward(model.state_dict(), changed, ids[0]),
                                   atol=1e-5, rtol=1e-5)
        # what a LexCache keeps: the window part holds the keys the next query sees, after the sink slots
        cache = LexCache(config)
        stepped = torch.cat([model(ids[:, :W], cache=cache).logits]
                            + [model(ids[:, i : i + 1], cache=cache).logits for i in range(W, ids.shape[1])], 1)
        assert cache.layers[0].keys.shape[2] == sinks + reach
        torch.testing.assert_close(stepped[0], logits, atol=1e-5, rtol=1e-5)
    # the static cache's slots
    assert LexStaticCache(config).window_slots == reach
    # generate(), with LexCache and with the static cache, past several windows: each new token the reference's
    for implementation in (None, "static"):
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                             cache_implementation=implementation)
        tokens = reference.forward(model.state_dict(), changed, out[0, :-1])[ids.shape[1] - 1 :].argmax(-1)
        assert out[0, ids.shape[1] :].tolist() == tokens.tolist(), implementation


GAP = 3  # the changed memory frame: the memory's places (and the sinks before them) this much further from the window
SKIP = 2  # the changed sink rule: a document's sinks begin this many tokens into it


@pytest.fixture
def memory_further(monkeypatch) -> int:
    """`reading.memory_places` changed in its one place: the memory's k * b_m places GAP further from the window."""
    own = reading.memory_places
    monkeypatch.setattr(reading, "memory_places", lambda count, device: own(count, device) - GAP)
    reading._frame_rotation.cache_clear()  # (its rotations are made once per model)
    yield GAP
    reading._frame_rotation.cache_clear()


@pytest.mark.parametrize("method", ["rope", "xpos", "alibi"])
@pytest.mark.parametrize("sinks", [0, 4])
def test_a_changed_memory_frame_is_followed_everywhere(memory_further, method, sinks):
    """Prompt chunks, pieces and decoding through a LexCache with the block memory, and generate(): the memory's
    keys, and the sinks before them, where the changed frame puts them, as the reference with the same gap."""
    config = memory_config(position_embedding_type=method, attention_mode="sliding", attention_sinks=sinks)
    model = perturbed_model(config)
    ids = distinct_prompt(60, seed=1)
    calls = [W, W - 3, 5, 1, 7] + [1] * 18
    logits = read(model, ids, calls, LexCache(config))
    state = model.state_dict()
    expected = reference.memory_forward(state, config, ids[0], as_read(calls), gap=memory_further)
    assert not torch.allclose(expected, reference.memory_forward(state, config, ids[0], as_read(calls)))
    torch.testing.assert_close(logits.double(), expected, atol=2e-5, rtol=0)
    out = model.generate(ids[:, :40], max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    forwards = as_read([40]) + [1] * 5
    tokens = reference.memory_forward(state, config, out[0, :-1], forwards, gap=memory_further)[39:].argmax(-1)
    assert out[0, 40:].tolist() == tokens.tolist()


@pytest.fixture
def sinks_further(monkeypatch) -> int:
    """`ReadingPolicy.sink_frame` changed in its one place: the sinks GAP places further from the window."""
    own = ReadingPolicy.sink_frame

    def changed(self, q_index, start):
        frame = own(self, q_index, start)
        return None if frame is None else (frame[0], frame[1] - GAP)

    monkeypatch.setattr(ReadingPolicy, "sink_frame", changed)
    yield GAP


@pytest.mark.parametrize("mode", ["sliding", "blockwise"])
@pytest.mark.parametrize("method", ["rope", "xpos", "alibi"])
def test_a_changed_sink_placement_is_followed_everywhere(sinks_further, mode, method):
    """A long forward, a LexCache read in chunks then token by token, and generate() (LexCache and static): the
    sinks seen where the changed rule places them, as the reference with the same gap."""
    config = tiny_config(attention_mode=mode, attention_sinks=3, attention_sink_positions="cache",
                         position_embedding_type=method, num_attention_heads=4)
    followed_everywhere(config, sink_gap=sinks_further)


def followed_everywhere(config, **change) -> LexCache:
    """A long forward, a LexCache read in chunks then token by token, and generate() (LexCache and static) of a
    perturbed model of `config`, each equal to `reference.forward` with `change` (which changes its numbers);
    returns the LexCache."""
    model = perturbed_model(config)
    ids = prompt(1, 3 * W + 5)
    state = model.state_dict()
    expected = reference.forward(state, config, ids[0], **change)
    assert not torch.allclose(expected, reference.forward(state, config, ids[0]))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[0].double(), expected, atol=1e-5, rtol=1e-5)
        cache = LexCache(config)
        stepped = torch.cat([model(ids[:, :W], cache=cache).logits]
                            + [model(ids[:, i : i + 1], cache=cache).logits for i in range(W, ids.shape[1])], 1)
        torch.testing.assert_close(stepped[0].double(), expected, atol=1e-5, rtol=1e-5)
    for implementation in (None, "static"):
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD,
                             cache_implementation=implementation)
        tokens = reference.forward(state, config, out[0, :-1], **change)[ids.shape[1] - 1 :].argmax(-1)
        assert out[0, ids.shape[1] :].tolist() == tokens.tolist(), implementation
    return cache


@pytest.fixture
def sinks_later(monkeypatch) -> int:
    """`ReadingPolicy.sink_indices` changed in its one place: a document's sinks are its S tokens after its first
    SKIP (as a model that keeps no sink for its BOS would read)."""

    def changed(self, start):
        return start[..., None] + SKIP + torch.arange(self.sinks, device=start.device)

    monkeypatch.setattr(ReadingPolicy, "sink_indices", changed)
    yield SKIP


@pytest.mark.parametrize("mode,where", [("sliding", "true"), ("sliding", "cache"), ("blockwise", "cache")])
def test_a_changed_sink_rule_is_followed_everywhere(sinks_later, mode, where):
    """Which tokens are sinks, changed where it is stated: who sees them in a long forward, what a LexCache keeps
    in its sink slots reading in chunks then token by token, generate() (LexCache and static), and where the block
    memory's candidates begin, as the reference with the same rule."""
    config = tiny_config(attention_mode=mode, attention_sinks=3, attention_sink_positions=where,
                         position_embedding_type="rope", num_attention_heads=4)
    cache = followed_everywhere(config, sink_skip=sinks_later)
    assert cache.stream.sink_index[0].tolist() == [sinks_later + j for j in range(3)]
    if where == "cache":  # the block memory: its candidates after the sinks, the sinks before its places
        config = memory_config(position_embedding_type="rope", attention_mode=mode, attention_sinks=4)
        model = perturbed_model(config)
        ids = distinct_prompt(60, seed=1)
        calls = [W, W - 3, 5, 1, 7] + [1] * 18
        logits = read(model, ids, calls, LexCache(config))
        expected = reference.memory_forward(model.state_dict(), config, ids[0], as_read(calls),
                                            sink_skip=sinks_later)
        assert not torch.allclose(expected, reference.memory_forward(model.state_dict(), config, ids[0],
                                                                     as_read(calls)))
        torch.testing.assert_close(logits.double(), expected, atol=2e-5, rtol=0)


@pytest.fixture
def turning_twice(monkeypatch) -> None:
    """`positions.rotary_factors` changed in its one place: RoPE turns every pair twice as far for a distance; the
    reference's own frequencies changed alike (`reference.frequencies`, twice the inverse frequencies)."""
    own, own_reference = positions.rotary_factors, reference.frequencies
    monkeypatch.setattr(positions, "rotary_factors", lambda relative, *rest, **options: own(2 * relative, *rest,
                                                                                              **options))
    monkeypatch.setattr(reference, "frequencies", lambda config: (2 * own_reference(config)[0],
                                                                  own_reference(config)[1]))
    reading._frame_rotation.cache_clear()
    yield
    reading._frame_rotation.cache_clear()


@pytest.mark.parametrize("mode", ["sliding", "blockwise"])
def test_changed_position_factors_are_followed_everywhere(turning_twice, mode, monkeypatch):
    """RoPE's factors changed where they are made: the new tokens, the sinks turned into their frame, the memory's
    keys turned to the query and back, a static cache's compiled-shape decoding, all as the reference's."""
    config = tiny_config(attention_mode=mode, attention_sinks=3, attention_sink_positions="cache",
                         position_embedding_type="rope", num_attention_heads=4)
    model = perturbed_model(config)
    ids = prompt(1, 3 * W + 5)
    state = model.state_dict()
    with torch.no_grad():
        changed = model(ids).logits[0]
        torch.testing.assert_close(changed.double(), reference.forward(state, config, ids[0]), atol=1e-5, rtol=1e-5)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD, cache_implementation="static")
    tokens = reference.forward(state, config, out[0, :-1])[ids.shape[1] - 1 :].argmax(-1)
    assert out[0, ids.shape[1] :].tolist() == tokens.tolist()
    config = memory_config(position_embedding_type="rope", attention_mode=mode, attention_sinks=4)
    model = perturbed_model(config)
    ids = distinct_prompt(60, seed=1)
    calls = [W, W - 3, 5, 1, 7] + [1] * 18
    logits = read(model, ids, calls, LexCache(config))
    expected = reference.memory_forward(model.state_dict(), config, ids[0], as_read(calls))
    torch.testing.assert_close(logits.double(), expected, atol=2e-5, rtol=0)
    monkeypatch.undo()  # (the change mattered)
    reading._frame_rotation.cache_clear()
    assert not torch.allclose(read(model, ids, calls, LexCache(config)), logits)
