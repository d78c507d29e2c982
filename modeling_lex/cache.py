"""The bounded KV cache: exactly what the next queries of the blockwise/sliding forward can see.

Keys are stored before any position encoding (as the reference fork does), with their position ids, so each
step re-encodes its <= w keys relative to the current window: decoding at token 10^6 uses the same numbers as
decoding at token 0. Between forwards each layer holds at most
- blockwise: the previous full block and the current partial one (b to w - 1 keys, b = w/2), dropping a whole
  block when the current one fills; left-padded rows count blocks from their own first token, and the cache
  keeps the union of what the rows need, still at most w - 1 (every row's current block starts within the
  last b positions);
- sliding: the last w - 1;
- full: everything (the ordinary unbounded cache).
A decoding step's queries therefore see at most w keys. Prompts longer than w are fed through the cache w
tokens at a time by `LexForCausalLM.forward`, so a prompt of any length is read in O(w) memory.
"""

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .attention import AttentionContext


class LexCacheLayer(DynamicLayer):
    """One layer's raw keys and values; `update` returns them with the new ones and keeps the last `keep`."""

    is_croppable = False  # dropped blocks are gone: generate() must not plan on rolling the cache back

    def __init__(self) -> None:
        super().__init__()
        self.cumulative_length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, keep: int | None = None, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        drop = 0 if keep is None else max(keys.shape[-2] - keep, 0)
        self.keys, self.values = keys[..., drop:, :], values[..., drop:, :]
        return keys, values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = 0 if self.keys is None else self.keys.shape[-2]
        return held + query_length, self.cumulative_length - held

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "LexCache cannot be cropped: the blocks it dropped cannot be restored, so assisted (speculative) "
            "decoding, which rolls the cache back, is not supported"
        )


class LexCache(Cache):
    """A transformers Cache for LEX models; `generate()` creates one by default.

    Besides each layer's keys and values it keeps, once for all layers, the position id and padding flag of
    every held key and each row's origin (its first real token), which the attention plan needs.
    """

    def __init__(self, config) -> None:
        super().__init__(layers=[LexCacheLayer() for _ in range(config.num_hidden_layers)])
        self.mode = config.attention_mode
        self.window = config.attention_window
        self.positions: torch.Tensor | None = None  # (B, held)
        self.valid: torch.Tensor | None = None  # (B, held) bool
        self.origin: torch.Tensor | None = None  # (B,)
        self.started: torch.Tensor | None = None  # (B,) bool: the row has seen a real token

    @property
    def seen(self) -> int:
        return self.layers[0].cumulative_length

    @property
    def held(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def _keep(self, total: int, available: int) -> int:
        """How many of the latest positions the queries after `total` tokens may still see."""
        if self.mode == "full":
            return available
        if self.mode == "sliding":
            return min(available, self.window - 1)
        block = self.window // 2
        block_start = self.origin + torch.div(total - self.origin, block, rounding_mode="floor") * block
        first_needed = int((block_start - block).min())
        return max(0, min(available, total - first_needed))

    def extend(self, query_positions: torch.Tensor, new_valid: torch.Tensor) -> tuple[AttentionContext, int]:
        """Register the new tokens of a forward; returns the attention context and how many keys layers keep."""
        # A row's origin is its first real token; rows that have only seen padding so far get theirs later.
        has_real = new_valid.any(dim=1)
        first_real = torch.where(has_real, new_valid.int().argmax(dim=1), new_valid.shape[1]) + self.seen
        self.origin = first_real if self.origin is None else torch.where(self.started, self.origin, first_real)
        self.started = has_real if self.started is None else self.started | has_real
        cached = self.held
        key_positions = query_positions if cached == 0 else torch.cat([self.positions, query_positions], dim=1)
        key_valid = new_valid if cached == 0 else torch.cat([self.valid, new_valid], dim=1)
        ctx = AttentionContext(query_positions, key_positions, key_valid, self.origin, self.seen, cached)
        keep = self._keep(self.seen + query_positions.shape[1], key_positions.shape[1])
        self.positions = key_positions[:, key_positions.shape[1] - keep :]
        self.valid = key_valid[:, key_valid.shape[1] - keep :]
        return ctx, keep

    def _apply_to_metadata(self, function) -> None:
        if self.positions is not None:
            self.positions, self.valid, self.origin, self.started = (
                function(t) for t in (self.positions, self.valid, self.origin, self.started)
            )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._apply_to_metadata(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._apply_to_metadata(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._apply_to_metadata(lambda t: t[indices])

    def reset(self) -> None:
        super().reset()
        for layer in self.layers:
            layer.cumulative_length = 0
        self.positions = self.valid = self.origin = self.started = None
