"""Attention resolution (LEX paper, eq. 3) from a model's real pre-softmax scores, and the analytic curve.

The paper defines, for the expected score s[n] at relative distance n (n = 0 .. N),

    R(s) = sum_i e^{s[i]} (e^{s[i]} - e^{s[i+1]}) / (sum_i e^{s[i]})^2

which is large when scores fall monotonically and steeply with distance (the model can tell positions
apart), and its eq. 11 estimates s[n] from data as the mean pre-softmax score of queries at distance n from
their keys. We take that mean over heads and query positions of windows of at most w tokens of real text.
Eq. 8's analytic expectation for random q, k is g[n] = sum_i cos(n theta_i) zeta_i^(n/B) (xPos; zeta = 1 for
RoPE), normalised here by d/2.
"""

import json
from pathlib import Path

import torch

from modeling_lex.attention import _position_terms
from modeling_lex.xpos import apply_rotary, inverse_frequencies, xpos_zeta


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
    """(layers, N) mean pre-softmax score at each distance n, from the model's own q, k and positions."""
    config = model.config
    captured: list[torch.Tensor] = []
    handles = [layer.self_attn.register_forward_pre_hook(lambda mod, args, kwargs: captured.append(
        (mod, args[0] if args else kwargs["hidden_states"])), with_kwargs=True) for layer in model.model.layers]
    length = min(len(w) for w in windows)
    sums = torch.zeros(len(model.model.layers), length, dtype=torch.float64)
    try:
        for window in windows:
            captured.clear()
            model(window[None, :length].to(model.device))
            for index, (module, hidden) in enumerate(captured):
                batch, n, _ = hidden.shape
                shape = (batch, n, module.num_heads, module.head_dim)
                q = module.q_proj(hidden).view(shape).transpose(1, 2).float()
                k = module.k_proj(hidden).view(shape).transpose(1, 2).float()
                positions = torch.arange(n, device=hidden.device)[None]
                factors, bias, distance = _position_terms(config, positions, positions)
                if factors is not None:
                    cos_q, sin_q, cos_k, sin_k = (f.unsqueeze(1) for f in factors)
                    q, k = apply_rotary(q, cos_q, sin_q), apply_rotary(k, cos_k, sin_k)
                scores = (q @ k.transpose(-1, -2)) * module.scaling
                if bias is not None:
                    scores = scores + bias
                if distance is not None:
                    scores = scores + module.learned_bias(distance)
                scores = scores.mean(dim=(0, 1)).double().cpu()  # (n, n) over batch and heads
                sums[index] += torch.stack([scores.diagonal(-d).mean() for d in range(n)])
    finally:
        for handle in handles:
            handle.remove()
    return sums / len(windows)


def resolution_report(models: list[str], texts: list[str], output_dir: Path, device: str = "cpu",
                      windows_per_model: int = 8) -> str:
    """Resolution per layer for each model folder on windows of w tokens; writes resolution.json/.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from transformers import AutoTokenizer

    from .eval_length import load_model

    rows, curves = [], {}
    for path in models:
        model = load_model(path, None, device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        w = model.config.attention_window
        ids = [torch.tensor(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
        windows = [d[i : i + w] for d in ids for i in range(0, len(d) - w + 1, w)][:windows_per_model]
        if not windows:
            raise ValueError(f"no evaluation text holds a window of {w} tokens for {path}")
        scores = expected_scores(model, windows)
        per_layer = [resolution(s) for s in scores]
        name = Path(path).name
        rows.append({"model": name, "position_embedding_type": model.config.position_embedding_type,
                     "resolution_per_layer": per_layer, "resolution": sum(per_layer) / len(per_layer)})
        curves[name] = scores.mean(0)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "resolution.json").write_text(json.dumps(rows, indent=2))

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in curves.items():
        left.plot(curve.numpy(), label=name)
    left.set_xlabel("relative distance n")
    left.set_ylabel("mean pre-softmax score ŝ[n]")
    left.legend(fontsize=7)
    for kind in ("rope", "xpos"):
        right.plot(analytic_curve(64, 4096, kind).numpy(), label=f"{kind} (d=64)")
    right.set_xlabel("relative distance n")
    right.set_ylabel("g[n] (eq. 8, normalised)")
    right.legend()
    fig.tight_layout()
    fig.savefig(output_dir / "resolution.png", dpi=100)
    plt.close(fig)

    lines = ["| model | position | resolution (mean) | per layer |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['position_embedding_type']} | {r['resolution']:.4f} | "
              + ", ".join(f"{x:.4f}" for x in r["resolution_per_layer"]) + " |" for r in rows]
    return "\n".join(lines)
