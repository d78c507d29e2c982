"""The attention kernels: a layer's q, k, v arranged as the forward's tile (reading.py) lays them out, for one call
of the attention backend transformers selects (eager, sdpa, ...), and the reference eager computation.

`arrange` gathers the tile's queries and keys (the sink columns first, the block memory's last), encodes the
positions the tile carries, and folds the tile's mask and any bias the layer learned into one additive term, which
reaches the backend as its `position_bias` with no boolean mask (`is_causal=False`): transformers' SDPA function then
reads grouped key/value heads as they are (`enable_gqa`) instead of repeating every key and value per layer, as it
does for any mask it is given (transformers 5.23-5.25); the numbers are the same."""

import torch
from torch import nn

from .reading import AttentionPlan, Tile, additive_mask


COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128, torch.float16: torch.complex32}


def _as_complex(pairs: torch.Tensor) -> torch.Tensor:
    """(..., 2n) of interleaved pairs -> (..., n) complex, a view: `Tensor.view(dtype)` (one call) where no
    gradient flows through it, `view_as_complex` (which autograd records) where one does."""
    if pairs.requires_grad:
        return torch.view_as_complex(pairs.unflatten(-1, (-1, 2)))
    return pairs.view(COMPLEX[pairs.dtype])


def apply_rotary(x: torch.Tensor, factors: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., head_dim) with each interleaved pair (x0, x1), read as the complex number x0 + i x1, multiplied by
    its factor from `rotary_factors`: TorchScale's rotation (x0 cos - x1 sin, x1 cos + x0 sin) and scale, taken in
    float32. Eager, as one complex product: one pass over x, where the real form takes four element-wise ops, each
    reading and writing all of it; compiled, in the real form, which inductor fuses into one kernel (it generates
    no code for complex numbers, torch 2.13). `out` (no autograd): the product is written there (it may be x),
    where a caller's buffer is its place: in float32 eager, with no copy of it."""
    if torch.compiler.is_compiling():
        pairs, f = x.float().unflatten(-1, (-1, 2)), factors.unflatten(-1, (-1, 2))
        x0, x1, cos, sin = pairs[..., 0], pairs[..., 1], f[..., 0], f[..., 1]
        result = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2).to(x.dtype)
    elif out is not None and out.dtype == torch.float32:
        torch.mul(_as_complex(x.float()), _as_complex(factors), out=_as_complex(out))
        return out
    else:
        product = _as_complex(x.float()) * _as_complex(factors)
        result = torch.view_as_real(product).flatten(-2).to(x.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result


def encode_tokens(query: torch.Tensor, key: torch.Tensor, factors: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' queries and keys (B, H, T, d) encoded at their own positions by per-token `factors` (B, 1,
    T, d), as Llama's apply_rotary_pos_emb (RoPE: the cache then holds encoded keys); unchanged where a method is
    not per token (None: the plan's tile carries its terms)."""
    if factors is None:
        return query, key
    return apply_rotary(query, factors), apply_rotary(key, factors)


def repeat_kv(hidden_states: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, K, d) -> (B, Hkv * groups, K, d): each key/value head once for each query head of its group, as
    Llama's eager attention repeats them."""
    if groups == 1:
        return hidden_states
    batch, heads, length, width = hidden_states.shape
    return hidden_states[:, :, None].expand(batch, heads, groups, length, width).reshape(batch, heads * groups,
                                                                                         length, width)


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
    is_causal: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention: softmax(q k^T * scaling [capped: softcap * tanh(. / softcap)] + bias, masked) v in
    float32 softmax; grouped key/value heads are repeated for their query heads. Without a mask or a bias,
    `is_causal` masks the keys after each query's own (the last query meets the last key)."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:  # Gemma 2's cap, before the mask
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is None and position_bias is None and is_causal:
        q_len, k_len = scores.shape[-2:]
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
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


def _tile_inputs(tile: Tile, sink_slots: int, query, key, value, recalled=None, lent: bool = False):
    """The tile's queries, keys and values; the block memory's blocks (`recalled`, keys in its frame) after the
    window part's keys, turned into the tile's frame: written in the columns the cache `lent` after its span
    (`AttentionPlan.memory_room`), where it did."""
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
        room = slice(keys.stop, keys.stop + memory_keys.shape[2])
        if lent and key.shape[2] >= room.stop:  # the cache lent the columns after its span: no copy of the span
            if tile.memory_place is not None:  # turned straight into its columns
                apply_rotary(memory_keys, tile.memory_place, out=key[:, :, room])
            else:
                key[:, :, room] = memory_keys
            value[:, :, room] = memory_values
            return q, key[:, :, keys.start : room.stop], value[:, :, keys.start : room.stop]
        if tile.memory_place is not None:
            memory_keys = apply_rotary(memory_keys, tile.memory_place)
        k, v = torch.cat([k, memory_keys], dim=2), torch.cat([v, memory_values], dim=2)
    return q, k, v


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


def arrange(
    module: nn.Module,
    plan: AttentionPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    recalled: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The attention backend's query, key, value and additive bias (None: plainly causal, or every key seen) for the
    plan's tile: q (B, H, T, d) as the positions encoded it, over the keys and values the cache returned (B, Hkv, K,
    d), sink slots first, and the block memory's blocks this layer `recalled` (keys in the memory's frame), last.
    A chunked tile puts its chunks in the batch (B * chunks, ., b, .). Where the tile meets its sinks or the memory
    in a frame of their own through a second copy of each query, the copies lie side by side along the head
    dimension (the values padded to that width: the caller keeps the first `head_dim` of the output). The keys and
    values the cache returned are read, never written (they may be views of its buffers), but for what it lends a
    decoding step: the copy of its sink slots, where the step turns its sinks to the query
    (`AttentionPlan.sinks_lent`; the cache writes the raw slots back when the forward's step ends), and the columns
    after its span, where the step puts the memory's blocks (`AttentionPlan.memory_room`; no key the cache holds)."""
    tile = plan.tile
    given, k, v = _tile_inputs(tile, plan.sink_slots, query, key, value, recalled if tile.n_memory else None,
                               lent=plan.memory_room > 0)
    if tile.sink_key_rotation is not None:  # the sinks turned to the query (one query per row, per-token RoPE)
        sinks = k[:, :, : tile.n_sinks]
        if tile.sinks_in_slots and not k.requires_grad:  # the cache lent its sink slots' copy for this forward
            apply_rotary(sinks, tile.sink_key_rotation, out=sinks)
        else:
            k = torch.cat([apply_rotary(sinks, tile.sink_key_rotation), k[:, :, tile.n_sinks :]], dim=2)
    q = given
    if tile.factors is not None:
        q, k = apply_rotary(given, tile.factors[0]), apply_rotary(k, tile.factors[1])
    if tile.sink_query_factors is not None:
        q, k, v = _meet_sinks_in_their_frame(q, apply_rotary(given, tile.sink_query_factors), k, v, tile.n_sinks,
                                             tile.n_memory)
    bias = tile.bias
    if tile.distance is not None:  # a bias the layer learned (KERPLE), on top of the mask
        learned = module.learned_bias(tile.distance).to(q.dtype)
        bias = additive_mask(None, learned, q.dtype) if bias is None else bias + learned  # (None: plainly causal)
    return q, k, v, bias


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


def attention_map(plan: AttentionPlan, output: torch.Tensor, weights: torch.Tensor, value: torch.Tensor,
                  recalled: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (B, T, H, d) and the attention map over the keys the cache returned (B, H, T, K), from the weights of
    a dense tile over every key (`AttentionPlan.attention_maps`): a sink column's weight goes to the key it was
    taken from; the block memory's columns are no key of the cache's. Where the map is rebuilt, the output is read
    from it, so that gradients reach it."""
    tile = plan.tile
    attention_map = _attention_map(tile, plan.sink_slots, weights, value.shape[2])
    if attention_map is weights:
        return output, attention_map
    memory_values = recalled[1] if tile.n_memory else None
    return _output_of_map(attention_map, weights, value, memory_values).to(output.dtype), attention_map


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


__all__ = ["apply_rotary", "arrange", "attention_map", "eager_attention_forward", "encode_tokens"]
