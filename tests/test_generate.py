"""generate() with the bounded cache: the incremental form of the no-cache forward in every mode."""

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, TextStreamer

import modeling_lex  # noqa: F401
from modeling_lex import LexCache
from tests.test_model import perturbed_model, tiny_config

W = 16  # tiny_config's attention_window
PAD = 0  # never sampled as a prompt token below, so generate() infers no padding inside prompts


def prompt(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 97, (batch, length), generator=generator)


def greedy(model, ids, **kwargs):
    return model.generate(
        ids, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=PAD, **kwargs
    )


@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
@pytest.mark.parametrize("kind", ["xpos", "rope", "decay", "alibi", "kerple", "sandwich", "sinusoidal"])
@pytest.mark.parametrize("prompt_len", [5, W, int(3.7 * W)])
def test_every_cached_step_equals_the_no_cache_forward(mode, kind, prompt_len):
    model = perturbed_model(tiny_config(attention_mode=mode, position_embedding_type=kind))
    ids = prompt(1, prompt_len)
    out = greedy(model, ids, max_new_tokens=3 * W)
    assert isinstance(out.past_key_values, LexCache)
    with torch.no_grad():
        reference = model(out.sequences).logits[0, prompt_len - 1 : -1]
    steps = torch.stack(out.logits, dim=1)[0]
    torch.testing.assert_close(steps, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode, bound", [("blockwise", W), ("sliding", W - 1)])
def test_cache_stays_within_the_window(mode, bound):
    model = perturbed_model(tiny_config(attention_mode=mode))
    out = greedy(model, prompt(1, 7), max_new_tokens=10 * W)
    cache = out.past_key_values
    assert cache.get_seq_length() == 7 + 10 * W - 1
    for layer in cache.layers:
        assert layer.keys.shape[2] <= bound and layer.values.shape[2] <= bound
    assert cache.positions.shape[1] <= bound


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


@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_left_padded_rows_generate_as_alone(mode):
    model = perturbed_model(tiny_config(attention_mode=mode))
    rows = [prompt(1, n, seed=n)[0] for n in (21, 13, 30)]
    longest = max(len(r) for r in rows)
    ids = torch.full((3, longest), PAD)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, longest - len(row) :] = row
        mask[i, longest - len(row) :] = 1
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=2 * W, do_sample=False, pad_token_id=PAD)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=2 * W, do_sample=False, pad_token_id=PAD)
        assert torch.equal(batch[i, longest:], alone[0, len(row) :])


def test_beam_search_and_sampling_across_blocks():
    model = perturbed_model(tiny_config())
    ids = prompt(2, 11)
    beams = model.generate(ids, num_beams=3, max_new_tokens=3 * W, do_sample=False, pad_token_id=PAD)
    assert beams.shape == (2, 11 + 3 * W)
    torch.manual_seed(0)
    sampled = model.generate(ids, do_sample=True, top_k=20, max_new_tokens=3 * W, pad_token_id=PAD)
    torch.manual_seed(0)
    again = model.generate(ids, do_sample=True, top_k=20, max_new_tokens=3 * W, pad_token_id=PAD)
    assert torch.equal(sampled, again)


def test_long_prompt_is_prefilled_block_by_block():
    model = perturbed_model(tiny_config())
    ids = prompt(1, 10 * W + 3)
    calls = []
    model.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                          with_kwargs=True)
    with torch.no_grad():
        cached = model(ids, past_key_values=LexCache(model.config), use_cache=True, logits_to_keep=1).logits
        assert max(calls) == W and len(calls) == 11
        torch.testing.assert_close(cached[0, -1], model(ids).logits[0, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forty_window_prompt_is_finite_in_half_precision(dtype):
    model = perturbed_model(tiny_config()).to(dtype)
    out = greedy(model, prompt(1, 40 * W), max_new_tokens=W)
    assert all(torch.isfinite(step).all() for step in out.logits)


def test_positions_shifted_by_a_million_generate_the_same_tokens():
    model = perturbed_model(tiny_config())
    ids = prompt(1, 2 * W + 5)
    cache = LexCache(model.config)
    shifted = ids.new_tensor(range(ids.shape[1]))[None] + 1_000_000
    tokens = {}
    with torch.no_grad():
        for name, positions in (("near", None), ("far", shifted)):
            cache = LexCache(model.config)
            logits = model(ids, position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1]
            generated = []
            next_position = ids.shape[1] + (1_000_000 if positions is not None else 0)
            for _ in range(3 * W):
                token = logits.argmax(-1, keepdim=True)
                generated.append(token.item())
                step_position = torch.tensor([[next_position]]) if positions is not None else None
                logits = model(token, position_ids=step_position, past_key_values=cache, use_cache=True).logits[:, -1]
                next_position += 1
            tokens[name] = generated
    assert tokens["near"] == tokens["far"]


def test_dynamic_cache_passed_by_hand_gives_the_same_logits():
    model = perturbed_model(tiny_config())
    ids = prompt(1, 3 * W)
    with torch.no_grad():
        cache = DynamicCache()
        first = model(ids[:, :20], past_key_values=cache, use_cache=True).logits
        second = model(ids[:, 20:], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(torch.cat([first, second], 1), model(ids).logits, atol=1e-5, rtol=1e-5)


def test_streamer_and_pipeline(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    words = [f"w{i}" for i in range(96)]
    backend = Tokenizer(models.WordLevel({w: i + 1 for i, w in enumerate(words)} | {"<pad>": 0}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
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
    assert generated.startswith(text) and len(generated) > len(text) + W


def test_bad_generate_input_raises_clearly():
    model = perturbed_model(tiny_config())
    with pytest.raises(ValueError, match="empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3, pad_token_id=PAD)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt(1, 5), max_new_tokens=-1, pad_token_id=PAD)
    wrong = torch.ones(2, 7, dtype=torch.long)
    wrong[1, :2] = 0  # a padded mask for a longer prompt
    with pytest.raises(ValueError, match="attention_mask"):
        model.generate(prompt(2, 5), attention_mask=wrong, max_new_tokens=3, pad_token_id=PAD)
