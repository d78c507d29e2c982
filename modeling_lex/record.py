"""One forward's record: what the forward reads of the stream, and what the cache keeps after it.

A forward of a LEX model has three moments, and only the last changes a cache:
1. begin: `Stream.begin` (stream.py, through `inputs.begin_forward`) makes the forward's `ForwardRecord` from
   the caller's inputs and the stream as it is, before any layer runs. Nothing changes.
2. each layer: inside `with cache.forward(record):`, `cache.read(key, value, layer_idx, request, query)` hands
   the layer's new keys, the plan's `CacheRequest` and the layer's queries to the cache, which returns what
   attention reads: the keys and values of its span (sink slots first) and, with a block memory, the blocks the
   layer's queries choose, apart from them. What it holds does not change (`update`, transformers' name, is the
   same read without the block memory).
3. commit: when the block ends after the last layer, the cache keeps what the record says (the sink slots' new
   contents, the last `keep` window keys, the evicted keys in the block memory) in every layer and moves the
   stream to `record.stream_after`. A forward that raises leaves the cache as it was: the block discards what the
   layers read.

Records, contexts and requests are frozen: the masks and tiles (masking.py) are a pure function of the record,
and they import neither the cache nor the stream. The one thing a forward gathers from layer to layer, the block
memory's evidence, is the cache's for the length of the block (memory.py, `Evidence`).

Shared terms (record.py, stream.py, cache.py, inputs.py, masking.py and kernels.py use each in this sense only):
- stream index: token i of a row has stream index i. `seen`: how many tokens the stream has had.
- document: a row's tokens from a real token whose position id does not continue the previous real token's.
- window part: the keys a cache holds for the window rule, at consecutive stream indices. `held`: how many.
- sinks (S = `sink_count(config)`): the first S tokens of each document, seen by every later query.
- sink slots: where a cache keeps a row's sinks once its window part has moved past them, in front of the window
  part among the keys it returns. `sink_slots`: how many a cache has now (a LexCache none before its first dropped
  key, a LexStaticCache from the start; none where a cache never drops a key).
- record: a `ForwardRecord`; `keep`: how many window keys the cache holds after the forward.
- request: a `CacheRequest`, what a layer hands the cache with its keys.
- evicted: window keys a cache has dropped for good (stream indices 0 ... E - 1 of the row). With a block memory
  (`attention_memory_blocks`, memory.py) the cache keeps them in blocks; `memory`: what one forward reads there.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch


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
    sink_index: torch.Tensor  # (B, sink_slots) stream index each sink slot holds
    sink_positions: torch.Tensor  # (B, sink_slots)
    sink_valid: torch.Tensor  # (B, sink_slots) bool: the slot holds that token
    allowed: torch.Tensor | None = None  # (B, 1, T, K) bool from a caller's own 4D mask, on top of the window


@dataclass(frozen=True)
class StreamAfter:
    """The stream's metadata after the forward, which `Stream.commit` stores (see stream.py for each field)."""

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


@dataclass(frozen=True)
class MemoryRead:
    """What a forward reads of the block memory (the same for every layer; which blocks, each layer's own)."""

    candidates: torch.Tensor  # (B, blocks) bool: complete, all real, after the sinks of the last query's document
    token_valid: torch.Tensor  # (B, k * block) bool: the slot holds a block (the last min(k, candidates) slots)
    document: torch.Tensor  # (B,) stream index where the last query's document starts: its queries read the memory


@dataclass(frozen=True)
class CacheRequest:
    """What a layer hands a LEX cache with its new keys (`cache.update(key, value, layer_idx, request)`), the same
    for every layer of a forward. Other caches take it as an extra argument they ignore."""

    sink_rotation: torch.Tensor | None = None  # the rotation of the cache's copy of its sink slots (RoPE), if any
    # With a block memory (RoPE; None otherwise and in layers without positions): (1, 1, k * b, d), the rotation of
    # raw memory keys to their places in the frame (visibility.memory_frame), applied once per choice, so the memory
    # holds the blocks it read so; and (B, 1, dropped, d), what undoes the rotation of the keys this forward evicts.
    memory_frame: torch.Tensor | None = None
    memory_unrotate: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardRecord:
    """What one forward reads and what the cache keeps after it: made by `Stream.begin` for every cache and for
    none, read by the plan (masking.py) and by each layer's `cache.update`, applied when `cache.forward(record)`
    ends."""

    context: AttentionContext
    keep: int | None  # window keys a cache holds after this forward (None: all of them)
    sink_source: torch.Tensor | None  # (B, S): where each sink slot's next content comes from (None: as it is)
    plain: bool  # one document from the stream's start, no padding, nothing held: plain causal attention is exact
    aligned: bool  # each row one document whose blocks start where the new tokens' chunks do
    stream_after: StreamAfter
    memory: MemoryRead | None = None  # what this forward reads of the block memory (None: nothing)
    # Read by every layer, so fields (set from the context when the record is made), not properties:
    new_tokens: int = field(init=False)  # T
    sink_slots: int = field(init=False)  # the sink slots in front of the keys the cache returns in this forward
    dropped: int = field(init=False)  # window keys this forward evicts (the oldest after the sink slots)

    def __post_init__(self) -> None:
        held = self.context.key_index.shape[0]
        object.__setattr__(self, "new_tokens", self.context.query_index.shape[0])
        object.__setattr__(self, "sink_slots", self.context.sink_index.shape[1])
        object.__setattr__(self, "dropped", 0 if self.keep is None else held - self.keep)


__all__ = [
    "AttentionContext", "CacheRequest", "ForwardRecord", "MemoryRead", "StreamAfter", "StreamState",
]
