"""The study's tables, plots and a reading of its numbers, as `report.md` a person reads on GitHub or the Hub.

Everything here is computed from the study's rows ({model, attention_mode, protocol, length, ppl, ...}) and
resolution rows, so the terminal, study.json and report.md cannot disagree. The study's plots live here (not
in eval_length / resolution / train) so that a later refactor can fold the package's matplotlib code together.
"""

from pathlib import Path

from .eval_length import table

# A perplexity that moves by less than this fraction between l and 16*l "stays" (the rest "rises" or "falls").
FLAT = 0.05


def tables(rows: list[dict], resolution: str, length: int) -> list[tuple[str, str]]:
    """(title, Markdown table) of the paper's Tables 2, 5 (both protocols) and 3, in reading order."""
    by_paper = [r for r in rows if r["protocol"] == "segments"]
    paper_rows = [r for r in by_paper if r["attention_mode"] == "full"]
    paper_rows += [dict(r, model=f"{r['model']} + BCA") for r in by_paper
                   if r["attention_mode"] == "blockwise" and r["model"] == "xpos"]
    return [
        (f"Table 2: perplexity by evaluation length (trained at l={length}; the paper's protocol: "
         "non-overlapping segments)", table(paper_rows)),
        ("Table 5: with (blockwise) and without (full) blockwise causal attention", table(rows, "segments")),
        ("The same with the strided protocol (every token scored with as much context as the length allows)",
         table(rows, "strided")),
        ("Table 3: attention resolution (eq. 3)", resolution),
    ]


def _ppl(rows: list[dict], model: str, mode: str, protocol: str, length: int) -> float:
    (value,) = [r["ppl"] for r in rows if (r["model"], r["attention_mode"], r["protocol"], r["length"])
                == (model, mode, protocol, length)]
    return value


def _change(before: float, after: float) -> str:
    """'rises by 27.4%' / 'falls by 3.1%' / 'stays within 2.0%' for a move from before to after."""
    ratio = after / before - 1
    if abs(ratio) < FLAT:
        return f"stays within {abs(ratio):.1%}"
    return f"{'rises' if ratio > 0 else 'falls'} by {abs(ratio):.1%}"


def reading(rows: list[dict], resolution_rows: list[dict], length: int) -> list[str]:
    """Sentences that read the numbers: each row past l, BCA against full attention, the best row at the longest
    length, the two protocols, and resolution. Nothing is claimed that the rows do not show."""
    longest = max(r["length"] for r in rows)
    models = list(dict.fromkeys(r["model"] for r in rows))
    modes = list(dict.fromkeys(r["attention_mode"] for r in rows))
    lines = [f"From l = {length} to {longest // length}·l = {longest} tokens (the paper's protocol):"]
    for model in models:
        for mode in modes:
            at_l, far = (_ppl(rows, model, mode, "segments", n) for n in (length, longest))
            lines.append(f"- {model}, {mode} attention: perplexity {_change(at_l, far)} past l ({at_l:.2f} → {far:.2f}).")
    if "full" in modes and "blockwise" in modes:
        lines.append(f"\nBlockwise causal attention (BCA) against full attention at {longest} tokens:")
        for model in models:
            full, block = (_ppl(rows, model, mode, "segments", longest) for mode in ("full", "blockwise"))
            lines.append(f"- {model}: {full:.2f} with full attention, {block:.2f} with BCA ({block / full - 1:+.2%}).")
    for protocol in ("segments", "strided"):
        best = min((r for r in rows if r["protocol"] == protocol and r["length"] == longest), key=lambda r: r["ppl"])
        lines.append(f"\nBest at {longest} tokens ({protocol} protocol): {best['model']} with {best['attention_mode']} "
                     f"attention, perplexity {best['ppl']:.2f}.")
    shortest = min(r["length"] for r in rows)
    lines.append("\nThe two protocols (strided against segments, mean over models and attention modes):")
    for n in (shortest, length, longest):
        pairs = [(r["ppl"], _ppl(rows, r["model"], r["attention_mode"], "strided", n))
                 for r in rows if r["protocol"] == "segments" and r["length"] == n]
        mean = sum(strided / segments - 1 for segments, strided in pairs) / len(pairs)
        lines.append(f"- at {n} tokens the strided protocol is {abs(mean):.1%} {'lower' if mean < 0 else 'higher'}.")
    if resolution_rows:
        best = max(resolution_rows, key=lambda r: r["resolution"])
        lines.append(f"\nHighest attention resolution: {best['model']} ({best['resolution']:.4f}).")
    return lines


def _plain_log2_axis(ax, ticks: list[int]) -> None:
    """A log2 x axis whose ticks are the evaluated lengths written as plain numbers (not 2^7)."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(ScalarFormatter())


def perplexity_figure(rows: list[dict]):
    """Perplexity against evaluation length, one panel per protocol; linear y with plain numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocols = list(dict.fromkeys(r["protocol"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(protocols), figsize=(6 * len(protocols), 4), squeeze=False)
    for ax, protocol in zip(axes[0], protocols):
        selected = [r for r in rows if r["protocol"] == protocol]
        for key in dict.fromkeys((r["model"], r["attention_mode"]) for r in selected):
            points = sorted((r["length"], r["ppl"]) for r in selected if (r["model"], r["attention_mode"]) == key)
            ax.plot(*zip(*points), marker="o", linestyle="-" if key[1] == "full" else "--",
                    label=f"{key[0]} / {key[1]}")
        for training_length in {r["training_length"] for r in selected}:
            ax.axvline(training_length, color="grey", linestyle=":", linewidth=1)
        _plain_log2_axis(ax, lengths)
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("evaluation length (tokens; dotted: training length l)")
        ax.set_ylabel("perplexity")
        ax.set_title(f"protocol: {protocol}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_perplexity(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = perplexity_figure(rows)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_losses(histories: dict[str, list[dict]], path: Path) -> None:
    """Training loss against step for every model in one plot (plain axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, history in histories.items():
        ax.plot(*zip(*[(e["step"], e["loss"]) for e in history if "loss" in e]), label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(study: dict, resolution: str) -> str:
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
        "| setting | value |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in settings.items()],
        f"| seed | {study['seed']} |",
        "",
        f"Ran in {study['seconds'] / 60:.1f} minutes on {machine['cpus']} CPUs ({machine['torch_threads']} torch "
        f"thread(s), device {machine['device']}, load average {machine['load_average']:.2f} at the start), "
        f"torch {machine['torch']}, transformers {machine['transformers']}.",
        "",
        "## Reading",
        "",
        *reading(study["rows"], study["resolution"], length),
        "",
    ]
    for title, body in tables(study["rows"], resolution, length):
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
