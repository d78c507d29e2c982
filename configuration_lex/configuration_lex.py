"""LexConfig: the LEX Transformer (xPos + blockwise causal attention) as a transformers v5 config.

The architecture switches (pre/post norm, subln, deepnorm, embedding layer norm and scale, activation,
biases, an optional fairseq sinusoidal absolute embedding) are here so that every dense TorchScale
`Decoder` language model maps onto a LexConfig without loss; the modern backbone (grouped-query attention,
`head_dim`, RMSNorm, a gated MLP, q/k/v biases apart from the output projection's, `rope_parameters`) so that
every Llama, Mistral, Qwen2, Qwen3 (per-head q/k norms), Phi-3 and SmolLM3 (layers without rotary) checkpoint does
too, and every Gemma 2 and Gemma 3 one (norms scaled by 1 + w, post-sublayer norms, GeGLU, soft-capped logits,
local layers with their own window and rotary beside global ones). Names follow LlamaConfig (Gemma's for Gemma's
own concepts) where the concept is the same. The defaults are TorchScale's decoder: every config saved before these
fields existed loads unchanged.

Validation is transformers v5's (`@strict` from huggingface_hub, as in LlamaConfig): every field is checked on
construction and on every later assignment against its type (the `Literal` types below list the allowed choices)
and its range validator; the cross-field rules live in `validate_architecture`, which `@strict` runs after
construction and `save_pretrained` runs again before writing. Errors are
`huggingface_hub.errors.StrictDataclassFieldValidationError` (a bad field: the message names it) and
`StrictDataclassClassValidationError` (a cross-field rule), both `StrictDataclassError`; neither is a ValueError.

The Literal types are the one source of the allowed values: POSITION_EMBEDDING_TYPES, ATTENTION_MODES,
HIDDEN_ACTS, NORM_TYPES, MLP_TYPES, ROPE_TYPES, ABSOLUTE_POSITION_EMBEDDINGS and HF_MODEL_TYPES are derived from
them; CLI choices and converters import those.
"""

from numbers import Integral
from typing import Literal, get_args

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.utils.type_validators import interval

PositionEmbeddingType = Literal["xpos", "rope", "decay", "alibi", "kerple", "sandwich", "sinusoidal", "none"]
AttentionMode = Literal["blockwise", "sliding", "full"]
# "gelu_pytorch_tanh": GELU's tanh approximation (Gemma's GeGLU).
HiddenAct = Literal["gelu", "relu", "swish", "silu", "gelu_pytorch_tanh"]
# "gemma_rmsnorm": RMSNorm scaled by (1 + weight) in float32 before the cast back (Gemma's; its weights start at 0).
NormType = Literal["layernorm", "rmsnorm", "gemma_rmsnorm"]
MlpType = Literal["fc", "gated"]
# transformers' rope types whose frequencies do not depend on the current length: a windowed model re-encodes
# positions inside each window, so "dynamic" (and "longrope", which switches factors by length) cannot be reproduced.
RopeType = Literal["default", "linear", "llama3", "yarn"]
AbsolutePositionEmbedding = Literal[None, "sinusoidal"]
# Where attention sinks are seen from: "true", at their own positions (the distance grows with the document);
# "cache", StreamingLLM's positions within the cache (the sinks just before the query's window), so a sink is never
# further than S + w from its query.
SinkPositions = Literal["true", "cache"]
# The transformers families a converted checkpoint can come from beside Llama, Mistral and Qwen2 (which the other
# fields imply), which `lex convert-to-hf` writes back.
HfModelType = Literal[None, "qwen3", "phi3", "smollm3", "gemma2", "gemma3_text"]

POSITION_EMBEDDING_TYPES: tuple[str, ...] = get_args(PositionEmbeddingType)
ATTENTION_MODES: tuple[str, ...] = get_args(AttentionMode)
HIDDEN_ACTS: tuple[str, ...] = get_args(HiddenAct)
NORM_TYPES: tuple[str, ...] = get_args(NormType)
MLP_TYPES: tuple[str, ...] = get_args(MlpType)
ROPE_TYPES: tuple[str, ...] = get_args(RopeType)
ABSOLUTE_POSITION_EMBEDDINGS: tuple[str | None, ...] = get_args(AbsolutePositionEmbedding)
SINK_POSITIONS: tuple[str, ...] = get_args(SinkPositions)
HF_MODEL_TYPES: tuple[str | None, ...] = get_args(HfModelType)
WINDOW_RULE = "an even integer >= 4"  # what a window is (blockwise attention halves it into blocks of >= 2)


def is_window(value: object) -> bool:
    """Whether `value` is a window (attention_window, local_attention_window, a policy's or a source's): the rule
    stated once, which every check of a window asks; each names its own field."""
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= 4 and value % 2 == 0

# Field validators (the type is checked first, so these see numbers only; bools are refused as numbers).
positive = interval(min=0, exclude_min=True)
non_negative = interval(min=0)
dropout = interval(min=0.0, max=1.0, exclude_max=True)


@strict
class LexConfig(PreTrainedConfig):
    r"""
    Configuration of a LEX Transformer decoder.

    Args:
        max_position_embeddings: the training length l. Inputs may be far longer: blockwise and sliding
            attention only ever look at `attention_window` keys.
        position_embedding_type: "xpos" (default, the paper's), "rope", "decay" (xPos without rotation),
            "alibi", "kerple" (log variant, learned per head), "sandwich" (sinusoidal inner-product bias),
            "sinusoidal" (absolute, fairseq's table added to the embeddings: the paper's "Transformer" row; the
            same as "none" with `absolute_position_embedding="sinusoidal"`, to which either spelling is brought)
            or "none" (no position information; TorchScale decoders without xpos).
        attention_mode: "blockwise" (BCA: blocks of `attention_window // 2`, a query sees its block and
            the previous one), "sliding" (the last `attention_window` keys) or "full".
        attention_window: w; defaults to `max_position_embeddings`. Must be even and at least 4.
        attention_sinks: S; in blockwise and sliding modes the first S tokens of each document stay visible to
            every later query of that document, whatever the distance (StreamingLLM's attention sinks). 0
            (default): none. Full mode sees everything anyway.
        attention_sink_positions: where a query sees its sinks from. "true" (default): at their own positions, so
            a sink's distance grows with the document (a model trained with sinks at true distance); "cache":
            StreamingLLM's positions within the cache, the S sinks just before the query's window (sink j at
            distance S - j + the query's offset in its window), never further than S + w, so a model pretrained
            with full attention never sees a distance beyond S + w (what a converted Llama, Mistral or Qwen2
            checkpoint gets).
        attention_memory_blocks: k, the blocks of keys the window has evicted that every query chunk and every
            decoded token also reads (a block memory past the window, in blockwise and sliding modes, through a
            LexCache): the keys and values that leave the window are kept in blocks of `attention_memory_block_size`
            tokens; each forward ranks a layer's blocks by what its queries find (all of a forward of at most
            max(b, w / 16) tokens, else b) against each block's representative keys (without positions; memory.py
            has the rule) and reads k of them, placed just before its window (and after the sinks, so a key is never
            farther than S + k * block + w). 0 (default): no memory, exactly the model without it. On SmolLM2-135M
            with w = 1024: 64 blocks of 16 (benchmarks/RESULTS.md).
        attention_memory_block_size: tokens per memory block (default 16: on SmolLM2-135M, 64 blocks of 16
            recalled more keys hidden in natural text than 16 of 64, 32 of 32, 24 of 64 or 8 of 128,
            benchmarks/RESULTS.md).
        xpos_scale_base: B in zeta^(n/B). xpos_gamma: gamma in zeta_i = (2i + gamma d) / ((1 + gamma) d).
        rope_parameters: the rotation frequencies of "xpos", "rope" and "decay" (transformers v5's field):
            `rope_theta` (default 10000; a `rope_theta=` keyword, as older configs saved it, lands here) and
            `rope_type` "default", "linear", "llama3" or "yarn" with that type's keys; frequencies and yarn's
            attention factor come from transformers' `ROPE_INIT_FUNCTIONS`. Length-dependent types ("dynamic",
            "longrope") are refused.
        num_key_value_heads: key/value heads (grouped-query attention; 1 is multi-query); default
            `num_attention_heads`. head_dim: size of each head; default `hidden_size // num_attention_heads`.
        norm_type: "layernorm" (TorchScale's, eps `layer_norm_eps`), "rmsnorm" (Llama's, eps `rms_norm_eps`) or
            "gemma_rmsnorm" (Gemma's: RMSNorm scaled by 1 + weight in float32, eps `rms_norm_eps`), used by every norm
            of the model.
        mlp_type: "fc" (TorchScale's fc1 -> act -> fc2) or "gated" (Llama's down_proj(act(gate_proj(x)) *
            up_proj(x))).
        qk_norm: a norm (`norm_type`, over each head's `head_dim`) on every head's queries and keys before
            positions are applied (Qwen3's q_norm and k_norm). Default False.
        rope_layers: per layer, whether it takes rotary positions (None, the default: every layer). A layer with
            False attends without any position information (SmolLM3's `no_rope_layers`, where 1 means rotary
            too); only with `position_embedding_type="rope"`.
        sublayer_output_norms: a norm (`norm_type`) on the attention's and the MLP's outputs before each residual
            sum, beside the pre-norms (Gemma 2/3's post_attention_layernorm and post_feedforward_layernorm). Default
            False.
        query_pre_attn_scalar: scores scaled by query_pre_attn_scalar^-0.5 instead of head_dim^-0.5 (Gemma's).
            None (default): head_dim.
        attn_logit_softcapping: c in c * tanh(scores / c), the attention scores capped before the mask (Gemma 2's);
            every backend then computes the scores explicitly (SDPA cannot cap them). None (default): no cap.
        final_logit_softcapping: the same cap on the output logits (Gemma 2's, some Gemma 3's). None: no cap.
        embedding_scale_in_lookup: `embedding_scale` is part of the token lookup, as in Gemma's scaled embedding:
            rounded to the embeddings' dtype first (`embed_scale.to(weight.dtype)`: sqrt(2304) is 48.0 in bfloat16),
            and `inputs_embeds` are taken as given. False (default): TorchScale's, every input's embeddings times the
            Python float.
        local_layers: per layer, whether it is a local layer (None, the default: none is): sliding attention over
            its own trained window `local_attention_window` with its own `local_rope_parameters`, without sinks,
            whatever `attention_mode`, `attention_window` and `attention_sinks` the other (global) layers take
            (Gemma 2/3's sliding_attention layers). With a block memory, only the global layers read it, and their
            window holds every key a local layer reads (the memory takes what leaves it): sliding, attention_window
            >= local_attention_window; blockwise, attention_window >= 2 * (local_attention_window - 1).
            local_attention_window: even and >= 4, given with local_layers.
            local_rope_parameters: the local layers' rope (Gemma 3's rope_local_base_freq); None: `rope_parameters`.
        hf_model_type: the transformers family a converted checkpoint came from, "qwen3", "phi3", "smollm3",
            "gemma2" or "gemma3_text" (Gemma3ForCausalLM), which `lex convert-to-hf` writes back (Phi-3's fused
            projections are no part of the model's math). None (default): the one the other fields imply (Llama,
            Mistral or Qwen2; Qwen3 with `qk_norm`, SmolLM3 with `rope_layers`).
        attention_bias: biases on q/k/v projections; attention_output_bias: on the output projection (default
            `attention_bias`; Qwen2 has q/k/v biases only). mlp_bias: biases on the MLP projections.
        normalize_before: pre-norm layers with a final layer norm (True) or post-norm (False).
        subln: TorchScale's sub-LayerNorms (on the attention output before out_proj and on the FFN
            activation before fc2).
        deepnorm: DeepNet residual scaling alpha = (2N)^(1/4) (post-norm in TorchScale's Decoder; fairseq's
            `lm_base --deepnorm` keeps pre-norm, so both combinations are allowed).
        layernorm_embedding: a LayerNorm on the scaled embeddings.
        embedding_scale: multiplier of the token embeddings (TorchScale: 1 or sqrt(hidden_size)).
        sandwich_dim: d' of the sinusoidal vectors whose inner products make the Sandwich bias.
        absolute_position_embedding: None, or "sinusoidal" for fairseq's sinusoidal table added to the
            token embeddings (fairseq-trained TorchScale LMs); positions start at
            `absolute_position_offset` (fairseq: padding_idx + 1).

    Float fields accept ints too (`xpos_scale_base=512`); they are stored as given.
    """

    model_type = "lex"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the cache, under either transformers name
    # Pipeline parallel (`DistributedConfig(pp_size=...)`): the layers split into stages, the embeddings on the first,
    # the final norm on the last. Tensor parallel: `base_model_tp_plan`, which follows the MLP's kind.
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = positive(default=32000)
    hidden_size: int = positive(default=768)
    intermediate_size: int = positive(default=3072)
    num_hidden_layers: int = positive(default=12)
    num_attention_heads: int = positive(default=12)
    hidden_act: HiddenAct = "gelu"
    max_position_embeddings: int = positive(default=1024)
    position_embedding_type: PositionEmbeddingType = "xpos"
    attention_mode: AttentionMode = "blockwise"
    attention_window: int | None = None  # even and >= 4 once defaulted: validate_architecture
    attention_sinks: int = non_negative(default=0)
    attention_sink_positions: SinkPositions = "true"
    attention_memory_blocks: int = non_negative(default=0)
    attention_memory_block_size: int = positive(default=16)
    xpos_scale_base: float | int = positive(default=512.0)
    xpos_gamma: float | int = non_negative(default=0.4)
    rope_parameters: RopeParameters | dict | None = None  # {"rope_type": "default", "rope_theta": 10000.0} once set
    sandwich_dim: int = positive(default=128)
    num_key_value_heads: int | None = None  # num_attention_heads once defaulted
    head_dim: int | None = None  # hidden_size // num_attention_heads once defaulted
    norm_type: NormType = "layernorm"
    layer_norm_eps: float | int = positive(default=1e-5)
    rms_norm_eps: float | int = positive(default=1e-6)
    mlp_type: MlpType = "fc"
    hidden_dropout: float | int = dropout(default=0.0)
    attention_dropout: float | int = dropout(default=0.0)
    activation_dropout: float | int = dropout(default=0.0)
    initializer_range: float | int = non_negative(default=0.02)
    normalize_before: bool = True
    subln: bool = False
    deepnorm: bool = False
    layernorm_embedding: bool = False
    embedding_scale: float | int = positive(default=1.0)
    attention_bias: bool = True
    attention_output_bias: bool | None = None  # attention_bias once defaulted
    mlp_bias: bool = True
    qk_norm: bool = False
    rope_layers: list[bool] | None = None
    sublayer_output_norms: bool = False
    query_pre_attn_scalar: float | int | None = None  # > 0 when set: validate_architecture
    attn_logit_softcapping: float | int | None = None  # > 0 when set: validate_architecture
    final_logit_softcapping: float | int | None = None  # > 0 when set: validate_architecture
    embedding_scale_in_lookup: bool = False
    local_layers: list[bool] | None = None
    local_attention_window: int | None = None  # even and >= 4 with local_layers: validate_architecture
    local_rope_parameters: RopeParameters | dict | None = None
    hf_model_type: HfModelType = None
    absolute_position_embedding: AbsolutePositionEmbedding = None
    absolute_position_offset: int = non_negative(default=2)
    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.attention_window is None:
            self.attention_window = self.max_position_embeddings
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        # One spelling of fairseq's absolute sinusoidal positions: "sinusoidal" is "none" plus the table.
        if self.position_embedding_type == "sinusoidal":
            self.absolute_position_embedding = "sinusoidal"
        elif self.position_embedding_type == "none" and self.absolute_position_embedding == "sinusoidal":
            self.position_embedding_type = "sinusoidal"
        kwargs.setdefault("rope_theta", 10000.0)  # TorchScale's theta; the base class moves it into rope_parameters
        super().__post_init__(**kwargs)

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Tensor parallel (`from_pretrained(..., tp_plan="auto")` under torchrun), as Llama's: each rank holds the
        rows of its query and key/value heads and of its part of the MLP's width (gated, or TorchScale's fc1/fc2);
        the output projections add up the ranks' parts. What a plan cannot split (a norm across every head or the
        MLP's width, a bias over every head) is refused by name at the first forward (modeling_lex)."""
        mlp = ({"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"} if self.mlp_type == "gated"
               else {"fc1": "colwise", "fc2": "rowwise"})
        return {**{f"layers.*.self_attn.{name}_proj": "colwise" for name in "qkv"},
                "layers.*.self_attn.o_proj": "rowwise", **{f"layers.*.mlp.{name}": way for name, way in mlp.items()}}

    @property
    def attention_scaling(self) -> float:
        """What attention scores are scaled by: query_pre_attn_scalar^-0.5 (Gemma's), else head_dim^-0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def validate_architecture(self):
        """Part of `@strict`-powered validation: the rules that tie several fields together."""
        super().validate_architecture()
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(
                f"LexConfig.head_dim={self.head_dim} (default hidden_size / num_attention_heads) must be even: "
                "rotary encodings rotate pairs of dimensions"
            )
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LexConfig.num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads="
                f"{self.num_attention_heads} (each key/value head serves a group of query heads)"
            )
        window = self.attention_window
        if not is_window(window):
            raise ValueError(f"LexConfig.attention_window={window!r} must be {WINDOW_RULE}")
        if self.attention_memory_blocks:
            if self.attention_mode == "full":
                raise ValueError(
                    f"LexConfig.attention_memory_blocks={self.attention_memory_blocks} with attention_mode='full': "
                    "full attention sees every key, a memory of evicted ones has nothing to add (allowed: "
                    "'blockwise', 'sliding', or attention_memory_blocks=0)"
                )
            if self.attention_sinks and self.attention_sink_positions != "cache":
                raise ValueError(
                    f"LexConfig.attention_memory_blocks={self.attention_memory_blocks} with attention_sinks="
                    f"{self.attention_sinks} at attention_sink_positions={self.attention_sink_positions!r}: the memory "
                    "sits between the sinks and the window in the cache's frame (allowed: 'cache')"
                )
            held = self.attention_window if self.attention_mode == "sliding" else self.attention_window // 2 + 1
            if self.local_layers is not None and (self.local_attention_window or 0) > held:
                # The memory takes the keys that leave the global layers' window; a local layer reading keys
                # older than that window would leave the global layers a gap between the memory and the window.
                least = self.local_attention_window if self.attention_mode == "sliding" else \
                    2 * (self.local_attention_window - 1)
                raise ValueError(
                    f"LexConfig.attention_window={self.attention_window} with attention_memory_blocks="
                    f"{self.attention_memory_blocks} and local_attention_window={self.local_attention_window}: the "
                    "block memory takes the keys that leave the global layers' window, which must hold every key "
                    f"a local layer reads (allowed in attention_mode={self.attention_mode!r}: attention_window >= "
                    f"{least}, or attention_memory_blocks=0)"
                )
        if self.rope_layers is not None:
            if len(self.rope_layers) != self.num_hidden_layers:
                raise ValueError(
                    f"LexConfig.rope_layers has {len(self.rope_layers)} entries: one per layer (num_hidden_layers="
                    f"{self.num_hidden_layers}) or None"
                )
            if self.position_embedding_type != "rope":
                raise ValueError(
                    f"LexConfig.rope_layers with position_embedding_type={self.position_embedding_type!r}: layers "
                    "without positions are supported with 'rope' only (allowed: None)"
                )
        for field in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or value <= 0):
                raise ValueError(f"LexConfig.{field}={value!r} must be a positive number or None")
        if self.local_layers is not None:
            if len(self.local_layers) != self.num_hidden_layers:
                raise ValueError(
                    f"LexConfig.local_layers has {len(self.local_layers)} entries: one per layer (num_hidden_layers="
                    f"{self.num_hidden_layers}) or None"
                )
            local = self.local_attention_window
            if not is_window(local):
                raise ValueError(f"LexConfig.local_attention_window={local!r} must be {WINDOW_RULE} with "
                                 "local_layers")
        elif self.local_attention_window is not None or self.local_rope_parameters is not None:
            raise ValueError(
                f"LexConfig.local_attention_window={self.local_attention_window!r} and local_rope_parameters="
                f"{self.local_rope_parameters!r} apply to local_layers, which is None (allowed: None)"
            )
        if (self.position_embedding_type, self.absolute_position_embedding) in (("none", "sinusoidal"),
                                                                              ("sinusoidal", None)):
            raise ValueError(
                f"LexConfig.position_embedding_type={self.position_embedding_type!r} with absolute_position_embedding="
                f"{self.absolute_position_embedding!r}: fairseq's sinusoidal table alone is position_embedding_type="
                "'sinusoidal' with absolute_position_embedding='sinusoidal' (either one given sets the other)"
            )

    def validate_rope_type(self):
        """Only rope types whose frequencies are fixed: a windowed model re-encodes positions in every window (the
        local layers' rope too)."""
        ropes = {"rope_parameters": self.rope_parameters, "local_rope_parameters": self.local_rope_parameters}
        for field, rope in ropes.items():
            if rope is None:
                continue
            rope_type = rope.get("rope_type", "default")
            if rope_type not in ROPE_TYPES:
                raise ValueError(
                    f"LexConfig.{field}['rope_type']={rope_type!r} is not supported: "
                    + ("its frequencies depend on the current length, which a windowed model cannot reproduce; "
                       if rope_type in ("dynamic", "longrope") else "")
                    + f"allowed: {', '.join(ROPE_TYPES)}"
                )
            if rope.get("partial_rotary_factor", 1.0) != 1.0:
                raise ValueError(
                    f"LexConfig.{field}['partial_rotary_factor']={rope['partial_rotary_factor']}"
                    " is not supported: LEX rotates every dimension of a head (allowed: 1.0)"
                )


__all__ = [
    "ABSOLUTE_POSITION_EMBEDDINGS",
    "ATTENTION_MODES",
    "HF_MODEL_TYPES",
    "HIDDEN_ACTS",
    "MLP_TYPES",
    "NORM_TYPES",
    "POSITION_EMBEDDING_TYPES",
    "ROPE_TYPES",
    "SINK_POSITIONS",
    "WINDOW_RULE",
    "AttentionMode",
    "HfModelType",
    "HiddenAct",
    "LexConfig",
    "MlpType",
    "NormType",
    "PositionEmbeddingType",
    "RopeType",
    "SinkPositions",
    "is_window",
]
