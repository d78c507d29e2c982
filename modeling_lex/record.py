"""One forward's record: what the forward reads of the stream, and what the cache keeps after it.

A forward of a LEX model has three moments, and only the last changes a cache:
1. begin: `Stream.begin` (stream.py, through `inputs.begin_forward`) makes the forward's `ForwardRecord` from
   the caller's inputs and the stream as it is, before any layer runs. Nothing changes.
2. each layer: `cache.update(key, value, layer_idx, plan.cache_kwargs)` hands the layer's new keys to the cache,
   which returns the keys and values attention reads (sink slots first). What it holds does not change.
3. commit: after the last layer, `cache.commit(record)` keeps what the record says (the sink slots' new contents,
   the last `keep` window keys) in every layer and moves the stream to `record.stream_after`. A forward that
   raises before it leaves the cache as it was.

The masks and tiles (masking.py) are a pure function of the record; they import neither the cache nor the stream.

Shared terms (record.py, stream.py, cache.py, inputs.py, masking.py and kernels.py use each in this sense only):
- stream index: token i of a row has stream index i. `seen`: how many tokens the stream has had.
- document: a row's tokens from a real token whose position id does not continue the previous real token's.
- window part: the keys a cache holds for the window rule, at consecutive stream indices. `held`: how many.
- sinks (S = `sink_count(config)`): the first S tokens of each document, seen by every later query.
- sink slots: where a cache keeps a row's sinks once its window part has moved past them, in front of the window
  part among the keys it returns. `sink_slots`: how many a cache has now (a LexCache none before its first dropped
  key, a LexStaticCache from the start; none where a cache never drops a key).
- record: a `ForwardRecord`; `keep`: how many window keys the cache holds after the forward.
- evicted: window keys a cache has dropped for good (stream indices 0 ... E - 1 of the row). With a block memory
  (`attention_memory_blocks`, memory.py) the cache keeps them in blocks; `memory`: what one forward reads there.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields

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

    def copy_(self, other: "StreamState") -> None:
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))


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
    sink_index: torch.Tensor  # (B, sink_slots) stream index each sink slot holds
    sink_positions: torch.Tensor  # (B, sink_slots)
    sink_valid: torch.Tensor  # (B, sink_slots) bool: the slot holds that token
    allowed: torch.Tensor | None = None  # (B, 1, T, K) bool from a caller's own 4D mask, on top of the window


@dataclass
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


@dataclass
class MemoryRead:
    """What a forward reads of the block memory (the same for every layer; which blocks, each layer's own)."""

    candidates: torch.Tensor  # (B, blocks) bool: complete, all real, after the sinks of the last query's document
    token_valid: torch.Tensor  # (B, k * block) bool: the slot holds a block (the last min(k, candidates) slots)
    document: torch.Tensor  # (B,) stream index where the last query's document starts: its queries read the memory
    carried: torch.Tensor  # (B, blocks) float32: the evidence this forward starts from (the last choice's, memory.py)
    evidence: torch.Tensor  # (B, blocks) float32: `carried` plus the block scores of the layers read so far
    layers_scored: int = 0  # layers that scored the blocks in this forward (none: each read the last choice's)


@dataclass
class MemoryTerms:
    """What each layer's cache gets with its keys for the block memory (the plan's `cache_kwargs["memory"]`)."""

    read: MemoryRead | None  # None: nothing to read in this forward
    place: torch.Tensor | None  # (B, 1, k * block, d): rotation of the raw memory keys into their slots (RoPE)
    unrotate: torch.Tensor | None  # (B, 1, dropped, d): undoes the rotation of the keys this forward evicts (RoPE)


@dataclass
class ForwardRecord:
    """What one forward reads and what the cache keeps after it: made by `Stream.begin` for every cache and for
    none, read by the plan (masking.py) and by each layer's `cache.update`, applied by `cache.commit`."""

    context: AttentionContext
    keep: int | None  # window keys a cache holds after this forward (None: all of them)
    sink_source: torch.Tensor | None  # (B, S): where each sink slot's next content comes from (None: as it is)
    plain: bool  # one document from the stream's start, no padding, nothing held: plain causal attention is exact
    aligned: bool  # each row one document whose blocks start where the new tokens' chunks do
    stream_after: StreamAfter
    memory: MemoryRead | None = None  # what this forward reads of the block memory (None: nothing)

    @property
    def dropped(self) -> int:
        """Window keys this forward evicts (the oldest of those the cache returns after its sink slots)."""
        return 0 if self.keep is None else self.context.key_index.shape[0] - self.keep

    @property
    def sink_slots(self) -> int:
        """The sink slots in front of the keys the cache returns in this forward."""
        return self.context.sink_index.shape[1]

    @property
    def new_tokens(self) -> int:
        return self.context.query_index.shape[0]


__all__ = ["AttentionContext", "ForwardRecord", "MemoryRead", "MemoryTerms", "StreamAfter", "StreamState"]
