"""Where LEX meets transformers' generation loop and serving: every coupling to a transformers internal, in one module.

Written against transformers 5.23 to 5.25, the range setup.cfg declares (`TESTED_TRANSFORMERS`; CI runs the
suite at both ends). Importing this module warns once when the installed transformers lies outside that range:
these couplings are exactly what a new minor version may move.

What changed inside the range, and how this module absorbs it:
- 5.24 renamed the cache argument and output field `past_key_values` to `cache` (its models and
  `GenerationMixin` accept the old name through `deprecate_kwarg`). `CACHE_NAME` is the installed version's
  name, read off its output classes; `accepts_both_cache_names` lets a forward take either name, as
  transformers' own Llama does; an output names its cache `CACHE_NAME`.
- 5.25's generate() passes `recurrent_states_to_keep` (the drafted tokens per step) to
  `Cache.activate_past_recording` and reads it back with `get_recurrent_states_to_keep`: LexCache takes both
  (cache.py says what the count means for a bounded cache). 5.25 also kernelizes every model `from_pretrained`
  loads (`use_kernels`): LEX's layers register no hub kernel, so nothing of LEX is swapped, on any device.

What LEX still overrides in `GenerationMixin`, each because transformers' own behaviour does not serve LEX
(`LexGenerationMixin`; modeling_llama overrides none of them):
- `_prepare_cache_for_generation`: generate() would build a DynamicCache or StaticCache from the config, which
  keep every key and never re-encode positions; LEX needs its bounded LexCache / LexStaticCache.
- `create_masks_for_generate` (a public hook generate() looks up): generate() would build a 4D mask over the
  static cache's slots; LEX builds its own masks from the new tokens' 2D columns.
- `_prepare_generated_length` and `_get_stopping_criteria`: transformers caps the default length at, and warns
  past, `max_position_embeddings`, which for LEX is the training length l that it reads past by design.

The caches subclass DynamicCache / StaticCache (what tools test for) but hold LEX's own layers;
`init_cache_layers` is the one place they set them up through `Cache.__init__`, past their parents' constructors,
which would build layers from the config.

What transformers' serving machinery would hand LEX, refused by name (LEX's window, sinks and block memory reach
the attention function only as its `position_bias`, and live only in LEX's own caches):
- Continuous batching (`ContinuousMixin`'s `init_continuous_batching`, `continuous_batching_context_manager` and
  `generate_batch`; `transformers serve --continuous-batching` calls the first) builds a `PagedAttentionCache` and
  paged attention, which know no sinks or memory: `LexGenerationMixin` overrides the three entry points to raise,
  naming `lex serve` and generate() with a padded batch instead.
- An attention implementation that ignores `position_bias` would compute other attention, silently
  (`refuse_attention_without_position_bias`): transformers' paged ones (names starting with "paged"), the
  engines' ("vllm", "sglang": their transformers backends set it on the config, then build the model) and kernels
  from the Hub ("org/name"). `LexAttentionGuard` overrides `PreTrainedModel._check_and_adjust_attn_implementation`,
  the one method that sees every requested name as it was asked for, at construction (`attn_implementation=`, a
  config's `_attn_implementation`) and in `set_attn_implementation`: the public `get_correct_attn_implementation`
  sees "paged|sdpa" as "sdpa" and never sees a Hub kernel, which 5.23 accepts for a model without flash attention.
  eager, sdpa and any function registered with `AttentionInterface.register` (it receives `position_bias`) pass;
  transformers itself refuses flash and flex attention (`_supports_flash_attn`, `_supports_flex_attn`). A name
  written onto the config's private `_attn_implementation` after the model is built passes unchecked, by
  transformers too; no engine takes that route.
- A forward handed a cache that is no transformers `Cache` (the `PagedAttentionCache`) raises a ValueError naming its
  class (`stream.begin_forward`, where a forward's inputs are checked), not an AttributeError inside a layer.
"""

import functools
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

from packaging.version import Version
from transformers import __version__ as TRANSFORMERS_VERSION
from transformers.cache_utils import Cache
from transformers.generation import MaxLengthCriteria, StoppingCriteriaList
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg

# The transformers versions this module was written against and CI tests: [oldest, first untested minor).
TESTED_TRANSFORMERS = ("5.23.0", "5.26.0")


def warn_if_untested(version: str) -> bool:
    """One warning naming the tested range when `version` lies outside it; whether it did."""
    oldest, untested = TESTED_TRANSFORMERS
    if Version(oldest) <= Version(version) < Version(untested):
        return False
    warnings.warn(
        f"lex-transformer is tested with transformers >={oldest},<{untested}; transformers {version} is installed, "
        "and LEX's generate() glue (modeling_lex/generation.py) may not match it",
        stacklevel=2,
    )
    return True


warn_if_untested(TRANSFORMERS_VERSION)

# The name under which the installed transformers passes the cache to a forward and reads it from its outputs.
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def accepts_both_cache_names(forward: Callable) -> Callable:
    """Let a forward whose argument is `cache` also take `past_key_values`: deprecated (with transformers' own
    warning) where transformers renamed it, silently where `past_key_values` is still the installed name."""
    if CACHE_NAME == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def renamed(*args, **kwargs):
        if "past_key_values" in kwargs:
            if kwargs.get("cache") is not None:
                raise ValueError("pass the cache once: as `cache` or as `past_key_values`, not both")
            kwargs["cache"] = kwargs.pop("past_key_values")
        return forward(*args, **kwargs)

    return renamed


def init_cache_layers(cache: Cache, layers: list) -> None:
    """Set up a LEX cache with its own layers (DynamicCache's and StaticCache's constructors would build
    transformers' layers from the config)."""
    Cache.__init__(cache, layers=layers)


# The attention implementations LEX refuses, because their functions ignore `position_bias`: transformers' paged ones
# ("paged|eager", "paged|sdpa", ...), the serving engines' (their transformers backends' functions) and kernels from
# the Hub ("org/name", flash attention). Any other name reaches a function that receives `position_bias`: eager, sdpa,
# or one registered with AttentionInterface.register.
PAGED_ATTENTION_PREFIX = "paged"
ENGINE_ATTENTION = ("vllm", "sglang")
ATTENTION_WITH_POSITION_BIAS = ("eager", "sdpa")


def refuse_attention_without_position_bias(name: str | None) -> None:
    """A ValueError for an attention implementation that ignores `position_bias`, through which LEX passes its
    window, sinks and block memory: the model would compute other attention, silently."""
    if not isinstance(name, str):  # None: transformers' default (sdpa)
        return
    if not (name.startswith(PAGED_ATTENTION_PREFIX) or name in ENGINE_ATTENTION or "/" in name):
        return
    raise ValueError(
        f"attn_implementation={name!r} is refused by LEX models: its attention function ignores `position_bias`, "
        "through which LEX passes its window, sinks and block memory, so the model would compute other attention "
        f"(refused: names starting with {PAGED_ATTENTION_PREFIX!r}, {', '.join(map(repr, ENGINE_ATTENTION))}, Hub "
        f"kernels 'org/name'). Allowed: {', '.join(map(repr, ATTENTION_WITH_POSITION_BIAS))}, or a function "
        "registered with transformers' AttentionInterface.register that adds `position_bias` to its scores. To "
        "serve concurrent requests use `lex serve MODEL`."
    )


def refuse_continuous_batching(entry: str) -> NoReturn:
    """transformers' continuous batching refused by name: its PagedAttentionCache and paged attention know no
    window re-encoding, sinks or block memory."""
    raise NotImplementedError(
        f"{entry}: transformers' continuous batching is not supported by LEX models (its PagedAttentionCache and "
        "paged attention know no sliding window re-encoding, sinks or block memory). For concurrent requests use "
        "`lex serve MODEL`, an OpenAI-compatible server that decodes concurrent requests together; in Python, "
        "generate() with a padded batch (the tokenizer's padding_side='left')."
    )


class LexAttentionGuard:
    """Refuses, when it is set, an attention implementation that ignores `position_bias` (see the module
    docstring); mixed in before PreTrainedModel."""

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, *args: Any, **kwargs: Any) -> str:
        refuse_attention_without_position_bias(attn_implementation)
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)


class LexGenerationMixin:
    """LEX's overrides of GenerationMixin (see the module docstring); mixed in before GenerationMixin by a model
    class that names its caches."""

    cache_class: type[Cache]  # generate()'s default cache
    static_cache_class: type[Cache]  # cache_implementation="static"

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ) -> None:
        """generate() gets a LexCache (bounded in blockwise/sliding modes), or with cache_implementation="static"
        a LexStaticCache of fixed shapes, unless the caller passed a cache. As transformers' own static caches, a
        static one is sized for the largest length asked so far (and `max_cache_len`), so that a later, shorter
        generate() keeps the compiled shapes."""
        if model_kwargs.get(CACHE_NAME) is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        implementation = generation_config.cache_implementation
        if implementation == "static":
            length = max(max_cache_length, generation_config.max_cache_len or 0,
                         getattr(self, "_previous_max_cache_length", 0))
            self._previous_max_cache_length = length  # transformers' own name for this, as in _prepare_static_cache
            cache = self.static_cache_class(self.config, max_cache_len=length)
        elif implementation in (None, "dynamic"):
            cache = self.cache_class(self.config)
        else:
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported by LEX models, whose caches re-encode "
                "positions inside each window; allowed: None, 'dynamic' (LexCache), 'static' (LexStaticCache)"
            )
        if generation_config.is_assistant:
            cache.activate_past_recording(recurrent_states_to_keep=generation_config.num_assistant_tokens)
        model_kwargs[CACHE_NAME] = cache

    def create_masks_for_generate(self, attention_mask=None, inputs_embeds=None, **kwargs):
        """Only the new tokens' columns of the 2D mask: the cache holds the padding flags of the past, so a compiled
        decoding step sees the same shapes at every step."""
        if attention_mask is None:
            return None
        return attention_mask[:, -inputs_embeds.shape[1] :]

    def _prepare_generated_length(self, generation_config, has_default_max_length, *args, **kwargs):
        """Without max_length/max_new_tokens, generate the default 20 new tokens after a prompt of any length
        (transformers would cap that at max_position_embeddings and refuse every prompt longer than l)."""
        if has_default_max_length and generation_config.max_new_tokens is None:
            generation_config.max_new_tokens = generation_config.max_length
        return super()._prepare_generated_length(generation_config, has_default_max_length, *args, **kwargs)

    def _get_stopping_criteria(self, *args, **kwargs) -> StoppingCriteriaList:
        """No warning past max_position_embeddings: for LEX that is the training length, not a limit."""
        criteria = super()._get_stopping_criteria(*args, **kwargs)
        for criterion in criteria:
            if isinstance(criterion, MaxLengthCriteria):
                criterion.max_position_embeddings = None
        return criteria

    def init_continuous_batching(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: see `refuse_continuous_batching`."""
        refuse_continuous_batching("init_continuous_batching")

    def continuous_batching_context_manager(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: see `refuse_continuous_batching`."""
        refuse_continuous_batching("continuous_batching_context_manager")

    def generate_batch(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: see `refuse_continuous_batching`."""
        refuse_continuous_batching("generate_batch")


__all__ = [
    "ATTENTION_WITH_POSITION_BIAS", "CACHE_NAME", "ENGINE_ATTENTION", "PAGED_ATTENTION_PREFIX",
    "TESTED_TRANSFORMERS", "LexAttentionGuard", "LexGenerationMixin", "accepts_both_cache_names", "init_cache_layers",
    "refuse_attention_without_position_bias", "refuse_continuous_batching", "warn_if_untested",
]
