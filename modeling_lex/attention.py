"""One attention path for full, blockwise (BCA) and sliding attention, computed in O(n*(w + S)).

The model builds an `AttentionPlan` once per forward from the forward's `StreamStep`: which keys each query may
see (the mode's window, attention sinks, causal order, padding and document boundaries, as one additive mask:
data), and the position terms of queries and keys relative to an anchor inside each window. Every layer then runs
the same code on its own q, k, v, tile by tile:

- a *dense* tile: one group of queries against one span of keys (short inputs, decoding steps, attention maps,
  and full attention, which walks long inputs in query chunks so no position is ever taken far from its anchor);
- a *chunked* tile: the queries cut into chunks of c = w/2 and each chunk paired with the L + c keys it can reach
  (L = b for aligned blockwise blocks, w - 1 otherwise), all chunks in one batched attention call. `chunk_map` is
  the one index map of a chunked tile: the attention inputs are gathered with it and the positions and masks are
  read through it. Time and memory are O(n * (L + c)), never n x n.

Attention sinks (`attention_sinks` = S, blockwise and sliding): a tile also gets, per row, S *sink columns*, the
first S tokens of the document of its first query, taken from the window part or, once the window has moved past
them, from the cache's sink slots. A query sees a sink column only where its window does not already show that
key, so no key counts twice. Sinks are seen at their true distance (position terms from their own positions).
Every other query of a tile belongs to a document that started inside the tile, whose first tokens are inside
its window.

Documents: a row may hold several documents (padding-free packing: `position_ids` restart at each document) or
start with padding. Each query sees only keys of its own document, and blockwise blocks are counted from the
document's first token, so every document is computed exactly as it would be alone.

No decision here reads tensor contents on the host: what needs a Python value comes from shapes or from
`StreamStep.plain` / `.aligned`, which the stream sets from what the caller passed. So the forward compiles
without graph breaks.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv

from .positions import PositionMethod
from .stream import AttentionContext, StreamStep, sink_count
from .xpos import apply_rotary


@dataclass
class Tile:
    """A group of queries against the keys they may see, with everything position-dependent precomputed.

    Dense: queries `query_slice`, keys the per-row `sink_columns` then the window part's `key_slice`. Chunked:
    `query_slots` (chunks, c) of the new tokens against `key_columns` (chunks or (B, chunks), L + c [+ S]) of the
    keys the cache returns (sink slots first); each chunk is one batch entry of the attention call.
    """

    factors: tuple[torch.Tensor, ...] | None  # cos_q, sin_q, cos_k, sin_k in the tile's layout
    mask: torch.Tensor | None  # additive (0 = may attend) with any fixed bias folded in; None = plain causal
    distance: torch.Tensor | None = None  # query-minus-key position, for biases the layers learn (KERPLE)
    query_slice: slice | None = None
    key_slice: slice | None = None
    sink_columns: torch.Tensor | None = None  # (B, S)
    query_slots: torch.Tensor | None = None  # (chunks, c)
    first_query: int = 0  # the chunked tile's first query (its outputs start there)
    key_columns: torch.Tensor | None = None  # (chunks, span) or (B, chunks, span)


@dataclass
class AttentionPlan:
    tiles: list[Tile]
    sink_slots: int  # S': the cache's sink slots, which come first among the keys it returns
    attention_maps: bool = False  # one dense tile over every key, whose weights are the full attention map
    token_factors: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, 1, T, d): per-token encodings (RoPE)

    def encode_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The new tokens' queries or keys (B, H, T, d) encoded at their own positions, for methods that are
        per token (the cache then holds encoded keys); unchanged otherwise."""
        return x if self.token_factors is None else apply_rotary(x, *self.token_factors)


def window_visible(config, q_index: torch.Tensor, k_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Whether the query at stream index q_index sees the key at k_index through its window (shapes broadcast).

    Causal, inside the query's document (which starts at `start`), and inside the mode's window: sliding, the
    last w keys; blockwise, the query's block and the one before it, blocks of w/2 counted from `start`.
    """
    allowed = (k_index <= q_index) & (k_index >= start)
    window = config.attention_window
    if config.attention_mode == "sliding":
        allowed = allowed & (q_index - k_index < window)
    elif config.attention_mode == "blockwise":
        block = window // 2
        q_block = torch.div(q_index - start, block, rounding_mode="floor")
        k_block = torch.div(k_index - start, block, rounding_mode="floor")
        allowed = allowed & (k_block >= q_block - 1)
    return allowed


def visible(config, q_index: torch.Tensor, k_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Whether the query sees the key at all: through its window, or as one of its document's first S tokens."""
    allowed = window_visible(config, q_index, k_index, start)
    sinks = sink_count(config)
    if sinks:
        allowed = allowed | ((k_index <= q_index) & (k_index >= start) & (k_index - start < sinks))
    return allowed


def chunk_map(total: int, n_keys: int, chunk: int, left: int, device: torch.device):
    """The index map of a chunked tile: queries in chunks of `chunk`, each against the `left + chunk` keys before
    and beside it.

    Of the window part's `n_keys` keys, the last `total` are the queries' own. Returns the query slots (chunks,
    chunk) (the tail of the last chunk repeats the last query), the key slots (chunks, left + chunk) clamped into
    range, and whether each key slot exists: slot s of chunk j is key n_keys - total - left + j*chunk + s.
    """
    n_chunks = -(-total // chunk)
    first = n_keys - total - left
    key_slots = first + torch.arange(n_chunks, device=device)[:, None] * chunk + torch.arange(left + chunk, device=device)
    exists = (key_slots >= 0) & (key_slots < n_keys)
    query_slots = torch.arange(n_chunks * chunk, device=device).clamp(max=total - 1).view(n_chunks, chunk)
    return query_slots, key_slots.clamp(0, n_keys - 1), exists


def _additive(allowed: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
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


def _sinks(config, ctx: AttentionContext, start: torch.Tensor):
    """The sink columns of documents starting at stream index `start` (B, ...): their columns among the keys the
    cache returns (sink slots first), stream indices, positions and validity, each `start.shape + (S,)`."""
    sinks, slots, n_keys = sink_count(config), ctx.sink_index.shape[1], ctx.key_index.shape[0]
    wanted = start[..., None] + torch.arange(sinks, device=start.device)
    column = wanted - ctx.key_index[0]
    in_window = column >= 0
    column = column.clamp(0, n_keys - 1)
    positions = _gather_rows(ctx.key_positions, column)
    valid = in_window & (wanted <= ctx.key_index[-1]) & _gather_rows(ctx.key_valid, column)
    columns = slots + column
    if slots:  # older sinks live in the cache's sink slots, one per row

        def per_row(t: torch.Tensor) -> torch.Tensor:
            return t.view(t.shape[0], *[1] * (wanted.dim() - 2), t.shape[1]).expand(wanted.shape)

        slot = torch.arange(sinks, device=start.device).expand(wanted.shape)
        held = per_row(ctx.sink_valid) & (per_row(ctx.sink_index) == wanted)
        positions = torch.where(in_window, positions, per_row(ctx.sink_positions))
        valid = torch.where(in_window, valid, held)
        columns = torch.where(in_window, columns, slot)
    return columns, wanted, positions, valid


def _mask(config, q_index, k_index, k_valid, start, n_sinks: int, allowed_4d=None) -> torch.Tensor:
    """Which keys each query sees; the first `n_sinks` key columns are sink columns, seen only where the window
    does not already show that key. Shapes broadcast: q_index/start (..., T, 1), k_index/k_valid (..., 1, K)."""
    k_index, sink_index = k_index[..., n_sinks:], k_index[..., :n_sinks]
    allowed = window_visible(config, q_index, k_index, start) & k_valid[..., n_sinks:]
    allowed = allowed | (q_index == k_index)  # a padding query sees itself, so its row has a key
    if allowed_4d is not None:
        allowed = allowed & allowed_4d
    if n_sinks:
        as_sink = (sink_index <= q_index) & (sink_index >= start) & (sink_index - start < n_sinks)
        as_sink = as_sink & k_valid[..., :n_sinks] & ~window_visible(config, q_index, sink_index, start)
        allowed = torch.cat([as_sink.expand(*allowed.shape[:-1], n_sinks), allowed], dim=-1)
    return allowed


def _terms(positions: PositionMethod, q_rel: torch.Tensor, k_rel: torch.Tensor):
    terms = positions.terms(q_rel, k_rel)
    return terms.factors, terms.bias, terms.distance


def _dense_tile(
    config, positions: PositionMethod, ctx: AttentionContext, queries: slice, keys: slice, dtype: torch.dtype,
    plain: bool,
) -> Tile:
    anchor = ctx.query_positions[:, queries.start : queries.start + 1]
    k_index = ctx.key_index[keys].expand(anchor.shape[0], -1)
    k_positions, k_valid = ctx.key_positions[:, keys], ctx.key_valid[:, keys]
    sink_columns, n_sinks = None, 0
    if sink_count(config) and not plain:
        sink_columns, sink_index, sink_positions, sink_valid = _sinks(
            config, ctx, ctx.document_start[:, queries.start])
        k_index = torch.cat([sink_index, k_index], dim=1)
        k_positions = torch.cat([sink_positions, k_positions], dim=1)
        k_valid = torch.cat([sink_valid, k_valid], dim=1)
        n_sinks = sink_index.shape[1]
    q_rel = ctx.query_positions[:, queries] - anchor
    k_rel = torch.where(k_valid, k_positions, anchor) - anchor  # padding and empty slots: at 0
    factors, bias, distance = _terms(positions, q_rel, k_rel)
    if factors is not None:
        factors = tuple(f.unsqueeze(1) for f in factors)  # broadcast over heads
    allowed = None
    if not plain:
        allowed_4d = None if ctx.allowed is None else ctx.allowed[:, 0, queries, keys]
        allowed = _mask(config, ctx.query_index[queries][None, :, None], k_index[:, None, :], k_valid[:, None, :],
                        ctx.document_start[:, queries, None], n_sinks, allowed_4d).unsqueeze(1)
    return Tile(factors, _additive(allowed, bias, dtype), distance, query_slice=queries, key_slice=keys,
                sink_columns=sink_columns)


def _chunked_tile(config, positions: PositionMethod, ctx: AttentionContext, dtype: torch.dtype, aligned: bool) -> Tile:
    """All new queries in chunks of c = w/2, each against its L + c reachable keys (and S sink columns), as one
    batched call."""
    total, n_keys = ctx.query_positions.shape[1], ctx.key_positions.shape[1]
    chunk = config.attention_window // 2
    left = chunk if aligned and config.attention_mode == "blockwise" else config.attention_window - 1
    query_slots, key_slots, exists = chunk_map(total, n_keys, chunk, left, ctx.query_positions.device)

    q_pos = ctx.query_positions[:, query_slots]  # (B, chunks, c)
    anchor = q_pos[:, :, :1]
    k_index = torch.where(exists, ctx.key_index[key_slots], -1).expand(q_pos.shape[0], -1, -1)  # -1: no key
    k_positions, k_valid = ctx.key_positions[:, key_slots], ctx.key_valid[:, key_slots] & exists
    key_columns, n_sinks = ctx.sink_index.shape[1] + key_slots, 0
    start = ctx.document_start[:, query_slots]  # (B, chunks, c)
    if sink_count(config):
        sink_columns, sink_index, sink_positions, sink_valid = _sinks(config, ctx, start[:, :, 0])
        key_columns = torch.cat([sink_columns, key_columns.expand(q_pos.shape[0], -1, -1)], dim=2)
        k_index = torch.cat([sink_index, k_index], dim=2)
        k_positions = torch.cat([sink_positions, k_positions], dim=2)
        k_valid = torch.cat([sink_valid, k_valid], dim=2)
        n_sinks = sink_index.shape[2]
    k_rel = torch.where(k_valid, k_positions, anchor) - anchor
    factors, bias, distance = _terms(positions, q_pos - anchor, k_rel)
    if factors is not None:
        factors = tuple(f.flatten(0, 1).unsqueeze(1) for f in factors)  # (B*chunks, 1, len, d)
    if bias is not None:
        bias = bias.flatten(0, 1)
    if distance is not None:
        distance = distance.flatten(0, 1)
    allowed = _mask(config, ctx.query_index[query_slots][None, :, :, None], k_index[:, :, None, :],
                    k_valid[:, :, None, :], start[..., None], n_sinks)
    mask = _additive(allowed.flatten(0, 1).unsqueeze(1), bias, dtype)  # (B*chunks, 1 or H, c, span)
    return Tile(factors, mask, distance, query_slots=query_slots, key_columns=key_columns)


def _uniform_chunked_tile(
    config, positions: PositionMethod, ctx: AttentionContext, dtype: torch.dtype, first: int
) -> Tile:
    """Queries from `first` on, in chunks of c, when every chunk sees the same pattern: one document from stream
    index 0 with consecutive positions and no padding, chunks aligned with blocks, every reachable key present
    and no sinks. Position factors, mask and bias are then one (c, L + c) pattern broadcast over all chunks."""
    total, n_keys = ctx.query_positions.shape[1], ctx.key_positions.shape[1]
    chunk = config.attention_window // 2
    left = chunk if config.attention_mode == "blockwise" else config.attention_window - 1
    device = ctx.query_positions.device
    query_slots, key_slots, _ = chunk_map(total - first, n_keys, chunk, left, device)
    q_rel = torch.arange(chunk, device=device)[None]
    k_rel = torch.arange(-left, chunk, device=device)[None]
    factors, bias, distance = _terms(positions, q_rel, k_rel)
    if factors is not None:
        factors = tuple(f.unsqueeze(1) for f in factors)  # (1, 1, len, d)
    q_index = first + q_rel[0, :, None]
    k_index = first + k_rel[0, None, :]
    allowed = window_visible(config, q_index, k_index, torch.zeros((), dtype=torch.long, device=device))
    return Tile(factors, _additive(allowed[None, None], bias, dtype), distance, query_slots=first + query_slots,
                first_query=first, key_columns=key_slots)


def build_plan(
    config, positions: PositionMethod, step: StreamStep, dtype: torch.dtype, attention_maps: bool = False
) -> AttentionPlan:
    """Choose the tiles for this forward. For n <= w all modes are the same computation (one causal tile).

    `attention_maps`: one dense tile over every key (O(T * keys) memory, the caller's choice), so each layer's
    attention weights are the full (batch, heads, T, keys) map.
    """
    ctx = step.context
    total, n_keys = ctx.query_positions.shape[1], ctx.key_positions.shape[1]
    window = config.attention_window
    plan = AttentionPlan([], ctx.sink_index.shape[1], attention_maps)
    if positions.per_token:
        plan.token_factors = tuple(f.unsqueeze(1) for f in positions.token_factors(ctx.query_positions))
    if total <= window or attention_maps or ctx.allowed is not None:  # a 4D mask is O(T * K) already
        plain = step.plain and not attention_maps
        plan.tiles = [_dense_tile(config, positions, ctx, slice(0, total), slice(0, n_keys), dtype, plain)]
    elif config.attention_mode != "full":
        if step.plain and step.aligned and not sink_count(config):  # the first w queries plainly causal, then one pattern
            first = _dense_tile(config, positions, ctx, slice(0, window), slice(0, window), dtype, plain=True)
            plan.tiles = [first, _uniform_chunked_tile(config, positions, ctx, dtype, window)]
        else:
            plan.tiles = [_chunked_tile(config, positions, ctx, dtype, step.aligned)]
    else:
        cached = n_keys - total
        plan.tiles = [
            _dense_tile(config, positions, ctx, slice(start, min(start + window, total)),
                        slice(0, cached + min(start + window, total)), dtype, plain=False)
            for start in range(0, total, window)
        ]
    return plan


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention: softmax(q k^T * scaling + bias, masked) v in float32 softmax; grouped key/value heads
    are repeated for their query heads."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is None:
        q_len, k_len = scores.shape[-2:]
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _chunks(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """x (B, H, K, d) at columns (chunks, n) shared by the rows, or (B, chunks, n) per row -> (B*chunks, H, n, d)."""
    by_key = x.transpose(1, 2)  # (B, K, H, d)
    if columns.dim() == 2:
        picked = by_key.index_select(1, columns.flatten())
    else:
        picked = by_key[torch.arange(x.shape[0], device=x.device)[:, None], columns.flatten(1)]
    picked = picked.view(x.shape[0], *columns.shape[-2:], x.shape[1], x.shape[3])  # (B, chunks, n, H, d)
    return picked.permute(0, 1, 3, 2, 4).flatten(0, 1)


def _tile_inputs(tile: Tile, sink_slots: int, query, key, value):
    if tile.query_slots is not None:
        return _chunks(query, tile.query_slots), _chunks(key, tile.key_columns), _chunks(value, tile.key_columns)
    keys = slice(sink_slots + tile.key_slice.start, sink_slots + tile.key_slice.stop)
    q, k, v = query[:, :, tile.query_slice], key[:, :, keys], value[:, :, keys]
    if tile.sink_columns is not None:
        index = tile.sink_columns[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        k = torch.cat([key.gather(2, index), k], dim=2)
        v = torch.cat([value.gather(2, index), v], dim=2)
    return q, k, v


def _attention_map(tile: Tile, sink_slots: int, weights: torch.Tensor, n_keys: int) -> torch.Tensor:
    """A dense tile's weights as a map over the keys the cache returned (sink slots first): a sink column's weight
    goes to the key it was taken from."""
    batch, heads, length, _ = weights.shape
    n_sinks = 0 if tile.sink_columns is None else tile.sink_columns.shape[1]
    if n_sinks == 0 and sink_slots == 0 and tile.key_slice == slice(0, n_keys):
        return weights  # the map itself, as the backend computed it (gradients flow through it)
    full = weights.new_zeros(batch, heads, length, n_keys)
    full[..., sink_slots + tile.key_slice.start : sink_slots + tile.key_slice.stop] = weights[..., n_sinks:]
    if n_sinks:
        index = tile.sink_columns[:, None, None, :].expand(-1, heads, length, -1)
        full.scatter_add_(3, index, weights[..., :n_sinks])
    return full


def run_attention(
    module: nn.Module,
    interface: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: AttentionPlan,
    dropout: float,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of raw (pre-position) q (B,H,T,d) over the raw keys and values the cache returned (B,Hkv,K,d) by
    the plan's tiles.

    `interface` is the attention backend (eager, sdpa, ...) with transformers' attention-interface signature; the
    caller's `kwargs` pass through to it, as in modeling_llama. Returns the output (B, T, H, d) and, when the
    plan keeps them, the attention weights as a map over the keys.
    """
    batch, _, total, _ = query.shape
    outputs, weights = [], None
    for tile in plan.tiles:
        q, k, v = _tile_inputs(tile, plan.sink_slots, query, key, value)
        if tile.factors is not None:
            cos_q, sin_q, cos_k, sin_k = tile.factors
            q, k = apply_rotary(q, cos_q, sin_q), apply_rotary(k, cos_k, sin_k)
        bias = None if tile.distance is None else module.learned_bias(tile.distance).to(q.dtype)
        out, weights = interface(
            module, q, k, v, tile.mask, dropout=dropout, scaling=module.scaling, position_bias=bias, is_causal=True,
            **kwargs,
        )
        if tile.query_slots is not None:
            out = out.unflatten(0, (batch, -1)).flatten(1, 2)[:, : total - tile.first_query]
        outputs.append(out)
    output = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    if plan.attention_maps:
        return output, _attention_map(plan.tiles[0], plan.sink_slots, weights, key.shape[2])
    return output, None
