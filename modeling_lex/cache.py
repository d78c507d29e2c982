"""The bounded KV caches: exactly what the next queries of the blockwise/sliding forward can see.

Keys are stored before any position encoding (as the reference fork does), with their position ids, so each
step re-encodes its <= w keys relative to the current window: decoding at token 10^6 uses the same numbers as
decoding at token 0. Two caches share that contract:

- `LexCache` (generate()'s default) grows and shrinks: between forwards each layer holds at most
  - blockwise: the previous full block and the current partial one (b to w - 1 keys, b = w/2), dropping a
    whole block when the current one fills; rows count blocks from their own document's first token, and the
    cache keeps the union of what the rows need, still at most w - 1;
  - sliding: the last w - 1;
  - full: everything (the ordinary unbounded cache).
  While generate() records the past (assisted and prompt-lookup decoding), it also keeps what the last forward
  read until `crop` says how many of its tokens were accepted: at most w - 1 plus the tokens of that forward.
- `LexStaticCache` (`generate(cache_implementation="static")`) has a fixed number of slots per layer, written in
  place, with positions, padding flags and stream indices as tensors: every decoding step has the same shapes
  and reads nothing on the host, so a compiled decoding step is compiled once (CUDA graphs too).

Prompts longer than w are fed through either cache w tokens at a time by `LexForCausalLM.forward`, so a prompt
of any length is read in O(w) memory.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer, StaticCache

from .attention import AttentionContext, StreamState, document_starts


class LexCacheLayer(DynamicLayer):
    """One layer's raw keys and values; `update` returns them with the new ones and keeps the last `keep`."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, keep: int | None = None, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.keep_last(keep, keys, values)
        return keys, values

    def keep_last(self, keep: int | None, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        keys = self.keys if keys is None else keys
        values = self.values if values is None else values
        drop = 0 if keep is None else max(keys.shape[-2] - keep, 0)
        self.keys, self.values = keys[..., drop:, :], values[..., drop:, :]

    def drop_latest(self, count: int) -> None:
        if count:
            self.keys, self.values = self.keys[..., :-count, :], self.values[..., :-count, :]


class LexCache(DynamicCache):
    """A transformers Cache for LEX models; `generate()` creates one by default.

    Besides each layer's keys and values it keeps, once for all layers, the position id, padding flag and
    stream index of every held key, and each row's document state, which the attention plan needs. It is a
    DynamicCache (what tools test for) with LEX's own layers.
    """

    def __init__(self, config) -> None:
        Cache.__init__(self, layers=[LexCacheLayer() for _ in range(config.num_hidden_layers)])
        self.config = config
        self.seen = 0  # tokens the stream has had
        self.positions: torch.Tensor | None = None  # (B, held)
        self.valid: torch.Tensor | None = None  # (B, held) bool
        self.index: torch.Tensor | None = None  # (held,) stream indices
        self.state: StreamState | None = None
        self.record_past = False
        self.plain = True  # every forward so far: one document from index 0, no padding (known from the caller)
        self._last: tuple | None = None  # (state before, seen before, positions, valid) of the last forward

    @property
    def held(self) -> int:
        return 0 if self.index is None else self.index.shape[0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.held + query_length, self.seen - self.held

    @property
    def is_croppable(self) -> bool:
        """Whether any rollback generate() may ask for leaves no trace: in full mode, or while recording."""
        return self.config.attention_mode == "full" or self.record_past

    def activate_past_recording(self) -> None:
        """Keep what each forward read until `crop` (generate() calls this for assisted decoding)."""
        self.record_past = True

    def _keep(self, total: int, available: int) -> int:
        """How many of the latest keys the queries after `total` tokens may still see."""
        mode, window = self.config.attention_mode, self.config.attention_window
        if mode == "full":
            return available
        if mode == "sliding" or torch.compiler.is_compiling():
            return min(available, window - 1)  # blockwise under compile: a superset, read without a host sync
        block = window // 2
        start = self.state.start
        block_start = start + torch.div(total - start, block, rounding_mode="floor") * block
        first_needed = int((block_start - block).min())
        return max(0, min(available, total - first_needed))

    def register_tokens(
        self, query_positions: torch.Tensor, new_valid: torch.Tensor, plain: bool
    ) -> tuple[AttentionContext, int | None]:
        """Register the new tokens of a forward; returns the attention context and how many keys layers keep.

        `plain`: the caller's tokens are one document continuing the stream without padding.
        """
        batch, length = query_positions.shape
        if self.state is None:
            self.state = StreamState.fresh(batch, query_positions.device)
        query_index = torch.arange(self.seen, self.seen + length, device=query_positions.device)
        # While recording, hold what this forward reads until crop() says how much of it stays.
        recorded = self._keep(self.seen, self.held) + length if self.record_past else None
        document_start, after = document_starts(query_positions, new_valid, query_index, self.state)
        self._last = (self.state, self.seen, query_positions, new_valid)
        self.plain = self.plain and plain
        key_positions, key_valid, key_index = query_positions, new_valid, query_index
        if self.held:
            key_positions = torch.cat([self.positions, query_positions], dim=1)
            key_valid = torch.cat([self.valid, new_valid], dim=1)
            key_index = torch.cat([self.index, query_index])
        ctx = AttentionContext(query_positions, key_positions, key_valid, query_index, key_index, document_start,
                               causal_only=self.plain and self.held == 0)
        self.seen += length
        self.state = after
        keep = recorded if self.record_past else self._keep(self.seen, key_index.shape[0])
        self._hold(key_positions, key_valid, key_index, keep)
        return ctx, keep

    def _hold(self, positions: torch.Tensor, valid: torch.Tensor, index: torch.Tensor, keep: int) -> None:
        drop = index.shape[0] - keep
        self.positions, self.valid, self.index = positions[:, drop:], valid[:, drop:], index[drop:]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (rejected candidates) and shrink to what the next forward needs.

        Tokens of the last forward can be removed while the past is recorded (generate() does that for assisted
        decoding), and any token while the cache still holds the whole stream (full mode); otherwise the keys
        the rolled-back stream would need are gone, and crop says so.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"LexCache.crop({tokens_to_remove}): pass minus the number of tokens to remove, as transformers does"
            )
        remove = -tokens_to_remove
        if remove:
            self._roll_back(remove)
        if self.index is not None:
            keep = self._keep(self.seen, self.held)
            for layer in self.layers:
                layer.keep_last(keep)
            self._hold(self.positions, self.valid, self.index, keep)

    def _roll_back(self, remove: int) -> None:
        target = self.seen - remove
        refused = (
            f"LexCache.crop: cannot remove {remove} of {self.seen} tokens in attention_mode="
            f"{self.config.attention_mode!r}: the keys the shorter stream needs were dropped. Only the tokens of "
            "the last forward can be rolled back, after activate_past_recording() (or any token in 'full' mode)"
        )
        if remove > self.held:
            raise ValueError(refused)
        if self._last is not None and target >= self._last[1]:
            before, seen, positions, valid = self._last
            index = torch.arange(seen, target, device=positions.device)
            _, state = document_starts(positions[:, : target - seen], valid[:, : target - seen], index, before)
        elif self.held == self.seen:  # the whole stream is held: recount its documents from the start
            fresh = StreamState.fresh(self.positions.shape[0], self.positions.device)
            _, state = document_starts(self.positions[:, :target], self.valid[:, :target], self.index[:target], fresh)
        else:
            raise ValueError(refused)
        current, self.state = self.state, state
        if self._keep(target, target) > self.held - remove:
            self.state = current
            raise ValueError(refused)
        for layer in self.layers:
            layer.drop_latest(remove)
        self.positions, self.valid, self.index = self.positions[:, :-remove], self.valid[:, :-remove], self.index[:-remove]
        self.seen, self._last = target, None

    def _apply_to_metadata(self, function) -> None:
        if self.positions is not None:
            self.positions, self.valid = function(self.positions), function(self.valid)
            self.state = self.state.map(function)
        if self._last is not None:
            state, seen, positions, valid = self._last
            self._last = (state.map(function), seen, function(positions), function(valid))

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
        self.seen = 0
        self.positions = self.valid = self.index = self.state = self._last = None
        self.plain = True


def _static(tensor: torch.Tensor) -> torch.Tensor:
    """Tell dynamo the buffer keeps its address, so compiled steps (and CUDA graphs) write into it in place."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
    return tensor


class LexStaticLayer(CacheLayerMixin):
    """The latest `slots` raw keys and values of one layer, oldest first, in buffers written in place."""

    is_compileable = True
    is_sliding = False

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.slots = slots

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = key_states.shape[:2] + (self.slots, key_states.shape[-1])
        self.keys = _static(torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.values = _static(torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.keys.copy_(keys[:, :, -self.slots :])
        self.values.copy_(values[:, :, -self.slots :])
        return keys, values

    def get_seq_length(self) -> int:
        return self.slots

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots + query_length, 0

    def get_max_length(self) -> int:
        return self.slots

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.keys.copy_(self.keys.index_select(0, beam_idx.to(self.device)))
            self.values.copy_(self.values.index_select(0, beam_idx.to(self.device)))


class LexStaticCache(StaticCache):
    """A LexCache of fixed shapes for compiled decoding: `generate(cache_implementation="static")` creates one.

    Each layer has `slots` = w - 1 slots in blockwise and sliding mode (what a query after them can see) and
    `max_cache_len` in full mode; every forward writes the latest keys in place. Positions, padding flags, stream
    indices and document state are tensors too, so a decoding step reads nothing on the host. Empty slots are
    marked as padding. It is a StaticCache (what tools test for) with LEX's own layers.
    """

    def __init__(self, config, max_cache_len: int | None = None) -> None:
        if config.attention_mode == "full":
            if max_cache_len is None:
                raise ValueError("LexStaticCache in attention_mode='full' needs max_cache_len (the longest stream)")
            slots = max_cache_len
        else:
            slots = config.attention_window - 1
        Cache.__init__(self, layers=[LexStaticLayer(slots) for _ in range(config.num_hidden_layers)])
        self.config = config
        self.slots = slots
        self.seen = torch.zeros((), dtype=torch.long)  # tokens the stream has had (a tensor: read without a sync)
        self.positions: torch.Tensor | None = None  # (B, slots)
        self.valid: torch.Tensor | None = None  # (B, slots) bool; empty slots are not valid
        self.index: torch.Tensor | None = None  # (slots,) stream indices
        self.state: StreamState | None = None

    def _initialize(self, batch: int, device: torch.device) -> None:
        self.seen = _static(self.seen.to(device))
        self.positions = _static(torch.zeros(batch, self.slots, dtype=torch.long, device=device))
        self.valid = _static(torch.zeros(batch, self.slots, dtype=torch.bool, device=device))
        self.index = _static(torch.arange(-self.slots, 0, device=device))
        fresh = StreamState.fresh(batch, device)
        self.state = StreamState(*(_static(t) for t in (fresh.start, fresh.last_position, fresh.started)))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.seen)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.slots + query_length, 0

    def register_tokens(
        self, query_positions: torch.Tensor, new_valid: torch.Tensor, plain: bool
    ) -> tuple[AttentionContext, None]:
        """Register the new tokens of a forward in place; returns the attention context."""
        batch, length = query_positions.shape
        if self.positions is None:
            self._initialize(batch, query_positions.device)
        query_index = self.seen + torch.arange(length, device=query_positions.device)
        document_start, after = document_starts(query_positions, new_valid, query_index, self.state)
        key_positions = torch.cat([self.positions, query_positions], dim=1)
        key_valid = torch.cat([self.valid, new_valid], dim=1)
        key_index = torch.cat([self.index, query_index])
        ctx = AttentionContext(query_positions, key_positions, key_valid, query_index, key_index, document_start)
        self.positions.copy_(key_positions[:, -self.slots :])
        self.valid.copy_(key_valid[:, -self.slots :])
        self.index.copy_(key_index[-self.slots :])
        for mine, new in zip((self.state.start, self.state.last_position, self.state.started),
                             (after.start, after.last_position, after.started)):
            mine.copy_(new)
        self.seen.add_(length)
        return ctx, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.positions is not None:
            for tensor in (self.positions, self.valid, self.state.start, self.state.last_position, self.state.started):
                tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))

    def reset(self) -> None:
        super().reset()
        self.seen = torch.zeros((), dtype=torch.long)
        self.positions = self.valid = self.index = self.state = None
