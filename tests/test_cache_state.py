"""The cache's state has one owner: a forward begins (its record, nothing changed), each layer's `cache.update`
returns what attention reads, and the end of `with cache.step(record):` keeps what the record says. So a forward
that raises leaves a cache exactly as it was, reading `keys`/`values` changes nothing, and attention never writes
a tensor the cache returned."""

from dataclasses import fields

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import modeling_lex.modeling_lex as modeling
from modeling_lex import LexCache, LexStaticCache
from modeling_lex.generation import CACHE_NAME
from tests.helpers import W, perturbed_model, prompt, tiny_config

# Every path a cache's state can take: window modes, sinks at either rule, per-token (RoPE, whose decoding steps
# read the sinks rotated in the cache's frame) and re-encoded (xPos) positions.
CASES = [
    ("sliding", 2, "cache", "rope"), ("sliding", 2, "true", "rope"), ("blockwise", 2, "cache", "rope"),
    ("blockwise", 2, "cache", "xpos"), ("sliding", 0, "cache", "xpos"), ("full", 0, "cache", "rope"),
]


class Boom(RuntimeError):
    pass


def snapshot(cache) -> dict:
    """Everything a cache holds: each layer's keys and values, and every field of its stream (copies)."""
    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if hasattr(value, "__dataclass_fields__"):
            return {f.name: copy(getattr(value, f.name)) for f in fields(value)}
        return value

    layers = [(copy(layer.keys), copy(layer.values)) for layer in cache.layers]
    stream = {name: copy(value) for name, value in vars(cache.stream).items() if name != "config"}
    return {"layers": layers, "stream": stream, "seen": int(cache.get_seq_length())}


def assert_same(a, b, where="cache") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def make_cache(kind: str, config):
    return LexCache(config) if kind == "dynamic" else LexStaticCache(config, max_cache_len=8 * W)


def model_for(mode: str, sinks: int, rule: str, kind: str):
    """`kind`: the position method, "+memory" for a block memory of 2 blocks of 4."""
    kind, memory = kind.removesuffix("+memory"), kind.endswith("+memory")
    return perturbed_model(tiny_config(attention_mode=mode, attention_sinks=sinks, attention_sink_positions=rule,
                                       position_embedding_type=kind, attention_memory_blocks=2 if memory else 0,
                                       attention_memory_block_size=4))


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("mode, sinks, rule, kind", CASES)
def test_a_forward_that_raises_in_a_layer_leaves_the_cache_as_it_was(mode, sinks, rule, kind, cache_kind):
    """A fault injected after the second layer's attention (a forward hook that raises), in a prompt chunk and in
    decoding steps past the window (sink slots in use): the cache is unchanged, keys, values and every stream field,
    and the next forwards give the logits they give without the fault."""
    model = model_for(mode, sinks, rule, kind)
    ids = prompt(1, 3 * W + 5)
    faulty, clean = make_cache(cache_kind, model.config), make_cache(cache_kind, model.config)

    def boom(*_):
        raise Boom

    with torch.no_grad():
        for cache in (faulty, clean):
            model(ids[:, : W + 3], **{CACHE_NAME: cache})
        starts = [*range(W + 3, 2 * W, 3), *range(2 * W, ids.shape[1])]  # prompt chunks of 3, then decoding steps
        for start, stop in zip(starts, starts[1:] + [ids.shape[1]]):
            chunk = ids[:, start:stop]
            before = snapshot(faulty)
            handle = model.model.layers[1].register_forward_hook(boom)
            with pytest.raises(Boom):
                model(chunk, **{CACHE_NAME: faulty})
            handle.remove()
            assert_same(snapshot(faulty), before)
            torch.testing.assert_close(model(chunk, **{CACHE_NAME: faulty}).logits,
                                       model(chunk, **{CACHE_NAME: clean}).logits, atol=0, rtol=0)
            assert_same(snapshot(faulty), snapshot(clean))


@pytest.mark.parametrize("mode, sinks, rule, kind", CASES)
def test_reading_keys_and_values_changes_nothing(mode, sinks, rule, kind):
    """`keys`/`values` read twice are equal and leave the cache unchanged, between forwards and after a forward
    that raised mid-way (when the buffer's copy of the sink keys may be rotated)."""
    model = model_for(mode, sinks, rule, kind)
    ids = prompt(1, 2 * W + 4)
    cache = LexCache(model.config)

    def boom(*_):
        raise Boom

    with torch.no_grad():
        model(ids[:, : 2 * W], **{CACHE_NAME: cache})
        for step in range(2 * W, ids.shape[1]):
            model(ids[:, step : step + 1], **{CACHE_NAME: cache})
            first = snapshot(cache)
            assert_same(snapshot(cache), first)
            handle = model.model.layers[1].register_forward_hook(boom)
            with pytest.raises(Boom):
                model(ids[:, step : step + 1], **{CACHE_NAME: cache})
            handle.remove()
            assert_same(snapshot(cache), first)
            assert_same(snapshot(cache), first)


@pytest.mark.parametrize("cache_kind, mode, sinks, rule, kind", [
    *[(cache, *case) for cache in ("dynamic", "static") for case in CASES],
    ("dynamic", "sliding", 2, "cache", "rope+memory"), ("dynamic", "blockwise", 2, "cache", "xpos+memory")])
def test_attention_writes_only_what_the_cache_lends(mode, sinks, rule, kind, cache_kind, monkeypatch):
    """Of the keys and values each layer's attention receives from the cache (views of its buffers), over a prompt
    and decoding steps that read sink slots in either frame, attention (the tile's arrangement and the backend's
    call) writes only what the request lends it (the copy of the sink slots, `AttentionPlan.sinks_lent`; the
    columns after the span, `memory_room`), and after the step the cache holds the raw sink keys there again."""
    model = model_for(mode, sinks, rule, kind)
    ids = prompt(2, 3 * W)
    calls, written, arranged, lent, rooms = [], [], [], [], []
    original = modeling.arrange

    def watched_arrange(module, plan, query, key, value, *args):
        slots = plan.sink_slots if plan.sinks_lent else 0
        room = plan.memory_room  # (the columns after the span are the forward's)
        if plan.tile.n_memory and query.shape[2] == 1:
            rooms.append(room)
        held = key.shape[2] - room
        arranged.append((key[:, :, :held], value[:, :, :held], key._version, value._version, bool(slots or room),
                         key[:, :, :slots].clone(), key[:, :, slots:held].clone(), value[:, :, :held].clone()))
        calls.append(bool(slots))
        return original(module, plan, query, key, value, *args)

    class WatchedInterfaces:
        """The backend each layer calls, then a look at what the cache returned to it."""

        def get_interface(self, implementation, default):
            backend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, default)

            def watched(module, *args, **kwargs):
                out = backend(module, *args, **kwargs)
                key, value, key_version, value_version, lends, front, rest, values = arranged.pop()
                if not torch.equal(value, values) or not torch.equal(key[:, :, front.shape[2] :], rest):
                    written.append(module.layer_idx)
                elif (key._version, value._version) != (key_version, value_version) and not lends:
                    written.append(module.layer_idx)  # (a counter counts the whole buffer's writes, lent ones too)
                elif front.shape[2]:
                    lent.append((module.layer_idx, front))
                return out

            return watched

    monkeypatch.setattr(modeling, "arrange", watched_arrange)
    monkeypatch.setattr(modeling, "ALL_ATTENTION_FUNCTIONS", WatchedInterfaces())
    cache = make_cache(cache_kind, model.config)
    restored = []
    with torch.no_grad():
        model(ids[:, : W + 2], **{CACHE_NAME: cache})
        for step in range(W + 2, ids.shape[1]):
            model(ids[:, step : step + 1], **{CACHE_NAME: cache})
            restored += [torch.equal(cache.layers[index].keys[:, :, : front.shape[2]], front) for index, front in lent]
            lent.clear()
    assert written == []
    assert all(restored)
    assert len(calls) >= model.config.num_hidden_layers * (ids.shape[1] - W - 1)  # the prompt, then each step
    if cache_kind == "dynamic" and sinks and rule == "cache" and kind.startswith("rope"):
        assert any(calls) and restored  # the path that reads the sink slots turned in the cache's frame ran
    if kind == "rope+memory":
        assert rooms and all(rooms)  # the path that puts the memory's blocks after the span ran, every step
