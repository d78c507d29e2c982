"""Every decoding strategy on the bounded cache, against transformers' own greedy path, with small trained models.

Random weights hardly ever accept a draft, so rollback would barely run: the models here are trained in-test on a
Markov chain (tests/helpers.py `markov_batch`), which a model learns well but not perfectly. Each test counts the
tokens `crop` rolled back, so it shows that rollback ran.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import modeling_lex  # noqa: F401
from modeling_lex import LexForCausalLM
from modeling_lex.stream import Stream
from tests.helpers import PAD, left_padded, markov_batch, tiny_config, trained_model

LENGTH = 64  # the training length of the models below
MODES = ["blockwise", "sliding", "full"]
DRAFTER = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1)


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.oldest]


@pytest.fixture(scope="module")
def weights() -> dict[str, dict]:
    """State dicts of a 2-layer model and of a separately trained, smaller drafter that errs more often."""
    main = trained_model(tiny_config(max_position_embeddings=LENGTH, attention_mode="full"), steps=150)
    drafter = trained_model(tiny_config(max_position_embeddings=LENGTH, attention_mode="full", **DRAFTER), steps=25,
                            seed=1)
    return {"main": main.state_dict(), "drafter": drafter.state_dict()}


def build(state: dict, strict: bool = True, **config) -> LexForCausalLM:
    model = LexForCausalLM(tiny_config(max_position_embeddings=LENGTH, **config)).eval()
    model.load_state_dict(state, strict=strict)
    return model


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


def greedy(model, ids, new_tokens: int, **options) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD, **options)


def same_as_greedy(model, ids, new_tokens: int, **options) -> None:
    """The tokens of transformers' greedy search without an assistant, and its logits at every step (trained models
    are confident: a wrong key or position would rarely change a token, but always the logits)."""
    outputs = [model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD, output_logits=True,
                              return_dict_in_generate=True, **extra) for extra in ({}, options)]
    expected, got = outputs
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- assisted decoding


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
        greedy(model, markov_batch(1, 100, seed=7), 40, assistant_model=assistant)
    finally:
        modeling_lex.LexCache.crop = original
    assert max(sizes) <= window - 1 + candidates + 1 and max(cropped) <= window - 1


# ---------------------------------------------------------------- prompt lookup


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


# ---------------------------------------------------------------- compiled decoding with the static cache


@pytest.mark.parametrize("sinks", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_compiled_static_cache_reads_a_padded_batch_past_the_window(sinks):
    """Prompts of 100 and 60 tokens, left-padded, window 16: the compiled (fullgraph) prefill and decoding give
    eager's tokens, and a second generate() of the same shapes compiles no new graph (with sink slots too)."""
    torch._dynamo.reset()
    counters.clear()
    model = build(trained_model(tiny_config(max_position_embeddings=16, num_hidden_layers=1), steps=20).state_dict(),
                  num_hidden_layers=1, attention_mode="blockwise", attention_window=16, attention_sinks=sinks)
    _, ids, mask = left_padded([100, 60])
    options = dict(attention_mask=mask, cache_implementation="static")
    eager = greedy(model, ids, 20, **options)
    assert torch.equal(eager, greedy(model, ids, 20, attention_mask=mask))
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    first = greedy(model, ids, 20, **options)
    graphs = counters["stats"]["unique_graphs"]
    second = greedy(model, ids, 20, **options)
    assert 0 < graphs == counters["stats"]["unique_graphs"]
    assert torch.equal(first, eager) and torch.equal(second, eager)
    torch._dynamo.reset()


def test_a_shorter_compiled_generation_reuses_the_static_shapes():
    """Prompt 7 and window 64: the static cache holds min(w - 1 + S, max_cache_len) slots, so a second generate()
    with fewer new tokens would shrink it and recompile; sized for the largest length asked so far (as
    transformers' static caches are), it compiles no new graph and gives eager's tokens."""
    torch._dynamo.reset()
    counters.clear()
    model = build(trained_model(tiny_config(max_position_embeddings=16, num_hidden_layers=1), steps=20).state_dict(),
                  num_hidden_layers=1, attention_mode="sliding", attention_window=64)
    ids = markov_batch(2, 7, seed=5)
    eager = greedy(model, ids, 2, cache_implementation="static")
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    greedy(model, ids, 5, cache_implementation="static")
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(greedy(model, ids, 2, cache_implementation="static"), eager)
    assert 0 < graphs == counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
