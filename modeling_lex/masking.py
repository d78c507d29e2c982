"""What each query sees, as data: the attention plan, a pure function of one forward's record (record.py).

`build_plan` turns the record into an `AttentionPlan` once per forward: which keys each query may see (the window and sink rules of visibility.py,
causal order, padding and document boundaries, as one additive mask) and the position terms of queries and keys
relative to an anchor inside each window, tile by tile. Every layer then runs the same plan on its own q, k, v
(kernels.py):

- a *dense* tile: one group of queries against one span of keys (short inputs, decoding steps, attention maps,
  and full attention, which walks long inputs in query chunks so no position is ever taken far from its anchor);
- a *chunked* tile: the queries cut into chunks of one block (b = w/2) and each chunk paired with the L + b keys
  it can reach (L = b for aligned blockwise blocks, w - 1 otherwise), all chunks in one batched attention call.
  `chunk_map` (visibility.py) is the one index map of a chunked tile: the attention inputs are gathered with it
  and the positions and masks are read through it. Time and memory are O(n * (L + b)), never n x n.

Attention sinks: a tile also gets, per row, S *sink columns*, the first S tokens of the document of its first
query, taken from the window part or, once the window has moved past them, from the cache's sink slots; the sink
rule says which queries see them. Every other query of a tile belongs to a document that started inside the tile,
whose first tokens are inside its window.

No decision here reads tensor contents on the host: what needs a Python value comes from shapes or from
`ForwardRecord.plain` / `.aligned`, which the stream sets from what the caller passed. So the forward compiles
without graph breaks. Nothing here imports the cache or the stream: the plan changes no state.
"""

import functools
from dataclasses import dataclass

import torch

from .positions import PositionMethod
from .record import AttentionContext, CacheRequest, ForwardRecord
from .visibility import (
    chunk_map, locate_in_window, memory_frame, memory_places, memory_tokens, seen_as_sink, sink_count, sink_frame,
    sink_indices, window_visible,
)
from .xpos import inverse_rotation


@dataclass
class Tile:
    """A group of queries against the keys they may see, with everything position-dependent precomputed.

    Dense: queries `query_slice`, keys the per-row `sink_columns` then the window part's `key_slice`. Chunked:
    `query_slots` (chunks, b) of the new tokens against `key_columns` (chunks or (B, chunks), L + b [+ S]) of the
    keys the cache returns (sink slots first); each chunk is one batch entry of the attention call.
    """

    factors: tuple[torch.Tensor, torch.Tensor] | None  # of queries and keys in the tile's layout (rotary methods)
    mask: torch.Tensor | None  # additive (0 = may attend) with any fixed bias folded in; None = plain causal
    distance: torch.Tensor | None = None  # query-minus-key position, for biases the layers learn (KERPLE)
    query_slice: slice | None = None
    key_slice: slice | None = None
    sink_columns: torch.Tensor | None = None  # (B, S)
    query_slots: torch.Tensor | None = None  # (chunks, b)
    first_query: int = 0  # the chunked tile's first query (its outputs start there)
    key_columns: torch.Tensor | None = None  # (chunks, span) or (B, chunks, span)
    # Sinks seen from a frame of their own (visibility.sink_frame) by a rotary method: the first
    # `n_sinks` key columns are met by a second copy of each query, encoded in the sink frame by these factors.
    sink_query_factors: torch.Tensor | None = None
    n_sinks: int = 0
    # A dense tile of one query per row (a decoding step) under per-token RoPE: the sink keys rotated back by the
    # query's shift instead (R(a)q . k = q . R(-a)k), so no second copy of the query is needed: these are the
    # factors of R(-a), which the kernel applies to the tile's copy of the sink keys. Where the sink columns are the
    # cache's own sink slots (`sinks_in_slots`), the cache applies them instead, to the copy of its sink slots it
    # puts before its window part (`AttentionPlan.cache_request`, cache.py), and the tile reads the keys and values
    # the cache returned as one span, without a mask.
    sink_key_rotation: torch.Tensor | None = None
    sinks_in_slots: bool = False
    # The block memory's key columns (memory.py), which the cache returns apart (`recall`), after the window
    # part's: met by the second copy of each query, where there is one; per-token RoPE keys turned into place.
    n_memory: int = 0
    memory_place: torch.Tensor | None = None  # (B, 1, 1, d): from the memory's frame to the tile's (_memory_terms)
    memory_query_rotation: torch.Tensor | None = None  # (B, 1, 1, d): one query per row turned into the frame


@dataclass
class AttentionPlan:
    """What every layer of one forward runs: the tiles, and what each layer hands its cache with its keys."""

    tiles: list[Tile]
    sink_slots: int  # the cache's sink slots, which come first among the keys it returns
    attention_maps: bool = False  # one dense tile over every key, whose weights are the full attention map
    token_factors: torch.Tensor | None = None  # (B, 1, T, d): per-token encodings (RoPE; xpos.encode_tokens)
    # (B, 1, 1, d): a decoding step's one query per row turned into the block memory's frame (RoPE; encode_tokens),
    # where it meets the memory's keys as the memory holds them (kernels.py)
    query_turn: torch.Tensor | None = None
    cache_request: CacheRequest | None = None  # what every layer hands its cache (set with the tiles)


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


def locate_sinks(config, ctx: AttentionContext, start: torch.Tensor):
    """The sink columns of documents starting at stream index `start` (B, ...): their columns among the keys the
    cache returns (sink slots first), stream indices, positions and validity, each `start.shape + (S,)`."""
    sinks, sink_slots = sink_count(config), ctx.sink_index.shape[1]
    wanted = sink_indices(start, sinks)
    column, in_window = locate_in_window(wanted, ctx.key_index)
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


def allowed_keys(config, q_index, k_index, k_valid, start, n_sinks: int, allowed_4d=None) -> torch.Tensor:
    """Which keys each query sees; the first `n_sinks` key columns are sink columns, seen by the sink rule. Shapes
    broadcast: q_index/start (..., T, 1), k_index/k_valid (..., 1, K)."""
    k_index, sink_index = k_index[..., n_sinks:], k_index[..., :n_sinks]
    allowed = window_visible(config, q_index, k_index, start) & k_valid[..., n_sinks:]
    allowed = allowed | (q_index == k_index)  # a padding query sees itself, so its row has a key
    if allowed_4d is not None:
        allowed = allowed & allowed_4d
    if n_sinks:
        as_sink = seen_as_sink(config, q_index, sink_index, start) & k_valid[..., :n_sinks]
        allowed = torch.cat([as_sink.expand(*allowed.shape[:-1], n_sinks), allowed], dim=-1)
    return allowed


def _terms(position_method: PositionMethod, q_rel: torch.Tensor, k_rel: torch.Tensor):
    terms = position_method.terms(q_rel, k_rel)
    return terms.factors, terms.bias, terms.distance


def _sink_frame_terms(position_method: PositionMethod, terms: tuple, frame: tuple, q_positions, sink_positions):
    """The position terms of the first S key columns (the sinks) in their frame (visibility.sink_frame); the other
    columns keep theirs. Returns (factors, bias, distance, sink_query_factors): a rotary method meets the sinks with
    a second copy of each query encoded in the frame (per-token RoPE: moved from its own position by the shift
    that puts the stored sink keys there)."""
    factors, bias, distance = terms
    q_frame, k_frame = frame
    sinks = k_frame.shape[0]
    if position_method.per_token:  # keys hold their own positions: sink j is at p_s + j, the frame puts it at
        shift = q_frame - k_frame[0] + sink_positions[..., :1] - q_positions  # p_q - (q_frame - k_frame[j]) - j
        return factors, bias, distance, position_method.shift_factors(shift)
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
    config, position_method: PositionMethod, ctx: AttentionContext, queries: slice, keys: slice, dtype: torch.dtype,
    plain: bool, record: ForwardRecord | None = None,
) -> Tile:
    """The tile of queries `queries` against the window part's keys `keys` and the sink columns; with the `record`
    of a forward that reads the block memory, the memory's slots last."""
    memory = None if record is None or not memory_tokens(config) else record.memory  # (a local layer: none)
    anchor = ctx.query_positions[:, queries.start : queries.start + 1]
    k_index = ctx.key_index[keys].expand(anchor.shape[0], -1)
    k_positions, k_valid = ctx.key_positions[:, keys], ctx.key_valid[:, keys]
    sink_columns, n_sinks = None, 0
    if sink_count(config) and not plain:
        sink_columns, sink_index, sink_positions, sink_valid = locate_sinks(
            config, ctx, ctx.document_start[:, queries.start])
        k_index = torch.cat([sink_index, k_index], dim=1)
        k_positions = torch.cat([sink_positions, k_positions], dim=1)
        k_valid = torch.cat([sink_valid, k_valid], dim=1)
        n_sinks = sink_index.shape[1]
    q_rel = ctx.query_positions[:, queries] - anchor
    k_rel = torch.where(k_valid, k_positions, anchor) - anchor  # padding and empty slots: at 0
    factors, bias, distance = _terms(position_method, q_rel, k_rel)
    sink_query_factors = sink_key_rotation = None
    sinks_in_slots = False
    frame = sink_frame(config, ctx.query_index[queries][None], ctx.document_start[:, queries]) if n_sinks else None
    if frame is not None:
        factors, bias, distance, sink_query_factors = _sink_frame_terms(
            position_method, (factors, bias, distance), frame, ctx.query_positions[:, queries], sink_positions)
        if sink_query_factors is not None and position_method.per_token and queries.stop - queries.start == 1:
            sink_key_rotation, sink_query_factors = inverse_rotation(sink_query_factors).unsqueeze(1), None
            sinks_in_slots = (keys.start == 0 and ctx.sink_index.shape[1] == n_sinks and not torch.compiler
                              .is_compiling()
                              and bool((sink_columns == torch.arange(n_sinks, device=sink_columns.device)).all()))
        elif sink_query_factors is not None:
            sink_query_factors = sink_query_factors.unsqueeze(1)
    memory_place = memory_query_rotation = None
    n_memory = 0
    if memory is not None:
        origin = sink_positions[:, :1] - frame[1][0] if frame is not None else memory_tokens(config)
        factors, bias, distance, sink_query_factors, memory_place, memory_query_rotation = _memory_terms(
            position_method, (factors, bias, distance, sink_query_factors), config, ctx, queries, origin)
        n_memory = memory.token_valid.shape[1]
    if factors is not None:
        factors = tuple(f.unsqueeze(1) for f in factors)  # broadcast over heads
    allowed = None
    if not plain:
        allowed_4d = None if ctx.allowed is None else ctx.allowed[:, 0, queries, keys]
        allowed = allowed_keys(config, ctx.query_index[queries][None, :, None], k_index[:, None, :],
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
                memory_place=memory_place, memory_query_rotation=memory_query_rotation)


def _memory_terms(position_method: PositionMethod, terms: tuple, config, ctx: AttentionContext, queries: slice,
                  origin):
    """The position terms of the block memory's k * b key columns (after the window part), in the frame
    (visibility.memory_frame). Returns (factors, bias, distance, sink_query_factors, memory_place,
    memory_query_rotation).

    A method that is not per token gets their terms in the frame, met by the query's second copy (the sinks' own,
    or made here). Per-token RoPE: the memory holds its keys at their frame places (`CacheRequest.memory_frame`), and
    `memory_place` (B, 1, 1, d) turns them by one shift to where the queries meet them, where the query meets its
    sinks through a second copy shifted into the frame: by `origin` (the position the sinks' frame puts frame place
    0 at: their first position plus S + k * b, or k * b without sinks), as the sinks' keys sit. One query per row
    is turned into the frame instead (`memory_query_rotation`: by its place in the frame less its position), so
    that it meets the keys where the memory holds them (kernels.py)."""
    factors, bias, distance, query_factors = terms
    q_index, start = ctx.query_index[queries][None], ctx.document_start[:, queries]
    q_frame, k_frame = memory_frame(config, q_index, start)  # (B, T), (M,)
    if position_method.per_token:
        q_positions = ctx.query_positions[:, queries]
        if q_positions.shape[1] == 1:
            turn = position_method.shift_factors(q_frame - q_positions).unsqueeze(1)
            return factors, bias, distance, query_factors, None, turn
        shift = origin if torch.is_tensor(origin) else torch.full_like(q_positions[:, :1], origin)
        if query_factors is None:
            query_factors = position_method.shift_factors(q_frame + origin - q_positions).unsqueeze(1)
        return factors, bias, distance, query_factors, position_method.shift_factors(shift).unsqueeze(1), None
    memory = position_method.terms(q_frame, k_frame.expand(q_frame.shape[0], -1))
    if memory.factors is not None:
        if query_factors is None:
            query_factors = memory.factors[0].unsqueeze(1)
        factors = (factors[0], torch.cat([factors[1], memory.factors[1]], dim=-2))
    if memory.bias is not None:
        bias = torch.cat([bias, memory.bias], dim=-1)
    if memory.distance is not None:
        distance = torch.cat([distance, memory.distance], dim=-1)
    return factors, bias, distance, query_factors, None, None


def _sees_every_key(allowed: torch.Tensor) -> bool:
    """A single query per row that sees every key the tile gives it (a decoding step whose cache holds exactly
    its window): attention without a mask computes the same. Read on the host, not while compiling (a compiled
    step keeps one graph with its mask)."""
    return allowed.shape[-2] == 1 and not torch.compiler.is_compiling() and bool(allowed.all())


def _chunked_tile(
    config, position_method: PositionMethod, ctx: AttentionContext, dtype: torch.dtype, aligned: bool
) -> Tile:
    """All new queries in chunks of one block (b = w/2), each against its L + b reachable keys (and S sink
    columns), as one batched call."""
    total, n_keys = ctx.query_positions.shape[1], ctx.key_positions.shape[1]
    block = config.bca_block_length
    left = block if aligned and config.attention_mode == "blockwise" else config.attention_window - 1
    query_slots, key_slots, exists = chunk_map(total, n_keys, block, left, ctx.query_positions.device)

    q_pos = ctx.query_positions[:, query_slots]  # (B, chunks, b)
    anchor = q_pos[:, :, :1]
    k_index = torch.where(exists, ctx.key_index[key_slots], -1).expand(q_pos.shape[0], -1, -1)  # -1: no key
    k_positions, k_valid = ctx.key_positions[:, key_slots], ctx.key_valid[:, key_slots] & exists
    key_columns, n_sinks = ctx.sink_index.shape[1] + key_slots, 0
    start = ctx.document_start[:, query_slots]  # (B, chunks, b)
    if sink_count(config):
        sink_columns, sink_index, sink_positions, sink_valid = locate_sinks(config, ctx, start[:, :, 0])
        key_columns = torch.cat([sink_columns, key_columns.expand(q_pos.shape[0], -1, -1)], dim=2)
        k_index = torch.cat([sink_index, k_index], dim=2)
        k_positions = torch.cat([sink_positions, k_positions], dim=2)
        k_valid = torch.cat([sink_valid, k_valid], dim=2)
        n_sinks = sink_index.shape[2]
    k_rel = torch.where(k_valid, k_positions, anchor) - anchor
    factors, bias, distance = _terms(position_method, q_pos - anchor, k_rel)
    sink_query_factors = None
    frame = sink_frame(config, ctx.query_index[query_slots][None], start) if n_sinks else None
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
    allowed = allowed_keys(config, ctx.query_index[query_slots][None, :, :, None], k_index[:, :, None, :],
                    k_valid[:, :, None, :], start[..., None], n_sinks)
    mask = additive_mask(allowed.flatten(0, 1).unsqueeze(1), bias, dtype)  # (B*chunks, 1 or H, b, span)
    return Tile(factors, mask, distance, query_slots=query_slots, key_columns=key_columns,
                sink_query_factors=sink_query_factors, n_sinks=n_sinks)


def _uniform_chunked_tile(
    config, position_method: PositionMethod, ctx: AttentionContext, dtype: torch.dtype, first: int
) -> Tile:
    """Queries from `first` on, in chunks of one block, when every chunk sees the same pattern: one document from stream
    index 0 with consecutive positions and no padding, chunks aligned with blocks, every reachable key present
    and no sinks. Position factors, mask and bias are then one (b, L + b) pattern broadcast over all chunks."""
    total, n_keys = ctx.query_positions.shape[1], ctx.key_positions.shape[1]
    block = config.bca_block_length
    left = block if config.attention_mode == "blockwise" else config.attention_window - 1
    device = ctx.query_positions.device
    query_slots, key_slots, _ = chunk_map(total - first, n_keys, block, left, device)
    q_rel = torch.arange(block, device=device)[None]
    k_rel = torch.arange(-left, block, device=device)[None]
    factors, bias, distance = _terms(position_method, q_rel, k_rel)
    if factors is not None:
        factors = tuple(f.unsqueeze(1) for f in factors)  # (1, 1, len, d)
    q_index = first + q_rel[0, :, None]
    k_index = first + k_rel[0, None, :]
    allowed = window_visible(config, q_index, k_index, torch.zeros((), dtype=torch.long, device=device))
    return Tile(factors, additive_mask(allowed[None, None], bias, dtype), distance, query_slots=first + query_slots,
                first_query=first, key_columns=key_slots)


def build_plan(
    config, position_method: PositionMethod, record: ForwardRecord, dtype: torch.dtype, attention_maps: bool = False
) -> AttentionPlan:
    """Choose the tiles for this forward. For n <= w all modes are the same computation (one causal tile).

    `attention_maps`: one dense tile over every key (O(T * keys) memory, the caller's choice), so each layer's
    attention weights are the full (batch, heads, T, keys) map.
    """
    ctx = record.context
    total, n_keys = ctx.query_positions.shape[1], ctx.key_positions.shape[1]
    window = config.attention_window
    plan = AttentionPlan([], record.sink_slots, attention_maps)
    if position_method.per_token:
        plan.token_factors = position_method.token_factors(ctx.query_positions).unsqueeze(1)
    if total <= window or attention_maps or ctx.allowed is not None:  # a 4D mask is O(T * K) already
        plain = record.plain and not attention_maps
        plan.tiles = [_dense_tile(config, position_method, ctx, slice(0, total), slice(0, n_keys), dtype, plain,
                                  record)]
    elif config.attention_mode != "full":
        if record.plain and record.aligned and not sink_count(config):  # w queries plainly causal, then one pattern
            first = _dense_tile(config, position_method, ctx, slice(0, window), slice(0, window), dtype, plain=True)
            plan.tiles = [first, _uniform_chunked_tile(config, position_method, ctx, dtype, window)]
        else:
            plan.tiles = [_chunked_tile(config, position_method, ctx, dtype, record.aligned)]
    else:
        cached = n_keys - total
        plan.tiles = [
            _dense_tile(config, position_method, ctx, slice(start, min(start + window, total)),
                        slice(0, cached + min(start + window, total)), dtype, plain=False)
            for start in range(0, total, window)
        ]
    first = plan.tiles[0]
    if not attention_maps:
        plan.query_turn = first.memory_query_rotation
    frame, unrotate = _memory_rotations(config, position_method, record)
    plan.cache_request = CacheRequest(sink_rotation=first.sink_key_rotation if first.sinks_in_slots else None,
                                      memory_frame=frame, memory_unrotate=unrotate)
    return plan


@functools.lru_cache(maxsize=8)
def _frame_rotation(position_method: PositionMethod, places: int, device: torch.device) -> torch.Tensor:
    """(1, 1, places, d): the rotation of raw memory keys to their places in the frame (`memory_places`), a constant
    of the model: made once per device."""
    return position_method.shift_factors(memory_places(places, device))[None, None]


def _memory_rotations(config, position_method: PositionMethod, record: ForwardRecord
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What each layer's cache needs for the block memory under per-token RoPE (else None, None): the rotation of
    the keys it reads to their frame places and of the keys this forward evicts back to position 0."""
    frame = unrotate = None
    if position_method.per_token and memory_tokens(config):
        if record.memory is not None:
            frame = _frame_rotation(position_method, memory_tokens(config), record.context.query_index.device)
        if record.dropped:
            unrotate = position_method.shift_factors(-record.context.key_positions[:, : record.dropped]).unsqueeze(1)
    return frame, unrotate


__all__ = ["AttentionPlan", "Tile", "build_plan"]
