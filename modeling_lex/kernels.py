"""The attention kernels: each layer's q, k, v run through the forward's plan (reading.py), tile by tile, on the
attention backend transformers selects (eager, sdpa, ...), with the reference eager computation beside them. A
decoding step with the block memory meets the memory's keys with a second encoding of its query, which no backend
takes: it is the one eager computation of its own here (`_one_query_and_the_memory`).

The backend is the one LexAttention takes from transformers' `ALL_ATTENTION_FUNCTIONS`, as Llama's attention does,
with one exception, which this module owns (transformers 5.23-5.25): `sdpa_attention_forward` repeats grouped
key/value heads (`repeat_kv`: a copy of every key and value per layer) whenever a mask is given, because CUDA's fused
kernels take no mask with grouped heads; torch's CPU kernel does (`enable_gqa`), and LEX's tiles always carry a mask.
So in its place, a masked SDPA call of several queries with grouped heads on CPU is made here
(`_grouped_sdpa_forward`), with the same numbers."""

from collections.abc import Callable

import torch
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from .reading import AttentionPlan, Tile
from .positions import apply_rotary, inverse_rotation


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention: softmax(q k^T * scaling [capped: softcap * tanh(. / softcap)] + bias, masked) v in
    float32 softmax; grouped key/value heads are repeated for their query heads."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:  # Gemma 2's cap, before the mask
        scores = torch.tanh(scores / softcap) * softcap
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


def _grouped_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA backend, but a masked call of several queries on CPU with grouped key/value heads reads
    the heads as they are (`enable_gqa`) instead of repeating them: the same result (the kernel serves query head h
    from key/value head h // groups, as `repeat_kv` lays them out), without copying every key and value per layer
    (at 64 queries against 2,115 keys, the copy took twice the attention's time)."""
    grouped = key.shape[1] != query.shape[1]
    if (attention_mask is None or position_bias is not None or not grouped or query.shape[2] == 1
            or query.device.type != "cpu" or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      position_bias=position_bias, **kwargs)
    output = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                        dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def _chunks(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """x (B, H, K, d) at columns (chunks, n) shared by the rows, or (B, chunks, n) per row -> (B*chunks, H, n, d)."""
    by_key = x.transpose(1, 2)  # (B, K, H, d)
    if columns.dim() == 2:
        picked = by_key.index_select(1, columns.flatten())
    else:
        picked = by_key[torch.arange(x.shape[0], device=x.device)[:, None], columns.flatten(1)]
    picked = picked.view(x.shape[0], *columns.shape[-2:], x.shape[1], x.shape[3])  # (B, chunks, n, H, d)
    return picked.permute(0, 1, 3, 2, 4).flatten(0, 1)


def _tile_inputs(tile: Tile, sink_slots: int, query, key, value, recalled=None):
    """The tile's queries, keys and values; the block memory's blocks (`recalled`, keys in its frame) after the
    window part's keys, turned into the tile's frame."""
    if tile.query_slots is not None:
        return _chunks(query, tile.query_slots), _chunks(key, tile.key_columns), _chunks(value, tile.key_columns)
    keys = slice(sink_slots + tile.key_slice.start, sink_slots + tile.key_slice.stop)
    if tile.sinks_in_slots:  # the sink columns are the cache's copy of its sink slots, before its window part
        keys = slice(0, keys.stop)
    q, k, v = query[:, :, tile.query_slice], key[:, :, keys], value[:, :, keys]
    if tile.sink_columns is not None and not tile.sinks_in_slots:
        index = tile.sink_columns[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        k = torch.cat([key.gather(2, index), k], dim=2)
        v = torch.cat([value.gather(2, index), v], dim=2)
    if recalled is not None:
        memory_keys, memory_values = recalled
        if tile.memory_place is not None:
            memory_keys = apply_rotary(memory_keys, tile.memory_place)
        elif tile.memory_query_rotation is not None:  # (attention maps of one query: the keys turned to it)
            memory_keys = apply_rotary(memory_keys, inverse_rotation(tile.memory_query_rotation))
        k, v = torch.cat([k, memory_keys], dim=2), torch.cat([v, memory_values], dim=2)
    return q, k, v


def _meets_the_memory_apart(tile: Tile, plan: AttentionPlan) -> bool:
    """A dense tile of one query per row whose block memory takes no position terms of the tile's own (per-token
    RoPE, or no positions): a decoding step, which meets the memory's keys where the memory holds them."""
    return (tile.n_memory > 0 and tile.query_slots is None and tile.query_slice.stop - tile.query_slice.start == 1
            and tile.factors is None and tile.sink_query_factors is None and tile.distance is None
            and not plan.attention_maps)


def _one_query_and_the_memory(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              mask: torch.Tensor | None, q_memory: torch.Tensor,
                              recalled: tuple[torch.Tensor, torch.Tensor], dropout: float) -> torch.Tensor:
    """One query per row (B, H, 1, d) against the window's keys k (B, Hkv, K, d) and, encoded in the block
    memory's frame (`q_memory`), against the memory's keys where the memory holds them, in one softmax (float32,
    as eager_attention_forward; the tile's mask covers both, the memory's columns last) -> (B, 1, H, d). No
    backend takes two encodings of one query: this is the eager computation, each key/value head serving its query
    heads by a view (no repeat_kv), so a decoding step neither rotates nor copies the memory's keys."""
    batch, heads, _, width = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    memory_keys, memory_values = recalled
    scores = torch.cat([torch.matmul(q.reshape(batch, kv_heads, groups, width), k.transpose(2, 3)),
                        torch.matmul(q_memory.reshape(batch, kv_heads, groups, width), memory_keys.transpose(2, 3))],
                       dim=-1)
    scores = scores * module.scaling
    if module.softcap is not None:  # Gemma 2's cap, before the mask
        scores = torch.tanh(scores / module.softcap) * module.softcap
    if mask is not None:  # (B, 1 or H, 1, K + M)
        scores = scores + mask.reshape(batch, -1, groups if mask.shape[1] == heads else 1, mask.shape[-1])
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    window = k.shape[2]
    output = torch.matmul(weights[..., :window], v) + torch.matmul(weights[..., window:], memory_values)
    return output.reshape(batch, heads, 1, -1).transpose(1, 2)


def _attention_map(tile: Tile, sink_slots: int, weights: torch.Tensor, n_keys: int) -> torch.Tensor:
    """A dense tile's weights as a map over the keys the cache returned (sink slots first): a sink column's weight
    goes to the key it was taken from."""
    batch, heads, length, _ = weights.shape
    n_sinks = 0 if tile.sink_columns is None else tile.sink_columns.shape[1]
    if n_sinks == 0 and sink_slots == 0 and tile.n_memory == 0 and tile.key_slice == slice(0, n_keys):
        return weights  # the map itself, as the backend computed it (gradients flow through it)
    full = weights.new_zeros(batch, heads, length, n_keys)  # (the block memory's columns are no key of the cache's)
    window = weights[..., n_sinks : weights.shape[-1] - tile.n_memory]
    full[..., sink_slots + tile.key_slice.start : sink_slots + tile.key_slice.stop] = window
    if n_sinks:
        index = tile.sink_columns[:, None, None, :].expand(-1, heads, length, -1)
        full.scatter_add_(3, index, weights[..., :n_sinks])
    return full


def _meet_sinks_in_their_frame(q: torch.Tensor, q_sink: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: int,
                               memory: int = 0):
    """Each query twice along the head dimension, as encoded and in the sink frame; the window keys meet the first
    copy and the first `sinks` and last `memory` key columns (the block memory's) the second, so one attention call
    scores the sinks and the memory at their places in the cache while every other key keeps its own. The values
    are padded with zeros to the same width (SDPA's fused CPU kernel needs equal widths, else it takes the unfused
    math path): the caller keeps the first half of the output."""
    width = k.shape[-1]
    keys = k.new_zeros(*k.shape[:-1], 2 * width)
    window = slice(sinks, k.shape[-2] - memory)
    keys[..., window, :width] = k[..., window, :]
    keys[..., :sinks, width:] = k[..., :sinks, :]
    keys[..., window.stop :, width:] = k[..., window.stop :, :]
    values = v.new_zeros(*v.shape[:-1], 2 * v.shape[-1])
    values[..., : v.shape[-1]] = v
    return torch.cat([q, q_sink], dim=-1), keys, values


def run_attention(
    module: nn.Module,
    interface: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: AttentionPlan,
    dropout: float,
    recalled: tuple[torch.Tensor, torch.Tensor] | None = None,
    frame_query: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of raw (pre-position) q (B,H,T,d) over the raw keys and values the cache returned (B,Hkv,K,d) and
    the block memory's blocks it `recalled` (B,Hkv,k*b,d, keys in the memory's frame), by the plan's tiles;
    `frame_query`: a decoding step's query turned into the memory's frame (`AttentionPlan.query_turn`), if any.

    `interface` is the attention backend (eager, sdpa, ...) with transformers' attention-interface signature
    (transformers' SDPA function runs as `_grouped_sdpa_forward`); the caller's `kwargs` pass through to it, as in
    modeling_llama. A decoding step with the block memory meets it
    apart (`_one_query_and_the_memory`). Returns the output (B, T, H, d) and, when the plan keeps them, the
    attention weights as a map over the keys. The keys and values are read, never written: they may be views of
    the cache's buffers.
    """
    batch, _, total, _ = query.shape
    if interface is sdpa_attention_forward:
        interface = _grouped_sdpa_forward
    outputs, weights = [], None
    for tile in plan.tiles:
        apart = recalled is not None and _meets_the_memory_apart(tile, plan)
        given, k, v = _tile_inputs(tile, plan.sink_slots, query, key, value,
                                   recalled if tile.n_memory and not apart else None)
        if tile.sink_key_rotation is not None and not tile.sinks_in_slots:  # (else the cache rotated its slots' copy)
            k = torch.cat([apply_rotary(k[:, :, : tile.n_sinks], tile.sink_key_rotation), k[:, :, tile.n_sinks :]],
                          dim=2)
        if apart:
            q_memory = given if frame_query is None else frame_query
            outputs.append(_one_query_and_the_memory(module, given, k, v, tile.mask, q_memory, recalled, dropout))
            continue
        q = given
        if tile.factors is not None:
            q, k = apply_rotary(given, tile.factors[0]), apply_rotary(k, tile.factors[1])
        if tile.sink_query_factors is not None:
            q, k, v = _meet_sinks_in_their_frame(q, apply_rotary(given, tile.sink_query_factors), k, v, tile.n_sinks,
                                                 tile.n_memory)
        mask = tile.mask
        bias = None if tile.distance is None else module.learned_bias(tile.distance).to(q.dtype)
        if module.softcap is not None:  # capped scores: the eager computation (LexAttention picks it)
            kwargs = {**kwargs, "softcap": module.softcap}
        out, weights = interface(
            module, q, k, v, mask, dropout=dropout, scaling=module.scaling, position_bias=bias, is_causal=True,
            **kwargs,
        )
        out = out[..., : value.shape[-1]]  # the values' own width (see _meet_sinks_in_their_frame)
        if tile.query_slots is not None:
            out = out.unflatten(0, (batch, -1)).flatten(1, 2)[:, : total - tile.first_query]
        outputs.append(out)
    output = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    if not plan.attention_maps:
        return output, None
    tile = plan.tiles[0]  # maps: one dense tile over every key
    attention_map = _attention_map(tile, plan.sink_slots, weights, key.shape[2])
    if attention_map is not weights:  # rebuilt over the cache's keys: the output read from it (gradients reach it)
        memory_values = recalled[1] if tile.n_memory else None
        output = _output_of_map(attention_map, weights, value, memory_values).to(output.dtype)
    return output, attention_map


def _grouped(value: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    return value.repeat_interleave(heads // value.shape[1], dim=1).to(dtype)


def _output_of_map(attention_map: torch.Tensor, weights: torch.Tensor, value: torch.Tensor,
                   memory_values: torch.Tensor | None):
    """The output (B, T, H, d) as the map (B, H, T, K) times the cache's values (B, Hkv, K, d), plus the block
    memory's weights (the tile's last columns, none of the map's) times its values."""
    heads, dtype = attention_map.shape[1], attention_map.dtype
    output = attention_map @ _grouped(value, heads, dtype)
    if memory_values is not None:
        output = output + weights[..., -memory_values.shape[2] :] @ _grouped(memory_values, heads, dtype)
    return output.transpose(1, 2).contiguous()


__all__ = ["eager_attention_forward", "run_attention"]
