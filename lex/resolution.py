"""Attention resolution (LEX paper, eq. 3) from a model's real pre-softmax scores, and the analytic curve.

The paper defines, for the expected score s[n] at relative distance n (n = 0 .. N),

    R(s) = sum_i e^{s[i]} (e^{s[i]} - e^{s[i+1]}) / (sum_i e^{s[i]})^2

which is large when scores fall monotonically and steeply with distance (the model can tell positions
apart), and its eq. 11 estimates s[n] from data as the mean pre-softmax score of queries at distance n from
their keys. We take that mean over heads and query positions of windows of at most w tokens of real text.
Eq. 8's analytic expectation for random q, k is g[n] = sum_i cos(n theta_i) zeta_i^(n/B) (xPos; zeta = 1 for
RoPE), normalised here by d/2.
"""

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from modeling_lex.kernels import eager_attention_forward
from modeling_lex.positions import inverse_frequencies, xpos_zeta

from .data import DataError, tokenized_documents


def resolution(scores: torch.Tensor) -> float:
    """Eq. 3 for an expected-score curve s[0..N] (invariant to adding a constant to s)."""
    s = scores.double() - scores.double().max()
    e = s.exp()
    return float((e[:-1] * (e[:-1] - e[1:])).sum() / e.sum() ** 2)


def analytic_curve(head_dim: int, distances: int, kind: str, theta: float = 1e4, gamma: float = 0.4,
                   scale_base: float = 512.0) -> torch.Tensor:
    """g[n] of eq. 8 for n = 0 .. distances-1, normalised by d/2 (so g[0] = 1)."""
    n = torch.arange(distances, dtype=torch.float64)[:, None]
    angles = n * inverse_frequencies(head_dim, theta, torch.device("cpu"))
    zeta = xpos_zeta(head_dim, gamma, torch.device("cpu")) if kind == "xpos" else torch.ones(head_dim // 2)
    return (angles.cos() * zeta ** (n / scale_base)).sum(-1) / (head_dim // 2)


@torch.no_grad()
def expected_scores(model, windows: list[torch.Tensor]) -> torch.Tensor:
    """(layers, N) mean pre-softmax score at each distance n, as the model itself computes it.

    The scores come from the model's own forward: a recording attention function is registered in transformers'
    attention registry (`ALL_ATTENTION_FUNCTIONS`) and selected with `set_attn_implementation` for the duration of
    the call. Each layer hands it q and k already position-encoded (xPos, RoPE, decay), the additive mask with any
    fixed bias folded in (ALiBi, Sandwich) and the learned bias (KERPLE); it records q k^T * scaling + bias + mask
    and then runs the eager attention, so the forward goes on unchanged. Windows are truncated to the shortest
    and must hold at most w tokens, so that each layer's attention is one dense causal tile.
    """
    window = model.config.attention_window
    length = min(len(w) for w in windows)
    if length > window:
        raise ValueError(f"expected_scores reads one dense attention tile per layer: windows must hold at most "
                         f"attention_window = {window} tokens, the shortest holds {length}")
    layers = len(model.model.layers)
    sums = torch.zeros(layers, length, dtype=torch.float64)
    recorded: dict[int, torch.Tensor] = {}

    def record(module, query, key, value, attention_mask, scaling, dropout=0.0, position_bias=None, **kwargs):
        if query.shape[-2] != length or key.shape[-2] != length or module.layer_idx in recorded:
            raise RuntimeError(f"expected_scores expects one dense {length} x {length} attention tile per layer, "
                               f"got queries {tuple(query.shape)} against keys {tuple(key.shape)} in layer "
                               f"{module.layer_idx}")
        key_per_query = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # grouped-query attention
        scores = (query.double() @ key_per_query.double().transpose(-1, -2)) * scaling
        if position_bias is not None:
            scores = scores + position_bias.double()
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            scores = scores + attention_mask.double()  # the fixed bias where allowed; only the causal part is read
        recorded[module.layer_idx] = scores.mean(dim=(0, 1)).cpu()  # (n, n) over batch and heads
        return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                       position_bias=position_bias, **kwargs)

    name = f"lex_expected_scores_{id(record):x}"
    previous = model.config._attn_implementation
    ALL_ATTENTION_FUNCTIONS[name] = record  # this call's own entry; removed below
    try:
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise RuntimeError(f"{type(model).__name__} did not take the recording attention implementation")
        for window_ids in windows:
            recorded.clear()
            model(window_ids[None, :length].to(model.device))
            if sorted(recorded) != list(range(layers)):
                raise RuntimeError(f"the recording attention saw layers {sorted(recorded)} of {layers}")
            for index in range(layers):
                scores = recorded[index]
                sums[index] += torch.stack([scores.diagonal(-d).mean() for d in range(length)])
    finally:
        try:
            model.set_attn_implementation(previous)
        finally:
            del ALL_ATTENTION_FUNCTIONS[name]
    return sums / len(windows)


def resolution_rows(model, tokenizer, name: str, texts: list[str], windows: int = 8) -> tuple[dict, list[float]]:
    """One model's resolution per layer on up to `windows` windows of w tokens of `texts`, and its mean
    expected-score curve (over layers) for the plot."""
    w = model.config.attention_window
    spans = [d[i : i + w] for d in tokenized_documents(tokenizer, texts) for i in range(0, len(d) - w + 1, w)][:windows]
    if not spans:
        raise DataError(f"no evaluation text holds a window of {w} tokens for {name}")
    scores = expected_scores(model, spans)
    per_layer = [resolution(s) for s in scores]
    row = {"model": name, "position_embedding_type": model.config.position_embedding_type,
           "resolution_per_layer": per_layer, "resolution": sum(per_layer) / len(per_layer)}
    return row, scores.mean(0).tolist()


def analytic_curves(head_dim: int = 64, distances: int = 4096) -> dict[str, list[float]]:
    """Eq. 8 for RoPE and xPos, the right panel of resolution.png."""
    return {f"{kind} (d={head_dim})": analytic_curve(head_dim, distances, kind).tolist() for kind in ("rope", "xpos")}
