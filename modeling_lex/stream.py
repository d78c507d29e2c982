"""The stream's bookkeeping: one forward's record, made from the caller's inputs and the stream as it stands.

A stream is what a model has read so far, row by row; token i of every row has stream index i. A row may start
with padding and may hold several documents: a real token whose position id does not continue the previous real
token's starts a new one (padding-free packing), and a document sees nothing before it.

A forward of a LEX model has three moments, and only the last changes a cache:
1. begin: `begin_forward` checks the caller's mask, position ids and cache, and `Stream.begin` makes the forward's
   `ForwardRecord`: what it reads (its `AttentionContext`, reading.py: where the keys come from and which documents
   the queries belong to), how many window keys the cache holds afterwards (`keep`, by the reading policy's
   `keep_from`), where its sink slots' new contents come from, and the stream's metadata after the forward. Nothing
   changes.
2. each layer: inside the cache's `step(record)`, each layer's `cache.update` returns what attention reads; what
   the cache holds does not change.
3. commit: when the step ends after the last layer, the cache keeps what the record says in every layer and
   `Stream.commit` stores the metadata. A forward that raises leaves the cache as it was.

It is the same code for every cache and for none: LexCache and LexStaticCache keep a `Stream` between forwards; a
forward without a cache, or with a transformers cache that holds every past key, reads through a `Stream` made for
that forward. A `Stream` holds, per key of the window part (oldest first, consecutive stream indices), its position
id, whether it is a real token, and the stream's state after it, so that `roll_back` returns exactly to any earlier
point it still holds (assisted decoding); per row its sink slots' metadata; and with a block memory, per row,
whether each evicted token is real (memory.py).

Shared terms (stream.py, cache.py, reading.py and kernels.py use each in this sense only):
- stream index: token i of a row has stream index i. `seen`: how many tokens the stream has had.
- document: a row's tokens from a real token whose position id does not continue the previous real token's.
- window part: the keys a cache holds for the window rule, at consecutive stream indices. `held`: how many.
- sinks (S = `ReadingPolicy.sinks`): the first S tokens of each document, seen by every later query.
- sink slots: where a cache keeps a row's sinks once its window part has moved past them, in front of the window
  part among the keys it returns. `sink_slots`: how many a cache has now (a LexCache none before its first dropped
  key, a LexStaticCache from the start; none where a cache never drops a key).
- record: a `ForwardRecord`; `keep`: how many window keys the cache holds after the forward.
- context: an `AttentionContext` (reading.py), what a forward reads; plan: the forward's `AttentionPlan`, which a
  layer hands the cache with its keys (what the cache lends the step).
- evicted: window keys a cache has dropped for good (stream indices 0 ... E - 1 of the row). With a block memory
  (`attention_memory_blocks`, memory.py) the cache keeps them in blocks; `memory`: what one forward reads there.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch
from transformers.cache_utils import Cache

from .reading import AttentionContext, ReadingPolicy, locate_sinks, readable_blocks


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

    def at(self, column: int) -> "StreamState":
        """The moment after the token at `column` of a (B, n) state: (B,) each."""
        return self.map(lambda t: t[:, column])

    def span(self, start: int | None = None, stop: int | None = None) -> "StreamState":
        """The moments after the tokens at columns start:stop of a (B, n) state."""
        return self.map(lambda t: t[:, start:stop])

    def copy_(self, other: "StreamState") -> None:
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))


@dataclass(frozen=True)
class ForwardRecord:
    """What one forward reads (`context`) and what the cache keeps after it: made by `Stream.begin` for every cache
    and for none, read by the plan (reading.py) and by each layer's cache, applied when the cache's `step(record)`
    ends."""

    context: AttentionContext
    keep: int | None  # window keys a cache holds after this forward (None: all of them)
    sink_source: torch.Tensor | None  # (B, S): where each sink slot's next content comes from (None: as it is)
    # The stream's metadata after the forward, which `Stream.commit` stores (see the module docstring):
    seen: int | torch.Tensor
    positions: torch.Tensor  # (B, held) of the window part
    valid: torch.Tensor
    index: torch.Tensor  # (held,)
    after: StreamState  # (B, held): the state after each held token (rollback)
    base: StreamState  # (B,): the state before the oldest held token
    state: StreamState  # (B,): the state after the forward
    sink_index: torch.Tensor  # (B, S)
    sink_positions: torch.Tensor
    sink_valid: torch.Tensor
    sink_slots: int
    floor: int  # the earliest stream length a rollback can return to, while recording
    memory_valid: torch.Tensor | None  # (B, E): whether each evicted token is real (block memory only)
    # Read by every layer, so fields (set from the context when the record is made), not properties:
    new_tokens: int = field(init=False)  # T
    dropped: int = field(init=False)  # window keys this forward evicts (the oldest after the sink slots)

    def __post_init__(self) -> None:
        object.__setattr__(self, "new_tokens", self.context.query_index.shape[0])
        object.__setattr__(self, "dropped", self.context.dropped)


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


class Stream:
    """The metadata a LEX cache keeps besides keys and values (see the module docstring).

    `static=True` (LexStaticCache): `window_slots` slots that exist from the start (empty ones not valid), written
    in place, and no reads on the host, so that a compiled decoding step has one shape and no graph break; its
    `sinks` sink slots exist from the start too (0 where its window slots hold the whole stream).
    `unbounded=True`: every key is kept (a forward without a LEX cache: nothing is dropped, so no sink slots).
    """

    def __init__(
        self, policy: ReadingPolicy, window_slots: int | None = None, sinks: int | None = None, static: bool = False,
        unbounded: bool = False,
    ) -> None:
        self.policy = policy
        self.window_slots = window_slots  # slots of the window part (static), or None: as many as the policy keeps
        self.sinks = policy.sinks if sinks is None else sinks  # S: the sinks this stream keeps in slots
        self.static = static
        self.unbounded = unbounded
        self.seen: int | torch.Tensor = torch.zeros((), dtype=torch.long) if static else 0
        self.positions = self.valid = self.index = None  # window part: (B, held), (B, held), (held,)
        self.after: StreamState | None = None  # (B, held): the state after each held token (rollback)
        self.base: StreamState | None = None  # (B,): the state before the oldest held token
        self.state: StreamState | None = None  # (B,): the state now
        self.sink_index = self.sink_positions = self.sink_valid = None  # (B, S)
        # Sink slots exist once a key was dropped (before that the window part holds every sink); static: always.
        self.sink_slots = self.sinks if static else 0
        self.record_past = False
        self.floor = 0  # the earliest stream length `roll_back` can return to, while recording
        self.removable_from: int | None = None  # tokens from this stream index on may be rolled back (see mark)
        # The block memory (memory.py): whether each evicted token is real, (B, E); None without one.
        self.memory = bool(policy.memory_tokens) and not static and not unbounded
        self.memory_valid: torch.Tensor | None = None

    @property
    def held(self) -> int:
        return 0 if self.index is None else self.index.shape[0]

    def _initialize(self, batch: int, device: torch.device) -> None:
        """The empty stream's metadata as tensors (the stream it describes is the same: empty)."""
        window_slots, sinks = self.window_slots or 0, self.sinks
        self.positions = torch.zeros(batch, window_slots, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, window_slots, dtype=torch.bool, device=device)
        self.index = torch.arange(-window_slots, 0, device=device)
        self.state = self.base = StreamState.fresh(batch, device)
        self.after = StreamState.fresh(batch, device).map(lambda t: t[:, None].expand(batch, window_slots).clone())
        self.sink_index = torch.arange(sinks, device=device).expand(batch, sinks).clone()
        self.sink_positions = torch.zeros(batch, sinks, dtype=torch.long, device=device)
        self.sink_valid = torch.zeros(batch, sinks, dtype=torch.bool, device=device)
        if self.memory:
            self.memory_valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        if self.static:
            self.seen = self.seen.to(device)
            for tensor in self._row_tensors() + [self.index, self.seen]:
                mark_static(tensor)

    def _row_tensors(self) -> list[torch.Tensor]:
        """Every tensor with one row per batch row."""
        return [self.positions, self.valid, self.sink_index, self.sink_positions, self.sink_valid,
                *(getattr(s, f.name) for s in (self.after, self.state) for f in fields(s))]

    # ------------------------------------------------------------------------------------------------ one forward

    def begin(self, position_ids: torch.Tensor | None, valid: torch.Tensor, caller_plain: bool) -> ForwardRecord:
        """The record of one forward of these tokens (their position ids, None to continue each row's positions,
        and which are real): what it reads, and what the cache keeps after it. Changes nothing.

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
        key_positions = torch.cat([self.positions, position_ids], dim=1)
        key_valid = torch.cat([self.valid, valid], dim=1)
        key_index = torch.cat([self.index, query_index])
        plain = caller_plain and self.held == 0 and not self.static
        if torch.compiler.is_compiling() or length <= self.policy.window:
            aligned = plain  # read by a chunked tile alone (more than w new tokens): no host read otherwise
        else:
            first = document_start[:, :1]
            block = self.policy.block
            aligned = bool((document_start == first).all()) and bool(((query_index[0] - first) % block == 0).all())
        all_after = StreamState(*(torch.cat([getattr(self.after, f.name), getattr(after, f.name)], dim=1)
                                  for f in fields(after)))
        seen = self.seen + length
        available = int(key_index.shape[0])
        keep, floor = self._keep(available, key_index[0], all_after, self.base, seen)
        drop = available - keep
        context = AttentionContext(
            query_positions=position_ids,
            key_positions=key_positions,
            key_valid=key_valid,
            query_index=query_index,
            key_index=key_index,
            document_start=document_start,
            sink_index=self.sink_index[:, : self.sink_slots],
            sink_positions=self.sink_positions[:, : self.sink_slots],
            sink_valid=self.sink_valid[:, : self.sink_slots],
            plain=plain,
            aligned=aligned,
            dropped=0 if self.unbounded else drop,
            memory=readable_blocks(self.policy, self.memory_valid, document_start[:, -1]) if self.memory else None,
        )
        sink_source, sinks_after = self._refill_sink_slots(context, after.at(-1), dropping=keep < available)
        return ForwardRecord(
            context, None if self.unbounded else keep, sink_source,
            seen=seen,
            positions=context.key_positions[:, drop:],
            valid=context.key_valid[:, drop:],
            index=context.key_index[drop:],
            after=all_after.span(drop),
            base=all_after.at(drop - 1) if drop > 0 and not self.static else self.base,
            state=all_after.at(-1),
            floor=floor,
            memory_valid=None if not self.memory else torch.cat([self.memory_valid, context.key_valid[:, :drop]], 1),
            **sinks_after,
        )

    def commit(self, record: ForwardRecord) -> None:
        """Store the stream's metadata after the record's forward (static: in place, the buffers keep their
        addresses)."""
        for name in ("positions", "valid", "index", "sink_index", "sink_positions", "sink_valid"):
            if self.static:
                getattr(self, name).copy_(getattr(record, name))
            else:
                setattr(self, name, getattr(record, name))
        if self.static:
            self.seen.copy_(record.seen)
            self.after.copy_(record.after)
            self.state.copy_(record.state)
        else:
            self.seen, self.after, self.state, self.base = record.seen, record.after, record.state, record.base
        self.sink_slots, self.floor = record.sink_slots, record.floor
        self.memory_valid = record.memory_valid

    # ------------------------------------------------------------------------------------------------ sink slots

    def _refill_sink_slots(
        self, context: AttentionContext, now: StreamState, dropping: bool
    ) -> tuple[torch.Tensor | None, dict]:
        """Point each sink slot at token (current document start + j): in the window part if it lies there, else
        the slot keeps what it holds. Returns where each slot's content comes from, as a column among the keys the
        cache returns (the sink slots first), or None where every slot keeps its content, and while there are no
        slots: they come into being with the first dropped key; and the slots' metadata after the forward."""
        sinks, sink_slots = self.sinks, context.sink_index.shape[1]
        unchanged = {"sink_index": self.sink_index, "sink_positions": self.sink_positions,
                     "sink_valid": self.sink_valid, "sink_slots": self.sink_slots}
        if sinks == 0 or not (sink_slots or dropping):
            return None, unchanged
        # (where each sink lies after the forward: where attention finds it, `locate_sinks`)
        columns, wanted, positions, valid = locate_sinks(self.policy, context, now.start)  # (B, S) each
        metadata = {"sink_index": wanted, "sink_positions": positions, "sink_valid": valid, "sink_slots": sinks}
        if (sink_slots == sinks and not self.static and not torch.compiler.is_compiling()
                and not bool((columns >= sink_slots).any())):  # (columns past the slots: in the window part)
            return None, metadata  # every slot keeps what it holds (each decoding step once the window has moved on)
        return columns, metadata

    # ------------------------------------------------------------------------------------------------ keep policy

    def _keep(
        self, available: int, first_index: torch.Tensor, after: StreamState, base: StreamState,
        seen: int | torch.Tensor,
    ) -> tuple[int, int]:
        """How many of the latest `available` window keys (from stream index `first_index`, with the state after
        each in `after` and before them in `base`) queries from the rollback floor on may still see, once the
        stream has had `seen` tokens; and that floor."""
        floor = self.floor
        if self.static:
            return self.window_slots, floor
        if self.policy.mode == "full" or self.unbounded:
            return available, floor
        if self.record_past:
            if self.removable_from is not None:  # tokens before it have no logits to verify: never rolled back
                floor = max(floor, min(self.removable_from, seen))
            first_seen = floor
        else:
            first_seen = seen
        start = None  # (sliding, or blockwise under compile: the sliding rule, a superset, no host read)
        if self.policy.mode == "blockwise" and not torch.compiler.is_compiling():
            offset = first_seen - 1 - int(first_index)
            start = after.start[:, offset] if offset >= 0 else base.start
        return max(0, min(available, seen - self.policy.keep_from(first_seen, start))), floor

    def shrink(self) -> tuple[int, torch.Tensor | None]:
        """After a crop: drop the metadata no query from now on can see; returns how many window keys to keep, and
        where each sink slot's content comes from (as `ForwardRecord.sink_source`: a column among the sink slots and
        the window part; None: every slot keeps what it holds), since the keys dropped here may hold the sinks."""
        if self.index is None:
            return 0, None
        first = self.index[0] if self.held else torch.tensor(self.seen)
        keep, self.floor = self._keep(self.held, first, self.after, self.base, self.seen)
        drop = self.held - keep
        held = AttentionContext(
            query_positions=None, key_positions=self.positions, key_valid=self.valid, query_index=None,
            key_index=self.index, document_start=None, sink_index=self.sink_index[:, : self.sink_slots],
            sink_positions=self.sink_positions[:, : self.sink_slots], sink_valid=self.sink_valid[:, : self.sink_slots],
        )
        sink_source, sinks_after = self._refill_sink_slots(held, self.state, dropping=drop > 0)
        self.sink_index, self.sink_positions = sinks_after["sink_index"], sinks_after["sink_positions"]
        self.sink_valid, self.sink_slots = sinks_after["sink_valid"], sinks_after["sink_slots"]
        if drop > 0:
            self.base = self.after.at(drop - 1)
            self.positions, self.valid, self.index = self.positions[:, drop:], self.valid[:, drop:], self.index[drop:]
            self.after = self.after.span(drop)
        return keep, sink_source

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
        if self.policy.mode == "full":
            floor = oldest  # every key is held
        if target < floor:
            raise ValueError(
                f"LexCache.crop: cannot remove {remove} of {self.seen} tokens in attention_mode="
                f"{self.policy.mode!r}: the keys the shorter stream needs were dropped. A LexCache rolls "
                "back over the tokens read since the last crop whose logits were computed, after "
                "activate_past_recording() (generate() does this for assisted decoding); in 'full' mode, any token"
            )
        kept = self.held - remove
        state = self.after.at(kept - 1) if kept > 0 else self.base
        if self.sinks:
            self._roll_back_sinks(state, target)
        self.positions, self.valid, self.index = self.positions[:, :kept], self.valid[:, :kept], self.index[:kept]
        self.after, self.state, self.seen = self.after.span(stop=kept), state, target
        self.floor, self.removable_from = target, None

    def _roll_back_sinks(self, state: StreamState, target: int) -> None:
        """Sink slots after a rollback: tokens removed are gone; a document that began in the removed tokens gives
        its rows back their earlier document, whose sinks must still be held (in a slot or the window part)."""
        wanted = self.policy.sink_indices(state.start)
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
        if self.memory_valid is not None:
            self.memory_valid = function(self.memory_valid)
        self.after, self.base, self.state = self.after.map(function), self.base.map(function), self.state.map(function)



def mark_static(tensor: torch.Tensor) -> torch.Tensor:
    """Tell dynamo a buffer keeps its address, so compiled steps (and CUDA graphs) write into it in place. The one
    use of a torch internal (`torch._dynamo.mark_static_address`, torch 2.13-2.14, as transformers' StaticCache
    uses it): torch has no public spelling of it."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
    return tensor


def begin_forward(
    policy: ReadingPolicy,
    batch: int,
    length: int,
    device: torch.device,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Cache | None,
) -> ForwardRecord:
    """The one place a forward's record comes from, the caller's inputs checked: a LEX cache's own stream (which it
    leaves as it is: the cache's `step(record)` applies it), or a stream made for this forward (no cache, or a
    transformers cache that holds every past key contiguously), or a caller's 4D mask.

    `attention_mask` is 2D, over the new tokens or over past and new ones (padding: 0), or 4D (B, 1, T, T).
    A cache that is no transformers `Cache` (transformers' continuous batching hands a `PagedAttentionCache`) is
    refused by name here, before any layer would fail on it.
    """
    if cache is not None and not isinstance(cache, Cache):
        raise ValueError(
            f"cache is a {type(cache).__name__}, which LEX models cannot read (transformers' continuous batching is "
            "not supported: use `lex serve MODEL`). Allowed: None, LexCache or LexStaticCache (what generate() "
            "makes), LexRows, or a transformers Cache such as DynamicCache (every key kept)"
        )
    if attention_mask is not None and attention_mask.dim() == 4:
        return _custom_mask_record(policy, batch, length, device, attention_mask, position_ids, cache)
    lex_cache = _is_lex_cache(cache)
    compiling = torch.compiler.is_compiling()
    seen = 0 if cache is None or lex_cache else cache.get_seq_length()
    if attention_mask is not None:
        past = attention_mask.shape[-1] - length
        known = int(cache.stream.seen) if lex_cache and not compiling else seen
        if attention_mask.dim() == 2 and not compiling and known == 0 and (attention_mask.shape[0] != batch or past):
            raise ValueError(  # generate()'s first forward: the prompt
                f"attention_mask has shape {tuple(attention_mask.shape)} but the prompt has {(batch, length)}; "
                "a forward without cached tokens needs one mask entry per input token"
            )
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or (
            not compiling and past not in (0, known)
        ):
            raise ValueError(
                f"attention_mask must have shape ({batch}, {length}) or ({batch}, {known + length}) "
                f"(new tokens, or past and new), got {tuple(attention_mask.shape)}"
            )
        mask = attention_mask.to(device=device, dtype=torch.bool)
    else:
        mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    caller_plain = _plain_input(mask if attention_mask is not None else None, position_ids, length, compiling)
    if lex_cache:
        return cache.stream.begin(position_ids, mask[:, -length:], caller_plain)
    # A stream for this forward: the past a foreign cache holds (contiguous, real unless the mask says padding),
    # then the new tokens.
    stream = Stream(policy, unbounded=True)
    if position_ids is None and mask.shape[1] == seen + length:
        position_ids = ((mask.long().cumsum(-1) - 1).masked_fill(~mask, 1))[:, -length:]
    if seen:
        first = position_ids[:, :1] if position_ids is not None else torch.full((batch, 1), seen, device=device)
        past_valid = mask[:, :seen] if mask.shape[1] == seen + length else mask.new_ones(batch, seen)
        stream.commit(stream.begin(first.to(device) - seen + torch.arange(seen, device=device), past_valid, False))
    return stream.begin(position_ids, mask[:, -length:], caller_plain and seen == 0)


def _plain_input(mask: torch.Tensor | None, position_ids: torch.Tensor | None, length: int, compiling: bool) -> bool:
    """Whether the caller's mask and position ids say no more than their absence would: no padding, and positions
    counting from 0. generate() passes both on every forward; read on the host as Llama's mask creation reads its
    padding mask (`_ignore_causal_mask_sdpa`), so that a plain prompt runs plain causal attention (SDPA's causal
    kernel with grouped key/value heads, no mask). Compiled: only their absence counts (no host read)."""
    if compiling:
        return mask is None and position_ids is None
    if mask is not None and not bool(mask.all()):
        return False
    if position_ids is None:
        return True
    return bool((position_ids == torch.arange(length, device=position_ids.device)).all())


def _is_lex_cache(cache: Cache | None) -> bool:
    """A LEX cache (LexCache, LexStaticCache): one that keeps a `Stream`."""
    return isinstance(getattr(cache, "stream", None), Stream)


def _custom_mask_record(
    policy: ReadingPolicy, batch: int, length: int, device: torch.device, attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None, cache: Cache | None,
) -> ForwardRecord:
    """A caller's own (B, 1, T, T) mask (e.g. a shared prefix with branches): it says which keys each query sees,
    on top of causality and the window; documents are not inferred from position ids then."""
    if cache is not None and cache.get_seq_length():
        raise ValueError("a 4D attention_mask is supported on a forward without cached tokens (an empty or no cache)")
    if attention_mask.shape != (batch, 1, length, length) and attention_mask.shape != (1, 1, length, length):
        raise ValueError(
            f"a 4D attention_mask must have shape ({batch}, 1, {length}, {length}), got {tuple(attention_mask.shape)}"
        )
    allowed = attention_mask.to(device).bool() if attention_mask.dtype in (torch.bool, torch.long, torch.int) else (
        attention_mask.to(device) == 0  # additive: 0 where allowed, the dtype's minimum elsewhere
    )
    if position_ids is None:
        position_ids = torch.arange(length, device=device)
    position_ids = position_ids.to(device).expand(batch, length)
    valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    stream = cache.stream if _is_lex_cache(cache) else Stream(policy, unbounded=True)
    record = stream.begin(position_ids, valid, False)
    context = replace(record.context, document_start=torch.zeros_like(record.context.document_start),
                      allowed=allowed.expand(batch, -1, -1, -1), plain=False, aligned=False)  # one document
    return replace(record, context=context)


__all__ = ["ForwardRecord", "Stream", "StreamState", "begin_forward", "mark_static"]
