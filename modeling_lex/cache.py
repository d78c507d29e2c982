"""The bounded KV caches: exactly what the next queries of the blockwise/sliding forward can see.

Keys are stored before any position encoding that depends on the window (as the reference fork does), with
their position ids, so each step re-encodes its keys relative to the current window: decoding at token 10^6 uses
the same numbers as decoding at token 0. (RoPE, a pure rotation, is the exception: its keys are stored rotated at
their own positions, angles taken in float64, since its scores depend on m - n alone.) A layer holds its S sink
slots (the first `attention_sinks` tokens of each row's document, kept once the window has moved past them)
followed by its window part; between forwards that is at most
  - blockwise: S + the previous full block and the current partial one (b to w - 1 keys, b = w/2), dropping a
    whole block when the current one fills; rows count blocks from their own document's first token, and the
    cache keeps the union of what the rows need, still at most w - 1;
  - sliding: S + the last w - 1;
  - full: everything (the ordinary unbounded cache; no sink slots).
The bookkeeping (documents, positions, what to keep, rollback) is `stream.Stream`'s: each forward's `StreamStep`
says what the layers keep, and every layer's `update(key, value, layer_idx, step)` is handed it, as Llama's
layers are handed their `layer_idx`. A cache only stores keys and values as the step says. Two caches share that
contract:

- `LexCache` (generate()'s default) grows and shrinks. While recording the past (assisted and prompt-lookup
  decoding) it also holds the tokens a later `crop` may remove: those read since the last crop whose logits the
  forward computed, which are the candidates generate() verifies (at most w - 1 + S plus those candidates).
- `LexStaticCache` (`generate(cache_implementation="static")`) has a fixed number of slots per layer, written in
  place, with positions, padding flags and stream indices as tensors: every decoding step has the same shapes and
  reads nothing on the host, so a compiled decoding step is compiled once (CUDA graphs too).

Prompts longer than w are fed through either cache w tokens at a time by `LexForCausalLM.forward`, so a prompt of
any length is read in O(w) memory.
"""

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer, StaticCache

from .generation import init_cache_layers
from .stream import Stream, StreamStep, _mark_static
from .visibility import sink_count


def _gather_columns(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """x (B, H, K, d) at per-row key columns (B, S) -> (B, H, S, d)."""
    index = columns[:, None, :, None].expand(x.shape[0], x.shape[1], columns.shape[1], x.shape[3])
    return x.gather(2, index)


def _with_room(like: torch.Tensor, length: int) -> torch.Tensor:
    """An empty buffer for `length` keys and room for more (a quarter, at least 256)."""
    return like.new_empty(*like.shape[:2], length + max(256, length // 4), like.shape[3])


def _move(source: torch.Tensor, begin: int, end: int, target: torch.Tensor, at: int) -> None:
    """target[at : at + end - begin] = source[begin:end] along the keys, through a copy where the two ranges of one
    buffer overlap."""
    held = source[:, :, begin:end]
    if target is source and abs(at - begin) < end - begin:
        held = held.clone()
    target[:, :, at : at + end - begin] = held


class LexCacheLayer(DynamicLayer):
    """One layer's raw keys and values: the sink slots (none before the first dropped key), then the window part.

    They live in buffers with room to grow, `keys` and `values` being views of what is held, so a forward writes its
    new keys in place where DynamicLayer's torch.cat copies every held key at every step (a tenth of a decoding
    step of SmolLM2-135M at 2k tokens of context). `update` returns the held keys with the new ones; what the
    forward's step says to keep (the sink slots' new contents, the last `keep` window keys) is applied at the next
    access, once attention has read them. The sink slots are kept apart (`_sinks`) and copied in front of the
    window part for each forward: attention may write over that copy (it turns the sink keys into their frame
    there, kernels.py), so the keys and values a forward reads are one contiguous span. Under autograd the buffers
    are never written in place."""

    def __init__(self) -> None:
        self._spans: list[tuple[torch.Tensor, int, int] | None] = [None, None]  # keys, values: (buffer, begin, end)
        self._sinks: list[torch.Tensor | None] = [None, None]  # keys, values of the sink slots (B, H, S, d)
        self._pending: tuple[int, int | None] | None = None  # sink slots the forward read, window keys to keep
        super().__init__()

    @property
    def keys(self) -> torch.Tensor | None:
        return self._held(0)

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._set(0, tensor)

    @property
    def values(self) -> torch.Tensor | None:
        return self._held(1)

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._set(1, tensor)

    def _held(self, which: int) -> torch.Tensor | None:
        self._settle()
        span = self._spans[which]
        return None if span is None else span[0][:, :, span[1] : span[2]]

    def _set(self, which: int, tensor: torch.Tensor | None) -> None:
        """A tensor set from outside (beam reordering, batch selection, offloading) becomes the buffer, its first
        columns the sink slots."""
        self._settle()
        self._spans[which] = None if tensor is None else (tensor, 0, tensor.shape[2])
        sinks = self._sinks[which]
        self._sinks[which] = None if tensor is None or sinks is None else tensor[:, :, : sinks.shape[2]].clone()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def get_seq_length(self) -> int:
        span = self._spans[0]
        return 0 if span is None else span[2] - span[1]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, step: StreamStep, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._settle()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self._append(0, key_states), self._append(1, value_states)
        if step.sink_source is not None:  # the slots' next contents, taken before attention reads (and rotates)
            self._sinks = [_gather_columns(x, step.sink_source) for x in held]
        self._pending = (step.context.sink_index.shape[1], step.keep)
        return held

    def _append(self, which: int, new: torch.Tensor) -> torch.Tensor:
        """The held part followed by `new`: written after it in place when the buffer has room after it, else
        with the held part moved to the front of the buffer (a window's buffer, once it has room for the window,
        is never replaced) or of a new one with room to grow; concatenated under autograd."""
        span = self._spans[which]
        if span is None:
            span = (new[:, :, :0], 0, 0)
        buffer, begin, end = span
        length = end - begin + new.shape[2]
        if new.requires_grad or buffer.requires_grad:
            buffer, begin, end = torch.cat([buffer[:, :, begin:end], new], dim=2), 0, length
        else:
            if end + new.shape[2] > buffer.shape[2]:  # no room after the held part: it moves to the front
                room = buffer if length <= buffer.shape[2] else _with_room(new, length)  # (of a larger buffer)
                _move(buffer, begin, end, room, 0)
                buffer, begin, end = room, 0, end - begin
            buffer[:, :, end : end + new.shape[2]] = new
            end += new.shape[2]
        self._spans[which] = (buffer, begin, end)
        return buffer[:, :, begin:end]

    def _settle(self) -> None:
        """Apply what the last update's step said to keep: the sink slots (their copy written again, over whatever
        attention made of it) right before the last `keep` window keys."""
        if self._pending is None:
            return
        sink_slots, keep = self._pending
        self._pending = None
        for which, (buffer, begin, end) in enumerate(self._spans):
            first = begin + sink_slots if keep is None else end - keep  # the first window key kept
            sinks = self._sinks[which]
            count = 0 if sinks is None else sinks.shape[2]
            if buffer.requires_grad:
                window = buffer[:, :, first:end]
                buffer = window if sinks is None else torch.cat([sinks, window], dim=2)
                first, end = count, buffer.shape[2]
            elif first < count:  # no room before the window (its first dropped key): the window part moves up
                length = count + end - first
                room = buffer if length <= buffer.shape[2] else _with_room(buffer, length)
                _move(buffer, first, end, room, count)
                buffer, first, end = room, count, length
            if count and not buffer.requires_grad:
                buffer[:, :, first - count : first] = sinks
            begin = first - count
            self._spans[which] = (buffer, begin, end)

    def keep_window(self, sink_slots: int, keep: int) -> None:
        self._settle()
        self._pending = (sink_slots, keep)
        self._settle()

    def drop_latest(self, count: int) -> None:
        self._settle()
        if count and self.is_initialized:
            self._spans = [(buffer, begin, end - count) for buffer, begin, end in self._spans]


class LexCache(DynamicCache):
    """A transformers Cache for LEX models; `generate()` creates one by default.

    Besides each layer's keys and values it keeps, once for all layers, a `Stream`: the position id, padding flag
    and stream index of every held key and each row's document state, which the attention plan needs. It is a
    DynamicCache (what tools test for) with LEX's own layers.
    """

    def __init__(self, config) -> None:
        init_cache_layers(self, [LexCacheLayer() for _ in range(config.num_hidden_layers)])
        self.config = config
        self.stream = Stream(config)

    @property
    def seen(self) -> int:
        """Tokens the stream has had."""
        return self.stream.seen

    @property
    def held(self) -> int:
        """Window keys held (the sink slots come on top)."""
        return self.stream.held

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.stream.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.stream.sink_slots + self.held + query_length, self.seen - self.held

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, step: StreamStep,
               *args, **kwargs):
        """The keys and values attention sees (sink slots first); the layer keeps what `step` says."""
        return self.layers[layer_idx].update(key_states, value_states, step)

    @property
    def is_croppable(self) -> bool:
        """Whether any rollback generate() may ask for leaves no trace: in full mode, or while recording."""
        return self.config.attention_mode == "full" or self.stream.record_past

    def activate_past_recording(self) -> None:
        """Hold what later forwards read until `crop` (generate() calls this for assisted decoding)."""
        self.stream.record_past = True
        self.stream.floor = self.stream.seen

    def mark_removable(self, first: int) -> None:
        """See `Stream.mark_removable`: tokens before stream index `first` will never be rolled back."""
        self.stream.mark_removable(first)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (rejected candidates) and shrink to what the next forward needs.

        While the past is recorded, the tokens read since the last crop whose logits were computed can be removed
        (generate() does this for assisted decoding), and any token in full mode, where the cache holds the whole
        stream; otherwise the keys the rolled-back stream would need are gone, and crop says so.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"LexCache.crop({tokens_to_remove}): pass minus the number of tokens to remove, as transformers does"
            )
        remove = -tokens_to_remove
        if remove:
            self.stream.roll_back(remove)
            for layer in self.layers:
                layer.drop_latest(remove)
        self.stream.floor, self.stream.removable_from = self.stream.seen, None
        keep = self.stream.shrink()
        for layer in self.layers:
            if layer.is_initialized:
                layer.keep_window(self.stream.sink_slots, keep)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.stream.apply_to_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.stream.apply_to_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.stream.apply_to_rows(lambda t: t[indices])

    def reset(self) -> None:
        super().reset()
        record = self.stream.record_past
        self.stream = Stream(self.config)
        self.stream.record_past = record


class LexStaticLayer(CacheLayerMixin):
    """S sink slots and the latest window keys and values of one layer, oldest first, in buffers written in place."""

    is_compileable = True
    is_sliding = False

    def __init__(self, window_slots: int, sink_slots: int) -> None:
        super().__init__()
        self.window_slots, self.sink_slots = window_slots, sink_slots

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = key_states.shape[:2] + (self.sink_slots + self.window_slots, key_states.shape[-1])
        self.keys = _mark_static(torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.values = _mark_static(torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, step: StreamStep, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        for buffer, x in ((self.keys, keys), (self.values, values)):
            if step.sink_source is not None:
                buffer[:, :, : self.sink_slots].copy_(_gather_columns(x, step.sink_source))
            buffer[:, :, self.sink_slots :].copy_(x[:, :, x.shape[2] - self.window_slots :])
        return keys, values

    def get_seq_length(self) -> int:
        return self.sink_slots + self.window_slots

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.sink_slots + self.window_slots + query_length, 0

    def get_max_length(self) -> int:
        return self.sink_slots + self.window_slots

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.keys.copy_(self.keys.index_select(0, beam_idx.to(self.device)))
            self.values.copy_(self.values.index_select(0, beam_idx.to(self.device)))


class LexStaticCache(StaticCache):
    """A LexCache of fixed shapes for compiled decoding: `generate(cache_implementation="static")` creates one.

    Each layer has S sink slots and w - 1 window slots in blockwise and sliding mode (what a query after them can
    see), or `max_cache_len` slots when that is fewer (as transformers' sliding static layers do: a stream that
    short never drops a key), and `max_cache_len` in full mode; every forward writes in place. Its `Stream`
    keeps positions, padding flags, stream indices and document state as tensors, so a decoding step reads
    nothing on the host. Empty slots are marked as padding. It is a StaticCache (what tools test for) with LEX's
    own layers.
    """

    def __init__(self, config, max_cache_len: int | None = None) -> None:
        sink_slots = sink_count(config)
        if config.attention_mode == "full":
            if max_cache_len is None:
                raise ValueError("LexStaticCache in attention_mode='full' needs max_cache_len (the longest stream)")
            window_slots = max_cache_len
        else:
            window_slots = config.attention_window - 1
            if max_cache_len is not None and max_cache_len <= sink_slots + window_slots:
                window_slots, sink_slots = max_cache_len, 0
        init_cache_layers(self, [LexStaticLayer(window_slots, sink_slots) for _ in range(config.num_hidden_layers)])
        self.config = config
        self.window_slots, self.sink_slots = window_slots, sink_slots
        self.stream = Stream(config, window_slots=window_slots, sinks=sink_slots, static=True)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.stream.seen)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.sink_slots + self.window_slots + query_length, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, step: StreamStep,
               *args, **kwargs):
        """The keys and values attention sees (sink slots first), written in place as `step` says."""
        return self.layers[layer_idx].update(key_states, value_states, step)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.stream.apply_to_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def reset(self) -> None:
        super().reset()
        self.stream = Stream(self.config, window_slots=self.window_slots, sinks=self.sink_slots, static=True)


LEX_CACHES = (LexCache, LexStaticCache)


__all__ = ["LEX_CACHES", "LexCache", "LexStaticCache"]
