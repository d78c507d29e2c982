"""Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 and Gemma 3 checkpoints <-> LEX models.

    lex convert-hf SRC OUT [--attention_mode M] [--attention_window W] [--attention_sinks S]
        [--attention_sink_positions cache|true] [--attention_memory_blocks K] [--attention_memory_block_size B]
        [--position_embedding_type rope|xpos] [--dtype D] [--force]
    lex convert-to-hf SRC OUT [--force]

SRC is a model folder (safetensors) or a `.gguf` file of an architecture transformers' GGUF loader reads (Llama,
Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3), or a folder holding exactly one, read by that loader (dequantized,
with its tokenizer; needs the `gguf` package).

A LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM or
SmolLM3ForCausalLM becomes a LexForCausalLM with RoPE positions, RMSNorm, a gated MLP, grouped-query attention and
the source's biases; Qwen3's per-head q/k norms become `qk_norm`, SmolLM3's layers without rotary `rope_layers`,
and Phi-3's fused `qkv_proj` and `gate_up_proj` are split into q/k/v and gate/up on the way in and fused again on
the way out (`hf_model_type` records the family to go back to). A Gemma2ForCausalLM or Gemma3ForCausalLM (text)
keeps its norms scaled by 1 + w (`norm_type="gemma_rmsnorm"`), its embeddings scaled by sqrt(hidden) in their dtype
(`embedding_scale_in_lookup`), its post-attention and post-MLP norms (`sublayer_output_norms`),
`query_pre_attn_scalar`, GeGLU, soft-capped attention scores (Gemma 2) and logits, Gemma 3's q/k norms, and its
sliding_attention layers as LEX local layers (`local_layers`): sliding over their own trained `sliding_window`
with their own rope (Gemma 3's per-layer-type rope_parameters), whatever mode and window the global
(full_attention) layers take. By default it computes exactly what the source
does: full attention, or the source's `sliding_window` on every layer as LEX `sliding` with w = that window (a
query at p sees p-w+1 ... p in both). `attention_mode="blockwise"` (BCA) or `"sliding"` makes it read past its
training length, and `attention_memory_blocks` k > 0 (with `attention_memory_block_size` b) adds a block memory
past the window to those modes: the k blocks of b evicted tokens that the current query scores best are read too
(by the global layers; Gemma's local layers keep their own window).

Position retrofit: `position_embedding_type="xpos"` keeps the source's rotation (its rope_type's frequencies and
attention factor, linear, llama3 and yarn included) and adds xPos's scale zeta^((m-n)/B), with B =
`xpos_scale_base` = max_position_embeddings / 2: the ratio of the xPos and LEX papers (B = 512 at a training length
of 1,024), so that at the source's training length the decay of each pair is what the paper's models saw at
theirs. A smaller B would fade distant keys that the checkpoint relies on inside its length; a larger one leaves it
nearly RoPE, with little decay to extrapolate by. The scale is new to the weights: the model needs fine-tuning.

Rotation layout: HF models rotate the two halves of each head (dims i and i + d/2 form pair i), LEX rotates
interleaved pairs (dims 2i and 2i+1), so the rows of q_proj and k_proj (and their biases) are permuted per head
(per key/value head for k_proj) on the way in and back on the way out. The dot product of a query and a key is the
same, since both are permuted alike.

Families: what each family has (norms and their offset, biases, local layers, caps, embedding scale, q/k norms,
fused projections, layers without rotary, its GGUF architecture, its config class) is one row of FAMILIES (a
`Family`). The rule: no function asks which family it converts, only what that family's row says; a family is added
by adding its row (and, if `lex convert-to-hf` names it back, its model_type to LexConfig's HfModelType).

Folders are converted tensor by tensor from safetensors (never a pickle), one output shard at a time, so at most
one shard of weights is in memory; the output folder appears only when complete (lex_base.staging). What no
target computes is refused, naming the field and why, before anything is written.
"""

import json
import logging
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args

import torch
from accelerate import init_empty_weights
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Gemma2Config,
    Gemma3TextConfig,
    Qwen3Config,
    SmolLM3Config,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import is_gguf_available
from transformers.utils.hub import convert_file_size_to_int

from configuration_lex import ATTENTION_MODES, HF_MODEL_TYPES, WINDOW_RULE, LexConfig, is_window
from lex_base.staging import atomic_directory
from modeling_lex import LexForCausalLM
from modeling_lex.positions import POSITION_METHODS

from .checkpoint import ConversionError, check_tensors, refuse_field

logger = logging.getLogger(__name__)

# Phi-3's fused projections: the fused name, then its parts in row order (a part's rows: `fused_parts`).
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# The position_embedding_type a converted checkpoint may take: its own RoPE, or the xPos retrofit (same rotation).
RETROFITS = ("rope", "xpos")
# Well-known decoders that are not Llama-family RoPE models, and what about them no LEX model computes.
FOREIGN_POSITIONS = {
    "gpt2": "learned absolute position embeddings (wpe)",
    "gpt_bigcode": "learned absolute position embeddings (wpe)",
    "opt": "learned absolute position embeddings",
    "bloom": "ALiBi biases with its own layout",
    "gpt_neox": "rotary embeddings on part of each head (rotary_pct)",
    "gptj": "rotary embeddings on part of each head (rotary_dim)",
    "phi": "rotary embeddings on part of each head (partial_rotary_factor)",
}
# HF activation names -> LexConfig.hidden_act (transformers' "gelu" is the exact erf GELU, as LEX's).
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu",
                  "gelu_pytorch_tanh": "gelu_pytorch_tanh"}
# Files carried over besides the weights and config.json: the tokenizer and the generation defaults.
CARRIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)
# Layer norms are the only tensors named differently (LEX keeps TorchScale's names); the rest are Llama's names.
# Llama's post_attention_layernorm is the MLP's pre-norm; Gemma's is the attention output's norm.
LEX_NORMS = {"input_layernorm": "self_attn_layer_norm", "post_attention_layernorm": "final_layer_norm"}
GEMMA_NORMS = {"input_layernorm": "self_attn_layer_norm", "post_attention_layernorm": "post_self_attn_layer_norm",
               "pre_feedforward_layernorm": "final_layer_norm", "post_feedforward_layernorm": "post_mlp_layer_norm"}
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
ROTARY_BUFFER = ".rotary_emb.inv_freq"  # in some older Llama saves; recomputed from the config
DEFAULT_MAX_SHARD_SIZE = "2GB"


# ---------------------------------------------------------------- the families


def every_layer_window(config: LexConfig, window: int | None) -> dict:
    """Mistral's and Phi-3's window field: `sliding_window` applies to every layer (None: full attention)."""
    return dict(sliding_window=window)


# How a family's sliding_window applies, and which attention biases it has (`Family.sliding`, `Family.biases`).
Sliding = Literal["layer_types", "every_layer", "local_layers"]
Biases = Literal["qkvo", "qkv", "none"]


@dataclass(frozen=True)
class Family:
    """What one transformers family has, as far as a LexConfig is concerned: one row of FAMILIES. Every function
    below that differs by family reads these fields, so that a family is added by adding its row. A flag left False
    is a feature the family lacks: its LexConfig field keeps the default on the way in, and a LexConfig that sets it
    does not go back to that family."""

    title: str  # its name in messages
    config_class: type[PreTrainedConfig]  # the config `lex convert-to-hf` writes
    # The fields of `config_class` that give every layer the window w (None: full attention); None: it has none.
    windows: Callable[[LexConfig, int | None], dict] | None
    gguf: str | None = None  # its general.architecture in the .gguf files transformers' loader reads; None: none
    # How its sliding_window applies: per its layer_types (all layers or none), to every layer (Mistral, Phi-3), or
    # to its sliding_attention layers, which become LEX local layers (Gemma).
    sliding: Sliding = "layer_types"
    # Its attention biases: `attention_bias` on q/k/v/o together, always on q/k/v only (Qwen2), or none.
    biases: Biases = "qkvo"
    mlp_bias: bool = False  # an `mlp_bias` field
    head_dim: bool = True  # a `head_dim` field (without one it is hidden_size / num_attention_heads)
    qk_norm: bool = False  # per-head q/k norms
    no_rope_layers: bool = False  # SmolLM3's per-layer rotary flags (LexConfig.rope_layers)
    implied_by: str | None = None  # the LexConfig field that names it back where hf_model_type is None
    fused: bool = False  # Phi-3's fused projections (FUSED), split on the way in and fused on the way out
    dropouts: tuple[str, ...] = ()  # its own dropouts, which no LexConfig field keeps: refused unless 0
    activation_field: str = "hidden_act"  # the field naming its MLP's activation (Gemma: hidden_activation)
    norm_type: str = "rmsnorm"  # "gemma_rmsnorm": its norms scale by 1 + w
    embedding_scale: bool = False  # embeddings scaled by sqrt(hidden_size) in their dtype, in the lookup
    sublayer_output_norms: bool = False  # norms on the attention's and the MLP's outputs
    query_pre_attn_scalar: bool = False  # scores scaled by query_pre_attn_scalar^-0.5
    attn_logit_softcapping: bool = False  # its model caps attention scores (Gemma 3 has the field, never applies it)
    final_logit_softcapping: bool = False  # its model caps the logits
    rope_per_layer_type: bool = False  # rope_parameters per layer type: local layers rotate with their own

    def __post_init__(self) -> None:
        """A new row's words are checked where it is written, not where a conversion first reads them."""
        for field, kind in (("sliding", Sliding), ("biases", Biases)):
            if getattr(self, field) not in get_args(kind):
                raise ValueError(f"Family.{field}={getattr(self, field)!r}: allowed: {', '.join(get_args(kind))}")


# What Gemma 2 and Gemma 3 share: Gemma's norms, embeddings, post-sublayer norms, scores and logits, local layers.
GEMMA = dict(activation_field="hidden_activation", norm_type="gemma_rmsnorm", embedding_scale=True,
             sublayer_output_norms=True, query_pre_attn_scalar=True, final_logit_softcapping=True,
             sliding="local_layers", windows=None)
# One row per convertible model_type, in the order refusals list them.
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", LlamaConfig, None, gguf="llama", mlp_bias=True),
    "mistral": Family("Mistral", MistralConfig, every_layer_window, gguf="mistral", sliding="every_layer",
                      biases="none"),
    "qwen2": Family("Qwen2", Qwen2Config, lambda config, window: dict(
        use_sliding_window=window is not None, sliding_window=window, max_window_layers=0), gguf="qwen2",
        biases="qkv"),
    "qwen3": Family("Qwen3", Qwen3Config, lambda config, window: {} if window is None else dict(
        use_sliding_window=True, sliding_window=window, max_window_layers=0), gguf="qwen3", qk_norm=True,
        implied_by="qk_norm"),
    "phi3": Family("Phi-3", Phi3Config, every_layer_window, gguf="phi3", sliding="every_layer", biases="none",
                   head_dim=False, fused=True, dropouts=("resid_pdrop", "embd_pdrop")),
    "smollm3": Family("SmolLM3", SmolLM3Config, lambda config, window: {} if window is None else dict(
        use_sliding_window=True, sliding_window=window, layer_types=["sliding_attention"] * config.num_hidden_layers),
        mlp_bias=True, head_dim=False, no_rope_layers=True, implied_by="rope_layers"),
    "gemma2": Family("Gemma 2", Gemma2Config, gguf="gemma2", attn_logit_softcapping=True, **GEMMA),
    # llama.cpp's "gemma3" is Gemma3ForCausalLM's gemma3_text (transformers' integrations/ggml.py)
    "gemma3_text": Family("Gemma 3", Gemma3TextConfig, gguf="gemma3", qk_norm=True, rope_per_layer_type=True,
                          **GEMMA),
}
SOURCE_TYPES = tuple(FAMILIES)  # the model_types convertible, for the commands that name them
# What `Family.biases` means, as refusals say it.
BIASES = {"qkvo": "biases on q/k/v/o together or none", "qkv": "biases on q/k/v only", "none": "no attention biases"}
# The LexConfig fields that only some families have (each a flag of Family): None in a LexConfig without them.
OPTIONAL_FIELDS = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
# The family that stands for Llama, Mistral and Qwen2 until their biases and window pick one (`implied_family`):
# the three share every other field.
LLAMA = "llama"


# ---------------------------------------------------------------- the rotation layouts


def interleave_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows (or biases) from HF's half layout to LEX's interleaved one: per head, row 2i+a = HF row a*d/2+i."""
    half = tensor.shape[0] // heads // 2
    return tensor.reshape(heads, 2, half, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def halve_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `interleave_heads`: LEX's interleaved q/k rows to HF's half layout."""
    half = tensor.shape[0] // heads // 2
    return tensor.reshape(heads, half, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def rotary_heads(name: str, config) -> int | None:
    """How many heads the rows of a q_proj/k_proj tensor hold, 1 for Qwen3's q_norm/k_norm (one head's weights);
    None for every other tensor."""
    if ".self_attn.q_proj." in name:
        return config.num_attention_heads
    if ".self_attn.k_proj." in name:
        return config.num_key_value_heads
    if ".self_attn.q_norm." in name or ".self_attn.k_norm." in name:
        return 1
    return None


def fused_parts(name: str, config) -> list[tuple[str, int]] | None:
    """A fused Phi-3 tensor's parts (HF's unfused name, rows) in row order; None for any other tensor or a family
    that fuses none."""
    if not family_of(config).fused:
        return None
    inner, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    rows = {"self_attn.qkv_proj": (inner, kv, kv), "mlp.gate_up_proj": (config.intermediate_size,) * 2}
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            return [(name.replace(f".{fused}.", f".{part}."), size) for part, size in zip(parts, rows[fused])]
    return None


def fused_name(name: str, config) -> str | None:
    """The fused Phi-3 tensor an HF-named part belongs to (None: not a part, or a family that fuses none)."""
    if not family_of(config).fused:
        return None
    for fused, parts in FUSED.items():
        for part in parts:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}.")
    return None


def layer_norm_names(config: LexConfig) -> dict[str, str]:
    """HF layer-norm name -> LEX name: Gemma's four where the config has `sublayer_output_norms`, else Llama's."""
    return GEMMA_NORMS if config.sublayer_output_norms else LEX_NORMS


def lex_name(hf_name: str, config: LexConfig) -> str:
    for hf, lex in layer_norm_names(config).items():
        if f".{hf}." in hf_name:
            return hf_name.replace(f".{hf}.", f".{lex}.")
    return hf_name


def hf_name(lex_name_: str, config: LexConfig) -> str:
    for hf, lex in layer_norm_names(config).items():
        if f".{lex}." in lex_name_:
            return lex_name_.replace(f".{lex}.", f".{hf}.")
    return lex_name_


# ---------------------------------------------------------------- HF -> LEX: configs


def source_window(hf_config, family: Family) -> int | None:
    """The source's sliding window (every layer the same), None for full attention (a family with local layers:
    its global layers; its sliding layers are local layers, `local_layer_fields`)."""
    if family.sliding == "local_layers":
        return None
    if family.sliding == "every_layer":
        return hf_config.sliding_window
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types or set(layer_types) == {"full_attention"}:
        return None
    if set(layer_types) == {"sliding_attention"}:
        return hf_config.sliding_window
    raise ConversionError(
        f"{hf_config.model_type} layer_types={list(layer_types)} (per-layer windows that differ, e.g. Qwen2's "
        f"use_sliding_window with max_window_layers={getattr(hf_config, 'max_window_layers', None)}): a LexConfig has "
        "one attention_mode and attention_window for every layer"
    )


def source_rope(hf_config, family: Family) -> dict:
    """The source's one rope (a family with a rope per layer type: the global layers', the local ones' in
    `local_layer_fields`); which rope types a LexConfig computes is LexConfig's rule (validate_rope_type)."""
    rope = dict(hf_config.rope_parameters or {})
    if family.rope_per_layer_type:
        rope = dict(rope["full_attention"])
    if any(isinstance(value, dict) for value in rope.values()):
        raise ConversionError(f"rope_parameters per layer type ({', '.join(rope)}): a LexConfig has one rope")
    return rope


def source_biases(hf_config, family: Family) -> dict:
    """Which projections carry biases (`Family.biases`), and the MLP's where the family has an mlp_bias field."""
    if family.biases == "qkvo":
        return dict(attention_bias=hf_config.attention_bias, attention_output_bias=hf_config.attention_bias,
                    mlp_bias=family.mlp_bias and hf_config.mlp_bias)
    return dict(attention_bias=family.biases == "qkv", attention_output_bias=False, mlp_bias=False)


def source_family(hf_config, family: Family) -> dict:
    """The LexConfig fields of a family's own features (its row's flags): q/k norms, layers without rotary, Gemma's
    norms, embedding scale, post-sublayer norms, query_pre_attn_scalar, soft-capping and local layers, and the family
    to convert back to where the other fields do not imply it. What no LexConfig computes is refused by name:
    dropouts of its own unless 0, bidirectional attention, a cap the family's model never applies."""
    model_type = hf_config.model_type
    for field in family.dropouts:
        if getattr(hf_config, field):
            raise ConversionError(f"{model_type} {field}={getattr(hf_config, field)}: no LexConfig field keeps "
                                  f"{family.title}'s own dropouts (allowed: 0.0)")
    if getattr(hf_config, "use_bidirectional_attention", None):
        raise ConversionError(f"{model_type} use_bidirectional_attention={hf_config.use_bidirectional_attention}: "
                              "LEX models are causal (allowed: False or None)")
    if not family.attn_logit_softcapping and getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise ConversionError(f"{model_type} attn_logit_softcapping={hf_config.attn_logit_softcapping}: "
                              f"transformers' {family.title} never applies it, a LEX model would (allowed: None)")
    rope_layers = None
    if family.no_rope_layers:
        if any(flag not in (0, 1) for flag in hf_config.no_rope_layers):
            raise ConversionError(f"{model_type} no_rope_layers={list(hf_config.no_rope_layers)}: allowed: 0 or 1 "
                                  "per layer")
        flags = [bool(flag) for flag in hf_config.no_rope_layers]
        rope_layers = None if all(flags) else flags  # rotary on every layer: as any LEX model with rope
    fields = dict(
        qk_norm=family.qk_norm, rope_layers=rope_layers,
        hf_model_type=model_type if model_type in HF_MODEL_TYPES else None,
        norm_type=family.norm_type, sublayer_output_norms=family.sublayer_output_norms,
        embedding_scale=hf_config.hidden_size**0.5 if family.embedding_scale else 1.0,
        embedding_scale_in_lookup=family.embedding_scale,
        **{field: getattr(hf_config, field) for field in family_fields(family)},
    )
    if family.sliding == "local_layers":
        fields.update(local_layer_fields(hf_config, family))
    return fields


def family_fields(family: Family) -> list[str]:
    """The OPTIONAL_FIELDS the family has (named alike in its config, a LexConfig and its row)."""
    return [field for field in OPTIONAL_FIELDS if getattr(family, field)]


def local_layer_fields(hf_config, family: Family) -> dict:
    """The sliding_attention layers as LEX local layers over their trained window (with the sliding_attention rope
    where the family has one per layer type); layer types other than full_attention and sliding_attention are
    refused by name."""
    model_type = hf_config.model_type
    layer_types = list(hf_config.layer_types)
    if not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ConversionError(f"{model_type} layer_types={layer_types}: allowed per layer: full_attention, "
                              "sliding_attention")
    local = [kind == "sliding_attention" for kind in layer_types]
    window = hf_config.sliding_window
    if any(local) and window is None:
        raise ConversionError(f"{model_type} sliding_window=None with sliding_attention layers: a local layer needs "
                              "its window")
    if window is None:
        return {}
    fields = dict(local_layers=local, local_attention_window=window)  # kept with all-global layers too: it goes back
    if family.rope_per_layer_type:
        fields["local_rope_parameters"] = dict(hf_config.rope_parameters["sliding_attention"])
    return fields


def xpos_scale_base(max_position_embeddings: int) -> float:
    """B of the xPos retrofit: half the training length, the papers' ratio (module docstring)."""
    return max_position_embeddings / 2


def lex_config_from_hf(
    hf_config: PreTrainedConfig, attention_mode: str | None = None, attention_window: int | None = None,
    attention_sinks: int = 0, attention_sink_positions: str = "cache", position_embedding_type: str = "rope",
    attention_memory_blocks: int = 0, attention_memory_block_size: int | None = None,
) -> LexConfig:
    """The LexConfig of a Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 or Gemma 3 (text) config, or a
    ConversionError naming what it cannot express.

    By default the LEX model computes what the source does (full attention, or the source's sliding window);
    `attention_mode` "blockwise" or "sliding" with `attention_window` (default: the source's sliding window, else
    its max_position_embeddings) reads past the training length, with `attention_sinks` first tokens of each
    document kept in view, by default at their positions within the cache (`attention_sink_positions` "cache"):
    a model pretrained with full attention then never sees a sink further than it was trained on ("true" places
    them at their own positions, distances such a model never saw past its training length).
    `position_embedding_type` "xpos" is the xPos retrofit (module docstring), logged as needing fine-tuning.
    `attention_memory_blocks` k > 0 adds the block memory past the window (blockwise and sliding modes only), in
    blocks of `attention_memory_block_size` tokens (None: LexConfig's default).
    """
    model_type = getattr(hf_config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        foreign = FOREIGN_POSITIONS.get(model_type)
        why = f" (it uses {foreign})" if foreign else ""
        raise ConversionError(f"model_type {model_type!r} is not a convertible model{why}; "
                              f"convertible: {', '.join(FAMILIES)}")
    if attention_mode is not None and attention_mode not in ATTENTION_MODES:
        raise ConversionError(f"attention_mode={attention_mode!r}: allowed: {', '.join(ATTENTION_MODES)}")
    if position_embedding_type not in RETROFITS:
        raise ConversionError(f"position_embedding_type={position_embedding_type!r}: allowed for a {model_type} "
                              f"checkpoint: {', '.join(RETROFITS)}")
    window = source_window(hf_config, family)
    if window is not None and not is_window(window):
        raise ConversionError(f"{model_type} sliding_window={window}: a LEX attention_window is {WINDOW_RULE}")
    rope = source_rope(hf_config, family)
    activation = getattr(hf_config, family.activation_field)
    if activation not in HF_ACTIVATIONS:
        raise ConversionError(f"{family.activation_field}={activation!r}: convertible: {', '.join(HF_ACTIVATIONS)}")
    length = hf_config.max_position_embeddings
    fields = dict(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads, num_key_value_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        hidden_act=HF_ACTIVATIONS[activation], max_position_embeddings=length,
        position_embedding_type=position_embedding_type, rope_parameters=rope,
        attention_mode=attention_mode or ("sliding" if window else "full"),
        attention_window=attention_window or window or length + length % 2, attention_sinks=attention_sinks,
        attention_sink_positions=attention_sink_positions, attention_memory_blocks=attention_memory_blocks,
        **({} if attention_memory_block_size is None else {"attention_memory_block_size": attention_memory_block_size}),
        rms_norm_eps=hf_config.rms_norm_eps, mlp_type="gated", **source_biases(hf_config, family),
        normalize_before=True, subln=False, deepnorm=False, layernorm_embedding=False,
        attention_dropout=hf_config.attention_dropout, initializer_range=hf_config.initializer_range,
        tie_word_embeddings=hf_config.tie_word_embeddings, pad_token_id=hf_config.pad_token_id,
        bos_token_id=hf_config.bos_token_id, eos_token_id=hf_config.eos_token_id,
    )
    fields.update(source_family(hf_config, family))
    if position_embedding_type == "xpos":
        fields["xpos_scale_base"] = xpos_scale_base(length)
    try:
        config = LexConfig(**fields)
    except (ValueError, StrictDataclassError) as error:  # @strict's field and class validation errors
        message = " ".join(str(error).split())  # one line
        raise ConversionError(f"the {model_type} config does not fit a LexConfig: {message}") from None
    config.architectures = ["LexForCausalLM"]
    config.dtype = hf_config.dtype
    if position_embedding_type == "xpos":
        logger.warning("xPos retrofit of a RoPE %s checkpoint (xpos_scale_base %g): its weights never saw the scale; "
                       "fine-tune it before use", model_type, config.xpos_scale_base)
    return config


# ---------------------------------------------------------------- LEX -> HF: configs


def hf_family(config: LexConfig) -> str | None:
    """The family a LEX config goes back to: its `hf_model_type`, else the first whose `implied_by` field it sets
    (Qwen3: q/k norms, SmolLM3: layers without rotary); None: Llama, Mistral or Qwen2, whichever its biases and
    window imply (`implied_family`)."""
    return config.hf_model_type or next((model_type for model_type, family in FAMILIES.items()
                                         if family.implied_by and getattr(config, family.implied_by)), None)


def family_of(config: LexConfig) -> Family:
    """The row of the family `config` goes back to; Llama's stands for the three that its biases and window pick
    from, which differ in nothing else."""
    return FAMILIES[hf_family(config) or LLAMA]


def implied_family(config: LexConfig) -> str:
    """Llama (full attention), Mistral (sliding) or Qwen2 (q/k/v biases only), whichever computes `config`'s biases
    and window; else a ConversionError naming the field none of them computes."""
    qkv_only = config.attention_bias and not config.attention_output_bias
    if config.attention_output_bias and not config.attention_bias:
        refuse_field(config, "attention_output_bias", "no HF architecture has a bias on o_proj without biases on "
                                                      "q/k/v (Llama: all four, Qwen2: q/k/v only)")
    sliding = config.attention_mode == "sliding"
    if sliding and config.attention_output_bias:
        refuse_field(config, "attention_output_bias", "with attention_mode='sliding' no HF architecture has it "
                                                      "(Mistral has no biases, Qwen2 none on o_proj)")
    if config.mlp_bias and (sliding or qkv_only):
        refuse_field(config, "mlp_bias", "only Llama has MLP biases, with full attention and biases on q/k/v/o or none")
    return "qwen2" if qkv_only else "mistral" if sliding else LLAMA


def check_family(config: LexConfig, model_type: str) -> None:
    """A ConversionError naming the first field of `config` that the family `model_type` does not compute: q/k
    norms, layers without rotary, biases, a window on every layer, the local layers' own rope."""
    family = FAMILIES[model_type]
    if family.qk_norm != config.qk_norm:
        refuse_field(config, "qk_norm", f"hf_model_type={model_type!r} {'has' if family.qk_norm else 'has no'} "
                                        f"per-head q/k norms (allowed: {family.qk_norm})")
    if config.rope_layers is not None and not family.no_rope_layers:
        without = " and ".join(other.title for other in FAMILIES.values() if other.no_rope_layers)
        refuse_field(config, "rope_layers", f"hf_model_type={model_type!r} rotates every layer; only {without} has "
                                            "layers without rotary (allowed: None)")
    allowed = {"qkvo": (config.attention_bias,) * 2, "qkv": (True, False), "none": (False, False)}[family.biases]
    for field, value in zip(("attention_bias", "attention_output_bias"), allowed):
        if getattr(config, field) != value:
            refuse_field(config, field, f"hf_model_type={model_type!r} has {BIASES[family.biases]} (allowed: {value})")
    if config.mlp_bias and not family.mlp_bias:
        refuse_field(config, "mlp_bias", f"hf_model_type={model_type!r} has no MLP biases (allowed: False)")
    if family.windows is None and config.attention_mode != "full":
        local = " and local layers that slide" if family.sliding == "local_layers" else ""
        refuse_field(config, "attention_mode", f"hf_model_type={model_type!r} has global layers with full attention"
                                               f"{local} (allowed: 'full')")
    if not family.rope_per_layer_type and config.local_rope_parameters not in (None, config.rope_parameters):
        refuse_field(config, "local_rope_parameters", f"{family.title} rotates local and global layers alike "
                                                      "(allowed: None)")


def family_config(config: LexConfig, model_type: str, common: dict) -> PreTrainedConfig:
    """The config of the family `model_type` computing what `config` does (`common`: the fields every family has),
    or a ConversionError naming the field (`check_family`)."""
    check_family(config, model_type)
    family = FAMILIES[model_type]
    fields = dict(common)
    fields[family.activation_field] = fields.pop("hidden_act")
    if not family.head_dim and config.head_dim == config.hidden_size // config.num_attention_heads:
        del fields["head_dim"]  # no field of theirs: their default, unsaved
    if family.biases == "qkvo":
        fields["attention_bias"] = config.attention_bias
    if family.mlp_bias:
        fields["mlp_bias"] = config.mlp_bias
    if family.no_rope_layers:
        fields["no_rope_layers"] = [int(flag) for flag in config.rope_layers or [True] * config.num_hidden_layers]
    optional = dict(query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
                    attn_logit_softcapping=config.attn_logit_softcapping,
                    final_logit_softcapping=config.final_logit_softcapping)
    fields.update({field: optional[field] for field in family_fields(family)})
    if family.sliding == "local_layers":
        local = config.local_layers or [False] * config.num_hidden_layers
        fields.update(sliding_window=config.local_attention_window,
                      layer_types=["sliding_attention" if flag else "full_attention" for flag in local])
    if family.rope_per_layer_type:
        fields["rope_parameters"] = {"full_attention": dict(config.rope_parameters), "sliding_attention": dict(
            config.local_rope_parameters or config.rope_parameters)}
    if family.windows is not None:
        fields.update(family.windows(config, config.attention_window if config.attention_mode == "sliding" else None))
    hf_config = family.config_class(**fields)
    hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type]]
    hf_config.dtype = config.dtype
    return hf_config


def hf_config_from_lex(config: LexConfig) -> PreTrainedConfig:
    """The Llama (full attention), Mistral (sliding) or Qwen2 (q/k/v biases only) config computing what `config`
    does, or the Qwen3, Phi-3, SmolLM3, Gemma 2 or Gemma 3 one of its family (`hf_family`); else a ConversionError
    naming the first field no HF architecture computes."""
    if not POSITION_METHODS[config.position_embedding_type].llama:
        refuse_field(config, "position_embedding_type",
                     "no HF architecture computes it (Llama, Mistral and Qwen2 rotate with RoPE: 'rope')")
    if config.absolute_position_embedding is not None:
        refuse_field(config, "absolute_position_embedding",
                     "no HF Llama-family architecture adds absolute positions (allowed: None)")
    if config.attention_sinks and config.attention_mode != "full":
        refuse_field(config, "attention_sinks", "no HF architecture keeps attention sinks in its window (allowed: 0)")
    if config.attention_memory_blocks and config.attention_mode != "full":
        refuse_field(config, "attention_memory_blocks", "no HF architecture keeps a block memory past its window "
                                                        "(allowed: 0)")
    if config.attention_mode == "blockwise":
        refuse_field(config, "attention_mode", "no HF architecture computes blockwise causal attention (allowed: "
                                               "'full' -> Llama or Qwen2, 'sliding' -> Mistral or Qwen2)")
    named = hf_family(config)
    family = family_of(config)
    required = {"normalize_before": True, "subln": False, "deepnorm": False, "layernorm_embedding": False,
                "norm_type": family.norm_type, "mlp_type": "gated",
                "embedding_scale": config.hidden_size**0.5 if family.embedding_scale else 1.0,
                "embedding_scale_in_lookup": family.embedding_scale,
                "sublayer_output_norms": family.sublayer_output_norms}
    required.update({field: None for field in OPTIONAL_FIELDS if not getattr(family, field)})
    if family.sliding != "local_layers":
        required["local_layers"] = None
    architecture = f"hf_model_type={named!r}" if named else "no HF Llama-family architecture"
    for field, value in required.items():
        if getattr(config, field) != value:
            refuse_field(config, field, f"{architecture} computes it (allowed: {value!r})")
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        hidden_act="silu" if config.hidden_act == "swish" else config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters), tie_word_embeddings=config.tie_word_embeddings,
        attention_dropout=config.attention_dropout, initializer_range=config.initializer_range,
        pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
    )
    return family_config(config, named or implied_family(config), common)


# ---------------------------------------------------------------- tensors


# What to convert: target name -> (the source names it is made of, its shape). One source each, except Phi-3's fused
# tensors: on the way in each part is one target of the fused source, on the way out the parts make one target.
Plan = dict[str, tuple[tuple[str, ...], tuple[int, ...]]]


def convert_tensor(target: str, sources: list[tuple[str, torch.Tensor]], config: LexConfig,
                   to_lex: bool) -> torch.Tensor:
    """One target tensor from its (name, tensor) sources: q/k rows (and Qwen3's q/k norm weights) permuted to the
    target's rotation layout; a part sliced out of a fused Phi-3 tensor on the way in, the parts fused on the way
    out (a slice of the source's rows: a view, no copy)."""
    if to_lex:
        ((name, tensor),) = sources
        start = 0
        for part, rows in fused_parts(name, config) or ():
            if lex_name(part, config) == target:
                name, tensor = part, tensor[start : start + rows]
                break
            start += rows
        heads = rotary_heads(name, config)
        return tensor if heads is None else interleave_heads(tensor, heads)
    pieces = []
    for name, tensor in sources:
        heads = rotary_heads(name, config)
        pieces.append(tensor if heads is None else halve_heads(tensor, heads))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def expected_shapes(build: Callable, config) -> dict[str, tuple[int, ...]]:
    """Every tensor `build(config)` loads, with its shape (parameters on the meta device: no memory)."""
    with init_empty_weights():
        model = build(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def plan_names(shapes: dict[str, tuple[int, ...]], config: LexConfig, to_lex: bool) -> Plan:
    """The plan (target name -> (source names, shape)) of every tensor to convert; `config` is the LEX side's."""
    plan: Plan = {}
    part_order = [part for parts in FUSED.values() for part in parts]
    for name, shape in shapes.items():
        if name.endswith(ROTARY_BUFFER) or config.tie_word_embeddings and name == "lm_head.weight":
            continue  # recomputed from the config; a tied head is the embedding (what transformers loads too)
        if to_lex:
            for part, rows in fused_parts(name, config) or [(name, None)]:
                plan[lex_name(part, config)] = ((name,), shape if rows is None else (rows, *shape[1:]))
            continue
        target = hf_name(name, config)
        fused = fused_name(target, config)
        if fused is None:
            plan[target] = ((name,), shape)
            continue
        sources, (rows, *rest) = plan.get(fused, ((), (0, *shape[1:])))
        sources = sorted((*sources, name), key=lambda n: next(i for i, p in enumerate(part_order) if f".{p}." in n))
        plan[fused] = (tuple(sources), (rows + shape[0], *rest))
    return plan


def check_plan(plan: Plan, expected: dict[str, tuple[int, ...]], source: str) -> None:
    """Every expected tensor once, nothing else, every shape right (named as the source names them)."""
    check_tensors({target: shape for target, (_, shape) in plan.items()}, expected,
                  f"{source}: the weights do not match the config",
                  lambda target: "+".join(plan[target][0]) if target in plan else target, limit=8)


def lex_from_hf(
    model: PreTrainedModel, attention_mode: str | None = None, attention_window: int | None = None,
    attention_sinks: int = 0, attention_sink_positions: str = "cache", position_embedding_type: str = "rope",
    attention_memory_blocks: int = 0, attention_memory_block_size: int | None = None,
) -> LexForCausalLM:
    """A loaded LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM,
    SmolLM3ForCausalLM, Gemma2ForCausalLM or Gemma3ForCausalLM as a LexForCausalLM, in memory.

    The LEX model shares the source's tensors (the permuted q/k projections and q/k norms excepted; Phi-3's v and
    gate/up are row slices of its fused tensors), on its device and in its dtype, so no second copy of the weights
    is made: train one of the two, not both. The arguments are `lex_config_from_hf`'s.
    """
    config = lex_config_from_hf(model.config, attention_mode, attention_window, attention_sinks,
                                attention_sink_positions, position_embedding_type, attention_memory_blocks,
                                attention_memory_block_size)
    config.dtype = model.dtype
    source = model.state_dict()
    plan = plan_names({name: tuple(tensor.shape) for name, tensor in source.items()}, config, to_lex=True)
    check_plan(plan, expected_shapes(LexForCausalLM, config), type(model).__name__)
    state = {target: convert_tensor(target, [(name, source[name].detach()) for name in names], config, to_lex=True)
             for target, (names, _) in plan.items()}
    with init_empty_weights():
        lex = LexForCausalLM(config)
    lex.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        lex.lm_head.weight = lex.model.embed_tokens.weight
    return lex.train(model.training)


def dtype_named(dtype: str | None) -> torch.dtype | None:
    """The torch dtype of a --dtype value (None: keep the source's)."""
    if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ConversionError(f"dtype={dtype!r} is not a torch dtype")
    return getattr(torch, dtype) if dtype else None


# ---------------------------------------------------------------- .gguf files (transformers' GGUF loader)


def gguf_file(path: str | Path) -> Path | None:
    """The .gguf file `path` names: the file itself, or the one .gguf file of a folder without config.json; None
    for anything else (a model folder, a Hub id, a folder with no .gguf file). A folder holding several .gguf
    files is refused, naming them."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ConversionError(f"{path}: a folder with {len(files)} .gguf files ({', '.join(f.name for f in files)}); "
                              "name the one to read")
    return files[0] if files else None


def check_gguf(path: Path) -> None:
    """The gguf package is there and `path` is a GGUF file of an architecture a family reads (`Family.gguf`; its
    header only)."""
    if not is_gguf_available():
        raise ConversionError(f"{path}: reading a .gguf file needs the gguf package (>= 0.10): pip install gguf, or "
                              "pip install 'lex-transformer[gguf]'")
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except (ValueError, KeyError, IndexError, OSError, UnicodeDecodeError) as error:
        why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConversionError(f"{path}: not a readable GGUF file ({why})") from None
    architectures = [family.gguf for family in FAMILIES.values() if family.gguf]
    if architecture not in architectures:
        raise ConversionError(f"{path}: a GGUF file of architecture {architecture!r}, which this converter does not "
                              f"read; convertible: {', '.join(architectures)}")


@lru_cache(maxsize=4)
def read_gguf_config(path: Path, stamp: tuple[int, int]) -> PreTrainedConfig:
    check_gguf(path)
    try:
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError, StrictDataclassError) as error:
        raise ConversionError(f"{path}: cannot read its config: {str(error).strip().splitlines()[0]}") from None


def gguf_config(path: Path) -> PreTrainedConfig:
    """The config of a .gguf file (`check_gguf`), without its weights (read once per file version)."""
    stat = Path(path).stat()
    return read_gguf_config(Path(path).absolute(), (stat.st_mtime_ns, stat.st_size))


def load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A .gguf file (`check_gguf`) as the transformers model it holds, dequantized to `dtype`, as a plain model:
    the loader's quantization_config (gguf) and quantizer are dropped, so that it saves as any model."""
    check_gguf(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except (OSError, ValueError, KeyError, StrictDataclassError) as error:
        raise ConversionError(f"{path}: cannot load a model from it: {str(error).strip().splitlines()[0]}") from None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    return model


def gguf_tokenizer(path: Path):
    """The tokenizer a .gguf file carries."""
    check_gguf(path)
    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError) as error:
        raise ConversionError(f"{path}: cannot load its tokenizer: {str(error).strip().splitlines()[0]}") from None


CardWriter = Callable[[Path, LexConfig, Path, Path], None]  # (staged folder, its config, source, OUT)


def convert_gguf(path: Path, out_dir: Path, attention_mode: str | None, attention_window: int | None,
                 attention_sinks: int, attention_sink_positions: str, position_embedding_type: str,
                 dtype: str | None, force: bool, max_shard_size: int | str, attention_memory_blocks: int = 0,
                 attention_memory_block_size: int | None = None, card: CardWriter | None = None) -> LexConfig:
    """A .gguf file -> a LEX folder with its tokenizer: dequantized in memory, converted (`lex_from_hf`), saved,
    with the model card `card` writes."""
    torch_dtype = dtype_named(dtype)
    check_gguf(path)
    with atomic_directory(out_dir, force) as staging:
        lex = lex_from_hf(load_gguf(path), attention_mode, attention_window, attention_sinks, attention_sink_positions,
                          position_embedding_type, attention_memory_blocks, attention_memory_block_size)
        if torch_dtype is not None:
            lex = lex.to(torch_dtype)
            lex.config.dtype = torch_dtype
        lex.save_pretrained(staging, max_shard_size=max_shard_size)
        gguf_tokenizer(path).save_pretrained(staging)
        if card is not None:
            card(staging, lex.config, path, out_dir)
    return lex.config


# ---------------------------------------------------------------- folders


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, sharded or not; pickled weights are refused, never opened."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as error:
            raise ConversionError(f"{index}: not a safetensors index ({error})") from None
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise ConversionError(f"{index} names shards that are not in the folder: {', '.join(missing)}")
        return [folder / name for name in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    pickles = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    why = (f"it holds pickled weights ({', '.join(pickles)}), which this converter never unpickles; save the model "
           "with save_pretrained (safetensors) first" if pickles
           else "no model.safetensors or model.safetensors.index.json")
    raise ConversionError(f"{folder}: {why}")


def read_names(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], torch.dtype]]:
    """name -> (file, shape, dtype) from the safetensors headers, without reading any tensor."""
    names = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                names[name] = (path, tuple(piece.get_shape()), SAFETENSORS_DTYPES[piece.get_dtype()])
    return names


def write_weights(names: dict, plan: Plan, config: LexConfig, to_lex: bool, staging: Path,
                  dtype: torch.dtype | None, max_shard_size: int) -> None:
    """Read, convert and write the tensors one output shard at a time (each shard's tensors read through their own
    safe_open handles, so neither the converted tensors nor the source's mapped pages outlive the shard)."""
    shards, shard, size = [], [], 0
    for target, (sources, shape) in plan.items():
        nbytes = torch.Size(shape).numel() * (dtype or names[sources[0]][2]).itemsize
        if shard and size + nbytes > max_shard_size:
            shards.append(shard)
            shard, size = [], 0
        shard.append(target)
        size += nbytes
    shards.append(shard)
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, start=1):
        file_name = ("model.safetensors" if len(shards) == 1
                     else f"model-{number:05d}-of-{len(shards):05d}.safetensors")
        tensors = {}
        with ExitStack() as files:
            paths = dict.fromkeys(names[name][0] for target in shard for name in plan[target][0])
            handles = {path: files.enter_context(safe_open(path, framework="pt")) for path in paths}
            for target in shard:
                sources = [(name, handles[names[name][0]].get_tensor(name)) for name in plan[target][0]]
                tensor = convert_tensor(target, sources, config, to_lex)
                tensors[target] = (tensor if dtype is None else tensor.to(dtype)).contiguous()
        save_file(tensors, staging / file_name, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file_name))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def convert_folder(src_dir: Path, out_dir: Path, lex_config: LexConfig, target_config, build: Callable, to_lex: bool,
                   dtype: str | None, force: bool, max_shard_size: int | str, card: CardWriter | None = None) -> None:
    """Check every name and shape from the headers, then stream the weights into a staged OUT; carry the tokenizer
    and generation_config over, and let `card` write OUT's model card. Nothing is written before every check has
    passed."""
    torch_dtype = dtype_named(dtype)
    names = read_names(weight_files(src_dir))
    plan = plan_names({name: shape for name, (_, shape, _) in names.items()}, lex_config, to_lex)
    check_plan(plan, expected_shapes(build, target_config), str(src_dir))
    if torch_dtype is not None:
        target_config.dtype = torch_dtype
    with atomic_directory(out_dir, force) as staging:
        write_weights(names, plan, lex_config, to_lex, staging, torch_dtype,
                      convert_file_size_to_int(max_shard_size))
        target_config.save_pretrained(staging)
        for name in CARRIED_FILES:
            if (src_dir / name).is_file():
                shutil.copy2(src_dir / name, staging / name)
        if card is not None:
            card(staging, lex_config, src_dir, out_dir)


def load_config(folder: Path):
    if not Path(folder).is_dir():
        raise ConversionError(f"{folder}: not a model folder")
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, StrictDataclassError) as error:
        raise ConversionError(f"{folder}: cannot read its config.json: {str(error).splitlines()[0]}") from None


def convert_hf(
    src_dir: str | Path, out_dir: str | Path, attention_mode: str | None = None, attention_window: int | None = None,
    dtype: str | None = None, force: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    attention_sinks: int = 0, attention_sink_positions: str = "cache", position_embedding_type: str = "rope",
    attention_memory_blocks: int = 0, attention_memory_block_size: int | None = None, card: CardWriter | None = None,
) -> LexConfig:
    """A Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 or Gemma 3 folder (safetensors) or .gguf file ->
    a LEX folder; returns its LexConfig. `card(staging, config, source, out_dir)` writes the folder's model card
    (README.md) while it is staged: `lex convert-hf` passes lex.model_card's, which names the source as
    base_model; None writes none.

    At most one output shard (`max_shard_size`) of weights is held in memory. An existing OUT is refused unless
    `force`, and replaced only once the new folder is complete.
    """
    src_dir = Path(src_dir)
    gguf = gguf_file(src_dir)
    if gguf is not None:
        return convert_gguf(gguf, Path(out_dir), attention_mode, attention_window, attention_sinks,
                            attention_sink_positions, position_embedding_type, dtype, force, max_shard_size,
                            attention_memory_blocks, attention_memory_block_size, card=card)
    if src_dir.is_dir() and not (src_dir / "config.json").is_file():
        raise ConversionError(f"{src_dir}: not a model folder (it has no config.json) and holds no .gguf file")
    config = lex_config_from_hf(load_config(src_dir), attention_mode, attention_window, attention_sinks,
                                attention_sink_positions, position_embedding_type, attention_memory_blocks,
                                attention_memory_block_size)
    convert_folder(src_dir, Path(out_dir), config, config, LexForCausalLM, True, dtype, force, max_shard_size, card)
    return config


def convert_to_hf(src_dir: str | Path, out_dir: str | Path, force: bool = False,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> PreTrainedConfig:
    """A LEX folder with RoPE positions -> a Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 or Gemma 3 folder
    that transformers loads without this package; returns its config. Refused, with nothing written, where no HF
    architecture computes the model."""
    src_dir = Path(src_dir)
    config = load_config(src_dir)
    if not isinstance(config, LexConfig):
        raise ConversionError(f"{src_dir} holds a {config.model_type!r} model, not a LEX one")
    hf_config = hf_config_from_lex(config)
    convert_folder(src_dir, Path(out_dir), config, hf_config, AutoModelForCausalLM.from_config, False, None, force,
                   max_shard_size)
    return hf_config
