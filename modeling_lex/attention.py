"""One attention path for full, blockwise (BCA) and sliding attention, computed in O(n*w).

The model builds an `AttentionPlan` once per forward: which keys each query may see (the mode's window as a
boolean mask, i.e. as data), and the position factors of queries and keys relative to an anchor inside each
window. Every layer then runs the same code on its own q, k, v:

- a *dense* tile: one group of queries against one span of keys (short inputs, decoding steps, and full
  attention, which walks long inputs in query chunks so no position is ever taken far from its anchor);
- an *unfolded* tile: the queries cut into chunks of c = w/2 and each chunk paired with the L + c keys it can
  reach (L = b for aligned blockwise blocks, 2b - 1 for blocks shifted by left padding, w - 1 for sliding),
  all chunks in one batched attention call. Time and memory are O(n * (L + c)), never n x n.

Block membership is counted from each row's first real token (its `origin`), so a left-padded row is split
into the same blocks as the row alone.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .xpos import alibi_bias, apply_rotary, rotary_factors, sandwich_bias


@dataclass
class AttentionContext:
    """Where the keys of one forward come from (shared by all layers).

    Keys are the `cached` keys held from earlier forwards followed by the new tokens' keys. Absolute indices:
    new tokens are `seen .. seen+T-1`, cached keys `seen-cached .. seen-1`.
    """

    query_positions: torch.Tensor  # (B, T) position ids of the new tokens
    key_positions: torch.Tensor  # (B, cached + T)
    key_valid: torch.Tensor  # (B, cached + T) bool: not padding
    origin: torch.Tensor  # (B,) absolute index of each row's first real token
    seen: int  # absolute index of the first new token
    cached: int  # number of cached keys in front of the new ones


@dataclass
class Tile:
    """A group of queries against the keys they may see, with everything position-dependent precomputed."""

    query_slice: slice  # which new tokens
    key_slice: slice  # which keys (dense) / ignored (unfolded)
    factors: tuple[torch.Tensor, ...] | None  # cos_q, sin_q, cos_k, sin_k in the tile's layout
    mask: torch.Tensor | None  # bool (True = may attend) until build_plan makes it additive; None = plain causal
    bias: torch.Tensor | None  # fixed additive float bias (ALiBi, Sandwich), tile layout
    distance: torch.Tensor | None = None  # query-minus-key position, for biases the layers learn (KERPLE)
    unfold: tuple[int, int] | None = None  # (chunk c, left context L) for unfolded tiles


@dataclass
class AttentionPlan:
    tiles: list[Tile]


def _block_rule(mode: str, window: int, q_index: torch.Tensor, k_index: torch.Tensor, origin: torch.Tensor):
    """Which key index each query index may see (causal, plus the mode's window). Shapes broadcast."""
    allowed = k_index <= q_index
    if mode == "sliding":
        allowed = allowed & (q_index - k_index < window)
    elif mode == "blockwise":
        block = window // 2
        q_block = torch.div(q_index - origin, block, rounding_mode="floor")
        k_block = torch.div(k_index - origin, block, rounding_mode="floor")
        allowed = allowed & (k_block >= q_block - 1)
    return allowed


def _position_terms(config, q_rel: torch.Tensor, k_rel: torch.Tensor):
    """Rotary factors, a fixed bias, or distances for a learned bias, from relative positions of one tile."""
    kind = config.position_embedding_type
    factors = bias = distance = None
    if kind in ("xpos", "rope", "decay"):
        common = dict(
            rotate=kind != "decay",
            decay=kind != "rope",
            theta=config.rope_theta,
            gamma=config.xpos_gamma,
            scale_base=config.xpos_scale_base,
        )
        cos_q, sin_q, _, _ = rotary_factors(q_rel, config.head_dim, **common)
        _, _, cos_k, sin_k = rotary_factors(k_rel, config.head_dim, **common)
        factors = (cos_q, sin_q, cos_k, sin_k)
    elif kind in ("alibi", "sandwich", "kerple"):
        distance = q_rel[..., :, None] - k_rel[..., None, :]
        if kind == "alibi":
            bias, distance = alibi_bias(distance, config.num_attention_heads), None
        elif kind == "sandwich":
            bias, distance = sandwich_bias(distance, config.num_attention_heads, config.sandwich_dim), None
    return factors, bias, distance


def _dense_tile(config, ctx: AttentionContext, queries: slice, keys: slice, causal_only: bool) -> Tile:
    anchor = ctx.query_positions[:, queries.start : queries.start + 1]
    q_rel = ctx.query_positions[:, queries] - anchor
    k_rel = ctx.key_positions[:, keys] - anchor
    factors, bias, distance = _position_terms(config, q_rel, k_rel)
    if factors is not None:
        factors = tuple(f.unsqueeze(1) for f in factors)  # broadcast over heads
    mask = None
    if not causal_only:
        q_index = torch.arange(queries.start, queries.stop, device=anchor.device) + ctx.seen
        k_index = torch.arange(keys.start, keys.stop, device=anchor.device) + ctx.seen - ctx.cached
        rule = _block_rule(
            config.attention_mode, config.attention_window, q_index[:, None], k_index[None, :], ctx.origin[:, None, None]
        )
        mask = (rule & ctx.key_valid[:, None, keys]) | (q_index[:, None] == k_index[None, :])
        mask = mask.unsqueeze(1)
    return Tile(queries, keys, factors, mask, bias, distance)


def _unfolded_tile(config, ctx: AttentionContext, total: int) -> Tile:
    """All new queries in chunks of c = w/2, each against its L + c reachable keys, as one batched call."""
    chunk = config.attention_window // 2
    if config.attention_mode == "sliding":
        left = config.attention_window - 1
    else:
        aligned = bool(((ctx.seen - ctx.origin) % chunk == 0).all())
        left = chunk if aligned else 2 * chunk - 1
    span = left + chunk
    n_chunks = -(-total // chunk)
    device = ctx.query_positions.device

    # Key slot s of chunk j holds absolute index seen - left + j*chunk + s.
    first_key = ctx.seen - left
    k_index = first_key + torch.arange(n_chunks, device=device)[:, None] * chunk + torch.arange(span, device=device)
    q_index = ctx.seen + torch.arange(n_chunks * chunk, device=device).view(n_chunks, chunk)
    held_from = ctx.seen - ctx.cached
    slot = (k_index - held_from).clamp(0, ctx.key_positions.shape[1] - 1)
    exists = (k_index >= held_from) & (k_index - held_from < ctx.key_positions.shape[1])

    q_slot = (q_index - ctx.seen).clamp(max=total - 1)
    q_pos = ctx.query_positions[:, q_slot]  # (B, n_chunks, chunk)
    anchor = q_pos[:, :, :1]
    k_pos = torch.where(exists, ctx.key_positions[:, slot], anchor)
    factors, bias, distance = _position_terms(config, q_pos - anchor, k_pos - anchor)
    if factors is not None:
        factors = tuple(f.flatten(0, 1).unsqueeze(1) for f in factors)  # (B*chunks, 1, len, d)
    if bias is not None:
        bias = bias.flatten(0, 1)
    if distance is not None:
        distance = distance.flatten(0, 1)

    origin = ctx.origin[:, None, None, None]
    rule = _block_rule(config.attention_mode, config.attention_window, q_index[:, :, None], k_index[:, None, :], origin)
    valid = (ctx.key_valid[:, slot] & exists)[:, :, None, :]
    diagonal = q_index[:, :, None] == k_index[:, None, :]
    mask = ((rule & valid) | diagonal).flatten(0, 1).unsqueeze(1)  # (B*chunks, 1, chunk, span)
    return Tile(slice(0, total), slice(None), factors, mask, bias, distance, unfold=(chunk, left))


def _additive_mask(tile: Tile, dtype: torch.dtype) -> Tile:
    """Fold the boolean mask and any fixed bias into one additive mask in the model's dtype, once per forward.

    Backends would otherwise convert a boolean mask (and add a bias) in every layer.
    """
    if tile.mask is None and tile.bias is None:
        return tile
    allowed = tile.mask
    if allowed is None:
        q_len = tile.query_slice.stop - tile.query_slice.start
        k_len = tile.bias.shape[-1]
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=tile.bias.device).tril(k_len - q_len)
    base = torch.zeros((), dtype=dtype, device=allowed.device) if tile.bias is None else tile.bias.to(dtype)
    tile.mask = torch.where(allowed, base, torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=allowed.device))
    tile.bias = None
    return tile


def build_plan(config, ctx: AttentionContext, dtype: torch.dtype) -> AttentionPlan:
    """Choose the tiles for this forward. For n <= w all modes are the same computation (one causal tile)."""
    total = ctx.query_positions.shape[1]
    window = config.attention_window
    if total <= window:
        plain = ctx.cached == 0 and bool(ctx.key_valid.all())
        keys = slice(0, ctx.cached + total)
        tiles = [_dense_tile(config, ctx, slice(0, total), keys, causal_only=plain)]
    elif config.attention_mode != "full":
        tiles = [_unfolded_tile(config, ctx, total)]
    else:
        tiles = [
            _dense_tile(config, ctx, slice(start, min(start + window, total)),
                        slice(0, ctx.cached + min(start + window, total)), causal_only=False)
            for start in range(0, total, window)
        ]
    return AttentionPlan([_additive_mask(tile, dtype) for tile in tiles])


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
    """Reference attention: softmax(q k^T * scaling + bias, masked) v in float32 softmax."""
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


def _unfold_keys(x: torch.Tensor, cached: int, total: int, chunk: int, left: int) -> torch.Tensor:
    """(B, H, cached+total, d) keys -> (B*chunks, H, left+chunk, d): chunk j gets keys seen-left+j*c onwards."""
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
    cached: int,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of raw (pre-position) q (B,H,T,d) over raw k, v (B,H,cached+T,d) by the plan's tiles.

    `interface` is the attention backend (eager, sdpa, ...) with transformers' attention-interface signature.
    Returns the output (B, T, H, d) and, for a single dense tile, the attention weights the backend gave.
    """
    batch, heads, total, head_dim = query.shape
    outputs, weights = [], None
    for tile in plan.tiles:
        if tile.unfold is not None:
            chunk, left = tile.unfold
            q = _chunk_queries(query, total, chunk)
            k = _unfold_keys(key, cached, total, chunk, left)
            v = _unfold_keys(value, cached, total, chunk, left)
        else:
            q, k, v = query[:, :, tile.query_slice], key[:, :, tile.key_slice], value[:, :, tile.key_slice]
        if tile.factors is not None:
            cos_q, sin_q, cos_k, sin_k = tile.factors
            q, k = apply_rotary(q, cos_q, sin_q), apply_rotary(k, cos_k, sin_k)
        bias = None if tile.distance is None else module.learned_bias(tile.distance).to(q.dtype)
        out, tile_weights = interface(
            module, q, k, v, tile.mask, dropout=dropout, scaling=module.scaling, position_bias=bias, is_causal=True
        )
        if tile.unfold is not None:
            out = out.unflatten(0, (batch, -1)).flatten(1, 2)[:, :total]
        elif len(plan.tiles) == 1:
            weights = tile_weights
        outputs.append(out)
    return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0], weights
