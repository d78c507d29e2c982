"""Tables, plots and report.md: every figure and Markdown table the project prints or writes is built here.

Everything is computed from result rows ({model, attention_mode, protocol, length, ppl, ...} per perplexity;
resolution and passkey rows), so the terminal, the JSON files and report.md cannot disagree.
"""

import csv
import json
from pathlib import Path

# A perplexity that moves by less than this fraction between l and 16*l "stays" (the rest "rises" or "falls").
FLAT = 0.05
GROUP_LABELS = {"model": "model", "attention_mode": "attention", "protocol": "protocol"}


# ---------------------------------------------------------------- Markdown tables


def attention_label(row: dict) -> str:
    """How a row's attention reads in a table: its mode, with its sinks when it has any ("sliding + 4 sinks"),
    their position rule when the row names one ("sliding + 4 sinks (cache positions)"), and its block memory when
    it has one ("sliding + 4 sinks (cache positions) + memory 64x16": 64 blocks of 16 tokens)."""
    mode, sinks = row.get("attention_mode", ""), row.get("attention_sinks", 0)
    rule = row.get("attention_sink_positions")
    label = f"{mode} + {sinks} sinks" + (f" ({rule} positions)" if rule else "") if sinks else mode
    memory = row.get("attention_memory_blocks")
    if memory:
        size = row.get("attention_memory_block_size")
        label += f" + memory {memory}" + (f"x{size}" if size else "")
    return label


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub Markdown table; cells are written with str()."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def length_table(records: list[dict], keys: tuple[str, ...] | None = None) -> str:
    """Perplexity by evaluation length: one row per distinct (keys) group, one column per length, "-" where a
    group lacks a length. `keys` default to those of model, attention_mode, protocol that the records have."""
    keys = keys or tuple(k for k in GROUP_LABELS if any(k in r for r in records))
    lengths = sorted({r["length"] for r in records})
    groups: dict[tuple, dict[int, float]] = {}
    for record in records:
        group = tuple(attention_label(record) if k == "attention_mode" else str(record.get(k, "")) for k in keys)
        groups.setdefault(group, {})[record["length"]] = record["ppl"]
    rows = [[*group, *(f"{values[n]:.2f}" if n in values else "-" for n in lengths)]
            for group, values in groups.items()]
    return markdown_table([GROUP_LABELS[k] for k in keys] + [str(n) for n in lengths], rows)


def protocol_table(rows: list[dict], protocol: str) -> str:
    """`length_table` of one protocol's rows: one row per (model, attention mode)."""
    return length_table([r for r in rows if r["protocol"] == protocol], ("model", "attention_mode"))


def resolution_table(rows: list[dict]) -> str:
    return markdown_table(
        ["model", "position", "resolution (mean)", "per layer"],
        [[r["model"], r["position_embedding_type"], f"{r['resolution']:.4f}",
          ", ".join(f"{x:.4f}" for x in r["resolution_per_layer"])] for r in rows],
    )


def passkey_table(rows: list[dict]) -> str:
    return markdown_table(
        ["model", "attention", "window", "distance", "accuracy", "key NLL/token"],
        [[r["model"], attention_label(r), r["window"], r["distance"], f"{r['accuracy']:.2f}",
          f"{r['key_nll_per_token']:.2f}"] for r in rows],
    )


PASSKEY_DISTANCES = {0.25: "w/4", 0.5: "w/2", 1: "w", 2: "2w", 4: "4w"}  # lex.passkey.passkey_rows' distances


def passkey_accuracy_table(rows: list[dict]) -> str:
    """Passkey rows as one row per (model, attention) and one column per distance in windows w (the attention
    window; the training length in full attention): "accuracy (key NLL per token)"."""
    groups: dict[tuple, dict[str, str]] = {}
    for r in rows:
        cells = groups.setdefault((r["model"], attention_label(r), r["window"]), {})
        cells[PASSKEY_DISTANCES.get(r["distance"] / r["window"], str(r["distance"]))] = (
            f"{r['accuracy']:.2f} ({r['key_nll_per_token']:.2f})")
    columns = list(dict.fromkeys([*PASSKEY_DISTANCES.values(), *(c for cells in groups.values() for c in cells)]))
    return markdown_table(["model", "attention", "w", *(f"{c} back" for c in columns)],
                          [[*group, *(cells.get(c, "-") for c in columns)] for group, cells in groups.items()])


def tables(rows: list[dict], resolution_rows: list[dict], length: int,
           passkey: list[dict] | None = None) -> list[tuple[str, str]]:
    """(title, Markdown table) of the paper's Tables 2, 5 (both protocols) and 3, and passkey retrieval when
    there are passkey rows, in reading order."""
    by_paper = [r for r in rows if r["protocol"] == "segments"]
    paper_rows = [r for r in by_paper if r["attention_mode"] == "full"]
    paper_rows += [dict(r, model=f"{r['model']} + BCA") for r in by_paper
                   if r["attention_mode"] == "blockwise" and r["model"] == "xpos" and not r.get("attention_sinks")]
    more = (" (and the converted checkpoint's sliding windows and attention sinks)"
            if any(r["attention_mode"] == "sliding" or r.get("attention_sinks") for r in rows) else "")
    out = [
        (f"Table 2: perplexity by evaluation length (trained at l={length}; the paper's protocol: "
         "non-overlapping segments)", protocol_table(paper_rows, "segments")),
        (f"Table 5: with (blockwise) and without (full) blockwise causal attention{more}",
         protocol_table(rows, "segments")),
        ("The same with the strided protocol (every token scored with as much context as the length allows)",
         protocol_table(rows, "strided")),
        ("Table 3: attention resolution (eq. 3)", resolution_table(resolution_rows)),
    ]
    if passkey:
        out.append(("Passkey retrieval: accuracy (key NLL per token) by distance back from the question; w: the "
                    "attention window (full attention: the training length l)",
                    passkey_accuracy_table(passkey)))
    return out


# ---------------------------------------------------------------- the reading of a study


def _ppl(rows: list[dict], model: str, mode: str, protocol: str, length: int) -> float:
    (value,) = [r["ppl"] for r in rows if (r["model"], attention_label(r), r["protocol"], r["length"])
                == (model, mode, protocol, length)]
    return value


def _change(before: float, after: float) -> str:
    """'rises by 27.4%' / 'falls by 3.1%' / 'stays within 2.0%' for a move from before to after."""
    ratio = after / before - 1
    if abs(ratio) < FLAT:
        return f"stays within {abs(ratio):.1%}"
    return f"{'rises' if ratio > 0 else 'falls'} by {abs(ratio):.1%}"


def reading(rows: list[dict], resolution_rows: list[dict], length: int, passkey: list[dict] | None = None) -> list[str]:
    """Sentences that read the numbers: each row past l, BCA against full attention, windows with sinks against
    full attention (models read with sinks), the best row at the longest length, the two protocols, resolution,
    and passkey retrieval by distance. Each model is read in its own readings (attention mode and sinks). Nothing
    is claimed that the rows do not show."""
    longest = max(r["length"] for r in rows)
    models = list(dict.fromkeys(r["model"] for r in rows))
    labels = {m: list(dict.fromkeys(attention_label(r) for r in rows if r["model"] == m)) for m in models}
    lines = [f"From l = {length} to {longest // length}·l = {longest} tokens (the paper's protocol):"]
    for model in models:
        for mode in labels[model]:
            at_l, far = (_ppl(rows, model, mode, "segments", n) for n in (length, longest))
            lines.append(f"- {model}, {mode} attention: perplexity {_change(at_l, far)} past l ({at_l:.2f} → {far:.2f}).")
    compared = [m for m in models if {"full", "blockwise"} <= set(labels[m])]
    if compared:
        lines.append(f"\nBlockwise causal attention (BCA) against full attention at {longest} tokens:")
        for model in compared:
            full, block = (_ppl(rows, model, mode, "segments", longest) for mode in ("full", "blockwise"))
            lines.append(f"- {model}: {full:.2f} with full attention, {block:.2f} with BCA ({block / full - 1:+.2%}).")
    for model in [m for m in models if "full" in labels[m] and any(r.get("attention_sinks") for r in rows
                                                                    if r["model"] == m)]:
        full_l, full_far = (_ppl(rows, model, "full", "segments", n) for n in (length, longest))
        lines.append(f"\n{model}: windows (w = l) with and without attention sinks against full attention as "
                     f"published, which {_change(full_l, full_far)} past l ({full_l:.2f} → {full_far:.2f}):")
        for mode in [m for m in labels[model] if m != "full"]:
            at_l, far = (_ppl(rows, model, mode, "segments", n) for n in (length, longest))
            flat = "flat" if abs(far / at_l - 1) < FLAT else "not flat"
            lines.append(f"- {mode}: {far:.2f} at {longest} tokens against {full_far:.2f} as published "
                         f"({far / full_far - 1:+.2%}); {flat} past l ({_change(at_l, far)}).")
    for protocol in ("segments", "strided"):
        best = min((r for r in rows if r["protocol"] == protocol and r["length"] == longest), key=lambda r: r["ppl"])
        lines.append(f"\nBest at {longest} tokens ({protocol} protocol): {best['model']} with {attention_label(best)} "
                     f"attention, perplexity {best['ppl']:.2f}.")
    shortest = min(r["length"] for r in rows)
    lines.append("\nThe two protocols (strided against segments, mean over models and attention modes):")
    for n in (shortest, length, longest):
        pairs = [(r["ppl"], _ppl(rows, r["model"], attention_label(r), "strided", n))
                 for r in rows if r["protocol"] == "segments" and r["length"] == n]
        mean = sum(strided / segments - 1 for segments, strided in pairs) / len(pairs)
        lines.append(f"- at {n} tokens the strided protocol is {abs(mean):.1%} {'lower' if mean < 0 else 'higher'}.")
    if resolution_rows:
        best = max(resolution_rows, key=lambda r: r["resolution"])
        lines.append(f"\nHighest attention resolution: {best['model']} ({best['resolution']:.4f}).")
    if passkey:
        lines += passkey_reading(passkey)
    return lines


def passkey_reading(passkey: list[dict]) -> list[str]:
    """Passkey accuracy by distance per reading, and plainly whether any reading retrieves the key from farther
    back than its window w (the attention window; the training length in full attention)."""
    lines = ["\nPasskey retrieval (accuracy by distance from the question; w: the window, or l in full attention):"]
    groups: dict[tuple, list[dict]] = {}
    for r in passkey:
        groups.setdefault((r["model"], attention_label(r), r["window"]), []).append(r)
    for (model, mode, window), probed in groups.items():
        accuracies = ", ".join(f"{r['accuracy']:.2f} at {r['distance']}" for r in probed)
        lines.append(f"- {model}, {mode} attention (w = {window}): {accuracies}.")
    past = [r for r in passkey if r["distance"] > r["window"] and r["accuracy"] > 0]
    if not any(r["accuracy"] > 0 for r in passkey):
        lines.append("No reading retrieves the key at any distance, within its window w or past it.")
    elif past:
        lines.append("Past the window the key is retrieved by: " + "; ".join(
            f"{r['model']}, {attention_label(r)} attention ({r['accuracy']:.2f} at {r['distance']})" for r in past)
            + ".")
    else:
        lines.append("No reading retrieves the key from farther back than its window w (accuracy 0 at every "
                     "distance past w).")
    return lines


# ---------------------------------------------------------------- plots


def _pyplot():
    """matplotlib's pyplot on the Agg backend: files only, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def _plain_log2_axis(ax, ticks: list[int]) -> None:
    """A log2 x axis whose ticks are the evaluated lengths written as plain numbers (not 2^7)."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(ScalarFormatter())


def perplexity_figure(rows: list[dict]):
    """Perplexity against evaluation length, one panel per protocol; linear y with plain numbers."""
    from matplotlib.ticker import ScalarFormatter

    plt = _pyplot()
    protocols = list(dict.fromkeys(r["protocol"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(protocols), figsize=(6 * len(protocols), 4), squeeze=False)
    for ax, protocol in zip(axes[0], protocols):
        selected = [r for r in rows if r["protocol"] == protocol]
        for key in dict.fromkeys((r["model"], attention_label(r)) for r in selected):
            points = sorted((r["length"], r["ppl"]) for r in selected if (r["model"], attention_label(r)) == key)
            ax.plot(*zip(*points), marker="o", linestyle="-" if key[1] == "full" else "--",
                    label=f"{key[0]} / {key[1]}")
        for training_length in {r["training_length"] for r in selected}:
            ax.axvline(training_length, color="grey", linestyle=":", linewidth=1)
        _plain_log2_axis(ax, lengths)
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("evaluation length (tokens; dotted: training length l)")
        ax.set_ylabel("perplexity")
        ax.set_title(f"protocol: {protocol}")
        ax.legend(fontsize=7)
    return fig


def plot_perplexity(rows: list[dict], path: Path) -> None:
    _save(perplexity_figure(rows), path)


def plot_losses(histories: dict[str, list[dict]], path: Path) -> None:
    """Training loss (lines) and validation loss (dots) against step, from Trainer log histories by name."""
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for name, history in histories.items():
        train = [(e["step"], e["loss"]) for e in history if "loss" in e]
        evaluation = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e]
        if train:
            ax.plot(*zip(*train), label=name)
        if evaluation:
            ax.plot(*zip(*evaluation), "o-", label=f"{name} (validation)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    _save(fig, path)


def plot_resolution(curves: dict, analytic: dict, path: Path) -> None:
    """Left: each model's mean pre-softmax score by distance; right: eq. 8's analytic curves."""
    fig, (left, right) = _pyplot().subplots(1, 2, figsize=(11, 4))
    for name, curve in curves.items():
        left.plot(curve, label=name)
    left.set_xlabel("relative distance n")
    left.set_ylabel("mean pre-softmax score ŝ[n]")
    left.legend(fontsize=7)
    for name, curve in analytic.items():
        right.plot(curve, label=name)
    right.set_xlabel("relative distance n")
    right.set_ylabel("g[n] (eq. 8, normalised)")
    right.legend()
    _save(fig, path)


# ---------------------------------------------------------------- files


def write_results(rows: list[dict], output_dir: Path) -> None:
    """results.json, results.csv and ppl_vs_length.png of perplexity rows."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(rows, indent=2))
    with (output_dir / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows(rows)
    plot_perplexity(rows, output_dir / "ppl_vs_length.png")


# ---------------------------------------------------------------- report.md


def markdown(study: dict) -> str:
    """report.md: settings, the tables, the plots embedded, and the reading, all from study.json's content."""
    settings, length = study["settings"], study["settings"]["length"]
    machine = study["machine"]
    lines = [
        "# LEX length-extrapolation study (`lex demo`)",
        "",
        f"Models ({', '.join(study['variants'])}) trained at l = {length} tokens for {study['steps']} steps each "
        f"({study['steps_from']}), seed {study['seed']}, corpus {study['corpus']}; evaluated at "
        f"{', '.join(str(n) for n in study['lengths'])} tokens on {study['eval_documents']} held-out documents.",
        "",
        "## Settings",
        "",
        markdown_table(["setting", "value"], [*settings.items(), ("seed", study["seed"])]),
        "",
        f"Ran in {study['seconds'] / 60:.1f} minutes on {machine['cpus']} CPUs ({machine['torch_threads']} torch "
        f"thread(s), device {machine['device']}, load average {machine['load_average']:.2f} at the start), "
        f"torch {machine['torch']}, transformers {machine['transformers']}.",
        "",
        "## Reading",
        "",
        *reading(study["rows"], study["resolution"], length, study.get("passkey")),
        "",
    ]
    for title, body in tables(study["rows"], study["resolution"], length, study.get("passkey")):
        lines += [f"## {title}", "", body, ""]
    lines += [
        "## Plots",
        "",
        "![perplexity by evaluation length](ppl_vs_length.png)",
        "",
        "![training loss](loss.png)",
        "",
        "![attention resolution](resolution.png)",
        "",
    ]
    return "\n".join(lines)
