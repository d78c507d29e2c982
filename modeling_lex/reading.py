"""The reading policy and the attention plan: what each query of a forward sees, as data.

`ReadingPolicy` is how a model reads, built from the config's reading fields (`ReadingPolicy.of(config)`) and
frozen: the window rule of each attention mode, the one attention-sink rule, the block memory's frame and constants,
what a cache must keep, and how a long input is split into forwards. It is the one owner of these rules: the
stream (stream.py) asks it what to keep and where the sinks are, the memory (memory.py) takes its constants, the
model its spans. Everything it decides is a function of stream indices (token i of a row has stream index i) and of
the stream index where each query's document starts, so the same rules serve the long forward, every cache, every
decoding step and the attention maps.

- The window: full attention sees every earlier key of the document; sliding, the last w keys; blockwise (BCA),
  the query's block and the one before it, blocks of b = w/2 counted from the document's first token.
- Attention sinks (S, blockwise and sliding): the first S tokens of each document stay visible to every later query
  of that document (StreamingLLM). A query sees a sink *as a sink* only where its window does not already show that
  key, so no key counts twice. Where it sees them from: "true", at their own positions; "cache", StreamingLLM's
  positions within the cache (`sink_frame`).
- The block memory (k blocks of b_m tokens): the blocks a forward reads of the keys its window has evicted
  (memory.py) sit in the same frame, in the k * b_m places just before the window; the sinks move before them.

`build_plan` turns one forward's `AttentionContext` (what it reads: made by the stream, stream.py) into an
`AttentionPlan` once per forward: which keys each query may see (the policy's rules, causal order, padding and
document boundaries, as one additive mask) and the position terms of queries and keys relative to an anchor inside
each window, tile by tile. Every layer then runs the same plan on its own q, k, v (kernels.py):

- a *dense* tile: one group of queries against one span of keys (short inputs, decoding steps, attention maps,
  and full attention, which walks long inputs in query chunks so no position is ever taken far from its anchor);
- a *chunked* tile: the queries cut into chunks of one block (b = w/2) and each chunk paired with the L + b keys
  it can reach (L = b for aligned blockwise blocks, w - 1 otherwise), all chunks in one batched attention call.
  `chunk_map` is the one index map of a chunked tile. Time and memory are O(n * (L + b)), never n x n.

A tile also gets, per row, S *sink columns*, the first S tokens of the document of its first query, taken from the
window part or, once the window has moved past them, from the cache's sink slots.

No decision here reads tensor contents on the host: what needs a Python value comes from shapes or from
`AttentionContext.plain` / `.aligned`, which the stream sets from what the caller passed. So the forward compiles
without graph breaks. Nothing here holds state or imports what does.
"""

import functools
from dataclasses import dataclass, field

import torch

from configuration_lex.configuration_lex import (ATTENTION_MODES, SINK_POSITIONS, WINDOW_RULE, AttentionMode,
                                                 SinkPositions, is_window)

from .positions import PositionMethod


@dataclass(frozen=True)
class ReadingPolicy:
    """How a model reads (see the module docstring): built from a config by `of`, or directly; validated by itself.

    The memory's constants are fields, named and documented (docs/concepts/retrieval-rule.md): a prompt's last w
    tokens are read in pieces of p = max(b_m, w / `piece_divisor`) tokens, the last p / `tail_divisor` of them in a
    forward of their own; a forward of at most p tokens chooses with every query, a longer one with b_m of them;
    each block keeps b_m / `representative_divisor` (at least 1) representative keys; floor(k / `centre_divisor`)
    blocks are chosen with their neighbours.
    """

    mode: AttentionMode  # attention_mode
    window: int  # attention_window: w
    sinks: int  # attention_sinks: S (none in full mode: it sees everything)
    sink_positions: SinkPositions  # attention_sink_positions
    memory_blocks: int = 0  # attention_memory_blocks: k (none in full mode)
    memory_block_size: int = 16  # attention_memory_block_size: b_m
    local_window: int | None = None  # local_attention_window: what local layers read (a cache keeps it too)
    piece_divisor: int = 16
    tail_divisor: int = 4
    representative_divisor: int = 4
    centre_divisor: int = 3
    # Derived once (fields, not properties: every layer of every forward reads them):
    block: int = field(init=False)  # b = w / 2: blockwise attention's blocks (a query sees its own and the last)
    memory_tokens: int = field(init=False)  # k * b_m: the memory's places in the frame (0 without a memory)
    piece: int = field(init=False)  # p = max(b_m, w / piece_divisor)
    representatives: int = field(init=False)  # per memory block and key/value head: b_m / representative_divisor, >= 1
    centre_blocks: int = field(init=False)  # blocks chosen with their neighbours: floor(k / centre_divisor)
    most_reach: int = field(init=False)  # the most keys before a query its window shows: what a cache keeps

    def __post_init__(self) -> None:
        if self.mode not in ATTENTION_MODES:
            raise ValueError(f"ReadingPolicy.mode={self.mode!r} (allowed: {', '.join(ATTENTION_MODES)})")
        if self.sink_positions not in SINK_POSITIONS:
            raise ValueError(f"ReadingPolicy.sink_positions={self.sink_positions!r} (allowed: "
                             f"{', '.join(SINK_POSITIONS)})")
        if not is_window(self.window):
            raise ValueError(f"ReadingPolicy.window={self.window!r} must be {WINDOW_RULE}")
        for name in ("sinks", "memory_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"ReadingPolicy.{name}={getattr(self, name)!r} must be >= 0")
        for name in ("memory_block_size", "piece_divisor", "tail_divisor", "representative_divisor", "centre_divisor"):
            if getattr(self, name) < 1:
                raise ValueError(f"ReadingPolicy.{name}={getattr(self, name)!r} must be >= 1")
        if self.mode == "full":  # what full attention reads: no sinks, no memory
            object.__setattr__(self, "sinks", 0)
            object.__setattr__(self, "memory_blocks", 0)
        derived = {"block": self.window // 2, "memory_tokens": self.memory_blocks * self.memory_block_size,
                   "piece": max(self.memory_block_size, self.window // self.piece_divisor),
                   "representatives": max(1, self.memory_block_size // self.representative_divisor),
                   "centre_blocks": self.memory_blocks // self.centre_divisor}
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        # (a block's last query reaches furthest back; past the document's first window: `window_reach`)
        object.__setattr__(self, "most_reach", self.window_reach(self.window + self.block - 1))

    @classmethod
    def _cached(cls, *fields) -> "ReadingPolicy":
        """One policy per set of fields (made once, outside compiled code: dynamo does not trace an lru_cache)."""
        return cls(*fields) if torch.compiler.is_compiling() else _policy(cls, *fields)

    @classmethod
    def of(cls, config) -> "ReadingPolicy":
        """The policy of a config's reading fields (attention_mode, attention_window, attention_sinks,
        attention_sink_positions, attention_memory_blocks, attention_memory_block_size, local_attention_window):
        read at each call, so a config changed at run time reads so from its next forward."""
        return cls._cached(config.attention_mode, config.attention_window, config.attention_sinks,
                           config.attention_sink_positions, config.attention_memory_blocks,
                           config.attention_memory_block_size, config.local_attention_window)

    def local(self) -> "ReadingPolicy":
        """What a local layer reads (`local_layers`): sliding over its own window, without sinks or a memory."""
        return ReadingPolicy._cached("sliding", self.local_window, 0, self.sink_positions, 0,
                                     self.memory_block_size, None)

    # ------------------------------------------------------------------------------------------ who sees whom

    def window_reach(self, offset: int | torch.Tensor) -> int | torch.Tensor:
        """The window rule, stated here alone: how many keys before a query its window shows, for queries `offset`
        tokens into their document (not cut at the document's start): sliding w - 1; blockwise its own block's keys
        before it and the last block, b + offset mod b; full every one, offset. Who sees whom, the first key of a
        window, what a cache keeps for the next query (`most_reach`), the static cache's slots and a chunk's reach
        all ask it."""
        if self.mode == "sliding":
            return 0 * offset + self.window - 1  # (an int for an int, a tensor of offsets' shape for a tensor)
        if self.mode == "blockwise":
            return self.block + offset % self.block
        return offset

    def visible(self, q_index: torch.Tensor, k_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Whether the query at stream index q_index sees the key at k_index through its window (shapes broadcast):
        causal, inside the query's document (which starts at `start`), and from its window's first key on."""
        allowed = (k_index <= q_index) & (k_index >= start)
        if self.mode != "full":  # (full: the document's start is the window's)
            allowed = allowed & (k_index >= self.window_first(q_index, start))  # (no (T, K) difference of indices)
        return allowed

    def sink_indices(self, start: torch.Tensor) -> torch.Tensor:
        """The sink rule, stated here alone: which tokens are the attention sinks of a document starting at stream
        index `start`, its first S (stream indices, start.shape + (S,)). Who sees a sink (`seen_as_sink`), where a
        cache finds and keeps them (`find_sinks`, a rollback) and where the block memory's candidates begin (after them:
        `readable_blocks`) ask it."""
        return start[..., None] + torch.arange(self.sinks, device=start.device)

    def seen_as_sink(self, q_index: torch.Tensor, k_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Whether the query sees the key as an attention sink: one of its document's sinks (`sink_indices`),
        before the query, and not shown by the query's window."""
        sink = (k_index[..., None] == self.sink_indices(start)).any(-1)
        return sink & (k_index <= q_index) & ~self.visible(q_index, k_index, start)

    def window_first(self, q_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Stream index of the first key the query's window shows (shapes broadcast): `window_reach` keys before
        it, not before its document's start."""
        return torch.maximum(q_index - self.window_reach(q_index - start), start)

    def memory_frame(self, q_index: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a query sees the block memory from: in a frame where its window starts at 0, the memory's k * b_m
        places just before it (-k * b_m ... -1) and the query at its offset in its window. Returns the query's place
        (the shape of q_index and start broadcast) and the memory's places (k * b_m,)."""
        return q_index - self.window_first(q_index, start), memory_places(self.memory_tokens, q_index.device)

    def sink_frame(self, q_index: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sink position rule: where a query sees its sinks from.

        "true": at their own positions (None: no frame of their own). "cache" (StreamingLLM): in a frame where the
        query's window starts at 0, sink j sits at j - S, just before it (just before the block memory's k * b_m
        places, if any, `memory_frame`: at j - S - k * b_m), and the query at its offset in its window: returns the
        query's place (the shape of q_index and start broadcast) and the sinks' places (S,), so sink j is seen at
        distance offset + S - j (+ k * b_m), never more than S + k * b_m + w.
        """
        if self.sink_positions == "true":
            return None
        query, memory = self.memory_frame(q_index, start)
        before = memory[0] if self.memory_tokens else 0  # (just before the memory's first place, where it has one)
        return query, torch.arange(-self.sinks, 0, device=q_index.device) + before

    # ------------------------------------------------------------------------------------------ what a cache keeps

    def keep_from(self, first_query: int, start: torch.Tensor | None) -> int:
        """The stream index of the first key that queries from stream index `first_query` on may see, over rows
        whose documents start at `start` (B,) (None: the most any query reaches back, `most_reach`, which reads no
        tensor on the host): the first query's window reaches furthest back (`window_reach`, not cut at the
        document's start); local layers (`local_window`) read their own window from the same keys."""
        if start is None:
            first = first_query - self.most_reach
        else:
            first = int((first_query - self.window_reach(first_query - start)).min())
        if self.local_window is not None:
            first = min(first, first_query - self.local().most_reach)
        return first

    # ------------------------------------------------------------------------------------------ forwards of an input

    def spans(self, length: int) -> list[tuple[int, int]]:
        """The (start, stop) of each forward in which an input of `length` tokens is read through a LEX cache: w
        tokens at a time; with a block memory, the w tokens before the last in pieces of p (at most
        `piece_divisor` forwards, whatever b_m), the last p / `tail_divisor` of them in a forward of their own, and
        the last token alone."""
        window = self.window
        if not self.memory_tokens or length == 1:
            stops = set(range(window, length, window)) | {length}
        else:
            piece = self.piece
            pieces_from = max(window, length - 1 - window)  # (a forward from token 0 to w evicts nothing first)
            stops = set(range(window, pieces_from, window)) | set(range(pieces_from, length - 1, piece))
            stops |= {length - 1, length}
            tail = length - 1 - max(1, piece // self.tail_divisor)
            if tail > pieces_from:
                stops.add(tail)
        stops = sorted(stops)
        return list(zip([0] + stops[:-1], stops))


@functools.lru_cache(maxsize=64)
def _policy(cls: type, *fields) -> ReadingPolicy:
    return cls(*fields)


def memory_places(count: int, device: torch.device) -> torch.Tensor:
    """The block memory's `count` = k * b_m places in a query's frame: -k * b_m ... -1, just before its window."""
    return torch.arange(-count, 0, device=device)


def find_sinks(policy: ReadingPolicy, start: torch.Tensor, key_index: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the sinks of documents starting at `start` are: their stream indices (`ReadingPolicy.sink_indices`,
    `start.shape + (S,)`), their columns among the window part's keys (consecutive stream indices `key_index`;
    clamped into range) and whether they lie there at all, or before it (then in a cache's sink slots)."""
    wanted = policy.sink_indices(start)
    column = wanted - key_index[0]
    return wanted, column.clamp(0, key_index.shape[0] - 1), column >= 0


def chunk_map(total: int, n_keys: int, block: int, left: int, device: torch.device):
    """The index map of a chunked tile: queries in chunks of one block, each against the `left + block` keys
    before and beside it.

    Of the window part's `n_keys` keys, the last `total` are the queries' own. Returns the query slots (chunks,
    block) (the tail of the last chunk repeats the last query), the key slots (chunks, left + block) clamped into
    range, and whether each key slot exists: slot s of chunk j is key n_keys - total - left + j*block + s.
    """
    n_chunks = -(-total // block)
    first = n_keys - total - left
    chunk_starts = first + torch.arange(n_chunks, device=device)[:, None] * block
    key_slots = chunk_starts + torch.arange(left + block, device=device)
    exists = (key_slots >= 0) & (key_slots < n_keys)
    query_slots = torch.arange(n_chunks * block, device=device).clamp(max=total - 1).view(n_chunks, block)
    return query_slots, key_slots.clamp(0, n_keys - 1), exists


# ------------------------------------------------------------------------------------------ what a forward reads


@dataclass(frozen=True)
class MemoryRead:
    """What a forward reads of the block memory (the same for every layer; which blocks, each layer's own)."""

    candidates: torch.Tensor  # (B, blocks) bool: complete, all real, after the sinks of the last query's document
    token_valid: torch.Tensor  # (B, n * block) bool: the slot holds a block (a row's last min(k, candidates) of the
    # n <= k slots read: as many as the row with most candidates fills)
    document: torch.Tensor  # (B,) stream index where the last query's document starts: its queries read the memory


def readable_blocks(policy: ReadingPolicy, evicted_valid: torch.Tensor, document: torch.Tensor
                    ) -> MemoryRead | None:
    """What a forward reads of the block memory, from whether each evicted token is real (`evicted_valid` (B, E)):
    the complete blocks, all real and after the sinks of the document of the forward's last query (which starts at
    `document`, (B,)), and the slots they fill; None where no row has a candidate. Only the slots some row fills
    are read (the last of the k: the empty ones come first, and a slot no row fills adds nothing to attention), so
    a document with fewer than k blocks past its window is not attended over k of them."""
    slots, block = policy.memory_blocks, policy.memory_block_size
    blocks = evicted_valid.shape[1] // block
    if blocks == 0:
        return None
    real = evicted_valid[:, : blocks * block].unflatten(1, (blocks, block)).all(-1)
    first = torch.arange(blocks, device=document.device) * block
    after = policy.sink_indices(document)[:, -1] + 1 if policy.sinks else document  # (past the last sink)
    candidates = real & (first[None, :] >= after[:, None])
    count = candidates.sum(1).clamp(max=slots)
    slots = int(count.max())
    if slots == 0:
        return None
    filled = torch.arange(slots, device=document.device)[None, :] >= slots - count[:, None]
    return MemoryRead(candidates, filled.repeat_interleave(block, dim=1), document)


@dataclass(frozen=True)
class AttentionContext:
    """What one forward reads, the same for every layer: where its keys come from and what each query may see.

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
    plain: bool = False  # one document from the stream's start, no padding, nothing held: plain causal attention
    aligned: bool = False  # each row one document whose blocks start where the new tokens' chunks do
    dropped: int = 0  # window keys this forward evicts (the oldest after the sink slots)
    memory: MemoryRead | None = None  # what this forward reads of the block memory (None: nothing)


# ------------------------------------------------------------------------------------------ the plan



@dataclass
class Tile:
    """A group of queries against the keys they may see, with everything position-dependent precomputed.

    Dense: queries `query_slice`, keys the per-row `sink_columns` then the window part's `key_slice`. Chunked:
    `query_slots` (chunks, b) of the new tokens against `key_columns` (chunks or (B, chunks), L + b [+ S]) of the
    keys the cache returns (sink slots first); each chunk is one batch entry of the attention call.
    """

    factors: tuple[torch.Tensor, torch.Tensor] | None  # of queries and keys in the tile's layout (rotary methods)
    bias: torch.Tensor | None  # additive: the mask (0 = may attend, -inf not) with any fixed bias; None = plain causal
    distance: torch.Tensor | None = None  # query-minus-key position, for biases the layers learn (KERPLE)
    query_slice: slice | None = None
    key_slice: slice | None = None
    sink_columns: torch.Tensor | None = None  # (B, S)
    query_slots: torch.Tensor | None = None  # (chunks, b)
    key_columns: torch.Tensor | None = None  # (chunks, span) or (B, chunks, span)
    # Sinks seen from a frame of their own (ReadingPolicy.sink_frame) by a rotary method: the first
    # `n_sinks` key columns are met by a second copy of each query, encoded in the sink frame by these factors.
    sink_query_factors: torch.Tensor | None = None
    n_sinks: int = 0
    # A dense tile of one query per row (a decoding step) under per-token RoPE: the sink keys rotated back by the
    # query's shift instead (R(a)q . k = q . R(-a)k), so no second copy of the query is needed: these are the
    # factors of R(-a), which the kernel applies to the tile's copy of the sink keys. Where the sink columns are the
    # cache's own sink slots (`sinks_in_slots`), the tile reads the keys and values the cache returned as one span,
    # without a mask, and the kernel turns the copy of the sink slots the cache lends it (`AttentionPlan.sinks_lent`).
    sink_key_rotation: torch.Tensor | None = None
    sinks_in_slots: bool = False
    # The block memory's key columns (memory.py: `recall`), after the window part's: met by the second copy of each
    # query, where there is one; per-token RoPE keys turned from the memory's frame into the tile's.
    n_memory: int = 0
    memory_place: torch.Tensor | None = None  # (B, 1, 1, d): from the memory's frame to the tile's (_memory_terms)


@dataclass
class AttentionPlan:
    """What every layer of one forward runs: its one tile (one call of the attention backend), and what each layer
    hands its cache with its keys (`cache.update(key, value, layer_idx, plan)`; other caches take the plan as an
    extra argument they ignore) and its block memory."""

    tile: Tile | None
    sink_slots: int  # the cache's sink slots, which come first among the keys it returns
    attention_maps: bool = False  # a dense tile over every key, whose weights are the full attention map
    token_factors: torch.Tensor | None = None  # (B, 1, T, d): per-token encodings (RoPE; positions.encode_tokens)
    # A decoding step that turns its sinks to the query (RoPE) turns the copy of the sink slots the cache returns
    # before its window part, in place (kernels.arrange): the cache lends that copy and writes the raw slots back
    # when the step ends.
    sinks_lent: bool = False
    # A decoding step that reads the block memory's blocks after its span: the columns the cache lends after the
    # span's end, where attention writes them (kernels.arrange), so that the span and the blocks are one tensor
    # without copying the span.
    memory_room: int = 0
    # With a block memory (RoPE; None otherwise and in layers without positions): (B, 1, dropped, d), what undoes
    # the rotation of the keys this forward evicts, which the cache hands the memory.
    memory_unrotate: torch.Tensor | None = None
    # With a block memory (RoPE; None otherwise and in layers without positions): (1, 1, n * b, d), the rotation of
    # raw memory keys to their places in the frame (ReadingPolicy.memory_frame: the last n * b of its k * b places,
    # for the n slots read), which each layer hands its memory (`BlockMemory.recall`): applied once per choice, so
    # the memory holds the blocks it read so.
    memory_frame: torch.Tensor | None = None


def additive_mask(allowed: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """One additive mask in the model's dtype (0 or the bias where allowed, the dtype's minimum elsewhere).

    Built once per forward: backends would otherwise convert a boolean mask (and add a bias) in every layer.
    """
    if allowed is None and bias is None:
        return None
    base = torch.zeros((), dtype=dtype, device=(allowed if bias is None else bias).device)
    if bias is not None:
        base = bias.to(dtype)
    if allowed is None:
        q_len, k_len = bias.shape[-2:]
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=bias.device).tril(k_len - q_len)
    return torch.where(allowed, base, torch.finfo(dtype).min)


def _gather_rows(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """values (B, K) at per-row columns (B, ...) -> (B, ...)."""
    return values.gather(1, columns.flatten(1)).view(columns.shape)


def locate_sinks(policy: ReadingPolicy, ctx: AttentionContext, start: torch.Tensor):
    """The sink columns of documents starting at stream index `start` (B, ...): their columns among the keys the
    cache returns (sink slots first), stream indices, positions and validity, each `start.shape + (S,)`."""
    sinks, sink_slots = policy.sinks, ctx.sink_index.shape[1]
    wanted, column, in_window = find_sinks(policy, start, ctx.key_index)
    positions = _gather_rows(ctx.key_positions, column)
    valid = in_window & (wanted <= ctx.key_index[-1]) & _gather_rows(ctx.key_valid, column)
    columns = sink_slots + column
    if sink_slots:  # older sinks live in the cache's sink slots, one per row

        def per_row(t: torch.Tensor) -> torch.Tensor:
            return t.view(t.shape[0], *[1] * (wanted.dim() - 2), t.shape[1]).expand(wanted.shape)

        slot = torch.arange(sinks, device=start.device).expand(wanted.shape)
        held = per_row(ctx.sink_valid) & (per_row(ctx.sink_index) == wanted)
        positions = torch.where(in_window, positions, per_row(ctx.sink_positions))
        valid = torch.where(in_window, valid, held)
        columns = torch.where(in_window, columns, slot)
    return columns, wanted, positions, valid


def allowed_keys(policy: ReadingPolicy, q_index, k_index, k_valid, start, n_sinks: int, allowed_4d=None) -> torch.Tensor:
    """Which keys each query sees; the first `n_sinks` key columns are sink columns, seen by the sink rule. Shapes
    broadcast: q_index/start (..., T, 1), k_index/k_valid (..., 1, K)."""
    k_index, sink_index = k_index[..., n_sinks:], k_index[..., :n_sinks]
    allowed = policy.visible(q_index, k_index, start) & k_valid[..., n_sinks:]
    allowed = allowed | (q_index == k_index)  # a padding query sees itself, so its row has a key
    if allowed_4d is not None:
        allowed = allowed & allowed_4d
    if n_sinks:
        as_sink = policy.seen_as_sink(q_index, sink_index, start) & k_valid[..., :n_sinks]
        allowed = torch.cat([as_sink.expand(*allowed.shape[:-1], n_sinks), allowed], dim=-1)
    return allowed


def _terms(position_method: PositionMethod, q_rel: torch.Tensor, k_rel: torch.Tensor):
    if position_method.per_token:  # encoded once at their own positions (`encode_tokens`): no terms of the tile's
        return None, None, None
    terms = position_method.terms(q_rel, k_rel)
    return terms.factors, terms.bias, terms.distance


def _sink_frame_terms(position_method: PositionMethod, terms: tuple, frame: tuple, q_positions, sink_positions,
                      turn_keys: bool = False):
    """The position terms of the first S key columns (the sinks) in their frame (ReadingPolicy.sink_frame); the other
    columns keep theirs. Returns (factors, bias, distance, sink_query_factors): a rotary method meets the sinks with
    a second copy of each query encoded in the frame (per-token RoPE: moved from its own position by the shift
    that puts the stored sink keys there; with `turn_keys`, the factors of the inverse shift instead, which turn the
    sink keys to the query: R(a)q . k = q . R(-a)k)."""
    factors, bias, distance = terms
    q_frame, k_frame = frame
    sinks = k_frame.shape[0]
    if position_method.per_token:  # keys hold their own positions: sink j is at p_s + j, the frame puts it at
        shift = q_frame - k_frame[0] + sink_positions[..., :1] - q_positions  # p_q - (q_frame - k_frame[j]) - j
        return factors, bias, distance, position_method.shift_factors(-shift if turn_keys else shift)
    sink = position_method.terms(q_frame, k_frame.expand(*q_frame.shape[:-1], sinks))
    query_factors = None
    if sink.factors is not None:
        query_factors, sink_keys = sink.factors
        factors = (factors[0], torch.cat([sink_keys, factors[1][..., sinks:, :]], dim=-2))
    if sink.bias is not None:
        bias = torch.cat([sink.bias, bias[..., sinks:]], dim=-1)
    if sink.distance is not None:
        distance = torch.cat([sink.distance, distance[..., sinks:]], dim=-1)
    return factors, bias, distance, query_factors


def _dense_tile(
    policy: ReadingPolicy, position_method: PositionMethod, ctx: AttentionContext, queries: slice, keys: slice,
    dtype: torch.dtype, plain: bool, memory: MemoryRead | None = None,
) -> Tile:
    """The tile of queries `queries` against the window part's keys `keys` and the sink columns; with what a forward
    reads of the block memory (`memory`), the memory's slots last."""
    anchor = ctx.query_positions[:, queries.start : queries.start + 1]
    k_index = ctx.key_index[keys].expand(anchor.shape[0], -1)
    k_positions, k_valid = ctx.key_positions[:, keys], ctx.key_valid[:, keys]
    sink_columns, n_sinks = None, 0
    if policy.sinks and not plain:
        sink_columns, sink_index, sink_positions, sink_valid = locate_sinks(
            policy, ctx, ctx.document_start[:, queries.start])
        k_index = torch.cat([sink_index, k_index], dim=1)
        k_positions = torch.cat([sink_positions, k_positions], dim=1)
        k_valid = torch.cat([sink_valid, k_valid], dim=1)
        n_sinks = sink_index.shape[1]
    q_rel = ctx.query_positions[:, queries] - anchor
    k_rel = torch.where(k_valid, k_positions, anchor) - anchor  # padding and empty slots: at 0
    factors, bias, distance = _terms(position_method, q_rel, k_rel)
    sink_query_factors = sink_key_rotation = None
    sinks_in_slots = False
    frame = policy.sink_frame(ctx.query_index[queries][None], ctx.document_start[:, queries]) if n_sinks else None
    if frame is not None:
        turn_keys = position_method.per_token and queries.stop - queries.start == 1
        factors, bias, distance, sink_query_factors = _sink_frame_terms(
            position_method, (factors, bias, distance), frame, ctx.query_positions[:, queries], sink_positions,
            turn_keys)
        if sink_query_factors is not None and turn_keys:
            sink_key_rotation, sink_query_factors = sink_query_factors.unsqueeze(1), None
            sinks_in_slots = (keys.start == 0 and ctx.sink_index.shape[1] == n_sinks and not torch.compiler
                              .is_compiling()
                              and bool((sink_columns == torch.arange(n_sinks, device=sink_columns.device)).all()))
        elif sink_query_factors is not None:
            sink_query_factors = sink_query_factors.unsqueeze(1)
    memory_place = None
    n_memory = 0
    if memory is not None:
        origin = sink_positions[:, :1] - frame[1][0] if frame is not None else policy.memory_tokens
        n_memory = memory.token_valid.shape[1]
        factors, bias, distance, sink_query_factors, memory_place = _memory_terms(
            position_method, (factors, bias, distance, sink_query_factors), policy, ctx, queries, origin, n_memory)
    if factors is not None:
        factors = tuple(f.unsqueeze(1) for f in factors)  # broadcast over heads
    allowed = None
    if not plain:
        allowed_4d = None if ctx.allowed is None else ctx.allowed[:, 0, queries, keys]
        allowed = allowed_keys(policy, ctx.query_index[queries][None, :, None], k_index[:, None, :],
                               k_valid[:, None, :],
                        ctx.document_start[:, queries, None], n_sinks, allowed_4d)
        if memory is not None:  # the slots that hold a block, for the queries of the document it was read for
            reads = ctx.document_start[:, queries, None] == memory.document[:, None, None]
            allowed = torch.cat([allowed, reads & memory.token_valid[:, None, :]], dim=-1)
        allowed = allowed.unsqueeze(1)
        if _sees_every_key(allowed):
            allowed = None
    return Tile(factors, additive_mask(allowed, bias, dtype), distance, query_slice=queries, key_slice=keys,
                sink_columns=sink_columns, sink_query_factors=sink_query_factors, n_sinks=n_sinks,
                sink_key_rotation=sink_key_rotation, sinks_in_slots=sinks_in_slots, n_memory=n_memory,
                memory_place=memory_place)


def _memory_terms(position_method: PositionMethod, terms: tuple, policy: ReadingPolicy, ctx: AttentionContext, queries: slice,
                  origin, n_memory: int):
    """The position terms of the block memory's `n_memory` key columns (after the window part: the last of its k * b
    places in the frame, ReadingPolicy.memory_frame). Returns (factors, bias, distance, sink_query_factors, memory_place).

    A method that is not per token gets their terms in the frame, met by the query's second copy (the sinks' own,
    or made here). Per-token RoPE: the memory holds its keys at their frame places (`AttentionPlan.memory_frame`), and
    `memory_place` (B, 1, 1, d) turns them by one shift to where the queries meet them, where the query meets its
    sinks through a second copy shifted into the frame: by `origin` (the position the sinks' frame puts frame place
    0 at: their first position plus S + k * b, or k * b without sinks). One query per row has no second copy (its
    sinks are turned to it): the keys are turned by its position less its place in the frame (R(a)q . k = q .
    R(-a)k)."""
    factors, bias, distance, query_factors = terms
    q_index, start = ctx.query_index[queries][None], ctx.document_start[:, queries]
    q_frame, k_frame = policy.memory_frame(q_index, start)  # (B, T), (M,)
    if position_method.per_token:
        q_positions = ctx.query_positions[:, queries]
        if q_positions.shape[1] == 1:
            return factors, bias, distance, query_factors, position_method.shift_factors(q_positions - q_frame
                                                                                         ).unsqueeze(1)
        shift = origin if torch.is_tensor(origin) else torch.full_like(q_positions[:, :1], origin)
        if query_factors is None:
            query_factors = position_method.shift_factors(q_frame + origin - q_positions).unsqueeze(1)
        return factors, bias, distance, query_factors, position_method.shift_factors(shift).unsqueeze(1)
    memory = position_method.terms(q_frame, k_frame[-n_memory:].expand(q_frame.shape[0], -1))
    if memory.factors is not None:
        if query_factors is None:
            query_factors = memory.factors[0].unsqueeze(1)
        factors = (factors[0], torch.cat([factors[1], memory.factors[1]], dim=-2))
    if memory.bias is not None:
        bias = torch.cat([bias, memory.bias], dim=-1)
    if memory.distance is not None:
        distance = torch.cat([distance, memory.distance], dim=-1)
    return factors, bias, distance, query_factors, None


def _sees_every_key(allowed: torch.Tensor) -> bool:
    """A single query per row that sees every key the tile gives it (a decoding step whose cache holds exactly
    its window): attention without a mask computes the same. Read on the host, not while compiling (a compiled
    step keeps one graph with its mask)."""
    return allowed.shape[-2] == 1 and not torch.compiler.is_compiling() and bool(allowed.all())


def _chunked_tile(
    policy: ReadingPolicy, position_method: PositionMethod, ctx: AttentionContext, dtype: torch.dtype, aligned: bool
) -> Tile:
    """All new queries in chunks of one block (b = w/2), each against its L + b reachable keys (and S sink
    columns), as one batched call."""
    total, n_keys = ctx.query_positions.shape[1], ctx.key_positions.shape[1]
    block = policy.block
    # (an aligned chunk starts a block: its first query reaches as one at its document's start does)
    left = policy.window_reach(0) if aligned else policy.most_reach
    query_slots, key_slots, exists = chunk_map(total, n_keys, block, left, ctx.query_positions.device)

    q_pos = ctx.query_positions[:, query_slots]  # (B, chunks, b)
    anchor = q_pos[:, :, :1]
    k_index = torch.where(exists, ctx.key_index[key_slots], -1).expand(q_pos.shape[0], -1, -1)  # -1: no key
    k_positions, k_valid = ctx.key_positions[:, key_slots], ctx.key_valid[:, key_slots] & exists
    key_columns, n_sinks = ctx.sink_index.shape[1] + key_slots, 0
    start = ctx.document_start[:, query_slots]  # (B, chunks, b)
    if policy.sinks:
        sink_columns, sink_index, sink_positions, sink_valid = locate_sinks(policy, ctx, start[:, :, 0])
        key_columns = torch.cat([sink_columns, key_columns.expand(q_pos.shape[0], -1, -1)], dim=2)
        k_index = torch.cat([sink_index, k_index], dim=2)
        k_positions = torch.cat([sink_positions, k_positions], dim=2)
        k_valid = torch.cat([sink_valid, k_valid], dim=2)
        n_sinks = sink_index.shape[2]
    k_rel = torch.where(k_valid, k_positions, anchor) - anchor
    factors, bias, distance = _terms(position_method, q_pos - anchor, k_rel)
    sink_query_factors = None
    frame = policy.sink_frame(ctx.query_index[query_slots][None], start) if n_sinks else None
    if frame is not None:
        factors, bias, distance, sink_query_factors = _sink_frame_terms(
            position_method, (factors, bias, distance), frame, q_pos, sink_positions)
        if sink_query_factors is not None:
            sink_query_factors = sink_query_factors.flatten(0, 1).unsqueeze(1)
    if factors is not None:
        factors = tuple(f.flatten(0, 1).unsqueeze(1) for f in factors)  # (B*chunks, 1, len, d)
    if bias is not None:
        bias = bias.flatten(0, 1)
    if distance is not None:
        distance = distance.flatten(0, 1)
    allowed = allowed_keys(policy, ctx.query_index[query_slots][None, :, :, None], k_index[:, :, None, :],
                    k_valid[:, :, None, :], start[..., None], n_sinks)
    mask = additive_mask(allowed.flatten(0, 1).unsqueeze(1), bias, dtype)  # (B*chunks, 1 or H, b, span)
    return Tile(factors, mask, distance, query_slots=query_slots, key_columns=key_columns,
                sink_query_factors=sink_query_factors, n_sinks=n_sinks)


def build_plan(
    policy: ReadingPolicy, position_method: PositionMethod, ctx: AttentionContext, dtype: torch.dtype,
    attention_maps: bool = False,
) -> AttentionPlan:
    """The forward's one tile. Up to w queries, a caller's own 4D mask (O(T * K) already), attention maps and full
    attention: one dense tile, plainly causal where nothing else is seen (as Llama reads). Past w queries in the
    blockwise and sliding modes: the queries in chunks of one block, each against the keys it can reach, so the
    work and the mask are O(T * (w + b)).

    `attention_maps`: one dense tile over every key (O(T * keys) memory, the caller's choice), so each layer's
    attention weights are the full (batch, heads, T, keys) map.
    """
    total, n_keys = ctx.query_positions.shape[1], ctx.key_positions.shape[1]
    memory = ctx.memory if policy.memory_tokens else None  # (a local layer reads none)
    plan = AttentionPlan(None, ctx.sink_index.shape[1], attention_maps)
    if position_method.per_token:
        plan.token_factors = position_method.token_factors(ctx.query_positions).unsqueeze(1)
    if total <= policy.window or attention_maps or ctx.allowed is not None or policy.mode == "full":
        # (from a document's start, a window hides nothing from its first most_reach + 1 queries: `window_reach`)
        plain = ctx.plain and not attention_maps and (policy.mode == "full" or total <= policy.most_reach + 1)
        plan.tile = _dense_tile(policy, position_method, ctx, slice(0, total), slice(0, n_keys), dtype, plain, memory)
    else:
        plan.tile = _chunked_tile(policy, position_method, ctx, dtype, ctx.aligned)
    frame, unrotate = _memory_rotations(policy, position_method, ctx, memory)
    tile = plan.tile
    one_span = tile.query_slots is None and total == 1 and tile.key_slice == slice(0, n_keys) and (
        tile.sinks_in_slots or tile.sink_columns is None)  # (a decoding step whose keys are the cache's span)
    plan.sinks_lent = tile.sinks_in_slots and tile.sink_key_rotation is not None
    plan.memory_room = tile.n_memory if one_span and not attention_maps else 0
    plan.memory_unrotate = unrotate
    plan.memory_frame = frame
    return plan


@functools.lru_cache(maxsize=8)
def _frame_rotation(position_method: PositionMethod, places: int, device: torch.device) -> torch.Tensor:
    """(1, 1, places, d): the rotation of raw memory keys to their places in the frame (`memory_places`), a constant
    of the model: made once per device."""
    return position_method.shift_factors(memory_places(places, device))[None, None]


def _memory_rotations(policy: ReadingPolicy, position_method: PositionMethod, ctx: AttentionContext,
                      memory: MemoryRead | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What each layer's cache needs for the block memory under per-token RoPE (else None, None): the rotation of
    the keys it reads to their frame places and of the keys this forward evicts back to position 0."""
    frame = unrotate = None
    if position_method.per_token and policy.memory_tokens:
        if memory is not None:
            frame = _frame_rotation(position_method, memory.token_valid.shape[1], ctx.query_index.device)
        if ctx.dropped:
            unrotate = position_method.shift_factors(-ctx.key_positions[:, : ctx.dropped]).unsqueeze(1)
    return frame, unrotate


__all__ = [
    "AttentionContext", "AttentionPlan", "MemoryRead", "ReadingPolicy", "Tile", "build_plan",
    "chunk_map", "find_sinks", "memory_places", "readable_blocks",
]
