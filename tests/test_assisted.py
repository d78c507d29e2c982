"""Rollback: assisted and prompt-lookup decoding, and `crop`, on the bounded caches.

Against transformers' own greedy path (the same tokens, and the logits at every step), with separate drafters,
around block boundaries, with sinks, and `crop` against a stream that never had the rejected tokens. Random weights
hardly ever accept a draft, so rollback would barely run: most models here are trained in-test on a Markov chain
(tests/helpers.py `markov_batch`), which a model learns well but not perfectly, and those tests count the tokens
`crop` rolled back, so they show that rollback ran.
"""

import pytest
import torch

import modeling_lex  # noqa: F401
from configuration_lex import SINK_POSITIONS
from modeling_lex import LexCache, LexForCausalLM
from modeling_lex.stream import Stream
from tests.helpers import (
    PAD,
    W,
    greedy,
    greedy_tokens,
    load_weights,
    markov_batch,
    perturbed_model,
    prompt,
    tiny_config,
    trained_model,
)

LENGTH = 64  # the training length of the trained models below
MODES = ["blockwise", "sliding", "full"]
DRAFTER = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1)
S = 4

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.oldest]


@pytest.fixture(scope="module")
def weights() -> dict[str, dict]:
    """State dicts of a 2-layer model and of a separately trained, smaller drafter that errs more often."""
    main = trained_model(tiny_config(max_position_embeddings=LENGTH, attention_mode="full"), steps=150)
    drafter = trained_model(tiny_config(max_position_embeddings=LENGTH, attention_mode="full", **DRAFTER), steps=25,
                            seed=1)
    return {"main": main.state_dict(), "drafter": drafter.state_dict()}


def build(state: dict, strict: bool = True, **config) -> LexForCausalLM:
    return load_weights(state, strict, max_position_embeddings=LENGTH, **config)


def drafts(model: LexForCausalLM, tokens: int) -> LexForCausalLM:
    """Make `model` an assistant that proposes `tokens` candidates every round, however unsure it is."""
    model.generation_config.num_assistant_tokens = tokens
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0
    return model


@pytest.fixture
def rolled_back(monkeypatch) -> list[int]:
    """Every rollback any cache makes during the test: how many tokens it removed."""
    removed = []
    original = Stream.roll_back

    def roll_back(self, remove):
        removed.append(remove)
        return original(self, remove)

    monkeypatch.setattr(Stream, "roll_back", roll_back)
    return removed


def same_as_greedy(model, ids, new_tokens: int, **options) -> None:
    """The tokens of transformers' greedy search without an assistant, and its logits at every step (trained models
    are confident: a wrong key or position would rarely change a token, but always the logits)."""
    outputs = [model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD, output_logits=True,
                              return_dict_in_generate=True, **extra) for extra in ({}, options)]
    expected, got = outputs
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- with trained models


@pytest.mark.parametrize("prompt_length", [10, 40, 100])
@pytest.mark.parametrize("window", [16, 64])
@pytest.mark.parametrize("mode", MODES)
def test_assisted_decoding_equals_greedy(weights, rolled_back, mode, window, prompt_length):
    """Three assistants: a separately trained smaller drafter with its own window, the model's own first layer,
    and the model itself; each gives the tokens of greedy search, and the cache rolls back the rejected ones."""
    model = build(weights["main"], attention_mode=mode, attention_window=window)
    assistants = {
        "drafter": drafts(build(weights["drafter"], attention_mode=mode, attention_window=window // 2, **DRAFTER), 5),
        "first layer": drafts(build(weights["main"], strict=False, attention_mode=mode, attention_window=window,
                                    num_hidden_layers=1), 4),
        "itself": model,
    }
    ids = markov_batch(1, prompt_length, seed=prompt_length)
    for assistant in assistants.values():
        same_as_greedy(model, ids, 30, assistant_model=assistant)
    assert sum(rolled_back) > 0 and max(rolled_back) >= 2  # candidates were rejected, several at a time


@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_a_growing_draft_rolls_back_past_its_first_count(weights, rolled_back, mode):
    """transformers' heuristic schedule drafts 2 more tokens after each fully accepted round, past the count
    generate() passed to `activate_past_recording(recurrent_states_to_keep=...)` (2 here): the caches still roll
    back whatever a round rejects (they hold every token read since the last crop), so the tokens are greedy's."""
    model = build(weights["main"], attention_mode=mode, attention_window=16)
    assistant = build(weights["main"], strict=False, attention_mode=mode, attention_window=16, num_hidden_layers=1)
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    same_as_greedy(model, markov_batch(1, 40, seed=11), 40, assistant_model=assistant)
    assert max(rolled_back) > 2


@pytest.mark.parametrize("sinks", [0, *SINK_POSITIONS])
@pytest.mark.parametrize("count", [None, 2])
def test_crop_returns_to_the_shorter_stream_whatever_the_recording_count(count, sinks):
    """A recording cache (told that `count` tokens are drafted, or nothing) removes 1 to 5 tokens read since the
    last crop, with the stream around the window's end, and reads on exactly as a cache that never had them: the
    count bounds nothing, and the sinks of keys the crop drops move to their slots, as a forward's would."""
    rule = {} if not sinks else dict(attention_sinks=2, attention_sink_positions=sinks)
    model = perturbed_model(tiny_config(attention_mode="sliding", **rule))
    ids, following = prompt(1, 2 * W + 3), prompt(1, 4, seed=9)
    for first, remove in [(W + 2, 2), (W - 3, 4), (2 * W - 4, 5), (2 * W - 4, 1)]:
        recorded, plain = LexCache(model.config), LexCache(model.config)
        recorded.activate_past_recording(recurrent_states_to_keep=count)
        with torch.no_grad():
            model(ids[:, :first], past_key_values=recorded)
            model(ids[:, first : first + remove + 2], past_key_values=recorded)
            model(ids[:, : first + 2], past_key_values=plain)
            recorded.crop(-remove)
            assert recorded.held == plain.held
            torch.testing.assert_close(model(following, past_key_values=recorded).logits,
                                       model(following, past_key_values=plain).logits, atol=1e-5, rtol=1e-5)


def test_the_drafted_count_is_reported_while_recording(weights):
    """`get_recurrent_states_to_keep` answers with the count `activate_past_recording` was given while the past is
    recorded (0 otherwise), so generate()'s own `max(1, cache.get_recurrent_states_to_keep())` keeps a larger one;
    a count that is not an int >= 0 is refused by name."""
    cache = LexCache(build(weights["main"], attention_mode="sliding", attention_window=16).config)
    assert cache.get_recurrent_states_to_keep() == 0
    cache.activate_past_recording(recurrent_states_to_keep=5)
    assert cache.get_recurrent_states_to_keep() == 5 and cache.is_croppable
    cache.activate_past_recording(recurrent_states_to_keep=max(1, cache.get_recurrent_states_to_keep()))
    assert cache.get_recurrent_states_to_keep() == 5
    cache.reset()
    assert cache.get_recurrent_states_to_keep() == 5  # reset keeps recording, as it keeps record_past
    with pytest.raises(ValueError, match=r"recurrent_states_to_keep=-1: allowed values are None or an int >= 0"):
        cache.activate_past_recording(recurrent_states_to_keep=-1)


def test_recorded_cache_holds_the_window_plus_the_candidates(weights):
    """While assisted decoding records the past, a layer holds at most w - 1 keys plus the candidates of the last
    round (and the bonus token); after each crop, at most w - 1 again."""
    window, candidates = 16, 5
    model = build(weights["main"], attention_mode="sliding", attention_window=window)
    assistant = drafts(build(weights["drafter"], attention_mode="sliding", attention_window=8, **DRAFTER), candidates)
    sizes = []
    model.model.register_forward_hook(
        lambda module, args, kwargs, output: sizes.append(output.past_key_values.layers[0].keys.shape[2]),
        with_kwargs=True,
    )
    cropped = []
    original = modeling_lex.LexCache.crop
    modeling_lex.LexCache.crop = lambda self, n: (original(self, n), cropped.append(self.layers[0].keys.shape[2]))
    try:
        greedy_tokens(model, markov_batch(1, 100, seed=7), 40, assistant_model=assistant)
    finally:
        modeling_lex.LexCache.crop = original
    assert max(sizes) <= window - 1 + candidates + 1 and max(cropped) <= window - 1


def _lookup_sweep(weights, rolled_back, mode: str, window: int, lookups: list[int], lengths: list[int]) -> None:
    model = build(weights["main"], attention_mode=mode, attention_window=window)
    for length in lengths:
        ids = markov_batch(1, length, seed=length)
        for tokens in lookups:
            same_as_greedy(model, ids, 20, prompt_lookup_num_tokens=tokens)
    assert max(rolled_back) >= 2


@pytest.mark.parametrize("mode", MODES)
def test_prompt_lookup_equals_greedy_around_block_boundaries(weights, rolled_back, mode):
    """5 lookup tokens, window 16, prompts around the block and window boundaries (the lengths that failed)."""
    _lookup_sweep(weights, rolled_back, mode, 16, [5], [23, 24, 28, 29, 31, 32, 33, 44, 46, 47, 48, 120])


@pytest.mark.slow
@pytest.mark.parametrize("window", [16, 64])
@pytest.mark.parametrize("mode", MODES)
def test_prompt_lookup_equals_greedy_at_every_prompt_length(weights, rolled_back, mode, window):
    """3, 5 and 10 lookup tokens at every prompt length from 20 to 52, and at 120."""
    _lookup_sweep(weights, rolled_back, mode, window, [3, 5, 10], [*range(20, 53), 120])


def test_crop_refuses_what_it_cannot_restore(weights):
    """Without recording, a blockwise cache cannot return past a dropped block, and says so; recording, it refuses
    to remove tokens whose logits were never computed."""
    model = build(weights["main"], attention_mode="blockwise", attention_window=16)
    cache = modeling_lex.LexCache(model.config)
    with torch.no_grad():
        model(markov_batch(1, 40, seed=1), past_key_values=cache, logits_to_keep=1)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cannot remove 1 of 40 tokens"):
        cache.crop(-1)
    cache.activate_past_recording()
    with torch.no_grad():
        model(markov_batch(1, 30, seed=2), past_key_values=cache, logits_to_keep=4)
    cache.crop(-3)  # within the 4 scored tokens
    assert cache.get_seq_length() == 67
    with torch.no_grad():
        model(markov_batch(1, 30, seed=3), past_key_values=cache, logits_to_keep=4)
    with pytest.raises(ValueError, match="cannot remove 5 of 97 tokens"):
        cache.crop(-5)


# ---------------------------------------------------------------- with random weights, and with sinks


@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
def test_assisted_and_prompt_lookup_decoding_equal_greedy(mode):
    """generate() rolls the cache back over rejected candidates: the tokens and logits of plain greedy search,
    with an assistant model (the same model and a different one) and with prompt lookup, across several
    blocks; between forwards the cache holds at most w - 1 plus the tokens of the last forward."""
    model = perturbed_model(tiny_config(attention_mode=mode))
    other = perturbed_model(tiny_config(attention_mode=mode), seed=5)
    for assistant in (model, other):
        assistant.generation_config.num_assistant_tokens = 4
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
    ids = torch.cat([prompt(1, 12, seed=3)] * 3, dim=1)  # repeats, so prompt lookup finds candidates
    expected = greedy(model, ids, max_new_tokens=3 * W)
    cache = LexCache(model.config)
    sizes = []
    hook = model.model.register_forward_hook(
        lambda module, args, output: sizes.append(max(layer.keys.shape[2] for layer in cache.layers))
    )
    runs = {
        "other assistant": dict(assistant_model=other, past_key_values=cache),
        "same model as assistant": dict(assistant_model=model),
        "prompt lookup": dict(prompt_lookup_num_tokens=4),
    }
    for name, options in runs.items():
        out = greedy(model, ids, max_new_tokens=3 * W, **options)
        hook.remove()
        assert torch.equal(out.sequences, expected.sequences), name
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), atol=1e-4, rtol=1e-4)
    if mode != "full":
        prefill = -(-ids.shape[1] // W)  # forwards of w prompt tokens: w - 1 + w at most while recording
        assert max(sizes[:prefill]) <= 2 * W - 1
        assert max(sizes[prefill:]) <= W - 1 + 4 + 1  # then 4 candidates and the token before them  # sizes[0]: the prompt, read before recording starts
        assert cache.held <= W - 1  # the last crop shrank it back


def test_crop_rolls_back_exactly():
    """crop(-n) after a recorded forward gives the cache of a stream that never had those n tokens."""
    model = perturbed_model(tiny_config())
    ids = prompt(1, 2 * W + 3)
    recorded, plain = LexCache(model.config), LexCache(model.config)
    recorded.activate_past_recording()
    with torch.no_grad():
        model(ids[:, : 2 * W - 4], past_key_values=recorded)
        model(ids[:, 2 * W - 4 :], past_key_values=recorded)  # 7 tokens, 5 of them rejected below
        model(ids[:, : 2 * W - 2], past_key_values=plain)
        recorded.crop(-5)
        assert recorded.seen == plain.seen and recorded.held == plain.held
        assert torch.equal(recorded.stream.positions, plain.stream.positions) and torch.equal(recorded.stream.index, plain.stream.index)
        following = prompt(1, 4, seed=9)
        torch.testing.assert_close(model(following, past_key_values=recorded).logits,
                                   model(following, past_key_values=plain).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rule", SINK_POSITIONS)
def test_assisted_and_prompt_lookup_decoding_with_sinks_equal_greedy(rule):
    """Rollback with sink slots: a smaller assistant and prompt lookup give greedy's tokens and logits."""
    model = perturbed_model(tiny_config(attention_mode="sliding", attention_sinks=S, attention_sink_positions=rule))
    assistant = perturbed_model(tiny_config(attention_mode="blockwise", attention_window=8, attention_sinks=2,
                                            num_hidden_layers=1), seed=3)
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    ids = torch.cat([prompt(1, 12, seed=3)] * 4, dim=1)  # repeats, so that prompt lookup finds candidates
    expected = greedy(model, ids, max_new_tokens=3 * W)
    for options in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=5)):
        out = greedy(model, ids, max_new_tokens=3 * W, **options)
        assert torch.equal(out.sequences, expected.sequences)
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), atol=1e-4, rtol=1e-4)
