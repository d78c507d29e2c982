"""The LEX Transformer decoder (Sun et al., "A Length-Extrapolatable Transformer") for transformers v5.

Reads top to bottom: norm -> feed-forward -> attention -> layer -> model -> causal-LM head. The layer math is
TorchScale's `DecoderLayer` (pre/post norm, subln, deepnorm), so TorchScale checkpoints convert without loss,
with the modern backbone of the Llama family beside it (grouped-query attention, RMSNorm, a gated MLP, per-head
q/k norms, layers without rotary; Gemma's norms, soft-capping and local layers), so Llama, Mistral, Qwen2, Qwen3,
Phi-3, SmolLM3, Gemma 2 and Gemma 3 checkpoints do too.

How a model reads is three components beside this file: the reading policy (`reading.py`: what each query sees,
what a cache keeps, how a long input is split; the attention plan made from it), storage (`cache.py`, with the
stream's bookkeeping in `stream.py`) and retrieval (`memory.py`, the block memory past the window). Attention reads
as Llama's: project, encode positions (`positions.py`), `cache.update`, the layer's memory's `recall`, and the
attention backend (`kernels.py`); `generation.py` owns the coupling to transformers' generate().
"""

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from transformers import AutoModel, AutoModelForCausalLM
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from configuration_lex.configuration_lex import LexConfig

from .cache import LEX_CACHES, LexCache, LexCacheSteps, LexRows, LexStaticCache
from .stream import ForwardRecord, begin_forward
from .generation import CACHE_NAME, LexAttentionGuard, LexGenerationMixin, accepts_both_cache_names
from .kernels import arrange, attention_map, eager_attention_forward, encode_tokens
from .reading import AttentionPlan, ReadingPolicy, build_plan
from .positions import position_method
from .positions import sinusoidal_embedding

logger = logging.get_logger(__name__)
ACTIVATIONS = {
    "gelu": nn.functional.gelu, "relu": nn.functional.relu, "swish": nn.functional.silu, "silu": nn.functional.silu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


class LexRMSNorm(nn.Module):
    """RMSNorm as Llama computes it: normalised in float32, cast back, then scaled by the weight (torch's fused
    rms_norm gives Llama's numbers without its temporaries of the input's size; where the dtypes agree, the weight
    scales the normalised tensor in place, which autograd records as it records the product). With `offset`
    (Gemma's): scaled by 1 + weight in float32, then cast back; the weight starts at 0."""

    def __init__(self, size: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normalized = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:
            return (normalized * (1.0 + self.weight.float())).to(x.dtype)
        normalized = normalized.to(x.dtype)
        if normalized.dtype != self.weight.dtype:  # a float32 weight on a lower-precision input: a float32 product
            return self.weight * normalized
        return normalized.mul_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(config: LexConfig, size: int) -> nn.Module:
    """The config's norm (every norm of a model is the same kind)."""
    if config.norm_type in ("rmsnorm", "gemma_rmsnorm"):
        return LexRMSNorm(size, eps=config.rms_norm_eps, offset=config.norm_type == "gemma_rmsnorm")
    return nn.LayerNorm(size, eps=config.layer_norm_eps)


class LexScaledEmbedding(nn.Embedding):
    """Gemma's scaled token lookup (`embedding_scale_in_lookup`): the rows times `scale` rounded to the weights'
    dtype, so that `get_input_embeddings()(ids)` (what PEFT's prompt tuning and `inputs_embeds` users build on) is
    what the model reads from `ids`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rounded = torch.tensor(self.scale, dtype=torch.float32, device=self.weight.device).to(self.weight.dtype)
        return super().forward(input_ids) * rounded


class LexMLP(nn.Module):
    """TorchScale's fc1 -> activation (in float32) -> [sub-LayerNorm] -> fc2, or Llama's gated
    down_proj(act(gate_proj(x)) * up_proj(x)) (activation in the input dtype, as Llama), with the sub-LayerNorm
    before down_proj."""

    def __init__(self, config: LexConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gated = config.mlp_type == "gated"
        if self.gated:
            self.gate_proj = nn.Linear(hidden, inner, bias=bias)
            self.up_proj = nn.Linear(hidden, inner, bias=bias)
            self.down_proj = nn.Linear(inner, hidden, bias=bias)
        else:
            self.fc1 = nn.Linear(hidden, inner, bias=bias)
            self.fc2 = nn.Linear(inner, hidden, bias=bias)
        self.ffn_layernorm = make_norm(config, inner) if config.subln else None
        self.act = ACTIVATIONS[config.hidden_act]
        self.activation_dropout = nn.Dropout(config.activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            # The product is written over the activation, a tensor made here: one tensor of the MLP's width fewer
            # to allocate (of a prefill's, the largest); autograd records it as it records the product.
            hidden = self.act(self.gate_proj(x)).mul_(self.up_proj(x))
        else:
            hidden = self.fc1(x)
            hidden = self.act(hidden.float()).type_as(hidden)
        if self.training:
            hidden = self.activation_dropout(hidden)
        if self.ffn_layernorm is not None:
            hidden = self.ffn_layernorm(hidden)
        return self.down_proj(hidden) if self.gated else self.fc2(hidden)


class LexAttention(nn.Module):
    """Multi-head self-attention with grouped key/value heads; positions and the window come from the forward's
    `AttentionPlan`. Keys and values keep their `num_key_value_heads` heads (in the cache too); backends serve
    each group of query heads from them (SDPA's `enable_gqa` where it can, `repeat_kv` otherwise: kernels.py)."""

    def __init__(self, config: LexConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads  # read by the backends
        self.head_dim = config.head_dim
        self.scaling = config.attention_scaling
        self.softcap = config.attn_logit_softcapping
        self.is_causal = True
        size, inner, kv = config.hidden_size, self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(size, inner, bias=config.attention_bias)
        self.k_proj = nn.Linear(size, kv, bias=config.attention_bias)
        self.v_proj = nn.Linear(size, kv, bias=config.attention_bias)
        self.o_proj = nn.Linear(inner, size, bias=config.attention_output_bias)
        # Qwen3's per-head norms of queries and keys, before positions (RMSNorm over head_dim is per head).
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.inner_attn_ln = make_norm(config, inner) if config.subln else None
        self.position_method = position_method(config)
        self.position_method.add_parameters(self)

    def tensor_parallel_group(self) -> ProcessGroup | None:
        """The group of ranks that hold this layer's other heads under tensor parallel (its projections are DTensors
        sharded over a "tp" mesh), else None."""
        weight = getattr(self.q_proj, "weight", None)  # (quantized projections hold their weights otherwise)
        if not isinstance(weight, DTensor):
            return None
        mesh = weight.device_mesh
        return mesh.get_group("tp") if "tp" in (mesh.mesh_dim_names or ()) else mesh.get_group()

    def learned_bias(self, distance: torch.Tensor) -> torch.Tensor:
        """This layer's learned position bias (KERPLE) for query-minus-key distances (tile layout)."""
        return self.position_method.learned_bias(self, distance)

    def forward(
        self,
        hidden_states: torch.Tensor,
        plan: AttentionPlan | list[AttentionPlan],
        cache: Cache | LexRows | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`plan`: the forward's, or with `LexRows` (requests decoded together) one per row: the projections run on
        the whole batch, and each row attends through its own cache with its own plan."""
        batch, length, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch, length, -1, self.head_dim)
        key = self.k_proj(hidden_states).view(batch, length, -1, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
        rows = list(zip(plan, cache.rows)) if isinstance(cache, LexRows) else [(plan, cache)]
        width = batch // len(rows)
        raw_query = query  # (the block memory chooses by the queries before positions)
        factors = [row_plan.token_factors for row_plan, _ in rows]  # (all None or none: one method, one kind)
        query, key = encode_tokens(query, key, factors[0] if len(rows) == 1 or factors[0] is None
                                   else torch.cat(factors))
        # Maps come from the eager computation, whatever the backend; so do capped scores (SDPA cannot cap them).
        implementation = ("eager" if rows[0][0].attention_maps or self.softcap is not None
                          else self.config._attn_implementation)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        outputs = []
        for (plan, cache), query_, key_, value_, raw_query_ in zip(
                rows, *(x.split(width) for x in (query, key, value, raw_query))):
            recalled = None
            if isinstance(cache, LexCacheSteps):
                key_, value_ = cache.update(key_, value_, self.layer_idx, plan)
                memory = cache.layers[self.layer_idx].memory
                if memory is not None:  # the blocks past the window this layer's queries choose
                    recalled = memory.recall(raw_query_, plan.memory_frame, self.tensor_parallel_group())
            elif cache is not None:  # a transformers cache: every key of the stream
                key_, value_ = cache.update(key_, value_, self.layer_idx)
            q, k, v, bias = arrange(self, plan, query_, key_, value_, recalled)
            output, weights = attention_interface(
                self, q, k, v, None, dropout=self.config.attention_dropout if self.training else 0.0,
                scaling=self.scaling, position_bias=bias, is_causal=bias is None, softcap=self.softcap, **kwargs,
            )
            output = output[..., : self.head_dim]  # (a second copy of each query widens the values: kernels.arrange)
            if plan.tile.query_slots is not None:  # the chunks, back in the order of the queries
                output = output.unflatten(0, (width, -1)).flatten(1, 2)[:, :length]
            if plan.attention_maps:
                output, weights = attention_map(plan, output, weights, value_, recalled)
            outputs.append(output.reshape(width, length, -1))
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        if self.inner_attn_ln is not None:
            output = self.inner_attn_ln(output)
        return self.o_proj(output), weights


SPLIT_POSITION_METHODS = ("xpos", "rope", "decay", "none", "sinusoidal")  # no term of their own per head


def refuse_what_parallelism_cannot_split(config: LexConfig, policy: ReadingPolicy, distributed) -> None:
    """What transformers' parallelism (its `DistributedConfig`) cannot compute as one process does, refused by name.

    Tensor parallel splits each layer by whole heads (LexConfig.base_model_tp_plan), so the number of ranks must
    divide the query and the key/value heads; TorchScale's sub-LayerNorms normalise across all heads and the MLP's
    whole width, and the bias of ALiBi, Sandwich and KERPLE is made for every head.
    Pipeline parallel hands a stage's hidden states to the next as its input embeddings: embeddings that the model
    scales, adds positions to or normalises after the lookup would be changed twice, and the block memory's choice,
    which adds up the scores of the layers below, would miss those of the earlier stages."""
    tp, pp = distributed.tp_size, distributed.pp_size or 1
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if tp > 1 and (heads % tp or kv_heads % tp):
        allowed = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise ValueError(f"LexConfig.num_attention_heads={heads} and num_key_value_heads={kv_heads} with tensor "
                         f"parallel (tp_size={tp}): each rank holds whole heads, so tp_size must divide both "
                         f"(allowed: {', '.join(map(str, allowed))})")
    if tp > 1 and config.subln:
        raise ValueError(f"LexConfig.subln=True with tensor parallel (tp_size={tp}): the sub-LayerNorms normalise "
                         "across every head and the MLP's whole width, which no rank holds (allowed: subln=False, "
                         "or tp_size=1)")
    if tp > 1 and config.position_embedding_type not in SPLIT_POSITION_METHODS:
        raise ValueError(f"LexConfig.position_embedding_type={config.position_embedding_type!r} with tensor parallel "
                         f"(tp_size={tp}): its bias is made for every head, not a rank's (allowed: "
                         f"{', '.join(SPLIT_POSITION_METHODS)}, or tp_size=1)")
    if pp > 1 and policy.memory_tokens:
        raise ValueError(f"LexConfig.attention_memory_blocks={policy.memory_blocks} with pipeline parallel "
                         f"(pp_size={pp}): a layer chooses blocks by the scores of the layers below it, which earlier "
                         "stages hold (allowed: attention_memory_blocks=0, or pp_size=1; tensor parallel keeps it)")
    if pp > 1 and (config.layernorm_embedding or config.absolute_position_embedding is not None
                   or (config.embedding_scale != 1.0 and not config.embedding_scale_in_lookup)):
        raise ValueError(f"LexConfig embeddings with embedding_scale={config.embedding_scale}, layernorm_embedding="
                         f"{config.layernorm_embedding}, absolute_position_embedding="
                         f"{config.absolute_position_embedding!r} with pipeline parallel (pp_size={pp}): a later stage "
                         "is given hidden states as input embeddings, which these would change again (allowed: "
                         "embedding_scale=1.0 or in the lookup, no layernorm_embedding, no absolute positions, or "
                         "pp_size=1)")


def without_positions(plan: AttentionPlan) -> AttentionPlan:
    """The plan of a layer that takes no positions (`rope_layers`): the same tile, window and sinks, without the
    rotations. RoPE's position terms are rotations only: of the new tokens (`token_factors`), of sinks seen in
    their cache frame (a second query copy, or the sink keys turned to the query) and of the memory's keys, so
    dropping those leaves plain attention under the same mask."""
    tile = dataclasses.replace(plan.tile, sink_query_factors=None, sink_key_rotation=None, memory_place=None)
    # (the block memory's keys: raw, and raw when evicted)
    return dataclasses.replace(plan, tile=tile, token_factors=None, sinks_lent=False, memory_unrotate=None,
                               memory_frame=None)


class LexDecoderLayer(GradientCheckpointingLayer):
    """TorchScale's DecoderLayer: pre- or post-norm residual blocks, residual scaled by alpha under deepnorm."""

    def __init__(self, config: LexConfig, layer_idx: int):
        super().__init__()
        self.normalize_before = config.normalize_before
        self.alpha = math.pow(2.0 * config.num_hidden_layers, 0.25) if config.deepnorm else 1.0
        self.self_attn = LexAttention(config, layer_idx)
        self.self_attn_layer_norm = make_norm(config, config.hidden_size)
        self.mlp = LexMLP(config)
        self.final_layer_norm = make_norm(config, config.hidden_size)
        # Gemma's norms on each sublayer's output, before the residual sum.
        outputs = config.sublayer_output_norms
        self.post_self_attn_layer_norm = make_norm(config, config.hidden_size) if outputs else None
        self.post_mlp_layer_norm = make_norm(config, config.hidden_size) if outputs else None
        self.dropout = nn.Dropout(config.hidden_dropout)

    def _residual(self, x: torch.Tensor, out: torch.Tensor, norm: nn.Module, out_norm: nn.Module | None
                  ) -> torch.Tensor:
        """x * alpha + dropout(out), then the norm in post-norm layers (no multiply by alpha = 1, no dropout call
        outside training); `out_norm`, if any, normalises the sublayer's output first."""
        if out_norm is not None:
            out = out_norm(out)
        if self.training:
            out = self.dropout(out)
        out = (x if self.alpha == 1.0 else x * self.alpha) + out
        return out if self.normalize_before else norm(out)

    def forward(
        self,
        hidden_states: torch.Tensor,
        plan: AttentionPlan | list[AttentionPlan],
        cache: Cache | LexRows | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """`plan`: the forward's, or with `LexRows` one per row."""
        norm = self.self_attn_layer_norm
        attended, _ = self.self_attn(norm(hidden_states) if self.normalize_before else hidden_states, plan=plan,
                                     cache=cache, **kwargs)
        hidden_states = self._residual(hidden_states, attended, norm, self.post_self_attn_layer_norm)
        norm = self.final_layer_norm
        return self._residual(hidden_states, self.mlp(norm(hidden_states) if self.normalize_before else hidden_states),
                              norm, self.post_mlp_layer_norm)


class LexPreTrainedModel(LexAttentionGuard, PreTrainedModel):
    config: LexConfig
    config_class = LexConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LexDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]  # the name of transformers >= 5.24, and before
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # As in modeling_llama: the forward's kwargs reach the attention backend. Padding-free (packed) batches are read
    # from position_ids restarts, which start a document that sees nothing before it.
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {"hidden_states": LexDecoderLayer, "attentions": LexAttention}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, LexRMSNorm) and module.offset:
            init.zeros_(module.weight)  # scaled by 1 + weight: the identity at 0
        if isinstance(module, LexAttention):
            module.position_method.init_parameters(module)


class LexModel(LexPreTrainedModel):
    def __init__(self, config: LexConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        if config.embedding_scale_in_lookup:
            self.embed_tokens = LexScaledEmbedding(config.vocab_size, config.hidden_size, self.padding_idx,
                                                   config.embedding_scale)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layernorm_embedding = make_norm(config, config.hidden_size) if config.layernorm_embedding else None
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList([LexDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = make_norm(config, config.hidden_size) if config.normalize_before else None
        self.position_method = position_method(config)
        # The local layers' positions: their own rope (Gemma 3's), or the global one.
        self.local_position_method = None
        if config.local_layers is not None:
            self.local_position_method = position_method(config, config.local_rope_parameters)
        self.gradient_checkpointing = False
        self.post_init()

    def embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, position_ids: torch.Tensor):
        """TorchScale's forward_embedding: scale (or Gemma's scaled lookup), [absolute sinusoidal positions],
        [LayerNorm], dropout."""
        scale = self.config.embedding_scale
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self.config.embedding_scale_in_lookup:  # Gemma's: the lookup scaled (LexScaledEmbedding)
            hidden = inputs_embeds
        else:
            hidden = inputs_embeds if scale == 1.0 else inputs_embeds * scale  # Llama's: no full-size multiply
        if self.config.absolute_position_embedding == "sinusoidal":
            if not torch.compiler.is_compiling() and position_ids.max() >= self.config.max_position_embeddings:
                logger.warning_once(
                    "sinusoidal (absolute) positions beyond the training length max_position_embeddings="
                    f"{self.config.max_position_embeddings} were never seen in training; blockwise and sliding "
                    "attention limit which keys a query sees, not the positions it is given"
                )
            table = sinusoidal_embedding(position_ids + self.config.absolute_position_offset, self.config.hidden_size)
            hidden = hidden + table.to(hidden.dtype)
        if self.layernorm_embedding is not None:
            hidden = self.layernorm_embedding(hidden)
        return self.dropout(hidden) if self.training else hidden

    @accepts_both_cache_names
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        hidden_states_to_keep: int = 0,
        in_spans: bool = True,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        """Hidden states of a LEX decoder.

        `position_ids` that restart inside a row (0, 1, 2, 0, 1, ...) start a new document there (padding-free
        packing, e.g. `DataCollatorWithFlattening`): it sees nothing before it. `output_attentions=True` returns
        one (batch, heads, T, keys) map per layer for any length, zeros where the window hides a key; that
        takes O(T * keys) memory, the caller's choice.

        An input longer than the window is read through a LEX cache a span at a time (`reading_spans`), so its
        activations stay O(w) however long it is; with a block memory so is any input of more than one token
        through a LexCache, and a long one without a cache through a new LexCache (returned with `use_cache`).
        Of an input read so, only its last `hidden_states_to_keep` hidden states are returned (0: all of them),
        what LexForCausalLM's `logits_to_keep` asks for. Maps and hidden states of every layer
        (`output_attentions`, `output_hidden_states`) come from one forward over the whole input, and so does any
        input with `in_spans=False` (a caller that runs `reading_spans` itself, one span a call).
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        policy = self.policy
        distributed = getattr(self.config, "distributed_config", None)  # (transformers sets it when it shards)
        if distributed is not None:
            refuse_what_parallelism_cannot_split(self.config, policy, distributed)
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if length == 0:
            raise ValueError("the input is empty: input_ids/inputs_embeds must hold at least one token")
        if isinstance(cache, LexCache) and cache.stream.record_past:
            # Only tokens whose hidden states this forward returns can be rejected by a later crop (the candidates
            # generate() verifies); the cache may let the window move past the others.
            scored = hidden_states_to_keep if hidden_states_to_keep > 0 else length
            if scored < length:
                cache.mark_removable(cache.seen + length - scored)
        memory = policy.memory_tokens > 0
        wants_internals = kwargs.get("output_hidden_states") or kwargs.get("output_attentions")
        long = in_spans and not wants_internals and (length > policy.window
                                                     or (memory and length > 1 and isinstance(cache, LexCache)))
        if long and cache is None and memory:  # the memory fills while the input is read
            outputs = self._read_in_spans(input_ids, inputs_embeds, attention_mask, position_ids,
                                          LexCache(self.config), hidden_states_to_keep, policy, **kwargs)
            if not use_cache:
                outputs[CACHE_NAME] = None
            return outputs
        if long and isinstance(cache, LEX_CACHES):
            return self._read_in_spans(input_ids, inputs_embeds, attention_mask, position_ids, cache,
                                       hidden_states_to_keep, policy, **kwargs)
        return self._read_once(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, policy,
                               **kwargs)

    @property
    def policy(self) -> ReadingPolicy:
        """How this model reads (`ReadingPolicy.of(config)`): the config's reading fields as they are now, so that
        setting one (`model.config.attention_window = 2048`) changes how the next forward reads."""
        return ReadingPolicy.of(self.config)

    def reading_spans(self, length: int) -> list[tuple[int, int]]:
        """The (start, stop) of each forward in which an input of `length` tokens is read through a LEX cache
        (`ReadingPolicy.spans`: w tokens at a time; with a block memory, the last w in pieces, the last token alone;
        see `_read_in_spans`)."""
        return self.policy.spans(length)

    def _read_in_spans(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.FloatTensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        cache: Cache,
        hidden_states_to_keep: int,
        policy: ReadingPolicy,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        """Run a long input through the bounded cache w tokens at a time, so activations stay O(w), not O(n).

        With a block memory, what the input ends with (a question about the document, as a rule) is read in pieces
        (`ReadingPolicy.spans`), its last p / 4 tokens alone and its last token alone. A forward of T tokens retrieves
        once, for b of its queries spread over it (memory.py; a piece for all of them): in a forward of w, the few
        of them that fall on the question choose among blocks by what the filler before it looks for, and its later
        queries have a gap of up to T - 1 keys between the memory (what the cache had evicted when the forward
        began) and their window. In pieces more of the question's queries choose, and each forward starts from what
        the one before it found (`OpenStep.carried`), so the token that predicts the next one reads the blocks the
        whole question points to; the last p / 4 tokens, read without the filler before them, hand on what the
        question's own words find.

        Only the last `hidden_states_to_keep` hidden states are kept (all of them when it is 0).
        """
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if attention_mask is not None:  # the cache holds the past's padding flags: the new tokens' columns suffice
            attention_mask = attention_mask[:, attention_mask.shape[1] - length :]
        keep_from = length - hidden_states_to_keep if hidden_states_to_keep > 0 else 0
        if isinstance(cache, LexCache):
            cache.reserve_memory(cache.seen + length)
        kept = []
        for start, stop in policy.spans(length):
            out = self._read_once(
                None if input_ids is None else input_ids[:, start:stop],
                None if attention_mask is None else attention_mask[:, start:stop],
                None if position_ids is None else position_ids[:, start:stop],
                cache,
                None if inputs_embeds is None else inputs_embeds[:, start:stop],
                True,
                policy,
                **kwargs,
            )
            if stop > keep_from:
                kept.append(out.last_hidden_state[:, max(keep_from - start, 0) :])
        return BaseModelOutputWithPast(last_hidden_state=torch.cat(kept, dim=1), **{CACHE_NAME: cache})

    def _read_once(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        cache: Cache | None,
        inputs_embeds: torch.FloatTensor | None,
        use_cache: bool | None,
        policy: ReadingPolicy,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        """One forward over the whole input, read by `policy`: its record, its plan, every layer inside the cache's
        step (with `LexRows`, each row's)."""
        if isinstance(cache, LexRows):
            return self._read_rows(input_ids, cache, policy, **kwargs)
        if use_cache and cache is None:
            cache = LexCache(self.config)
        reference = input_ids if input_ids is not None else inputs_embeds
        if policy.memory_tokens and reference.shape[1] > policy.window:
            raise ValueError(
                f"an input of {reference.shape[1]} tokens in one forward with attention_memory_blocks="
                f"{policy.memory_blocks}: the block memory is read at most attention_window="
                f"{policy.window} tokens at a time, through a LexCache (forward() reads longer inputs "
                "so, without output_attentions or output_hidden_states)"
            )
        # (the weights' device and dtype; a later pipeline stage has no embeddings and is given hidden states)
        like = inputs_embeds if inputs_embeds is not None else self.embed_tokens.weight
        record = begin_forward(policy, *reference.shape[:2], like.device, attention_mask, position_ids, cache)
        maps = bool(kwargs.get("output_attentions", self.config.output_attentions))
        plans = self._layer_plans(policy, record, like.dtype, maps)
        hidden_states = self.embed(input_ids, inputs_embeds, record.context.query_positions)
        step = cache.step(record) if isinstance(cache, LexCacheSteps) else contextlib.nullcontext()
        with step:  # a LEX cache keeps what the record says once every layer ran
            for layer, layer_plan in zip(self.layers, plans):
                hidden_states = layer(hidden_states, plan=layer_plan, cache=cache, **kwargs)
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_NAME: cache})

    def _read_rows(self, input_ids: torch.LongTensor | None, rows: LexRows, policy: ReadingPolicy,
                   **kwargs: Unpack[TransformersKwargs]) -> BaseModelOutputWithPast:
        """One forward of the rows' next tokens (B, T), each row continuing its own cache's stream: one record and
        plan per row, every row's cache inside its step, the layers run once on the whole batch."""
        if input_ids is None or input_ids.shape[0] != len(rows.rows):
            raise ValueError(f"a forward over LexRows of {len(rows.rows)} rows takes input_ids of as many rows, got "
                             f"{None if input_ids is None else tuple(input_ids.shape)}")
        weight = self.embed_tokens.weight
        records = [begin_forward(policy, 1, input_ids.shape[1], weight.device, None, None, cache)
                   for cache in rows.rows]
        plans = [self._layer_plans(policy, record, weight.dtype, False) for record in records]
        positions = torch.cat([record.context.query_positions for record in records])
        hidden_states = self.embed(input_ids, None, positions)
        with contextlib.ExitStack() as steps:  # every row's cache keeps what its record says once every layer ran
            for cache, record in zip(rows.rows, records):
                steps.enter_context(cache.step(record))
            for index, layer in enumerate(self.layers):
                hidden_states = layer(hidden_states, plan=[row[index] for row in plans], cache=rows, **kwargs)
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_NAME: rows})

    def _layer_plans(self, policy: ReadingPolicy, record: ForwardRecord, dtype: torch.dtype, maps: bool
                     ) -> list[AttentionPlan]:
        """Each layer's plan for the forward of `record`: one per kind of layer (local or global, with or without
        positions), made once per forward."""
        rope_layers, local_layers = self.config.rope_layers, self.config.local_layers
        plan = build_plan(policy, self.position_method, record.context, dtype, attention_maps=maps)
        kinds = {}  # (local, rotary) -> the plan of such layers
        plans = []
        for index in range(len(self.layers)):
            kind = (local_layers is not None and local_layers[index], rope_layers is None or rope_layers[index])
            if kind not in kinds:
                layer_plan = plan
                if kind[0]:  # a local layer: its own window and rope over the same record
                    layer_plan = build_plan(policy.local(), self.local_position_method, record.context, dtype,
                                            attention_maps=maps)
                kinds[kind] = layer_plan if kind[1] else without_positions(layer_plan)
            plans.append(kinds[kind])
        return plans


class LexForCausalLM(LexPreTrainedModel, LexGenerationMixin, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # as Llama's (LexConfig.base_model_tp_plan: the layers)
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    cache_class, static_cache_class = LexCache, LexStaticCache  # what generate() creates (generation.py)

    def __init__(self, config: LexConfig):
        super().__init__(config)
        self.model = LexModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def reading_spans(self, length: int) -> list[tuple[int, int]]:
        """The (start, stop) of each forward in which an input of `length` tokens is read through a LEX cache
        (`LexModel.reading_spans`)."""
        return self.model.reading_spans(length)

    @accepts_both_cache_names
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            hidden_states_to_keep=logits_to_keep if isinstance(logits_to_keep, int) else 0,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma's soft-capped logits
            logits = torch.tanh(logits / cap) * cap
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


AutoModel.register(LexConfig, LexModel, exist_ok=True)
AutoModelForCausalLM.register(LexConfig, LexForCausalLM, exist_ok=True)

__all__ = ["LexPreTrainedModel", "LexModel", "LexForCausalLM"]
