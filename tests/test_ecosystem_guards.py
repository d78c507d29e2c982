"""What transformers' serving machinery would hand a LEX model is refused by name (modeling_lex/generation.py):
continuous batching and its PagedAttentionCache, and attention implementations that ignore `position_bias` (through
which LEX passes its window, sinks and block memory); eager, sdpa and a registered backend keep working."""

import pytest
import torch
from transformers import AutoModel, AttentionInterface
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from modeling_lex import LexForCausalLM
from modeling_lex.cache import LexCache
from modeling_lex.generation import CACHE_NAME
from modeling_lex.kernels import eager_attention_forward
from tests.helpers import W, perturbed_model, prompt, tiny_config

pytestmark = pytest.mark.oldest  # the hooks are transformers internals: checked at both ends of the range

REFUSED_ATTENTION = ["paged|eager", "paged|sdpa", "vllm", "sglang", "kernels-community/flash-attn2"]
ALLOWED = "Allowed: 'eager', 'sdpa', or a function registered with transformers' AttentionInterface.register"


@pytest.fixture(scope="module")
def model() -> LexForCausalLM:
    """Sliding window with sinks: the mask reaches the backend only as `position_bias`."""
    return perturbed_model(tiny_config(attention_mode="sliding", attention_sinks=2))


@pytest.fixture
def engine_attention():
    """A function registered under a name the way vLLM and SGLang register theirs (ALL_ATTENTION_FUNCTIONS[name] =
    ...), removed afterwards; it ignores position_bias, as theirs do."""
    names = []

    def register(name: str) -> None:
        def ignores_position_bias(module, query, key, value, attention_mask, position_bias=None, **kwargs):
            return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

        ALL_ATTENTION_FUNCTIONS[name] = ignores_position_bias
        names.append(name)

    yield register
    for name in names:
        del ALL_ATTENTION_FUNCTIONS[name]


@pytest.mark.parametrize("entry", ["generate_batch", "init_continuous_batching", "continuous_batching_context_manager"])
def test_continuous_batching_is_refused_by_name(model, entry):
    """Each public entry point of transformers' ContinuousMixin raises, naming itself and what to use instead."""
    call = {"generate_batch": lambda: model.generate_batch([[1, 2, 3]], max_new_tokens=2),
            "init_continuous_batching": model.init_continuous_batching,
            "continuous_batching_context_manager": lambda: model.continuous_batching_context_manager().__enter__()}
    with pytest.raises(NotImplementedError, match=rf"^{entry}: transformers' continuous batching .*`lex serve MODEL`"
                                                  r".*generate\(\) with a padded batch"):
        call[entry]()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("how", ["cache", "past_key_values", "positional", "base model"])
def test_a_paged_attention_cache_is_refused_by_name(model, how):
    """Continuous batching's PagedAttentionCache (not a transformers Cache) gets a ValueError naming its class and
    the caches a LEX forward reads, however it is passed, before any layer runs."""
    paged = object.__new__(PagedAttentionCache)  # (its type is what is checked; building one needs a device plan)
    ids = prompt(1, 4)
    calls = {"cache": lambda: model(ids, cache=paged), "past_key_values": lambda: model(ids, past_key_values=paged),
             "positional": lambda: model.model(ids, None, None, paged),
             "base model": lambda: model.model(input_ids=ids, **{CACHE_NAME: paged})}
    with pytest.raises(ValueError, match=r"cache is a PagedAttentionCache, which LEX models cannot read .*`lex serve "
                                         r"MODEL`.*Allowed: None, LexCache or LexStaticCache .*LexRows, or a "
                                         r"transformers Cache"):
        calls[how]()


@pytest.mark.parametrize("name", REFUSED_ATTENTION)
def test_attention_that_ignores_position_bias_is_refused_when_set(model, name, engine_attention):
    """set_attn_implementation refuses it by name (registered, as the engines register theirs, or not) and the model
    keeps computing as before."""
    if "/" not in name and not name.startswith("paged"):
        engine_attention(name)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=rf"^attn_implementation={name!r} is refused by LEX models: .*position_bias"
                                         rf".*{ALLOWED}"):
        model.set_attn_implementation(name)
    assert model.config._attn_implementation == before
    model(prompt(1, 4))


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_the_engines_route_is_refused_at_construction(model, name, engine_attention, tmp_path):
    """vLLM's transformers backend writes the name on the config and builds the model with AutoModel.from_config;
    SGLang's passes attn_implementation to from_config; from_pretrained takes it too."""
    engine_attention(name)
    config = tiny_config(attention_mode="sliding", attention_sinks=2)
    config._attn_implementation = name
    with pytest.raises(ValueError, match=rf"^attn_implementation={name!r} is refused"):
        AutoModel.from_config(config)
    with pytest.raises(ValueError, match=rf"^attn_implementation={name!r} is refused"):
        AutoModel.from_config(tiny_config(), attn_implementation=name)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^attn_implementation={name!r} is refused"):
        LexForCausalLM.from_pretrained(tmp_path, attn_implementation=name)


@pytest.mark.parametrize("name", ["flash_attention_2", "flex_attention"])
def test_transformers_refuses_flash_and_flex_attention(model, name):
    """LEX declares neither (`_supports_flash_attn`, `_supports_flex_attn`): transformers' own refusal."""
    with pytest.raises((ValueError, ImportError)):
        model.set_attn_implementation(name)
    assert model.config._attn_implementation in ("eager", "sdpa")


def test_eager_sdpa_and_a_registered_backend_still_work(model):
    """The same logits through eager, sdpa and a function registered with AttentionInterface.register (set by
    name, called by every layer of a forward past the window, a decoding step through a LexCache included)."""
    calls = []

    def recording(module, query, key, value, attention_mask, position_bias=None, **kwargs):
        calls.append(position_bias is not None)
        return eager_attention_forward(module, query, key, value, attention_mask, position_bias=position_bias,
                                       **kwargs)

    AttentionInterface.register("lex_guard_recording", recording)
    ids = prompt(1, 3 * W, seed=3)
    logits, steps = {}, {}
    try:
        for name in ("eager", "sdpa", "lex_guard_recording"):
            model.set_attn_implementation(name)
            assert model.config._attn_implementation == name
            with torch.no_grad():
                logits[name] = model(ids).logits
                cache = LexCache(model.config)
                model(ids[:, :-1], **{CACHE_NAME: cache})
                steps[name] = model(ids[:, -1:], **{CACHE_NAME: cache}).logits
    finally:
        model.set_attn_implementation("sdpa")
    assert len(calls) > 2 * model.config.num_hidden_layers and calls[0]  # the whole prompt's mask: position_bias
    for name in ("sdpa", "lex_guard_recording"):
        torch.testing.assert_close(logits[name], logits["eager"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(steps[name], steps["eager"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(steps["eager"][:, -1], logits["eager"][:, -1], atol=1e-5, rtol=1e-5)
