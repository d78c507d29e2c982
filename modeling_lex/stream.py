"""The stream's bookkeeping: documents, positions, and what a cache holds of the past, one forward at a time.

A stream is what a model has read so far, row by row; token i of every row has stream index i. A row may start
with padding and may hold several documents: a real token whose position id does not continue the previous real
token's starts a new one (padding-free packing), and a document sees nothing before it.

`Stream.step` turns the tokens of one forward into a `StreamStep`, the one record the attention plan reads:
where the keys come from and which documents the queries belong to (`AttentionContext`), how many window keys
the cache holds afterwards and where its sink slots' new contents come from (what a cache's layers store, handed to
them as an argument), and whether plain causal attention is exact. It is the same code for every cache and
for none: LexCache and LexStaticCache keep a `Stream` between forwards; a forward without a cache, or with a
transformers cache that holds every past key, reads through a `Stream` made for that forward.

A `Stream` holds, per key of the window part (oldest first, consecutive stream indices), its position id,
whether it is a real token, and the stream's state after it, so that `roll_back` returns exactly to any earlier
point it still holds (assisted decoding); and per row the `attention_sinks` sink slots, the first S tokens of the
row's current document, kept after the window has moved past them.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from .visibility import locate_in_window, sink_count, sink_indices


@dataclass
class StreamState:
    """Per row: the stream index where the current document starts, the position id of the last real token, and
    whether a real token was seen. Each tensor is (B,) for one moment, or (B, n) for the moments after n tokens."""

    start: torch.Tensor
    last_position: torch.Tensor
    started: torch.Tensor

    @classmethod
    def fresh(cls, batch: int, device: torch.device) -> "StreamState":
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(zeros, zeros - 1, torch.zeros(batch, dtype=torch.bool, device=device))

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> "StreamState":
        """The same state with `function` applied to each tensor (row selection, a column, concatenation)."""
        return StreamState(*(function(getattr(self, f.name)) for f in fields(self)))

    def copy_(self, other: "StreamState") -> None:
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))


def document_starts(
    positions: torch.Tensor, valid: torch.Tensor, index: torch.Tensor, state: StreamState
) -> tuple[torch.Tensor, StreamState]:
    """Stream index of the first token of each new token's document (B, T), and the state after each token.

    A document starts at a row's first real token and wherever a real token's position id does not continue the
    previous real token's. Padding in between does not break a document; a padding token itself is a document of
    one token that nobody sees.
    """
    batch, length = positions.shape
    steps = torch.arange(length, device=positions.device).expand(batch, length)
    last_real = torch.where(valid, steps, -1).cummax(dim=1).values  # latest real token at or before t
    before = torch.cat([last_real.new_full((batch, 1), -1), last_real[:, :-1]], dim=1)  # latest real before t
    previous_position = torch.where(
        before >= 0, positions.gather(1, before.clamp(min=0)), state.last_position[:, None]
    )
    had_real = (before >= 0) | state.started[:, None]
    restart = valid & (~had_real | (positions != previous_position + 1))
    starts = torch.where(restart, index[None, :], state.start[:, None]).cummax(dim=1).values
    after = StreamState(
        start=starts,
        last_position=torch.where(
            last_real >= 0, positions.gather(1, last_real.clamp(min=0)), state.last_position[:, None]
        ),
        started=(last_real >= 0) | state.started[:, None],
    )
    return torch.where(valid, starts, index[None, :]), after


@dataclass
class AttentionContext:
    """Where the keys of one forward come from and what each query may see (shared by all layers).

    The keys a cache returns are its sink slots (per row, `sink_*`; none without sinks), then its window part:
    the window keys it held followed by the new tokens' keys, at consecutive stream indices `key_index`. Empty
    static slots and padding are not `key_valid`.
    """

    query_positions: torch.Tensor  # (B, T) position ids of the new tokens
    key_positions: torch.Tensor  # (B, K) position ids of the window part
    key_valid: torch.Tensor  # (B, K) bool: a real token (not padding, not an empty slot)
    query_index: torch.Tensor  # (T,) stream index of each new token
    key_index: torch.Tensor  # (K,) stream index of each key of the window part
    document_start: torch.Tensor  # (B, T) stream index of the first token of each query's document
    sink_index: torch.Tensor  # (B, S') stream index each sink slot holds
    sink_positions: torch.Tensor  # (B, S')
    sink_valid: torch.Tensor  # (B, S') bool: the slot holds that token
    allowed: torch.Tensor | None = None  # (B, 1, T, K) bool from a caller's own 4D mask, on top of the window


@dataclass
class StreamStep:
    """What one forward reads from the stream: produced by `Stream.step` for every cache and for none."""

    context: AttentionContext
    keep: int | None  # window keys a cache holds after this forward (None: all of them)
    sink_source: torch.Tensor | None  # (B, S) where each sink slot's next content comes from (None: as it is)
    plain: bool  # one document from the stream's start, no padding, nothing held: plain causal attention is exact
    aligned: bool  # each row one document whose blocks start where the new tokens' chunks do


class Stream:
    """The metadata a LEX cache keeps besides keys and values (see the module docstring).

    `static=True` (LexStaticCache): `window_slots` slots that exist from the start (empty ones not valid), written
    in place, and no reads on the host, so that a compiled decoding step has one shape and no graph break.
    `unbounded=True`: every key is kept (a forward without a cache, or with a cache that keeps all past keys).
    """

    def __init__(
        self, config, window_slots: int | None = None, sinks: int | None = None, static: bool = False,
        unbounded: bool = False,
    ) -> None:
        self.config = config
        self.window_slots = window_slots  # slots of the window part (static), or None: as many as the policy keeps
        self.sinks = sink_count(config) if sinks is None else sinks
        self.static = static
        self.unbounded = unbounded  # hold every key (a forward without a LEX cache: nothing is dropped)
        self.seen: int | torch.Tensor = torch.zeros((), dtype=torch.long) if static else 0
        self.positions = self.valid = self.index = None  # window part: (B, K), (B, K), (K,)
        self.after: StreamState | None = None  # (B, K): the state after each held token (rollback)
        self.base: StreamState | None = None  # (B,): the state before the oldest held token
        self.state: StreamState | None = None  # (B,): the state now
        self.sink_index = self.sink_positions = self.sink_valid = None  # (B, S)
        # Sink slots exist once a key was dropped (before that the window part holds every sink); static: always.
        self.sink_slots = self.sinks if static else 0
        self.record_past = False
        self.floor = 0  # the earliest stream length `roll_back` can return to, while recording
        self.removable_from: int | None = None  # tokens from this stream index on may be rolled back (see mark)

    @property
    def held(self) -> int:
        return 0 if self.index is None else self.index.shape[0]

    def _initialize(self, batch: int, device: torch.device) -> None:
        window_slots, sinks = self.window_slots or 0, self.sinks
        self.positions = torch.zeros(batch, window_slots, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, window_slots, dtype=torch.bool, device=device)
        self.index = torch.arange(-window_slots, 0, device=device)
        self.state = self.base = StreamState.fresh(batch, device)
        self.after = StreamState.fresh(batch, device).map(lambda t: t[:, None].expand(batch, window_slots).clone())
        self.sink_index = torch.arange(sinks, device=device).expand(batch, sinks).clone()
        self.sink_positions = torch.zeros(batch, sinks, dtype=torch.long, device=device)
        self.sink_valid = torch.zeros(batch, sinks, dtype=torch.bool, device=device)
        if self.static:
            self.seen = self.seen.to(device)
            for tensor in self._row_tensors() + [self.index, self.seen]:
                _mark_static(tensor)

    def _row_tensors(self) -> list[torch.Tensor]:
        """Every tensor with one row per batch row."""
        return [self.positions, self.valid, self.sink_index, self.sink_positions, self.sink_valid,
                *(getattr(s, f.name) for s in (self.after, self.state) for f in fields(s))]

    # ------------------------------------------------------------------------------------------------ one forward

    def step(
        self,
        position_ids: torch.Tensor | None,
        valid: torch.Tensor,
        caller_plain: bool,
    ) -> StreamStep:
        """Register the tokens of one forward (their position ids, None to continue each row's positions, and
        which are real) and return what the forward reads, with what the cache's layers keep (`keep`,
        `sink_source`); the metadata is updated to after the forward.

        `caller_plain`: the caller passed neither a mask nor position ids, so the tokens are one document without
        padding (known without reading tensors on the host).
        """
        batch, length = valid.shape
        device = valid.device
        if self.positions is None:
            self._initialize(batch, device)
        if position_ids is None:  # continue each row's positions (padding takes its neighbour's)
            position_ids = torch.where(self.state.started, self.state.last_position, -1)[:, None] + valid.cumsum(-1)
        position_ids = position_ids.to(device).expand(batch, length)
        query_index = self.seen + torch.arange(length, device=device)
        document_start, after = document_starts(position_ids, valid, query_index, self.state)
        context = AttentionContext(
            query_positions=position_ids,
            key_positions=torch.cat([self.positions, position_ids], dim=1),
            key_valid=torch.cat([self.valid, valid], dim=1),
            query_index=query_index,
            key_index=torch.cat([self.index, query_index]),
            document_start=document_start,
            sink_index=self.sink_index[:, : self.sink_slots],
            sink_positions=self.sink_positions[:, : self.sink_slots],
            sink_valid=self.sink_valid[:, : self.sink_slots],
        )
        nothing_held = self.held == 0 and not self.static
        plain = caller_plain and nothing_held
        if torch.compiler.is_compiling() or length <= self.config.attention_window:
            aligned = plain  # read by chunked tiles alone (more than w new tokens): no host read otherwise
        else:
            first = document_start[:, :1]
            block = self.config.bca_block_length
            aligned = bool((document_start == first).all()) and bool(((query_index[0] - first) % block == 0).all())
        all_after = StreamState(*(torch.cat([getattr(self.after, f.name), getattr(after, f.name)], dim=1)
                                  for f in fields(after)))
        if self.static:
            self.seen.add_(length)
        else:
            self.seen += length
        available = int(context.key_index.shape[0])
        keep = self._keep(available, context.key_index[0], all_after, self.base)
        sink_source = self._refill_sink_slots(context, after.map(lambda t: t[:, -1]), dropping=keep < available)
        self._hold(context, all_after, keep)
        return StreamStep(context, None if self.unbounded else keep, sink_source, plain, aligned)

    def _refill_sink_slots(self, context: AttentionContext, now: StreamState, dropping: bool) -> torch.Tensor | None:
        """Point each sink slot at token (current document start + j): in the window part if it lies there, else
        the slot keeps what it holds. Returns where each slot's content comes from, as a column among the keys the
        cache returns (the sink slots first), or None where every slot keeps its content, and while there are no
        slots: they come into being with the first dropped key."""
        sinks, sink_slots = self.sinks, context.sink_index.shape[1]
        if sinks == 0 or not (sink_slots or dropping):
            return None
        wanted = sink_indices(now.start, sinks)  # (B, S)
        column, in_window = locate_in_window(wanted, context.key_index)
        exists = in_window & (wanted < self.seen)
        slot = torch.arange(sinks, device=column.device)
        kept = (self.sink_index == wanted) & self.sink_valid
        positions = torch.where(in_window, context.key_positions.gather(1, column), self.sink_positions)
        valid = torch.where(in_window, exists & context.key_valid.gather(1, column), kept)
        self._store(("sink_index", wanted), ("sink_positions", positions), ("sink_valid", valid))
        self.sink_slots = sinks
        if sink_slots == sinks and not self.static and not torch.compiler.is_compiling() and not bool(in_window.any()):
            return None  # every slot keeps what it holds (each decoding step once the window has moved on)
        return torch.where(in_window, sink_slots + column, slot.clamp(max=max(sink_slots - 1, 0)))

    def _keep(self, available: int, first_index: torch.Tensor, after: StreamState, base: StreamState) -> int:
        """How many of the latest `available` window keys (from stream index `first_index`, with the state after
        each in `after` and before them in `base`) queries from the rollback floor on may still see."""
        if self.static:
            return self.window_slots
        mode, window = self.config.attention_mode, self.config.attention_window
        if mode == "full" or self.unbounded:
            return available
        floor = self.seen
        if self.record_past:
            if self.removable_from is not None:  # tokens before it have no logits to verify: never rolled back
                self.floor = max(self.floor, min(self.removable_from, self.seen))
            floor = self.floor
        if mode == "sliding" or torch.compiler.is_compiling():  # blockwise under compile: a superset, no host read
            first_needed = floor - (window - 1)
        else:
            offset = floor - 1 - int(first_index)
            start = after.start[:, offset] if offset >= 0 else base.start
            block = self.config.bca_block_length
            first_needed = int((start + torch.div(floor - start, block, rounding_mode="floor") * block - block).min())
        return max(0, min(available, self.seen - first_needed))

    def shrink(self) -> int:
        """After a crop: drop the metadata no query from now on can see; returns how many window keys to keep."""
        if self.index is None:
            return 0
        keep = self._keep(self.held, self.index[0] if self.held else torch.tensor(self.seen), self.after, self.base)
        drop = self.held - keep
        if drop > 0:
            self.base = self.after.map(lambda t: t[:, drop - 1])
            self.positions, self.valid, self.index = self.positions[:, drop:], self.valid[:, drop:], self.index[drop:]
            self.after = self.after.map(lambda t: t[:, drop:])
        return keep

    def _hold(self, context: AttentionContext, after: StreamState, keep: int) -> None:
        """Keep the metadata of the last `keep` keys of the window part (the cache's layers keep the same keys)."""
        drop = context.key_index.shape[0] - keep
        if drop > 0 and not self.static:
            self.base = after.map(lambda t: t[:, drop - 1])
        self._store(
            ("positions", context.key_positions[:, drop:]), ("valid", context.key_valid[:, drop:]),
            ("index", context.key_index[drop:]),
        )
        if self.static:
            self.after.copy_(after.map(lambda t: t[:, drop:]))
            self.state.copy_(after.map(lambda t: t[:, -1]))
        else:
            self.after = after.map(lambda t: t[:, drop:])
            self.state = after.map(lambda t: t[:, -1])

    def _store(self, *pairs: tuple[str, torch.Tensor]) -> None:
        """Assign (dynamic) or write in place (static: the buffers keep their addresses)."""
        for name, value in pairs:
            if self.static:
                getattr(self, name).copy_(value)
            else:
                setattr(self, name, value)

    # ------------------------------------------------------------------------------------------------ rollback

    def mark_removable(self, first: int) -> None:
        """Tokens from stream index `first` on may be removed by the next `roll_back` (the forward computed their
        logits, so generate() may reject them); those before it never will, so the window moves past them."""
        self.removable_from = first

    def roll_back(self, remove: int) -> None:
        """Return to the stream without its last `remove` tokens, exactly, or raise naming why it cannot."""
        target = self.seen - remove
        oldest = int(self.index[0]) if self.held else self.seen
        floor = self.floor if self.record_past else self.seen
        if self.config.attention_mode == "full":
            floor = oldest  # every key is held
        if target < floor:
            raise ValueError(
                f"LexCache.crop: cannot remove {remove} of {self.seen} tokens in attention_mode="
                f"{self.config.attention_mode!r}: the keys the shorter stream needs were dropped. A LexCache rolls "
                "back over the tokens read since the last crop whose logits were computed, after "
                "activate_past_recording() (generate() does this for assisted decoding); in 'full' mode, any token"
            )
        kept = self.held - remove
        state = self.after.map(lambda t: t[:, kept - 1]) if kept > 0 else self.base
        if self.sinks:
            self._roll_back_sinks(state, target)
        self.positions, self.valid, self.index = self.positions[:, :kept], self.valid[:, :kept], self.index[:kept]
        self.after, self.state, self.seen = self.after.map(lambda t: t[:, :kept]), state, target
        self.floor, self.removable_from = target, None

    def _roll_back_sinks(self, state: StreamState, target: int) -> None:
        """Sink slots after a rollback: tokens removed are gone; a document that began in the removed tokens gives
        its rows back their earlier document, whose sinks must still be held (in a slot or the window part)."""
        wanted = sink_indices(state.start, self.sinks)
        oldest = int(self.index[0]) if self.held else self.seen
        lost = (wanted != self.sink_index) & (wanted < oldest) & (wanted < target)
        if bool(lost.any()):
            raise ValueError(
                "LexCache.crop: the rollback returns to a document whose attention sinks were replaced by a newer "
                "document's; they are no longer held"
            )
        self.sink_valid = self.sink_valid & (self.sink_index == wanted) & (wanted < target)
        self.sink_index = wanted

    def apply_to_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Beam reordering and batch selection: apply `function` to every per-row tensor."""
        if self.positions is None:
            return
        if self.static:
            for tensor in self._row_tensors():
                tensor.copy_(function(tensor))
            return
        self.positions, self.valid = function(self.positions), function(self.valid)
        self.sink_index, self.sink_positions = function(self.sink_index), function(self.sink_positions)
        self.sink_valid = function(self.sink_valid)
        self.after, self.base, self.state = self.after.map(function), self.base.map(function), self.state.map(function)


def _mark_static(tensor: torch.Tensor) -> torch.Tensor:
    """Tell dynamo a buffer keeps its address, so compiled steps (and CUDA graphs) write into it in place."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
    return tensor
