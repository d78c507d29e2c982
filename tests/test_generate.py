"""generate() with the bounded cache: the incremental form of the no-cache forward in every mode.

References: the model's own no-cache forward over the final sequence (itself held to tests/reference.py in
test_model.py), the float64 naive reference directly for xPos, and generate() without any cache. Rollback
(assisted and prompt-lookup decoding) is tested in test_assisted.py, the static cache in test_static_cache.py.
"""

import contextlib
import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache, GenerationConfig, TextStreamer
from transformers.testing_utils import CaptureLogger

import modeling_lex  # noqa: F401
from modeling_lex import LexCache
from modeling_lex.generation import CACHE_NAME
from tests import reference
from tests.helpers import (
    PAD,
    W,
    greedy,
    left_padded,
    perturb,
    perturbed_model,
    prompt,
    tiny_config,
    word_tokenizer,
)

KINDS = ["xpos", "rope", "decay", "alibi", "kerple", "sandwich", "sinusoidal", "none"]


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.oldest]


def record_cache_size(model, cache: LexCache) -> list[int]:
    """After every forward's step through the cache (each prefill chunk, each step): the most any layer holds."""
    sizes = []
    step = cache.step

    @contextlib.contextmanager
    def recorded(record):
        with step(record):
            yield
        sizes.append(max(max(layer.keys.shape[2] for layer in cache.layers), cache.stream.positions.shape[1]))

    cache.step = recorded
    return sizes


# ---------------------------------------------------------------- the contract


@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompt_len", [5, W, int(3.7 * W)])
def test_every_cached_step_equals_the_no_cache_forward(mode, kind, prompt_len):
    model = perturbed_model(tiny_config(attention_mode=mode, position_embedding_type=kind))
    ids = prompt(1, prompt_len)
    out = greedy(model, ids, max_new_tokens=3 * W)
    assert isinstance(out.past_key_values, LexCache) and out.sequences.shape[1] == prompt_len + 3 * W
    with torch.no_grad():
        reference_logits = model(out.sequences).logits[0, prompt_len - 1 : -1]
    steps = torch.stack(out.logits, dim=1)[0]
    torch.testing.assert_close(steps, reference_logits, atol=1e-4, rtol=1e-4)


def held_after(mode: str, seen: int) -> int:
    """Window keys a LexCache holds after `seen` tokens of one document (tiny_config's window W)."""
    if mode == "full":
        return seen
    if mode == "sliding":
        return min(seen, W - 1)
    block = W // 2
    return seen - max(0, (seen // block - 1) * block)


@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
@pytest.mark.parametrize("decoding", ["default cache", "static cache", "assisted"])
def test_every_layer_cache_receives_each_step_keys(monkeypatch, mode, decoding):
    """A renamed cache argument cannot fool this: during generate() every layer's cache is handed the keys of
    every forward (counted where the layers store them), ends holding what the mode holds, and every step's
    logits equal a no-cache forward."""
    from modeling_lex.cache import LexCacheLayer, LexStaticLayer

    received: dict[int, int] = {}
    for layer_class in (LexCacheLayer, LexStaticLayer):
        def recording(self, key_states, value_states, *args, _update=layer_class.update, **kwargs):
            received[id(self)] = received.get(id(self), 0) + key_states.shape[-2]
            return _update(self, key_states, value_states, *args, **kwargs)

        monkeypatch.setattr(layer_class, "update", recording)
    model = perturbed_model(tiny_config(attention_mode=mode))
    ids = torch.cat([prompt(1, W + 3, seed=3)] * 2, dim=1)  # repeats: candidates for the assistant to get right
    options = {"default cache": {}, "static cache": dict(cache_implementation="static"),
               "assisted": dict(assistant_model=perturbed_model(tiny_config(attention_mode=mode), seed=5))}[decoding]
    out = greedy(model, ids, max_new_tokens=2 * W, **options)
    cache = getattr(out, CACHE_NAME)
    fed = out.sequences.shape[1] - 1  # the last token is returned, never read
    assert cache.get_seq_length() == fed
    counts = [received.get(id(layer), 0) for layer in cache.layers]
    assert len(counts) == model.config.num_hidden_layers
    if decoding == "assisted":  # candidates rejected and cropped were received too
        assert all(count == counts[0] >= fed for count in counts)
    else:
        assert counts == [fed] * len(counts)
    if decoding != "static cache":
        assert cache.held == held_after(mode, fed)
        assert all(layer.keys.shape[2] == held_after(mode, fed) for layer in cache.layers)
    with torch.no_grad():
        expected = model(out.sequences).logits[0, ids.shape[1] - 1 : -1]
    torch.testing.assert_close(torch.stack(out.logits, dim=1)[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
def test_cached_steps_equal_the_float64_reference(mode):
    config = tiny_config(attention_mode=mode)
    model = perturbed_model(config, seed=2)
    ids = prompt(1, int(3.7 * W), seed=5)
    out = greedy(model, ids, max_new_tokens=3 * W)
    expected = reference.forward(model.state_dict(), config, out.sequences[0])[ids.shape[1] - 1 : -1]
    torch.testing.assert_close(torch.stack(out.logits, dim=1)[0].double(), expected, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- bounded memory


@pytest.mark.parametrize("mode, bound", [("blockwise", W - 1), ("sliding", W - 1)])
def test_cache_stays_within_the_window_at_every_step(mode, bound):
    """Left-padded rows (blocks counted from each row's own start) and a prompt of several windows."""
    model = perturbed_model(tiny_config(attention_mode=mode))
    _, ids, mask = left_padded([3 * W + 5, 13, 30])
    cache = LexCache(model.config)
    sizes = record_cache_size(model, cache)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10 * W, do_sample=False,
                         pad_token_id=PAD, return_dict_in_generate=True)
    assert out.past_key_values is cache and cache.get_seq_length() == ids.shape[1] + 10 * W - 1
    assert len(sizes) == 4 + 10 * W - 1  # four prefill chunks, then one forward per step
    assert max(sizes) <= bound and sizes[-1] >= W // 2
    for layer in cache.layers:
        assert layer.keys.shape == layer.values.shape and layer.keys.shape[2] <= bound


def test_blockwise_cache_drops_whole_blocks():
    model = perturbed_model(tiny_config())
    cache = LexCache(model.config)
    held = []
    with torch.no_grad():
        for token in prompt(1, 3 * W)[0]:
            model(token.view(1, 1), past_key_values=cache, use_cache=True)
            held.append(cache.layers[0].keys.shape[2])
    # after t tokens the next query's block is t // b; it sees from block t // b - 1
    b = W // 2
    expected = [t - max(0, (t // b - 1) * b) for t in range(1, 3 * W + 1)]
    assert held == expected


def test_full_mode_keeps_everything():
    model = perturbed_model(tiny_config(attention_mode="full"))
    out = greedy(model, prompt(1, 5), max_new_tokens=3 * W)
    assert out.past_key_values.layers[0].keys.shape[2] == 5 + 3 * W - 1


def test_long_prompt_is_prefilled_block_by_block():
    """generate() and a forward by hand both run every layer on at most w tokens at a time."""
    model = perturbed_model(tiny_config())
    ids = prompt(1, 10 * W + 3)
    lengths = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    out = greedy(model, ids, max_new_tokens=2)
    assert max(lengths) == W and len(lengths) == 2 * (11 + 1)  # 2 layers x (11 prefill chunks + 1 step)
    with torch.no_grad():
        torch.testing.assert_close(out.logits[0][0], model(ids).logits[0, -1], atol=1e-5, rtol=1e-5)
        lengths.clear()
        cached = model(ids, past_key_values=LexCache(model.config), use_cache=True, logits_to_keep=1).logits
    assert max(lengths) == W and cached.shape[1] == 1
    torch.testing.assert_close(cached[0, -1], out.logits[0][0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- batches, beams, sampling, the Cache API


@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
def test_left_padded_rows_generate_as_alone(mode):
    model = perturbed_model(tiny_config(attention_mode=mode))
    rows, ids, mask = left_padded([21, 13, 30])
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=2 * W, do_sample=False, pad_token_id=PAD)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=2 * W, do_sample=False, pad_token_id=PAD)
        assert torch.equal(batch[i, ids.shape[1] :], alone[0, len(row) :])


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_beam_search_and_sampling_equal_generation_without_cache(mode, sinks):
    """num_beams=3 and sampling over several blocks pick what the no-cache forward picks at every step (with sinks,
    beams reordered hold their own sink slots)."""
    model = perturbed_model(tiny_config(attention_mode=mode, attention_sinks=sinks))
    ids = prompt(2, 11)
    beams = {}
    for use_cache in (True, False):
        beams[use_cache] = model.generate(ids, num_beams=3, max_new_tokens=3 * W, do_sample=False,
                                          pad_token_id=PAD, use_cache=use_cache)
    assert beams[True].shape == (2, 11 + 3 * W)
    assert torch.equal(beams[True], beams[False])
    sampled = {}
    for use_cache in (True, False):
        torch.manual_seed(0)
        sampled[use_cache] = model.generate(ids, do_sample=True, top_k=20, max_new_tokens=3 * W, pad_token_id=PAD,
                                            use_cache=use_cache)
    assert torch.equal(sampled[True], sampled[False])


@pytest.mark.parametrize("change", ["reorder_cache", "batch_select_indices", "batch_repeat_interleave"])
@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_rows_taken_from_a_cache_with_sink_slots_read_on_as_those_rows(mode, change):
    """A LexCache past its window (its sink slots filled) whose rows are reordered (beam search), selected or
    repeated (transformers' batch_select_indices, batch_repeat_interleave) reads on as a cache of those rows: each
    layer's sink slots follow their rows."""
    model = perturbed_model(tiny_config(attention_mode=mode, attention_sinks=2))
    ids = prompt(2, 3 * W + 2, seed=7)
    rows, argument = {"reorder_cache": ([1, 0], torch.tensor([1, 0])), "batch_select_indices": ([1], torch.tensor([1])),
                      "batch_repeat_interleave": ([0, 0, 1, 1], 2)}[change]
    cache = LexCache(model.config)
    with torch.no_grad():
        model(ids[:, :-2], **{CACHE_NAME: cache})
        assert cache.stream.sink_slots == 2 and all(layer.keys.shape[2] == 2 + cache.held for layer in cache.layers)
        getattr(cache, change)(argument)
        steps = (ids[rows, -2:-1], ids[rows, -1:])  # two steps: the second reads the sink slots the first kept
        logits = torch.cat([model(step, **{CACHE_NAME: cache}).logits for step in steps], dim=1)
        expected = model(ids[rows]).logits[:, -2:]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_generation_continues_from_a_returned_cache():
    model = perturbed_model(tiny_config())
    first = greedy(model, prompt(1, 3 * W + 3), max_new_tokens=W)
    longer = torch.cat([first.sequences, prompt(1, 20, seed=3)], dim=1)
    continued = greedy(model, longer, past_key_values=first.past_key_values, max_new_tokens=W)
    fresh = greedy(model, longer, max_new_tokens=W)
    assert torch.equal(continued.sequences, fresh.sequences)
    torch.testing.assert_close(torch.stack(continued.logits), torch.stack(fresh.logits), atol=1e-5, rtol=1e-5)


def test_inputs_embeds_prompt_generates_as_input_ids():
    model = perturbed_model(tiny_config())
    ids = prompt(1, 3 * W + 3)
    from_ids = greedy(model, ids, max_new_tokens=W)
    from_embeds = greedy(model, None, inputs_embeds=model.get_input_embeddings()(ids).detach(), max_new_tokens=W)
    assert torch.equal(from_embeds.sequences, from_ids.sequences[:, ids.shape[1] :])


def test_dynamic_cache_passed_by_hand_gives_the_same_logits():
    model = perturbed_model(tiny_config())
    ids = prompt(1, 3 * W)
    with torch.no_grad():
        cache = DynamicCache()
        first = model(ids[:, :20], past_key_values=cache, use_cache=True).logits
        second = model(ids[:, 20:], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(torch.cat([first, second], 1), model(ids).logits, atol=1e-5, rtol=1e-5)


def test_default_length_after_a_prompt_longer_than_training():
    """transformers caps its default max_length at max_position_embeddings; LEX gets 20 new tokens, no warning.

    transformers warns through its own logger (`logger.warning_once`, remembered per process), not `warnings`:
    the test clears that memory and reads the logger.
    """
    model = perturbed_model(tiny_config())
    logger = transformers.utils.logging.get_logger("transformers")
    logger.warning_once.cache_clear()
    with CaptureLogger(logger) as captured, warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(prompt(1, 3 * W), pad_token_id=PAD)
    assert out.shape[1] == 3 * W + 20
    assert captured.out == ""


# ---------------------------------------------------------------- positions far away, half precision


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_positions_shifted_by_a_million_generate_the_same(dtype):
    model = perturbed_model(tiny_config()).to(dtype)
    ids = prompt(1, 2 * W + 5)
    near = greedy(model, ids, max_new_tokens=3 * W)
    far = greedy(model, ids, position_ids=torch.arange(ids.shape[1])[None] + 1_000_000, max_new_tokens=3 * W)
    assert torch.equal(near.sequences, far.sequences)
    assert all(torch.equal(a, b) for a, b in zip(near.logits, far.logits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forty_window_prompt_is_finite_in_half_precision(dtype):
    model = perturbed_model(tiny_config()).to(dtype)
    out = greedy(model, prompt(1, 40 * W), max_new_tokens=W)
    assert all(torch.isfinite(step).all() for step in out.logits)


# ---------------------------------------------------------------- streaming, pipeline, CLI


def test_streamer_and_pipeline():
    from transformers import pipeline

    tokenizer, words = word_tokenizer()
    model = perturbed_model(tiny_config())
    model.generation_config = GenerationConfig(pad_token_id=0)
    streamed = []

    class Collect(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            streamed.append(text)

    ids = tokenizer(" ".join(words[:30]), return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=2 * W, do_sample=False, streamer=Collect(tokenizer))
    assert "".join(streamed).split() == tokenizer.decode(out[0]).split()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = " ".join(words[:25])
    generated = generator(text, max_new_tokens=W, do_sample=False)[0]["generated_text"]
    ids = tokenizer(text, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=W, do_sample=False)[0, ids.shape[1] :]
    assert generated.startswith(text) and generated[len(text) :].split() == tokenizer.decode(expected).split()


def test_cli_streams_the_greedy_continuation(tmp_path, capsys):
    from lex.cli import main as lex

    tokenizer, words = word_tokenizer()
    model = perturbed_model(tiny_config())
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    text = " ".join(words[i % 96] for i in range(5 * W + 7))
    (tmp_path / "prompt.txt").write_text(text)
    assert lex(["generate", str(tmp_path / "model"), "--prompt-file", str(tmp_path / "prompt.txt"),
                "--max-new-tokens", str(2 * W)]) == 0
    captured = capsys.readouterr()
    ids = tokenizer(text, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=2 * W, do_sample=False, pad_token_id=PAD)[0, ids.shape[1] :]
    assert captured.out.split() == tokenizer.decode(expected).split()
    assert f"prompt: {ids.shape[1]} tokens" in captured.err and "tok/s" in captured.err  # the progress bar
    held = int(captured.err.split("the cache holds ")[1].split()[0])
    assert held < W
    assert lex(["generate", str(tmp_path / "model"), "--prompt-file", str(tmp_path / "prompt.txt"),
                "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------- errors


def test_bad_generate_input_raises_clearly():
    model = perturbed_model(tiny_config())
    with pytest.raises(ValueError, match="empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3, pad_token_id=PAD)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt(1, 5), max_new_tokens=-1, pad_token_id=PAD)
    wrong = torch.ones(2, 7, dtype=torch.long)
    wrong[1, :2] = 0  # a padded mask for a longer prompt
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 7\) but the prompt has \(2, 5\)"):
        model.generate(prompt(2, 5), attention_mask=wrong, max_new_tokens=3, pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 5\) but the prompt has \(2, 5\)"):
        model.generate(prompt(2, 5), attention_mask=wrong[1:, :5], max_new_tokens=3, pad_token_id=PAD)
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not supported"):
        model.generate(prompt(1, 5), cache_implementation="offloaded", max_new_tokens=3, pad_token_id=PAD)
    out = greedy(model, prompt(1, 3 * W), max_new_tokens=2)
    cache = out.past_key_values
    assert not cache.is_croppable  # blockwise, not recording the past: dropped blocks are gone
    with pytest.raises(ValueError, match="cannot remove"):
        cache.crop(-(cache.held + 1))
    with pytest.raises(ValueError, match="minus the number of tokens"):
        cache.crop(3)


# ---------------------------------------------------------------- attention maps while generating


def test_attention_maps_while_generating_cover_the_held_keys():
    """What transformers' common suite expects of an unbounded cache, for a bounded one: each step's map spans
    the keys the cache held plus the new token (at most w), sums to 1, and shows the window."""
    model = perturbed_model(tiny_config(attention_mode="sliding"))
    model.set_attn_implementation("eager")
    out = greedy(model, prompt(1, 5), max_new_tokens=2 * W, output_attentions=True)
    for step, maps in enumerate(out.attentions[1:], start=1):
        seen = 5 + step - 1
        for layer_map in maps:
            assert layer_map.shape == (1, 2, 1, min(seen, W - 1) + 1)
            torch.testing.assert_close(layer_map.sum(-1), torch.ones(1, 2, 1))


# ---------------------------------------------------------------- grouped key/value heads


@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
def test_caches_hold_key_value_heads(mode):
    """A Llama-shaped model with 4 query heads and 1 key/value head: LexCache and LexStaticCache hold 1 head
    (memory in proportion to the KV heads), and cached decoding equals the no-cache forward."""
    config = tiny_config(attention_mode=mode, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                         norm_type="rmsnorm", mlp_type="gated", hidden_act="silu", attention_bias=False)
    model = perturbed_model(config)
    _, ids, mask = left_padded([2 * W + 3, W - 3])
    for implementation in (None, "static"):
        out = greedy(model, ids, attention_mask=mask, max_new_tokens=2 * W, cache_implementation=implementation)
        for layer in out.past_key_values.layers:
            assert layer.keys.shape[:2] == (2, 1) and layer.keys.shape[-1] == 8 and layer.values.shape == layer.keys.shape
        full_mask = torch.cat([mask, torch.ones(2, 2 * W, dtype=mask.dtype)], dim=1)
        with torch.no_grad():
            expected = model(out.sequences, attention_mask=full_mask).logits[:, ids.shape[1] - 1 : -1]
        torch.testing.assert_close(torch.stack(out.logits, dim=1), expected, atol=1e-4, rtol=1e-4)


def test_sdpa_serves_query_groups_without_copying_keys(monkeypatch):
    """The SDPA backend repeats K/V per query head nowhere on CPU: a plain causal forward passes enable_gqa, a
    decoding step packs the query groups (transformers' SDPA function), and a masked forward (a long input's
    chunks with sinks, a padded batch) passes enable_gqa with its mask (kernels.py); none calls repeat_kv, and the
    masked forwards give the eager computation's logits."""
    from transformers.integrations import sdpa_attention

    calls = []
    original = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: calls.append(n) or original(x, n))
    config = tiny_config(attention_mode="full", num_attention_heads=4, num_key_value_heads=2)
    model = perturbed_model(config)
    model.set_attn_implementation("sdpa")
    ids = prompt(1, 12)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        model(prompt(1, 1, seed=4), past_key_values=out.past_key_values)
    assert calls == []

    model = perturbed_model(tiny_config(attention_mode="sliding", attention_sinks=2, num_attention_heads=4,
                                        num_key_value_heads=2))
    _, padded, mask = left_padded([3 * W, 3 * W - 5])
    logits = {}
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = (model(padded, attention_mask=mask).logits,
                                      model(padded[:1, : 3 * W]).logits)
    assert calls == []
    for eager, sdpa in zip(logits["eager"], logits["sdpa"]):
        torch.testing.assert_close(sdpa, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["full", "sliding", "blockwise"])
def test_generate_runs_plain_attention_where_nothing_is_hidden(monkeypatch, mode):
    """generate() passes an all-ones mask and position ids counting from 0 on every forward; they say no more than
    their absence, so the prompt runs SDPA's causal kernel without a mask (as Llama's does), and every decoding step
    whose cache holds exactly its window runs without one. A left-padded batch keeps its masks, and both equal
    the no-cache forward."""
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recorded(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape[2], attn_mask is None, kwargs.get("is_causal", False)))
        return original(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    model = perturbed_model(tiny_config(attention_mode=mode, num_attention_heads=4, num_key_value_heads=2))
    model.set_attn_implementation("sdpa")
    layers = model.config.num_hidden_layers
    ids = prompt(1, W)  # one window: the prompt is one plain causal forward in every mode
    out = greedy(model, ids, max_new_tokens=2 * W)
    prefill, steps = calls[:layers], calls[layers:]
    assert prefill == [(W, True, True)] * layers
    assert len(steps) == (2 * W - 1) * layers and all(length == 1 and no_mask for length, no_mask, _ in steps)
    with torch.no_grad():
        expected = model(out.sequences).logits[:, W - 1 : -1]
    torch.testing.assert_close(torch.stack(out.logits, dim=1), expected, atol=1e-5, rtol=1e-5)

    calls.clear()
    _, padded, mask = left_padded([W, W - 5])
    out = greedy(model, padded, attention_mask=mask, max_new_tokens=4)
    assert not any(no_mask for _, no_mask, _ in calls[:layers])
    full_mask = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        expected = model(out.sequences, attention_mask=full_mask).logits[:, W - 1 : -1]
    for row, pad in enumerate([0, 5]):
        torch.testing.assert_close(torch.stack(out.logits, dim=1)[row], expected[row], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["full", "sliding", "blockwise"])
def test_a_decoding_step_writes_its_keys_in_place(mode):
    """LexCache's layers hold their keys in buffers with room to grow: a decoding step writes its key after the held
    ones instead of copying them all (DynamicLayer's torch.cat). Over 4 windows of steps (a window wider than a
    buffer's room, so the held part moves to the front of its own buffer, onto itself) a window's buffer is
    allocated twice (the prompt's, then one with room for the window), and a full cache's grows by a quarter at a
    time; the logits stay those of the no-cache forward."""
    window = 320
    model = perturbed_model(tiny_config(attention_mode=mode, attention_window=window,
                                        attention_sinks=2 if mode != "full" else 0))
    ids = prompt(1, 4 * window)
    cache = LexCache(model.config)
    storages, logits = [], []
    with torch.no_grad():
        logits.append(model(ids[:, :5], **{CACHE_NAME: cache}).logits)
        for step in range(5, ids.shape[1]):
            logits.append(model(ids[:, step : step + 1], **{CACHE_NAME: cache}).logits)
            pointer = cache.layers[0].keys.untyped_storage().data_ptr()
            storages += [pointer] if not storages or storages[-1] != pointer else []
        expected = model(ids).logits
    assert len(storages) == (5 if mode == "full" else 2)  # full: 261, 518, 774, 1030, 1286 slots; else 261, 518
    torch.testing.assert_close(torch.cat(logits, dim=1), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["full", "sliding"])
def test_a_cache_under_autograd_gives_the_no_cache_gradients(mode):
    """Read in two forwards through a LexCache with gradients on, the keys are concatenated, never written in
    place: backward runs and gives the gradients of one no-cache forward."""
    config = tiny_config(attention_mode=mode, attention_sinks=2 if mode != "full" else 0)
    ids = prompt(1, 2 * W + 3)
    grads = []
    for cached in (True, False):
        model = perturbed_model(config)
        if cached:
            cache = LexCache(config)
            first = model(ids[:, :W + 2], **{CACHE_NAME: cache}).logits
            second = model(ids[:, W + 2 :], **{CACHE_NAME: cache}).logits
            logits = torch.cat([first, second], dim=1)
        else:
            logits = model(ids).logits
        logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- a Llama checkpoint


def test_cli_continues_a_llama_folder_through_a_window_with_sinks(tmp_path, capsys):
    """`lex generate LLAMA --attention_mode sliding --attention_window 8 --attention_sinks 4`: the continuation is
    transformers' own Llama decoding greedily over the whole sequence under a naive sliding attention whose 4 sinks
    sit within the cache (tests/reference.py), and the cache holds S + w - 1 = 11 positions; without the flags the
    folder runs as published."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lex.cli import main as lex

    tokenizer, words = word_tokenizer()
    torch.manual_seed(0)
    source = perturb(LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, eos_token_id=None, bos_token_id=None)),
        seed=0).eval()
    source.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    text = " ".join(words[(7 * i) % 96] for i in range(40))
    (tmp_path / "prompt.txt").write_text(text)
    ids = tokenizer(text, return_tensors="pt").input_ids
    sequence = ids
    reference_llama = reference.use_window_attention(LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval(),
                                                     "sliding", 8, 4)
    for _ in range(12):
        with torch.no_grad():
            following = reference_llama(sequence).logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, following], 1)
    expected = tokenizer.decode(sequence[0, ids.shape[1] :])
    assert lex(["generate", str(tmp_path / "llama"), "--prompt_file", str(tmp_path / "prompt.txt"),
                "--max_new_tokens", "12", "--attention_mode", "sliding", "--attention_window", "8",
                "--attention_sinks", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == expected.split()
    assert "sliding attention, window 8, 4 attention sinks" in captured.err
    assert "the cache holds 11 positions per layer" in captured.err
    assert lex(["generate", str(tmp_path / "llama"), "--prompt-file", str(tmp_path / "prompt.txt"),
                "--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    as_published = source.generate(ids, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids))
    assert captured.out.split() == tokenizer.decode(as_published[0, ids.shape[1] :]).split()
    assert "llama as published" in captured.err and f"the cache holds {ids.shape[1] + 2} positions" in captured.err


def test_cli_generates_with_a_block_memory_in_ram_and_on_disk(tmp_path, capsys):
    """`lex generate LLAMA --attention_mode sliding --attention_window 8 --attention_sinks 4
    --attention_memory_blocks 2 --attention_memory_block_size 4`: the prompt but its last token is read through a
    LexCache under a bar that shows the store's size, then generate() continues from that cache: the continuation is
    the converted model's generate() on the whole prompt (which reads it in the same forwards); with
    --memory_directory the store is memory-mapped there and the output is the same."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from convert.hf import lex_from_hf
    from lex.cli import main as lex

    tokenizer, words = word_tokenizer()
    torch.manual_seed(0)
    source = perturb(LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, eos_token_id=None, bos_token_id=None)),
        seed=0).eval()
    source.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    text = " ".join(words[(7 * i) % 96] for i in range(40))
    (tmp_path / "prompt.txt").write_text(text)
    ids = tokenizer(text, return_tensors="pt").input_ids
    model = lex_from_hf(source, "sliding", 8, 4, attention_memory_blocks=2, attention_memory_block_size=4).eval()
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)
    cache = LexCache(model.config)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache)  # the store the bar shows once the prompt but its last token is read
    assert cache.memory_bytes > 0
    flags = ["--max_new_tokens", "8", "--attention_mode", "sliding", "--attention_window", "8", "--attention_sinks",
             "4", "--attention_memory_blocks", "2", "--attention_memory_block_size", "4"]
    command = ["generate", str(tmp_path / "llama"), "--prompt_file", str(tmp_path / "prompt.txt"), *flags]
    assert lex(command) == 0
    in_ram = capsys.readouterr()
    assert in_ram.out.split() == tokenizer.decode(expected[0, ids.shape[1] :]).split()
    assert "a memory of 2 blocks of 4 tokens" in in_ram.err
    assert "prompt" in in_ram.err and f"memory {cache.memory_bytes / 1e6:.1f} MB" in in_ram.err  # the bar's postfix
    assert "the block memory holds" in in_ram.err
    (tmp_path / "store").mkdir()
    assert lex([*command, "--memory_directory", str(tmp_path / "store"), "--no_progress"]) == 0
    on_disk = capsys.readouterr()
    assert on_disk.out == in_ram.out and f"in {tmp_path / 'store'}" in on_disk.err
    assert list((tmp_path / "store").iterdir()) == []  # (the files are unlinked at once)
    for extra, message in ((["--memory_directory", str(tmp_path / "none")], "no such folder"),
                           (["--attention_memory_blocks", "-1"], "--attention_memory_blocks must be >= 0")):
        assert lex([*command, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert lex(["generate", str(tmp_path / "llama"), "--prompt_file", str(tmp_path / "prompt.txt"),
                "--attention_mode", "full", "--attention_memory_blocks", "2"]) == 2
    assert "attention_memory_blocks=2 with attention_mode 'full'" in capsys.readouterr().err
    assert lex(["generate", str(tmp_path / "llama"), "--prompt_file", str(tmp_path / "prompt.txt"),
                "--attention_mode", "sliding", "--memory_directory", str(tmp_path / "store")]) == 2
    assert "--memory_directory" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_cli_compile_streams_the_eager_continuation_from_one_graph(tmp_path, capsys):
    """`lex generate --compile`: the prompt read into the static cache, then one compiled decoding step (Inductor):
    the continuation of a prompt of 5 windows, with sinks, is the eager command's, from one graph; a memory, or a
    published checkpoint without --attention_mode, is refused by name."""
    from torch._dynamo.utils import counters

    from lex.cli import main as lex

    tokenizer, words = word_tokenizer()
    model = perturbed_model(tiny_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=2,
                                        attention_sink_positions="cache"))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "prompt.txt").write_text(" ".join(words[(5 * i) % 96] for i in range(5 * W + 7)))
    command = ["generate", str(tmp_path / "model"), "--prompt_file", str(tmp_path / "prompt.txt"),
               "--max_new_tokens", str(2 * W), "--no_progress"]
    assert lex(command) == 0
    eager = capsys.readouterr()
    assert lex([*command, "--compile"]) == 0
    compiled = capsys.readouterr()
    assert compiled.out == eager.out and "compiling the decoding step" in compiled.err
    assert counters["stats"]["unique_graphs"] == 1
    assert lex([*command, "--compile", "--attention_memory_blocks", "2"]) == 2
    assert "--compile with a block memory (attention_memory_blocks=2)" in capsys.readouterr().err
