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
The bookkeeping (documents, positions, what to keep, rollback) is `stream.Stream`'s: each forward's record
(stream.py) says what the layers keep, by the reading policy's rules. A cache's state changes in one place: a
forward runs its layers inside `with cache.step(record):`, where each layer's `update(key, value, layer_idx,
plan)` returns what attention reads (its span) and changes nothing held, and when the block ends every layer
keeps what the record says (the keys it evicts go to its block memory, memory.py, with the choice the layer's
attention recalled from it) and the stream moves on; if the forward raises, every layer and memory drops what it
read. So a forward that raises leaves the cache as it was, and reading `keys`/`values` changes nothing. No query
enters the cache: attention asks a layer's memory (`cache.layers[i].memory.recall`). Both caches share that
contract (`LexCacheSteps`):

- `LexCache` (generate()'s default) grows and shrinks. While recording the past (assisted and prompt-lookup
  decoding) it also holds the tokens a later `crop` may remove: those read since the last crop whose logits the
  forward computed, which are the candidates generate() verifies (at most w - 1 + S plus those candidates).
- `LexStaticCache` (`generate(cache_implementation="static")`) has a fixed number of slots per layer, written in
  place, with positions, padding flags and stream indices as tensors: every decoding step has the same shapes and
  reads nothing on the host, so a compiled decoding step is compiled once (CUDA graphs too).

Prompts longer than w are fed through either cache w tokens at a time by `LexModel.forward`, so a prompt of
any length is read in O(w) memory.
"""

import contextlib
from collections.abc import Callable, Iterator

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer, StaticCache

from .generation import init_cache_layers
from .memory import BlockMemory, Evicted, OpenStep
from .reading import AttentionPlan, ReadingPolicy
from .stream import ForwardRecord, Stream, mark_static


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
    moved = source[:, :, begin:end]
    if target is source and abs(at - begin) < end - begin:
        moved = moved.clone()
    target[:, :, at : at + end - begin] = moved


class LexCacheLayer(DynamicLayer):
    """One layer's raw keys and values: the sink slots (none before the first dropped key), then the window part,
    in a buffer with room to grow around them; `keys` and `values` are views of what is held.

    A forward's `update` writes the new keys after the window part, in place where DynamicLayer's torch.cat copies
    every held key at every step, and returns the sink slots, the window part and the new keys as one contiguous
    span for attention to read (with room after it that a decoding step with the block memory may write: the
    plan's `memory_room`). That changes nothing held: `commit` does, with the record's sink slots and last
    `keep` window keys. A decoding step that sees its sinks in the cache's frame (RoPE) turns them in the buffer's
    copy of the sink slots, which the plan has it lend (`sinks_lent`; attention writes nothing else the cache
    returned); the slots' raw contents are kept apart (`_sinks`) and written back when the forward's step ends
    (commit or discard), and until then `keys` reads them from there. Under autograd the buffers are never written
    in place.

    With a block memory (memory.py), the keys and values `commit` drops go there when the step ends, with the
    choice the layer read in the forward (`OpenStep.close`, once for every layer)."""

    def __init__(self, memory: BlockMemory | None = None) -> None:
        self._window: list[tuple[torch.Tensor, int, int] | None] = [None, None]  # keys, values: (buffer, begin, end)
        self._sinks: list[torch.Tensor | None] = [None, None]  # raw keys, values of the sink slots (B, H, S, d)
        self._joined: list[torch.Tensor | None] = [None, None]  # under autograd: the window part and the new keys
        self.memory = memory
        self._plan: AttentionPlan | None = None  # the forward's, between update and commit
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

    def _slots(self, which: int) -> int:
        sinks = self._sinks[which]
        return 0 if sinks is None else sinks.shape[2]

    @property
    def forward_open(self) -> bool:
        """Whether a forward's step is open (between `update` and its commit or discard)."""
        return self._plan is not None

    def _front_lent(self, which: int) -> bool:
        """Whether the buffer's copy of the sink slots is lent to attention, which turns it: the sink keys, in a
        forward that reads them in the cache's frame (between `update` and the step's end)."""
        return which == 0 and self._plan is not None and self._plan.sinks_lent

    def _held(self, which: int) -> torch.Tensor | None:
        """The sink slots followed by the window part, raw (a view of the buffer, a new tensor while rotated)."""
        span = self._window[which]
        if span is None:
            return None
        buffer, begin, end = span
        if self._front_lent(which):
            return torch.cat([self._sinks[0], buffer[:, :, begin:end]], dim=2)
        return buffer[:, :, begin - self._slots(which) : end]

    def _set(self, which: int, tensor: torch.Tensor | None) -> None:
        """A tensor set from outside (beam reordering, batch selection, offloading) becomes the buffer, its first
        columns the sink slots."""
        count = 0 if tensor is None else self._slots(which)
        self._sinks[which] = tensor[:, :, :count].clone() if count else None
        self._window[which] = None if tensor is None else (tensor, count, tensor.shape[2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def get_seq_length(self) -> int:
        span = self._window[0]
        return 0 if span is None else span[2] - span[1] + self._slots(0)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, plan: AttentionPlan | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sink slots, the window part and the new keys (and values), as attention reads them; `plan`: the
        forward's (what the cache lends it; None: nothing)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._plan = plan
        room = 0 if plan is None else plan.memory_room
        return self._span(0, key_states, room), self._span(1, value_states, room)

    def _span(self, which: int, new: torch.Tensor, lent: int) -> torch.Tensor:
        """The sink slots, the window part and `new` as one span, and after it `lent` columns attention may write
        (the memory's blocks: `AttentionPlan.memory_room`): `new` written after the window part (where there is no
        room, the sink slots and the window part move, to the front of the buffer or of a new one with room to grow;
        what they hold stays the same); concatenated, with nothing lent, under autograd."""
        sinks, count = self._sinks[which], self._slots(which)
        buffer, begin, end = self._window[which] or (new[:, :, :0], 0, 0)
        if new.requires_grad or buffer.requires_grad:
            self._joined[which] = torch.cat([buffer[:, :, begin:end], new], dim=2)
            return self._joined[which] if sinks is None else torch.cat([sinks, self._joined[which]], dim=2)
        self._joined[which] = None
        stop = end + new.shape[2]
        rewrite = False
        if stop + lent > buffer.shape[2]:  # no room after the window part
            length = count + stop - begin
            room = buffer if length + lent <= buffer.shape[2] else _with_room(new, length + lent)
            _move(buffer, begin, end, room, count)
            buffer, begin, end, stop, rewrite = room, count, count + end - begin, length, True
            self._window[which] = (buffer, begin, end)
        buffer[:, :, end:stop] = new
        if count and rewrite:
            buffer[:, :, begin - count : begin] = sinks
        return buffer[:, :, begin - count : stop + lent]

    def commit(self, record: ForwardRecord) -> Evicted | None:
        """Hold what the record says: the sink slots' new contents (taken from the raw keys the forward read, sink
        slots first), then the last `keep` keys of the window part with the forward's new keys. With a block
        memory, returns the keys and values the window part drops, for the memory (`OpenStep.close`)."""
        if not self.is_initialized:
            return None
        plan = self._plan
        evicted = []
        for which in (0, 1):
            joined, self._joined[which] = self._joined[which], None
            sinks = self._sinks[which]
            if joined is not None:  # autograd: the concatenated span
                buffer, begin, end = joined, 0, joined.shape[2]
            else:
                buffer, begin, end = self._window[which]
                end += record.new_tokens
            if self.memory is not None:  # the keys that leave the window part (copied: `_hold` may write over them)
                evicted.append(buffer[:, :, begin : begin + record.dropped].clone())
            if record.sink_source is not None:  # (not while decoding once the window has moved past the sinks)
                read = buffer[:, :, begin:end] if sinks is None else torch.cat([sinks, buffer[:, :, begin:end]], dim=2)
                sinks = _gather_columns(read, record.sink_source)
            first = begin if record.keep is None else end - record.keep
            rewrite = record.sink_source is not None or first != begin or self._front_lent(which)
            self._hold(which, buffer, first, end, sinks, rewrite)
        self._plan = None
        if self.memory is None:
            return None
        return Evicted(*evicted, None if plan is None else plan.memory_unrotate)

    def _hold(self, which: int, buffer: torch.Tensor, first: int, end: int, sinks: torch.Tensor | None,
              rewrite: bool) -> None:
        """Hold buffer[first:end] as the window part with `sinks` as the sink slots, written right before it (the
        window part moves up where there is no room before it: the first dropped key; concatenated under
        autograd)."""
        count = 0 if sinks is None else sinks.shape[2]
        if buffer.requires_grad:
            window = buffer[:, :, first:end]
            buffer = window if sinks is None else torch.cat([sinks, window], dim=2)
            first, end, rewrite = count, buffer.shape[2], False
        elif first < count:
            length = count + end - first
            room = buffer if length <= buffer.shape[2] else _with_room(buffer, length)
            _move(buffer, first, end, room, count)
            buffer, first, end, rewrite = room, count, length, True
        if count and rewrite:
            buffer[:, :, first - count : first] = sinks
        self._sinks[which] = sinks
        self._window[which] = (buffer, first, end)

    def discard(self) -> None:
        """The forward raised: drop what it read, and write the raw sink keys back over the buffer's copy where it
        was lent."""
        if self._front_lent(0) and self._joined[0] is None:
            buffer, begin, _ = self._window[0]
            buffer[:, :, begin - self._slots(0) : begin] = self._sinks[0]
        self._joined, self._plan = [None, None], None

    def keep_window(self, keep: int, sink_source: torch.Tensor | None = None) -> None:
        """Hold only the last `keep` keys of the window part (a crop), the sink slots taken from `sink_source`
        (columns among the sink slots and the window part; None: as they are)."""
        for which, span in enumerate(self._window):
            if span is not None:
                buffer, begin, end = span
                sinks = self._sinks[which]
                if sink_source is not None:
                    read = buffer[:, :, begin:end] if sinks is None else torch.cat([sinks, buffer[:, :, begin:end]], 2)
                    sinks = _gather_columns(read, sink_source)
                self._hold(which, buffer, end - keep, end, sinks,
                           rewrite=end - keep != begin or sink_source is not None)

    def drop_latest(self, count: int) -> None:
        if count and self.is_initialized:
            self._window = [(buffer, begin, end - count) for buffer, begin, end in self._window]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.memory is not None:
            self.memory.apply_to_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.memory is not None:
            self.memory.apply_to_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.memory is not None:
            self.memory.apply_to_rows(lambda t: t[indices])


class LexCacheSteps:
    """One forward's step, the same for both LEX caches: `step(record)` opens it, each layer's `update` returns what
    attention reads, and the step's end commits (or, if the forward raised, discards) in every layer and in the
    stream."""

    layers: list
    stream: Stream

    @contextlib.contextmanager
    def step(self, record: ForwardRecord) -> Iterator[None]:
        """Run one forward's layers inside: when the block ends every layer holds what `record` says and the stream
        moves to the record's metadata after the forward; if it raises, every layer drops what it read and the
        cache is as it was."""
        self._open(record)
        try:
            yield
        except BaseException:
            for layer in self.layers:
                layer.discard()
            self._close()
            raise
        evicted = [layer.commit(record) for layer in self.layers]
        self.stream.commit(record)
        self._close(record, evicted)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               plan: AttentionPlan | None = None, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """What layer `layer_idx` of the forward open now attends to, for the forward's `plan`: the keys and values
        of its span (sink slots first, the new ones last). What the layer holds changes when the step ends."""
        return self.layers[layer_idx].update(key_states, value_states, plan)

    def _open(self, record: ForwardRecord) -> None:
        """What the cache keeps for the length of one forward (nothing, but for the block memory's evidence)."""

    def _close(self, record: ForwardRecord | None = None, evicted: list[Evicted | None] | None = None) -> None:
        """The forward's step ended: committed (`record`, with what each layer `evicted` for its block memory) or
        discarded (None)."""


class LexCache(LexCacheSteps, DynamicCache):
    """A transformers Cache for LEX models; `generate()` creates one by default.

    Besides each layer's keys and values it keeps, once for all layers, a `Stream`: the position id, padding flag
    and stream index of every held key and each row's document state, which the attention plan needs. It is a
    DynamicCache (what tools test for) with LEX's own layers.
    """

    def __init__(self, config, memory_directory: str | None = None) -> None:
        """`memory_directory`: with a block memory (`attention_memory_blocks`), keep its keys and values in
        memory-mapped files there instead of RAM (the blocks' representatives stay in RAM: memory.py)."""
        self.config, self.memory_directory = config, memory_directory
        self.policy = ReadingPolicy.of(config)
        self._open_step = OpenStep()  # the forward open now, which every layer's memory reads
        init_cache_layers(self, [LexCacheLayer(self._memory(index)) for index in range(config.num_hidden_layers)])
        self.stream = Stream(self.policy)
        # (B, blocks then): what the last forward that chose blocks found, one layer's worth; None before one
        self.memory_evidence: torch.Tensor | None = None
        self.drafted_tokens = 0  # activate_past_recording's recurrent_states_to_keep

    def _memory(self, layer_idx: int) -> BlockMemory | None:
        """Layer `layer_idx`'s block memory, or None: without one, and in local layers (`local_layers`), which keep
        their own window."""
        local = self.config.local_layers is not None and self.config.local_layers[layer_idx]
        if not self.policy.memory_tokens or local:
            return None
        return BlockMemory(self.policy, self.config.attention_scaling, self._open_step, self.memory_directory)

    @property
    def memory_bytes(self) -> int:
        """Bytes the block memory holds, over all layers (0 without one)."""
        return sum(layer.memory.nbytes() for layer in self.layers if layer.memory is not None)

    def reserve_memory(self, tokens: int) -> None:
        """The stream will have seen `tokens` tokens: the block memory's stores make room for them at once (no
        effect without a block memory)."""
        for layer in self.layers:
            if layer.memory is not None:
                layer.memory.reserve(tokens)

    def _refuse_with_memory(self, what: str) -> None:
        if self.policy.memory_tokens:
            raise ValueError(
                f"LexCache.{what} with attention_memory_blocks={self.policy.memory_blocks}: the block memory "
                "keeps evicted keys for good and reads per forward, so a rollback (assisted or prompt-lookup "
                "decoding) cannot be exact; decode without a draft, or set attention_memory_blocks=0"
            )

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

    def _open(self, record: ForwardRecord) -> None:
        """A forward that reads the block memory starts its evidence from what the last one that chose found; its
        layers' memories read it (`OpenStep`) until the step ends."""
        self._open_step.open(record.context.memory, self.memory_evidence)

    def _close(self, record: ForwardRecord | None = None, evicted: list[Evicted | None] | None = None) -> None:
        found = self._open_step.close([layer.memory for layer in self.layers], evicted if record else None)
        if found is not None:  # a forward that chose: what it found is what the next one starts from
            self.memory_evidence = found

    def _apply_to_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Beam reordering and batch selection of what the cache holds besides its layers."""
        self.stream.apply_to_rows(function)
        if self.memory_evidence is not None:
            self.memory_evidence = function(self.memory_evidence)

    @property
    def is_croppable(self) -> bool:
        """Whether any rollback generate() may ask for leaves no trace: in full mode, or while recording."""
        return self.policy.mode == "full" or self.stream.record_past

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Hold what later forwards read until `crop` (generate() calls this for assisted decoding and prompt lookup).

        `recurrent_states_to_keep` (passed by transformers >= 5.25) is the number of drafted tokens a later crop may
        remove, for which a recurrent layer records one state each. A LexCache has no recurrent state: while
        recording it holds the keys of every token read since the last crop, which is every token a crop can
        remove, however many tokens are drafted (transformers' heuristic schedule drafts more as it goes). So the
        count bounds nothing here; it is held so that `get_recurrent_states_to_keep` answers with it, and a later
        `activate_past_recording(recurrent_states_to_keep=max(1, cache.get_recurrent_states_to_keep()))` (generate()'s
        own call) keeps the larger count."""
        if recurrent_states_to_keep is not None and (
            not isinstance(recurrent_states_to_keep, int) or recurrent_states_to_keep < 0
        ):
            raise ValueError(
                f"recurrent_states_to_keep={recurrent_states_to_keep!r}: allowed values are None or an int >= 0"
            )
        self._refuse_with_memory("activate_past_recording")
        self.stream.record_past = True
        self.stream.floor = self.stream.seen
        self.drafted_tokens = recurrent_states_to_keep or 0

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """The count the last `activate_past_recording` was given while the past is recorded, else 0 (see there)."""
        return self.drafted_tokens if self.stream.record_past else 0

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
        self._refuse_with_memory("crop")
        remove = -tokens_to_remove
        if remove:
            self.stream.roll_back(remove)
            for layer in self.layers:
                layer.drop_latest(remove)
        self.stream.floor, self.stream.removable_from = self.stream.seen, None
        keep, sink_source = self.stream.shrink()
        for layer in self.layers:
            if layer.is_initialized:
                layer.keep_window(keep, sink_source)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._apply_to_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._apply_to_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._apply_to_rows(lambda t: t[indices])

    def reset(self) -> None:
        super().reset()
        for index, layer in enumerate(self.layers):
            layer.memory = self._memory(index)
        record = self.stream.record_past
        self.stream = Stream(self.policy)
        self.stream.record_past = record
        self.memory_evidence = None


class LexStaticLayer(CacheLayerMixin):
    """S sink slots and the latest window keys and values of one layer, oldest first, in buffers written in place.

    `update` returns the slots followed by the new keys as new tensors, and `commit` writes the slots. A decoding
    step that sees its sinks in the cache's frame turns them in what `update` returned (`sinks_lent`): the raw
    sink keys are kept apart until `commit`, which reads them from there."""

    is_compileable = True
    is_sliding = False
    memory = None  # (a static cache holds no block memory)

    def __init__(self, window_slots: int, sink_slots: int) -> None:
        super().__init__()
        self.window_slots, self.sink_slots = window_slots, sink_slots
        self._joined = self._raw_sinks = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = key_states.shape[:2] + (self.sink_slots + self.window_slots, key_states.shape[-1])
        self.keys = mark_static(torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.values = mark_static(torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, plan: AttentionPlan | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots followed by the new keys (and values), as new tensors; the slots are written at `commit`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._joined = torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
        lent = plan is not None and plan.sinks_lent
        self._raw_sinks = self.keys[:, :, : self.sink_slots].clone() if lent else None
        return self._joined

    def commit(self, record: ForwardRecord) -> None:
        """Write the slots in place: the sink slots' new contents where the record says (from the raw keys), the
        latest window keys."""
        if not self.is_initialized:
            return None
        for which, (buffer, joined) in enumerate(zip((self.keys, self.values), self._joined)):
            if record.sink_source is not None:
                sinks = _gather_columns(joined, record.sink_source)
                if which == 0 and self._raw_sinks is not None:  # (a source among the sink slots: their raw keys)
                    raw = _gather_columns(self._raw_sinks, record.sink_source.clamp(max=self.sink_slots - 1))
                    sinks = torch.where((record.sink_source < self.sink_slots)[:, None, :, None], raw, sinks)
                buffer[:, :, : self.sink_slots].copy_(sinks)
            buffer[:, :, self.sink_slots :].copy_(joined[:, :, joined.shape[2] - self.window_slots :])
        self._joined = self._raw_sinks = None

    def discard(self) -> None:
        """The forward raised: drop what it read."""
        self._joined = self._raw_sinks = None

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


class LexStaticCache(LexCacheSteps, StaticCache):
    """A LexCache of fixed shapes for compiled decoding: `generate(cache_implementation="static")` creates one.

    Each layer has S sink slots and w - 1 window slots in blockwise and sliding mode (what a query after them can
    see), or `max_cache_len` slots when that is fewer (as transformers' sliding static layers do: a stream that
    short never drops a key), and `max_cache_len` in full mode; every forward writes in place. Its `Stream`
    keeps positions, padding flags, stream indices and document state as tensors, so a decoding step reads
    nothing on the host. Empty slots are marked as padding. It is a StaticCache (what tools test for) with LEX's
    own layers.
    """

    def __init__(self, config, max_cache_len: int | None = None) -> None:
        policy = ReadingPolicy.of(config)
        if policy.memory_tokens:
            raise ValueError(
                f"LexStaticCache with attention_memory_blocks={policy.memory_blocks}: a block memory grows "
                "with the document, which fixed shapes cannot hold; use LexCache (generate()'s default cache, "
                "cache_implementation=None), or attention_memory_blocks=0"
            )
        sink_slots = policy.sinks
        if policy.mode == "full":
            if max_cache_len is None:
                raise ValueError("LexStaticCache in attention_mode='full' needs max_cache_len (the longest stream)")
            window_slots = max_cache_len
        else:
            # (local layers read their own window from the same slots: the wider of the two)
            window_slots = max(policy.most_reach, policy.local().most_reach if policy.local_window else 0)
            if max_cache_len is not None and max_cache_len <= sink_slots + window_slots:
                window_slots, sink_slots = max_cache_len, 0
        init_cache_layers(self, [LexStaticLayer(window_slots, sink_slots) for _ in range(config.num_hidden_layers)])
        self.config, self.policy = config, policy
        self.window_slots, self.sink_slots = window_slots, sink_slots
        self.stream = Stream(policy, window_slots=window_slots, sinks=sink_slots, static=True)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.stream.seen)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.sink_slots + self.window_slots + query_length, 0

    def load(self, cache: LexCache) -> "LexStaticCache":
        """Hold what `cache` (a LexCache of the same config, between forwards) holds: its sink slots in the sink
        slots, its window part in the last window slots (the slots before it empty, as a fresh cache's are), and
        its stream's metadata. A prompt read through a LexCache, which reads a first forward plainly causal without
        empty slots in front of it, then continues in fixed shapes (`lex.compiled_decoding.read_prompt`)."""
        source, target = cache.stream, self.stream
        if source.positions is None:  # (nothing read)
            return self
        held, slots = source.held, self.window_slots
        # (its window part must fill the slots, or hold the whole stream: the window slots hold consecutive stream
        # indices, the empty ones before the stream's first)
        if (held != slots and held != source.seen) or held > slots or source.record_past or (
                source.sink_slots not in (0, self.sink_slots)):
            raise ValueError(f"LexStaticCache.load: a LexCache that has read {source.seen} tokens and holds {held} "
                             f"window keys and {source.sink_slots} sink slots (while recording: "
                             f"{source.record_past}); allowed: {slots} window keys, or every token read and at most "
                             f"{slots}, and {self.sink_slots} or no sink slots, not recording")
        target._initialize(source.positions.shape[0], source.positions.device)
        for name in ("positions", "valid"):
            getattr(target, name)[:, slots - held :] = getattr(source, name)
        target.index[slots - held :] = source.index
        for name in ("start", "last_position", "started"):
            getattr(target.after, name)[:, slots - held :] = getattr(source.after, name)
        target.state.copy_(source.state)
        if self.sink_slots:
            for name in ("sink_index", "sink_positions", "sink_valid"):
                getattr(target, name).copy_(getattr(source, name))
        target.seen.fill_(source.seen)
        for mine, theirs in zip(self.layers, cache.layers):
            if theirs.keys is None:
                continue
            mine.lazy_initialization(theirs.keys, theirs.values)
            for buffer, raw, sinks in zip((mine.keys, mine.values), (theirs.keys, theirs.values), theirs._sinks):
                count = 0 if sinks is None else sinks.shape[2]
                buffer[:, :, :count] = raw[:, :, :count]
                buffer[:, :, buffer.shape[2] - held :] = raw[:, :, count:]
        return self

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.stream.apply_to_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def reset(self) -> None:
        super().reset()
        self.stream = Stream(self.policy, window_slots=self.window_slots, sinks=self.sink_slots, static=True)


LEX_CACHES = (LexCache, LexStaticCache)


class LexRows:
    """The caches of requests decoded together, one LexCache (of one row) per row of the batch: a server's
    continuous batch, whose requests have read different documents to different lengths. A forward over it runs
    the embeddings, norms, projections, MLPs and head on the whole batch and each row's attention through its own
    cache, with that row's own record and plan, so a row attends exactly as a lone forward of it does; each cache
    keeps what its row's forward read when the forward ends, and a forward that raises leaves every one as it was.
    Rows join and leave between forwards (a list, read once per forward)."""

    def __init__(self, caches: list[LexCache]) -> None:
        if not caches or any(not isinstance(cache, LexCache) or cache.stream.positions is None
                             or cache.stream.positions.shape[0] != 1 for cache in caches):
            raise ValueError("LexRows takes LexCaches of one row each that have read at least one forward (a "
                             "request's prompt): each row continues its own stream")
        self.rows = caches

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest row's stream (what transformers' tools ask a cache; each row has its own)."""
        return max(cache.seen for cache in self.rows)


__all__ = ["LEX_CACHES", "LexCache", "LexCacheSteps", "LexRows", "LexStaticCache"]
