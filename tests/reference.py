"""A naive O(n^2) LEX forward in float64, written from the paper and DESIGN.md, independent of modeling_lex.

Absolute positions, an explicit n x n mask per mode, explicit per-head loops: slow and simple on purpose.
It reads the weights of a LexForCausalLM state dict by name.
"""

import copy
import math

import torch


def _rotate_every_two(x):
    out = torch.empty_like(x)
    out[..., 0::2] = -x[..., 1::2]
    out[..., 1::2] = x[..., 0::2]
    return out


def frequencies(config):
    """(inverse frequencies (d/2,) float64, attention factor) of config.rope_parameters: theta^(-2i/d) for the
    default type, transformers' ROPE_INIT_FUNCTIONS for scaled ones (as HF Llama computes them)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = config.rope_parameters
    d = config.head_dim
    if rope["rope_type"] == "default":
        return rope["rope_theta"] ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d), 1.0
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device("cpu"))
    return inv_freq.double(), factor


def encode(x, positions, kind, theta=10000.0, gamma=0.4, scale_base=512.0, downscale=False, inv_freq=None,
           attention_factor=1.0):
    """x: (n, d) float64 at absolute integer positions (n,). xPos/RoPE/decay with interleaved pairs."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    if inv_freq is None:
        inv_freq = theta ** (-2 * i / d)
    angle = positions[:, None].double() * inv_freq
    zeta = (2 * i + gamma * d) / ((1 + gamma) * d)
    scale = zeta ** (positions[:, None].double() / scale_base)
    if downscale:
        scale = 1 / scale
    if kind == "rope":
        scale = torch.ones_like(scale)
    if kind == "decay":  # no rotation: rope_parameters (frequencies, attention factor) play no part
        angle, attention_factor = torch.zeros_like(angle), 1.0
    scale = scale * attention_factor
    cos = (angle.cos() * scale).repeat_interleave(2, -1)
    sin = (angle.sin() * scale).repeat_interleave(2, -1)
    return x * cos + _rotate_every_two(x) * sin


def alibi_slopes(h):
    def p2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**k for k in range(n)]

    if math.log2(h).is_integer():
        return p2(h)
    c = 2 ** math.floor(math.log2(h))
    return p2(c) + p2(2 * c)[0::2][: h - c]


def sandwich(positions, heads, dim):
    """(heads, n, n): (p_m . p_n - d'/2) / (8h/H) with p = [sin(m w_i), cos(m w_i)], w_i = 10000^(-2i/d')."""
    w = 10000.0 ** (-2 * torch.arange(1, dim // 2 + 1, dtype=torch.float64) / dim)
    angles = positions[:, None].double() * w
    p = torch.cat([angles.sin(), angles.cos()], dim=-1)
    inner = p @ p.T - dim / 2
    return torch.stack([inner / (8 * h / heads) for h in range(1, heads + 1)])


def fairseq_sinusoidal(positions, dim):
    """fairseq's SinusoidalPositionalEmbedding rows, written from its definition."""
    half = dim // 2
    rows = []
    for pos in positions.tolist():
        f = [math.exp(-j * math.log(10000.0) / (half - 1)) for j in range(half)]
        rows.append([math.sin(pos * x) for x in f] + [math.cos(pos * x) for x in f] + [0.0] * (dim % 2))
    return torch.tensor(rows, dtype=torch.float64)


def activation(config):
    return {"gelu": torch.nn.functional.gelu, "relu": torch.relu, "swish": torch.nn.functional.silu,
            "silu": torch.nn.functional.silu,
            "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}[config.hidden_act]


def norm(sd, config, x, p):
    """The config's norm with the weights (and bias) named p in the float64 state dict `sd` (Gemma's RMSNorm scales
    by 1 + weight)."""
    if config.norm_type in ("rmsnorm", "gemma_rmsnorm"):
        weight = sd[p + ".weight"] + (1.0 if config.norm_type == "gemma_rmsnorm" else 0.0)
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + config.rms_norm_eps) * weight
    return torch.nn.functional.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], config.layer_norm_eps)


def visible(mode, window, n, pad, sinks=0, sink_skip=0):
    """n x n bool: may query i see key j (indices in a row whose first `pad` tokens are padding).

    Sinks: in blockwise and sliding modes, the document's first `sinks` tokens (after its first `sink_skip`) are
    seen by every later query, whatever the distance (at their true positions)."""
    allowed = torch.zeros(n, n, dtype=torch.bool)
    b = window // 2
    for i in range(n):
        for j in range(i + 1):
            if j < pad:
                continue
            if mode != "full" and sink_skip <= j - pad < sinks + sink_skip:
                allowed[i, j] = True
                continue
            if mode == "sliding" and i - j >= window:
                continue
            if mode == "blockwise" and (j - pad) // b < (i - pad) // b - 1:
                continue
            allowed[i, j] = True
        if i < pad:
            allowed[i, i] = True
    return allowed


def sinks_in_the_cache(config, n, pad, gap=0, skip=0):
    """attention_sink_positions="cache": [(query i, sink key j, the distance it is seen at)] for every sink a query
    sees outside its window, placed as StreamingLLM places them: just before the query's window (`gap` places
    further); the sinks are the document's first tokens after its first `skip`."""
    mode, window, sinks = config.attention_mode, config.attention_window, config.attention_sinks
    if mode == "full" or not sinks or getattr(config, "attention_sink_positions", "true") != "cache":
        return []
    b, pairs = window // 2, []
    for i in range(pad, n):
        first = max(pad, i - window + 1) if mode == "sliding" else max(pad, pad + ((i - pad) // b - 1) * b)
        for j in range(pad + skip, min(pad + skip + sinks, first)):
            pairs.append((i, j, gap + sinks + (i - first) - (j - pad - skip)))
    return pairs


def forward(state, config, input_ids, pad=0, positions=None, maps=None, layer_scores=None, sink_gap=0, sink_skip=0):
    """Logits (n, vocab) of one row; the first `pad` tokens are padding (masked as keys). `sink_gap`: sinks in the
    cache's frame sit that many places further from the window; `sink_skip`: the sinks are the document's first
    tokens after its first `sink_skip`.

    `maps`: a list that receives each layer's attention weights (heads, n, n); `layer_scores`: one that receives each
    layer's pre-softmax scores (heads, n, n), position terms included, before the mask."""
    sd = {k: v.double() for k, v in state.items()}
    n = input_ids.shape[0]
    h, d = config.num_attention_heads, config.head_dim
    group = h // config.num_key_value_heads  # query heads per key/value head
    inv_freq, attention_factor = frequencies(config)
    if positions is None:
        positions = torch.clamp(torch.arange(n) - pad, min=0)
    act = activation(config)

    def ln(x, p):
        return norm(sd, config, x, p)

    lin = lambda x, p: x @ sd[p + ".weight"].T + (sd[p + ".bias"] if p + ".bias" in sd else 0)
    x = sd["model.embed_tokens.weight"][input_ids] * config.embedding_scale
    if config.absolute_position_embedding == "sinusoidal":
        x = x + fairseq_sinusoidal(positions + config.absolute_position_offset, config.hidden_size)
    if config.layernorm_embedding:
        x = ln(x, "model.layernorm_embedding")
    allowed = visible(config.attention_mode, config.attention_window, n, pad, config.attention_sinks, sink_skip)
    placed_sinks = sinks_in_the_cache(config, n, pad, sink_gap, sink_skip)
    alpha = (2 * config.num_hidden_layers) ** 0.25 if config.deepnorm else 1.0
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        residual = x
        y = ln(x, p + "self_attn_layer_norm") if config.normalize_before else x
        q, k, v = (lin(y, p + f"self_attn.{name}_proj") for name in "qkv")
        heads, weights, raw = [], [], []
        for head in range(h):
            sl, kv = slice(head * d, (head + 1) * d), slice((head // group) * d, (head // group + 1) * d)
            qh, kh, vh = q[:, sl], k[:, kv], v[:, kv]
            kh_raw = kh
            kind = config.position_embedding_type
            if kind in ("xpos", "rope", "decay"):
                options = dict(gamma=config.xpos_gamma, scale_base=config.xpos_scale_base, inv_freq=inv_freq,
                               attention_factor=attention_factor)
                qh = encode(qh, positions, kind, **options)
                kh = encode(kh, positions, kind, downscale=True, **options)
            scores = qh @ kh.T / math.sqrt(d)
            distance = (positions[:, None] - positions[None, :]).double()
            for i, j, seen_at in placed_sinks:  # the sink key re-encoded at the query's position minus that distance
                distance[i, j] = seen_at
                if kind in ("xpos", "rope", "decay"):
                    placed = encode(kh_raw[j : j + 1], positions[i : i + 1] - seen_at, kind, downscale=True, **options)
                    scores[i, j] = qh[i] @ placed[0] / math.sqrt(d)
            if kind == "alibi":
                scores = scores - alibi_slopes(h)[head] * distance
            if kind == "kerple":
                r1 = sd[p + "self_attn.kerple_r1"][head].clamp(min=1e-2)
                r2 = sd[p + "self_attn.kerple_r2"][head].clamp(min=1e-2)
                scores = scores - r1 * torch.log(1 + r2 * distance.abs())
            if kind == "sandwich":
                scores = scores + sandwich(positions, h, config.sandwich_dim)[head]
            raw.append(scores)
            scores = scores.masked_fill(~allowed, float("-inf"))
            weights.append(torch.softmax(scores, -1))
            heads.append(weights[-1] @ vh)
        if maps is not None:
            maps.append(torch.stack(weights))
        if layer_scores is not None:
            layer_scores.append(torch.stack(raw))
        attn = torch.cat(heads, -1)
        if config.subln:
            attn = ln(attn, p + "self_attn.inner_attn_ln")
        x = residual * alpha + lin(attn, p + "self_attn.o_proj")
        if not config.normalize_before:
            x = ln(x, p + "self_attn_layer_norm")
        residual = x
        y = ln(x, p + "final_layer_norm") if config.normalize_before else x
        if config.mlp_type == "gated":
            y = act(lin(y, p + "mlp.gate_proj")) * lin(y, p + "mlp.up_proj")
        else:
            y = act(lin(y, p + "mlp.fc1"))
        if config.subln:
            y = ln(y, p + "mlp.ffn_layernorm")
        x = residual * alpha + lin(y, p + ("mlp.down_proj" if config.mlp_type == "gated" else "mlp.fc2"))
        if not config.normalize_before:
            x = ln(x, p + "final_layer_norm")
    if config.normalize_before:
        x = ln(x, "model.norm")
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return x @ head.T


def attention_maps(state, config, input_ids):
    """Each layer's attention weights (heads, n, n) of one row, zeros where the mode's window hides a key."""
    maps = []
    forward(state, config, input_ids, maps=maps)
    return maps


def pre_softmax_scores(state, config, input_ids):
    """Each layer's pre-softmax scores (heads, n, n) of one row: q.k / sqrt(d) with its position terms, unmasked."""
    out = []
    forward(state, config, input_ids, layer_scores=out)
    return out


def llama_window_attention(model, mode: str, window: int, sinks: int, rule: str):
    """An attention function for transformers' own Llama: the mode's window (no padding, one document from 0) plus
    S sinks, placed by `rule`: "true", at their own positions; "cache", StreamingLLM's positions within the cache
    (sink j just before the query's window, at distance S + (the query's offset in its window) - j), by undoing
    the rotation HF applied and rotating the query anew against each sink key. Naive: n x n scores in float32.
    Gemma's local layers (layer_type "sliding_attention") keep their own sliding window (`sliding_window`), without
    sinks, and its soft-capping (the `softcap` its layers pass) caps every score, the re-rotated sinks' included.
    Register it with `ALL_ATTENTION_FUNCTIONS.register(name, ...)` and `model.set_attn_implementation(name)`."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = model.model.rotary_emb
    per_layer_type = hasattr(rotary, "layer_types")  # Gemma 3: a rope per layer type

    def rotate(x, positions, layer_type=None):
        cos, sin = rotary(x, positions, layer_type) if per_layer_type else rotary(x, positions)
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    def window_start(index, mode, window):
        if mode == "sliding":
            return (index - window + 1).clamp(min=0)
        block = window // 2
        return ((index // block - 1) * block).clamp(min=0)

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, **kwargs):
        layer_type = getattr(module, "layer_type", None)
        local = layer_type == "sliding_attention"
        layer_mode, layer_window = ("sliding", model.config.sliding_window) if local else (mode, window)
        layer_sinks = 0 if local else sinks
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        n = query.shape[2]
        index = torch.arange(n, device=query.device)
        q_index, k_index = index[:, None], index[None, :]
        scores = query @ key.transpose(-1, -2) * scaling
        in_window = (k_index <= q_index) & (k_index >= window_start(q_index, layer_mode, layer_window))
        as_sink = (k_index < layer_sinks) & (k_index <= q_index) & ~in_window
        if rule == "cache" and getattr(module, "use_rope", True):  # SmolLM3's layers without rotary: nothing to move
            query_raw = rotate(query, -index[None], layer_type)
            sink_keys = rotate(key[:, :, :layer_sinks], -index[None, :layer_sinks], layer_type)
            offset = index - window_start(index, layer_mode, layer_window)
            for j in range(min(layer_sinks, n)):
                placed = rotate(query_raw, (layer_sinks + offset - j)[None], layer_type)
                scores[..., j] = torch.where(as_sink[:, j], (placed * sink_keys[:, :, j : j + 1]).sum(-1) * scaling,
                                             scores[..., j])
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~(in_window | as_sink), float("-inf"))
        return (scores.softmax(-1, dtype=torch.float32).to(value.dtype) @ value).transpose(1, 2).contiguous(), None

    return attention


def use_window_attention(model, mode: str, window: int, sinks: int, rule: str = "cache"):
    """Give transformers' Llama (or Qwen2, Qwen3, Mistral, Phi-3, SmolLM3, Gemma 2, Gemma 3: the same rotation)
    `llama_window_attention` as its attention implementation; returns the model."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"lex-reference-{mode}-{window}-{sinks}-{rule}-{id(model)}"
    ALL_ATTENTION_FUNCTIONS.register(name, llama_window_attention(model, mode, window, sinks, rule))
    model.set_attn_implementation(name)
    return model


def chosen_blocks(summed: dict[int, float], slots: int) -> list[int]:
    """The retrieval rule over the candidate blocks' summed scores: the blocks read, in the order of the last
    len(result) slots. The best slots // 3 (of equal sums, the later) with the candidates beside each, then the best
    of the rest; runs of consecutive blocks in stream order, the runs by their best sum, the best last (of equal
    ones, the earlier run first)."""
    ranked = sorted(((s, j) for j, s in summed.items()), reverse=True)
    chosen = set()
    for _, j in ranked[: slots // 3]:
        chosen.update(m for m in (j - 1, j, j + 1) if m in summed)
    for _, j in ranked:
        if len(chosen) < min(slots, len(ranked)):
            chosen.add(j)
    runs = []
    for j in sorted(chosen):
        if runs and runs[-1][-1] == j - 1:
            runs[-1].append(j)
        else:
            runs.append([j])
    runs.sort(key=lambda run: max(summed[j] for j in run))  # (sort is stable)
    return [j for run in runs for j in run]


def memory_forward(state, config, input_ids, forwards, margins=None, gap=0, sink_skip=0):
    """Logits (n, vocab) of one row (one document from position 0, no padding) read as `forwards` (token counts,
    in order) through a cache with the block memory past the window (attention_memory_blocks = k, blocks of
    b = attention_memory_block_size) and S sinks at cache positions; the retrieval rule written out naively.

    Before a forward that starts at token a, the cache has evicted tokens 0 ... E - 1 (sliding: E = a - w + 1;
    blockwise: the start of the block before a's). Its complete blocks after the S sinks are the candidates; each
    layer scores them with all queries q of a forward of at most p = max(b, w // 16) tokens, else b of them (every
    ceil(count / b)-th, ending at its last; per head, before positions): the sum over queries and heads of the
    square of the block's share of that query and head's softmax over the candidates of the best q . r / sqrt(d)
    over the block's b // 4 keys (at least 1) of largest norm r (per key/value head, before positions). A layer
    ranks the blocks by its score plus the scores of the layers below it in the same forward plus what the last
    forward that chose found: the scores its layers added, over the number of those layers (0 for a block that was
    no candidate then). The best k // 3 blocks (of equal sums, the later), each with the candidates beside it, then
    the best of the rest up to k fill the last slots of k, each run of consecutive blocks in stream order and the runs
    by their best sum, the best last (of equal sums, the earlier run first) (a forward of one token among as many
    complete blocks as at the layer's last choice reads the blocks chosen then, and adds no score); slot s's token t
    is seen at distance (query - its window's first token) + k*b - (s*b + t), sink j at (query - window's first) +
    k*b + S - j. Supports xpos, rope, decay, alibi, none. `margins`: a list that receives, per forward and layer
    that chose among more than k blocks, the gap between the (k // 3)-th best score (k < 3: the best) and the next
    (a float32 model may choose otherwise where it is tiny). `gap`: the memory's slots and the sinks before them sit
    that many places further from the window (every distance above plus `gap`). `sink_skip`: the sinks are the
    document's first S tokens after its first `sink_skip` (sink j: token sink_skip + j), the candidates after them.

    Gemma's architecture too: local layers (`local_layers`) slide over their own window with their own rope, see no
    sinks and no memory and add no score; scores are scaled by `attention_scaling` (the block scores too) and capped
    by `attn_logit_softcapping` (attention only), per-head q/k norms, norms on each sublayer's output, Gemma's
    RMSNorm, capped logits."""
    sd = {k: v.double() for k, v in state.items()}
    n = input_ids.shape[0]
    h, d = config.num_attention_heads, config.head_dim
    group = h // config.num_key_value_heads
    mode, w, sinks = config.attention_mode, config.attention_window, config.attention_sinks
    slots, block = config.attention_memory_blocks, config.attention_memory_block_size
    half, memory_places = w // 2, slots * block
    kind = config.position_embedding_type
    scale, cap = config.attention_scaling, config.attn_logit_softcapping
    local_layers = config.local_layers or [False] * config.num_hidden_layers
    local_rope = copy.copy(config)
    local_rope.rope_parameters = config.local_rope_parameters or config.rope_parameters
    options_of = {}  # local? -> the rotary's options
    for local, rope in ((False, config), (True, local_rope)):
        inv_freq, attention_factor = frequencies(rope)
        options_of[local] = dict(gamma=config.xpos_gamma, scale_base=config.xpos_scale_base, inv_freq=inv_freq,
                                 attention_factor=attention_factor)
    act = activation(config)

    def ln(x, p):
        return norm(sd, config, x, p)

    def lin(x, p):
        return x @ sd[p + ".weight"].T + (sd[p + ".bias"] if p + ".bias" in sd else 0)

    def window_first(i, local):
        if local:
            return max(0, i - config.local_attention_window + 1)
        return max(0, i - w + 1) if mode == "sliding" else max(0, (i // half - 1) * half)

    def scores_of(qh, keys, q_at, k_at, head, local):
        """q . k * scale [capped] of a raw query seen at q_at and raw keys (m, d) seen at k_at (m,), with the
        method's terms."""
        if kind in ("xpos", "rope", "decay"):
            qh = encode(qh[None], torch.tensor([q_at]), kind, **options_of[local])[0]
            keys = encode(keys, k_at, kind, downscale=True, **options_of[local])
        value = keys @ qh * scale
        if cap is not None:
            value = torch.tanh(value / cap) * cap
        if kind == "alibi":
            value = value - alibi_slopes(h)[head] * (q_at - k_at).double()
        return value

    def attend(a, count, memory, local):
        """Queries a ... a + count - 1 of the layer (q, k, v, attn of the loop below) over the window, the sinks and
        `memory`: (stream index, place in the memory's slots); a local layer over its own window alone."""
        for i in range(a, a + count):
            first = window_first(i, local)
            offset = i - first
            for head in range(h):
                kv = head // group
                seen = [(j, i - j) for j in range(first, i + 1)]  # (key, distance)
                if not local:
                    seen += [(j, offset + memory_places + gap + sinks - (j - sink_skip))
                             for j in range(sink_skip, min(sinks + sink_skip, first))]
                    seen += [(j, offset + memory_places + gap - place) for j, place in memory]
                index = torch.tensor([j for j, _ in seen])
                at = i - torch.tensor([dist for _, dist in seen])
                weights = torch.softmax(scores_of(q[i, head], k[index, kv], i, at, head, local), 0)
                attn[i, head] = weights @ v[index, kv]

    starts = [sum(forwards[:f]) for f in range(len(forwards))]
    layers = range(config.num_hidden_layers)
    # each layer's raw queries, keys and values of the tokens read so far
    qs = [torch.zeros(n, h, d, dtype=torch.float64) for _ in layers]
    ks = [torch.zeros(n, config.num_key_value_heads, d, dtype=torch.float64) for _ in layers]
    vs = [torch.zeros(n, config.num_key_value_heads, d, dtype=torch.float64) for _ in layers]
    held = [None for _ in layers]  # per layer: (complete blocks, memory) of its last choice
    carried = {}  # block -> the scores the last forward that chose added, over the layers that added them
    x = sd["model.embed_tokens.weight"][input_ids] * config.embedding_scale
    for a, count in zip(starts, forwards):
        rows = slice(a, a + count)
        evicted = max(0, a - w + 1) if mode == "sliding" else max(0, (a // half - 1) * half)
        candidates = [j for j in range(evicted // block) if j * block >= sinks + (sink_skip if sinks else 0)]
        last = a + count - 1
        summed = {j: carried.get(j, 0.0) for j in candidates}  # block -> carried + the layers' scores so far
        scored = 0  # layers that scored
        for layer in layers:
            p = f"model.layers.{layer}."
            y = ln(x[rows], p + "self_attn_layer_norm")
            q, k, v = qs[layer], ks[layer], vs[layer]
            for name, into in zip("qkv", (q, k, v)):
                into[rows] = lin(y, p + f"self_attn.{name}_proj").view(count, -1, d)
                if config.qk_norm and name != "v":  # per head, before positions
                    into[rows] = ln(into[rows], p + f"self_attn.{name}_norm")
            attn = torch.zeros(n, h, d, dtype=torch.float64)
            local = local_layers[layer]
            if local:
                attend(a, count, [], local)
            elif not candidates or (count == 1 and held[layer] is not None and held[layer][0] == evicted // block):
                # nothing to choose from, or one token among the same blocks: what was chosen then
                attend(a, count, held[layer][1] if candidates else [], local)
            else:

                def block_logit(j, head, query):
                    keys = k[j * block : (j + 1) * block, head // group]
                    top = keys.norm(dim=-1).topk(max(1, block // 4)).indices
                    return float((keys[top] @ q[query, head]).max()) * scale

                for query in range(last, a - 1, -1 if count <= max(block, w // 16) else -math.ceil(count / block)):
                    for head in range(h):  # each query and head's softmax over the candidates, summed
                        logits = {j: block_logit(j, head, query) for j in candidates}
                        top = max(logits.values())
                        total = sum(math.exp(value - top) for value in logits.values())
                        for j in candidates:
                            summed[j] += (math.exp(logits[j] - top) / total) ** 2
                scored += 1
                ranked = sorted(((s, j) for j, s in summed.items()), reverse=True)  # of equal sums, the later
                if margins is not None and len(ranked) > slots:
                    boundary = max(slots // 3, 1)
                    margins.append(ranked[boundary - 1][0] - ranked[boundary][0])
                read = chosen_blocks(summed, slots)
                memory = []  # (stream index, place in the memory's slots)
                for rank, j in enumerate(read):
                    slot = slots - len(read) + rank
                    memory += [(j * block + t, slot * block + t) for t in range(block)]
                held[layer] = (evicted // block, memory)
                attend(a, count, memory, local)
            out = lin(attn[rows].reshape(count, h * d), p + "self_attn.o_proj")
            if config.sublayer_output_norms:
                out = ln(out, p + "post_self_attn_layer_norm")
            x[rows] = x[rows] + out
            y = ln(x[rows], p + "final_layer_norm")
            if config.mlp_type == "gated":
                y = act(lin(y, p + "mlp.gate_proj")) * lin(y, p + "mlp.up_proj")
            else:
                y = act(lin(y, p + "mlp.fc1"))
            out = lin(y, p + ("mlp.down_proj" if config.mlp_type == "gated" else "mlp.fc2"))
            if config.sublayer_output_norms:
                out = ln(out, p + "post_mlp_layer_norm")
            x[rows] = x[rows] + out
        if scored:
            carried = {j: (summed[j] - carried.get(j, 0.0)) / scored for j in candidates}
    x = ln(x, "model.norm")
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    logits = x @ head.T
    final_cap = config.final_logit_softcapping
    return logits if final_cap is None else torch.tanh(logits / final_cap) * final_cap
