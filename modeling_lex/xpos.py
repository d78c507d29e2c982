"""Position encodings: xPos, RoPE, decay-only (xPos without rotation), ALiBi, KERPLE, Sandwich, sinusoidal.

The formulas; `positions.py` says which method uses which. xPos follows TorchScale's `XPOS` exactly: pairs are
interleaved (dims 2i and 2i+1), theta_i = base^(-2i/d), zeta_i = (2i + gamma*d) / ((1+gamma)*d), queries are
scaled by zeta^(m/B) and keys by zeta^(-n/B), so the score depends on m - n only. Callers pass positions
*relative to an anchor inside the current attention window* (never absolute ones): angles and powers are built
in float64 from integers, so the factors stay exact and finite at any absolute position and in any dtype.
"""

import math

import torch


def inverse_frequencies(head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """theta_i = base^(-2i/d) for i < d/2, in float64."""
    return base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)


def xpos_zeta(head_dim: int, gamma: float, device: torch.device) -> torch.Tensor:
    """zeta_i = (2i + gamma*d) / ((1 + gamma)*d): TorchScale's `xpos.scale` buffer for gamma = 0.4."""
    two_i = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64)
    return (two_i + gamma * head_dim) / ((1.0 + gamma) * head_dim)


def rotary_factors(
    relative_positions: torch.Tensor,
    inverse_frequencies: torch.Tensor | None,
    log_decay: torch.Tensor | None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Per-position factors, `relative_positions.shape + (head_dim,)` float32: for each interleaved pair i, the
    complex number (cos, sin) of p*theta_i (1 when `inverse_frequencies` is None) scaled by exp(p * log_decay_i)
    (xPos: log(zeta_i)/B for queries, minus that for keys; none when None) and by `scale` (yarn's attention factor).

    `apply_rotary` multiplies each pair of x, read as a complex number, by it. Angles and powers are taken in
    float64 from integer positions, so the scale folded in costs nothing when applying them.
    """
    device = relative_positions.device
    positions = relative_positions.to(torch.float64)[..., None]
    reference = inverse_frequencies if inverse_frequencies is not None else log_decay
    if inverse_frequencies is not None:
        angles = positions * inverse_frequencies.to(device)
        cos, sin = angles.cos(), angles.sin()
    else:
        cos = torch.ones(positions.shape[:-1] + reference.shape, dtype=torch.float64, device=device)
        sin = torch.zeros_like(cos)
    factor = (positions * log_decay.to(device)).exp() * scale if log_decay is not None else scale
    return torch.stack((cos * factor, sin * factor), dim=-1).to(torch.float32).flatten(-2)


def inverse_rotation(factors: torch.Tensor) -> torch.Tensor:
    """The factors of the inverse of a pure rotation (complex conjugates: the sines negated)."""
    return (factors.unflatten(-1, (-1, 2)) * factors.new_tensor([1.0, -1.0])).flatten(-2)


def apply_rotary(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) with each interleaved pair (x0, x1), read as the complex number x0 + i x1, multiplied by
    its factor from `rotary_factors`: TorchScale's rotation (x0 cos - x1 sin, x1 cos + x0 sin) and scale, taken in
    float32. Eager, as one complex product: one pass over x, where the real form takes four element-wise ops, each
    reading and writing all of it; compiled, in the real form, which inductor fuses into one kernel (it generates
    no code for complex numbers, torch 2.13)."""
    pairs, f = x.float().unflatten(-1, (-1, 2)), factors.unflatten(-1, (-1, 2))
    if torch.compiler.is_compiling():
        x0, x1, cos, sin = pairs[..., 0], pairs[..., 1], f[..., 0], f[..., 1]
        product = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1)
    else:
        product = torch.view_as_real(torch.view_as_complex(pairs) * torch.view_as_complex(f))
    return product.flatten(-2).to(x.dtype)


def encode_tokens(query: torch.Tensor, key: torch.Tensor, factors: torch.Tensor | None,
                  turn: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The new tokens' queries and keys (B, H, T, d) encoded at their own positions by per-token `factors` (B, 1,
    T, d), as Llama's apply_rotary_pos_emb (RoPE: the cache then holds encoded keys); unchanged where a method is
    not per token (None: the plan's tiles carry its terms). Third: the encoded queries turned once more by `turn`
    (B, 1, 1, d), into the block memory's frame (`AttentionPlan.query_turn`), or None without a turn."""
    if factors is not None:
        query, key = apply_rotary(query, factors), apply_rotary(key, factors)
    return query, key, None if turn is None else apply_rotary(query, turn)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's head slopes: a geometric sequence 2^(-8/n), interleaved for non-powers of two."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(distance: torch.Tensor, num_heads: int) -> torch.Tensor:
    """-slope_h * (m - n) from query-minus-key distances `(..., queries, keys)` -> `(..., heads, queries, keys)`."""
    slopes = alibi_slopes(num_heads).to(distance.device)
    return -slopes[:, None, None] * distance.unsqueeze(-3).float()


def kerple_log_bias(distance: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """KERPLE (log variant): -r1_h * log(1 + r2_h * |m - n|), r1, r2 > 0 learned per head."""
    r1, r2 = r1.clamp(min=1e-2)[:, None, None], r2.clamp(min=1e-2)[:, None, None]
    return -r1 * torch.log1p(r2 * distance.unsqueeze(-3).abs().float())


def sandwich_bias(distance: torch.Tensor, num_heads: int, dim: int) -> torch.Tensor:
    """Sandwich: the inner product p_m . p_n of d'-dim sinusoidal vectors, sum_i cos((m-n) w_i), w_i = 10000^(-2i/d').

    Shifted by -d'/2 (softmax ignores it; the bias is then <= 0) and divided per head by 8h/H, ALiBi-like, as
    the Sandwich paper does. On average it falls with |m - n|.
    """
    frequencies = 10000.0 ** (-torch.arange(1, dim // 2 + 1, dtype=torch.float64, device=distance.device) * 2 / dim)
    inner = torch.cos(distance.to(torch.float64)[..., None] * frequencies).sum(-1) - dim / 2
    heads = torch.arange(1, num_heads + 1, dtype=torch.float64, device=distance.device)
    return (inner.unsqueeze(-3) / (heads * 8 / num_heads)[:, None, None]).float()


def sinusoidal_embedding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """fairseq's SinusoidalPositionalEmbedding table rows: [sin(p*f) | cos(p*f)], f_j = 10000^(-j/(dim/2-1))."""
    half = dim // 2
    frequencies = torch.exp(
        torch.arange(half, dtype=torch.float64, device=positions.device) * -(math.log(10000.0) / (half - 1))
    )
    angles = positions.to(torch.float64)[..., None] * frequencies
    table = torch.cat([angles.sin(), angles.cos()], dim=-1)
    if dim % 2:
        table = torch.nn.functional.pad(table, (0, 1))
    return table.to(torch.float32)
