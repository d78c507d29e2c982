"""Position methods: one class per `position_embedding_type`, in one registry, POSITION_METHODS.

A method says what it adds to the attention of one tile from the positions of its queries and keys (relative to
the tile's anchor): rotary factors for q and k, a fixed additive bias, or distances for a bias the layers learn.
It also owns the parameters each attention layer learns for it and their initialisation, and says which other
implementations compute it, which the converters ask: TorchScale's Decoder (`torchscale`) and transformers'
Llama family (`llama`). fairseq's absolute sinusoidal table is no attention term: the model adds it to the
embeddings when `absolute_position_embedding` is set, as "sinusoidal" implies.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .xpos import alibi_bias, inverse_frequencies, kerple_log_bias, rotary_factors, sandwich_bias, xpos_zeta


@dataclass
class PositionTerms:
    """What one tile's attention gets from positions (any of them may be absent)."""

    factors: tuple[torch.Tensor, torch.Tensor] | None = None  # of queries and keys (xpos.rotary_factors)
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

    def __init__(self, config) -> None:
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

    def __init__(self, config) -> None:
        super().__init__(config)
        head_dim, rope = config.head_dim, config.rope_parameters
        self.inverse_frequencies, self.scale = None, 1.0
        if self.rotate:
            config.validate_rope_type()  # again: a config changed after it was built (rope_type="dynamic") is refused
            if rope["rope_type"] == "default":
                self.inverse_frequencies = inverse_frequencies(head_dim, rope["rope_theta"], torch.device("cpu"))
            else:  # transformers' own frequencies and attention factor, never a copy (on the CPU, also while
                with torch.device("cpu"):  # from_pretrained builds the model on the meta device)
                    frequencies, self.scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device("cpu"))
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


def position_method(config) -> PositionMethod:
    """The method of `config.position_embedding_type` (the registry covers every allowed value; a test checks)."""
    return POSITION_METHODS[config.position_embedding_type](config)
