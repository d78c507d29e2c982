"""Position encodings: the formulas (xPos, RoPE, decay-only, ALiBi, KERPLE, Sandwich, sinusoidal) and one class per
`position_embedding_type` using them, in one registry, POSITION_METHODS.

The formulas: xPos follows TorchScale's `XPOS` exactly: pairs are interleaved (dims 2i and 2i+1), theta_i =
base^(-2i/d), zeta_i = (2i + gamma*d) / ((1+gamma)*d), queries are scaled by zeta^(m/B) and keys by zeta^(-n/B), so
the score depends on m - n only. Callers pass positions *relative to an anchor inside the current attention window*
(never absolute ones): angles and powers are built in float64 from integers, so the factors stay exact and finite
at any absolute position and in any dtype.

The methods: a method says what it adds to the attention of one tile from the positions of its queries and keys
(relative to the tile's anchor): rotary factors for q and k, a fixed additive bias, or distances for a bias the
layers learn. It also owns the parameters each attention layer learns for it and their initialisation, and says
which other implementations compute it, which the converters ask: TorchScale's Decoder (`torchscale`) and
transformers' Llama family (`llama`). fairseq's absolute sinusoidal table is no attention term: the model adds it
to the embeddings when `absolute_position_embedding` is set, as "sinusoidal" implies.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


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

    `kernels.apply_rotary` multiplies each pair of x, read as a complex number, by it. Angles and powers are taken in
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


@dataclass
class PositionTerms:
    """What one tile's attention gets from positions (any of them may be absent)."""

    factors: tuple[torch.Tensor, torch.Tensor] | None = None  # of queries and keys (rotary_factors)
    bias: torch.Tensor | None = None  # (..., heads, queries, keys) added to the scores
    distance: torch.Tensor | None = None  # (..., queries, keys) query minus key position, for a learned bias


class PositionMethod:
    """No position information (TorchScale decoders without xPos)."""

    torchscale = True  # TorchScale's Decoder computes it (convert-torchscale / convert-to-torchscale)
    llama = False  # transformers' Llama, Mistral and Qwen2 compute it (convert-to-hf)
    # Whether each token's encoding depends on its own position alone (a pure rotation, whose scores depend on
    # m - n whatever the anchor): queries and keys are then encoded once, at their position ids, before the
    # cache, instead of relative to every tile's anchor.
    per_token = False

    def __init__(self, config, rope_parameters: dict | None = None) -> None:
        self.config = config

    def terms(self, q_rel: torch.Tensor, k_rel: torch.Tensor) -> PositionTerms:
        return PositionTerms()

    def add_parameters(self, attention: nn.Module) -> None:
        """Register the parameters one attention layer learns for this method (none by default)."""

    def init_parameters(self, attention: nn.Module) -> None:
        """Initialise what `add_parameters` registered (from `_init_weights`)."""

    def learned_bias(self, attention: nn.Module, distance: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"position_embedding_type={self.config.position_embedding_type!r} learns no bias")

    def token_factors(self, positions: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"position_embedding_type={self.config.position_embedding_type!r} is not per token")

    def shift_factors(self, shift: torch.Tensor) -> torch.Tensor:
        """The factors that move a per-token encoding by `shift` positions (no second attention factor)."""
        raise TypeError(f"position_embedding_type={self.config.position_embedding_type!r} is not per token")


class Sinusoidal(PositionMethod):
    """fairseq's absolute sinusoidal table added to the embeddings (by the model); nothing in attention."""


class Rotary(PositionMethod):
    """Rotation by positions (frequencies from `rope_parameters`) and/or xPos's decay zeta^(+-n/B)."""

    rotate = True
    decay = True

    def __init__(self, config, rope_parameters: dict | None = None) -> None:
        """`rope_parameters`: the rope of the layers this method serves (None: the config's; local layers pass
        `local_rope_parameters`)."""
        super().__init__(config)
        head_dim, rope = config.head_dim, rope_parameters or config.rope_parameters
        self.inverse_frequencies, self.scale = None, 1.0
        if self.rotate:
            config.validate_rope_type()  # again: a config changed after it was built (rope_type="dynamic") is refused
            if rope["rope_type"] == "default":
                self.inverse_frequencies = inverse_frequencies(head_dim, rope["rope_theta"], torch.device("cpu"))
            else:  # transformers' own frequencies and attention factor, never a copy (on the CPU, also while
                with torch.device("cpu"):  # from_pretrained builds the model on the meta device)
                    frequencies, self.scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](_WithRope(config, rope),
                                                                                     torch.device("cpu"))
                self.inverse_frequencies = frequencies.to(torch.float64)
        self.log_decay = None
        if self.decay:
            self.log_decay = xpos_zeta(head_dim, config.xpos_gamma, torch.device("cpu")).log() / config.xpos_scale_base

    def terms(self, q_rel: torch.Tensor, k_rel: torch.Tensor) -> PositionTerms:
        negated = None if self.log_decay is None else -self.log_decay
        return PositionTerms(factors=(rotary_factors(q_rel, self.inverse_frequencies, self.log_decay, self.scale),
                                      rotary_factors(k_rel, self.inverse_frequencies, negated, self.scale)))


class XPos(Rotary):
    """xPos (the paper's): rotation and decay."""


class Rope(Rotary):
    """RoPE: rotation only (what Llama, Mistral and Qwen2 use). A rotation's scores depend on m - n alone, so each
    token is rotated once by its own position id (angles in float64, exact at any position) and the cache keeps
    rotated keys: decoding re-encodes nothing, as in Llama."""

    decay = False
    torchscale = False
    llama = True
    per_token = True

    def terms(self, q_rel: torch.Tensor, k_rel: torch.Tensor) -> PositionTerms:
        return PositionTerms()

    def token_factors(self, positions: torch.Tensor) -> torch.Tensor:
        """The factors at each position id, (..., head_dim) float32."""
        return rotary_factors(positions, self.inverse_frequencies, None, self.scale)

    def shift_factors(self, shift: torch.Tensor) -> torch.Tensor:
        return rotary_factors(shift, self.inverse_frequencies, None)


class Decay(Rotary):
    """xPos without rotation (the paper's "- Rotation" ablation)."""

    rotate = False
    torchscale = False


def _distance(q_rel: torch.Tensor, k_rel: torch.Tensor) -> torch.Tensor:
    return q_rel[..., :, None] - k_rel[..., None, :]


class Alibi(PositionMethod):
    """ALiBi: -slope_h * (m - n)."""

    torchscale = False

    def terms(self, q_rel: torch.Tensor, k_rel: torch.Tensor) -> PositionTerms:
        return PositionTerms(bias=alibi_bias(_distance(q_rel, k_rel), self.config.num_attention_heads))


class Sandwich(PositionMethod):
    """Sandwich: inner products of sinusoidal position vectors as a bias."""

    torchscale = False

    def terms(self, q_rel: torch.Tensor, k_rel: torch.Tensor) -> PositionTerms:
        bias = sandwich_bias(_distance(q_rel, k_rel), self.config.num_attention_heads, self.config.sandwich_dim)
        return PositionTerms(bias=bias)


class Kerple(PositionMethod):
    """KERPLE (log variant): -r1_h * log(1 + r2_h |m - n|) with r1, r2 learned per head and layer."""

    torchscale = False

    def terms(self, q_rel: torch.Tensor, k_rel: torch.Tensor) -> PositionTerms:
        return PositionTerms(distance=_distance(q_rel, k_rel))

    def add_parameters(self, attention: nn.Module) -> None:
        attention.kerple_r1 = nn.Parameter(torch.empty(self.config.num_attention_heads))
        attention.kerple_r2 = nn.Parameter(torch.empty(self.config.num_attention_heads))

    def init_parameters(self, attention: nn.Module) -> None:
        init.uniform_(attention.kerple_r1, 0.0, 2.0)  # the KERPLE paper's initialisation
        init.uniform_(attention.kerple_r2, 0.0, 1.0)

    def learned_bias(self, attention: nn.Module, distance: torch.Tensor) -> torch.Tensor:
        return kerple_log_bias(distance, attention.kerple_r1, attention.kerple_r2)


POSITION_METHODS: dict[str, type[PositionMethod]] = {
    "xpos": XPos,
    "rope": Rope,
    "decay": Decay,
    "alibi": Alibi,
    "kerple": Kerple,
    "sandwich": Sandwich,
    "sinusoidal": Sinusoidal,
    "none": PositionMethod,
}


class _WithRope:
    """The config as transformers' rope functions read it, with another layer type's `rope_parameters`."""

    def __init__(self, config, rope_parameters: dict) -> None:
        self._config, self.rope_parameters = config, rope_parameters

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def position_method(config, rope_parameters: dict | None = None) -> PositionMethod:
    """The method of `config.position_embedding_type` (the registry covers every allowed value; a test checks),
    with the rope `rope_parameters` (None: the config's)."""
    return POSITION_METHODS[config.position_embedding_type](config, rope_parameters)
