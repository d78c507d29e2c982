"""One attention path for full, blockwise (BCA) and sliding attention, computed in O(n*w).

The model builds an `AttentionPlan` once per forward: which keys each query may see (the mode's window, causal
order, padding and document boundaries, as one additive mask: data), and the position factors of queries and
keys relative to an anchor inside each window. Every layer then runs the same code on its own q, k, v:

- a *dense* tile: one group of queries against one span of keys (short inputs, decoding steps, attention maps,
  and full attention, which walks long inputs in query chunks so no position is ever taken far from its anchor);
- an *unfolded* tile: the queries cut into chunks of c = w/2 and each chunk paired with the L + c keys it can
  reach (L = b for aligned blockwise blocks, w - 1 otherwise), all chunks in one batched attention call. Time
  and memory are O(n * (L + c)), never n x n.

Documents: a row may hold several documents (padding-free packing: `position_ids` restart at each document) or
start with padding. Each query sees only keys of its own document, and blockwise blocks are counted from the
document's first token, so every document is computed exactly as it would be alone.

No decision here reads tensor contents on the host: what needs a Python value comes from shapes or from
`AttentionContext.causal_only`, which the model sets from what the caller passed. So the forward compiles
without graph breaks.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv

from .positions import PositionMethod
from .xpos import apply_rotary


@dataclass
class AttentionContext:
    """Where the keys of one forward come from and what each query may see (shared by all layers).

    Keys are the keys a cache holds from earlier forwards followed by the new tokens' keys. `query_index` and
    `key_index` count tokens from the start of the stream (the cache's first token), so a window is a
    difference of indices; keys of empty static-cache slots are not `key_valid`.
    """

    query_positions: torch.Tensor  # (B, T) position ids of the new tokens
    key_positions: torch.Tensor  # (B, K) position ids of every key
    key_valid: torch.Tensor  # (B, K) bool: a real token (not padding, not an empty slot)
    query_index: torch.Tensor  # (T,) stream index of each new token
    key_index: torch.Tensor  # (K,) stream index of each key
    document_start: torch.Tensor  # (B, T) stream index of the first token of each query's document
    causal_only: bool = False  # one document, no padding, no cache: plain causal attention is exact
    allowed: torch.Tensor | None = None  # (B, 1, T, K) bool from a caller's own 4D mask, on top of the window


@dataclass
class Tile:
    """A group of queries against the keys they may see, with everything position-dependent precomputed."""

    query_slice: slice  # which new tokens
    key_slice: slice | None  # which keys (dense tile); None for an unfolded tile
    factors: tuple[torch.Tensor, ...] | None  # cos_q, sin_q, cos_k, sin_k in the tile's layout
    mask: torch.Tensor | None  # additive mask (0 = may attend) with any fixed bias folded in; None = plain causal
    distance: torch.Tensor | None = None  # query-minus-key position, for biases the layers learn (KERPLE)
    unfold: tuple[int, int] | None = None  # (chunk c, left context L) of an unfolded tile


@dataclass
class AttentionPlan:
    tiles: list[Tile]
    attention_maps: bool = False  # one dense tile over every key, whose weights are the full attention map


@dataclass
class StreamState:
    """What the next forward of a stream needs to know about documents: per row, the stream index where the
    current document starts, the position id of the last real token, and whether a real token was seen."""

    start: torch.Tensor  # (B,) long
    last_position: torch.Tensor  # (B,) long
    started: torch.Tensor  # (B,) bool

    @classmethod
    def fresh(cls, batch: int, device: torch.device) -> "StreamState":
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(zeros, zeros.clone(), torch.zeros(batch, dtype=torch.bool, device=device))

    def map(self, function) -> "StreamState":
        """The same state with `function` applied to each row tensor (beam reordering, batch selection)."""
        return StreamState(function(self.start), function(self.last_position), function(self.started))


def document_starts(
    positions: torch.Tensor, valid: torch.Tensor, index: torch.Tensor, state: StreamState
) -> tuple[torch.Tensor, StreamState]:
    """Stream index of the first token of each new token's document (B, T), and the state after them.

    A document starts at a row's first real token and wherever a real token's position id does not continue
    the previous real token's (a restart: padding-free packing). Padding in between does not break a
    document; a padding token itself is a document of one token that nobody sees.
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
    any_real = last_real[:, -1] >= 0
    after = StreamState(
        start=starts[:, -1],
        last_position=torch.where(any_real, positions.gather(1, last_real[:, -1:].clamp(min=0))[:, 0],
                                  state.last_position),
        started=state.started | any_real,
    )
    return torch.where(valid, starts, index[None, :]), after


def visible(config, q_index: torch.Tensor, k_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Whether the query at stream index q_index may see the key at k_index (shapes broadcast).

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


def _dense_tile(
    config, positions: PositionMethod, ctx: AttentionContext, queries: slice, keys: slice, dtype: torch.dtype,
    plain: bool,
) -> Tile:
    anchor = ctx.query_positions[:, queries.start : queries.start + 1]
    key_valid = ctx.key_valid[:, keys]
    q_rel = ctx.query_positions[:, queries] - anchor
    k_rel = torch.where(key_valid, ctx.key_positions[:, keys], anchor) - anchor  # padding and empty slots: at 0
    terms = positions.terms(q_rel, k_rel)
    factors, bias, distance = terms.factors, terms.bias, terms.distance
    if factors is not None:
        factors = tuple(f.unsqueeze(1) for f in factors)  # broadcast over heads
    allowed = None
    if not plain:
        q_index = ctx.query_index[queries][:, None]
        k_index = ctx.key_index[keys][None, :]
        start = ctx.document_start[:, queries, None]
        allowed = (visible(config, q_index, k_index, start) & key_valid[:, None, :]) | (q_index == k_index)
        allowed = allowed.unsqueeze(1)
        if ctx.allowed is not None:
            allowed = allowed & ctx.allowed[:, :, queries, keys]
    return Tile(queries, keys, factors, _additive(allowed, bias, dtype), distance)


def _unfolded_tile(config, positions: PositionMethod, ctx: AttentionContext, dtype: torch.dtype, aligned: bool) -> Tile:
    """All new queries in chunks of c = w/2, each against its L + c reachable keys, as one batched call."""
    total = ctx.query_positions.shape[1]
    n_keys = ctx.key_positions.shape[1]
    chunk = config.attention_window // 2
    left = chunk if aligned and config.attention_mode == "blockwise" else config.attention_window - 1
    span = left + chunk
    n_chunks = -(-total // chunk)
    device = ctx.query_positions.device

    # Key slot s of chunk j is key number (cached - left + j*c + s) of the forward's keys; some lie outside.
    cached = n_keys - total
    slot = cached - left + torch.arange(n_chunks, device=device)[:, None] * chunk + torch.arange(span, device=device)
    exists = (slot >= 0) & (slot < n_keys)
    slot = slot.clamp(0, n_keys - 1)
    q_slot = torch.arange(n_chunks * chunk, device=device).clamp(max=total - 1).view(n_chunks, chunk)

    q_pos = ctx.query_positions[:, q_slot]  # (B, n_chunks, chunk)
    anchor = q_pos[:, :, :1]
    valid = ctx.key_valid[:, slot] & exists  # (B, n_chunks, span)
    k_pos = torch.where(valid, ctx.key_positions[:, slot], anchor)
    terms = positions.terms(q_pos - anchor, k_pos - anchor)
    factors, bias, distance = terms.factors, terms.bias, terms.distance
    if factors is not None:
        factors = tuple(f.flatten(0, 1).unsqueeze(1) for f in factors)  # (B*chunks, 1, len, d)
    if bias is not None:
        bias = bias.flatten(0, 1)
    if distance is not None:
        distance = distance.flatten(0, 1)

    q_index = ctx.query_index[q_slot][:, :, None]  # (n_chunks, chunk, 1)
    k_index = torch.where(exists, ctx.key_index[slot], -1)[:, None, :]  # (n_chunks, 1, span); -1: no key
    start = ctx.document_start[:, q_slot][..., None]  # (B, n_chunks, chunk, 1)
    allowed = (visible(config, q_index, k_index, start) & valid[:, :, None, :]) | (q_index == k_index)
    mask = _additive(allowed.flatten(0, 1).unsqueeze(1), bias, dtype)  # (B*chunks, 1 or H, chunk, span)
    return Tile(slice(0, total), None, factors, mask, distance, unfold=(chunk, left))


def _uniform_unfolded_tile(
    config, positions: PositionMethod, ctx: AttentionContext, dtype: torch.dtype, first: int
) -> Tile:
    """Queries from `first` on, in chunks of c, when every chunk sees the same pattern: one document from stream
    index 0 with consecutive positions and no padding, chunks aligned with blocks and every reachable key present.

    Position factors, mask and bias are then one (c, L + c) pattern broadcast over all chunks, built once.
    """
    total = ctx.query_positions.shape[1]
    chunk = config.attention_window // 2
    left = chunk if config.attention_mode == "blockwise" else config.attention_window - 1
    device = ctx.query_positions.device
    q_rel = torch.arange(chunk, device=device)[None]
    k_rel = torch.arange(-left, chunk, device=device)[None]
    terms = positions.terms(q_rel, k_rel)
    factors, bias, distance = terms.factors, terms.bias, terms.distance
    if factors is not None:
        factors = tuple(f.unsqueeze(1) for f in factors)  # (1, 1, len, d)
    q_index = first + q_rel[0, :, None]
    k_index = first + k_rel[0, None, :]
    allowed = visible(config, q_index, k_index, torch.zeros((), dtype=torch.long, device=device))
    return Tile(slice(first, total), None, factors, _additive(allowed[None, None], bias, dtype), distance,
                unfold=(chunk, left))


def build_plan(
    config, positions: PositionMethod, ctx: AttentionContext, dtype: torch.dtype, attention_maps: bool = False,
    aligned: bool = False,
) -> AttentionPlan:
    """Choose the tiles for this forward. For n <= w all modes are the same computation (one causal tile).

    `attention_maps`: one dense tile over every key (O(T * keys) memory, the caller's choice), so each layer's
    attention weights are the full (batch, heads, T, keys) map. `aligned`: every row is one document starting
    at a multiple of w/2 (known from what the caller passed), so blockwise chunks need only b keys of context.
    """
    total = ctx.query_positions.shape[1]
    n_keys = ctx.key_positions.shape[1]
    window = config.attention_window
    if total <= window or attention_maps or ctx.allowed is not None:  # a 4D mask is O(T * K) already
        plain = ctx.causal_only and not attention_maps
        tiles = [_dense_tile(config, positions, ctx, slice(0, total), slice(0, n_keys), dtype, plain)]
        return AttentionPlan(tiles, attention_maps)
    if config.attention_mode != "full":
        if ctx.causal_only and aligned:  # the first w queries are plainly causal, the rest share one pattern
            first = _dense_tile(config, positions, ctx, slice(0, window), slice(0, window), dtype, plain=True)
            return AttentionPlan([first, _uniform_unfolded_tile(config, positions, ctx, dtype, window)])
        return AttentionPlan([_unfolded_tile(config, positions, ctx, dtype, aligned)])
    cached = n_keys - total
    tiles = [
        _dense_tile(config, positions, ctx, slice(start, min(start + window, total)),
                    slice(0, cached + min(start + window, total)), dtype, plain=False)
        for start in range(0, total, window)
    ]
    return AttentionPlan(tiles)


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


def _unfold_keys(x: torch.Tensor, total: int, chunk: int, left: int) -> torch.Tensor:
    """(B, H, K, d) keys, the last `total` of them the chunked queries' own -> (B*chunks, H, left+chunk, d):
    chunk j gets keys K-total-left+j*c onwards."""
    cached = x.shape[2] - total
    n_chunks = -(-total // chunk)
    before = max(left - cached, 0)
    x = x[:, :, max(cached - left, 0) :]
    after = n_chunks * chunk - total
    x = nn.functional.pad(x, (0, 0, before, after))
    windows = x.unfold(2, left + chunk, chunk)  # (B, H, chunks, d, span)
    return windows.permute(0, 2, 1, 4, 3).flatten(0, 1)


def _chunk_queries(x: torch.Tensor, total: int, chunk: int) -> torch.Tensor:
    """(B, H, total, d) -> (B*chunks, H, chunk, d), zero-padding the last chunk."""
    n_chunks = -(-total // chunk)
    x = nn.functional.pad(x, (0, 0, 0, n_chunks * chunk - total))
    return x.unflatten(2, (n_chunks, chunk)).transpose(1, 2).flatten(0, 1)


def run_attention(
    module: nn.Module,
    interface: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: AttentionPlan,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of raw (pre-position) q (B,H,T,d) over raw k, v (B,H,K,d) by the plan's tiles.

    `interface` is the attention backend (eager, sdpa, ...) with transformers' attention-interface signature.
    Returns the output (B, T, H, d) and, when the plan keeps them, the attention weights the backend gave.
    """
    batch, heads, total, head_dim = query.shape
    outputs = []
    for tile in plan.tiles:
        if tile.unfold is not None:
            chunk, left = tile.unfold
            count = tile.query_slice.stop - tile.query_slice.start
            q = _chunk_queries(query[:, :, tile.query_slice], count, chunk)
            k = _unfold_keys(key, count, chunk, left)
            v = _unfold_keys(value, count, chunk, left)
        else:
            q, k, v = query[:, :, tile.query_slice], key[:, :, tile.key_slice], value[:, :, tile.key_slice]
        if tile.factors is not None:
            cos_q, sin_q, cos_k, sin_k = tile.factors
            q, k = apply_rotary(q, cos_q, sin_q), apply_rotary(k, cos_k, sin_k)
        bias = None if tile.distance is None else module.learned_bias(tile.distance).to(q.dtype)
        out, weights = interface(
            module, q, k, v, tile.mask, dropout=dropout, scaling=module.scaling, position_bias=bias, is_causal=True
        )
        if tile.unfold is not None:
            out = out.unflatten(0, (batch, -1)).flatten(1, 2)[:, :count]
        outputs.append(out)
    output = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    return output, weights if plan.attention_maps else None
