"""Perplexity by evaluation length, in two protocols, for any causal LM (LEX in every attention mode).

- "segments" (the paper's): the first N tokens of each document cut into non-overlapping segments of the
  target length, each read from a cold start; mean token NLL per length. Longer segments win partly because
  fewer tokens start cold.
- "strided" (HF's "perplexity of fixed-length models"): windows of the target length moved by half a window;
  each token is scored once, with as much context as the length allows. This isolates real use of context.

`lex eval-length MODEL --files GLOB --lengths 256,512 --attention_modes full,blockwise --output_dir DIR`
prints the table and writes results.csv, results.json and ppl_vs_length.png (and, with --resolution, the
attention resolution per layer and resolution.png; with --passkey, the passkey probe).
"""

import argparse
import csv
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from modeling_lex import LexCache, LexForCausalLM

PROTOCOLS = ("segments", "strided")


@dataclass
class Score:
    nll: float  # summed negative log-likelihood (nats)
    tokens: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")


HEAD_TOKENS = 1024  # at most this many positions (summed over the batch) have vocabulary logits at once


def _scored_states(model, ids: torch.Tensor) -> tuple[Iterator[tuple[int, torch.Tensor]], Callable]:
    """(first position, states) pieces covering `ids`, and the head that turns a slice of states into logits.

    A LEX model reads the window 2w tokens at a time through a fresh LexCache (the incremental form of its
    forward), so blockwise and sliding attention hold O(w) keys and activations for any length; full attention
    keeps every key, by nature. 2w rather than w: a forward of more than w new tokens runs each query against
    its <= w keys, one of w or fewer against all w + held keys (measured at w = 1024 on one CPU thread: 0.73
    against 0.83 s per 1,024 tokens). Other causal LMs give their logits in one forward.
    """
    if not isinstance(model, LexForCausalLM):
        return iter([(0, model(ids).logits)]), nn.Identity()

    def stream() -> Iterator[tuple[int, torch.Tensor]]:
        cache, step = LexCache(model.config), 2 * model.config.attention_window
        for start in range(0, ids.shape[1], step):
            chunk = ids[:, start : start + step]
            yield start, model.model(input_ids=chunk, past_key_values=cache, use_cache=True).last_hidden_state

    return stream(), model.lm_head


@torch.no_grad()
def _window_nll(model, ids: torch.Tensor, score_from: int, bar: tqdm) -> tuple[float, int]:
    """NLL of tokens score_from+1 .. end of each row of `ids`, predicted from everything before them.

    Logits exist for at most HEAD_TOKENS positions at a time, never for the whole window (n x vocab floats).
    """
    ids = ids.to(model.device)
    batch, length = ids.shape
    pieces, head = _scored_states(model, ids)
    span = max(1, HEAD_TOKENS // batch)
    nll = 0.0
    for start, states in pieces:
        stop = start + states.shape[1]
        for first in range(max(start, score_from), min(stop, length - 1), span):
            last = min(first + span, stop, length - 1)
            logits = head(states[:, first - start : last - start]).float()
            targets = ids[:, first + 1 : last + 1]
            nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        bar.update(batch * (stop - start))
    return nll, batch * (length - 1 - score_from)


def windows(document: torch.Tensor, length: int, protocol: str) -> list[tuple[int, int, int]]:
    """(start, stop, score_from) of each window over one document: the tokens it reads, and that it scores
    the tokens after window position `score_from` (each token of the document at most once)."""
    if protocol == "segments":
        return [(s, s + length, 0) for s in range(0, len(document) - length + 1, length)]
    stride, out, scored_to = max(1, length // 2), [], 0
    for start in range(0, len(document), stride):
        stop = min(start + length, len(document))
        out.append((start, stop, max(scored_to - start - 1, 0)))
        scored_to = stop
        if stop == len(document):
            break
    return out


def perplexity_by_length(
    model, documents: list[torch.Tensor], lengths: list[int], protocol: str, batch_size: int = 8, progress: bool = False
) -> dict[int, Score]:
    """Score every length on the same tokens: each document's first max(lengths) tokens.

    Memory does not grow with the length in blockwise and sliding modes (see `_scored_states`); `progress`
    shows a bar in tokens read. A strided window as long as the document is one pass over it; windows longer
    than w overlap by half and each is read from a cold start, so the strided protocol reads about twice the
    tokens it scores.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is not one of {list(PROTOCOLS)}")
    budget = max(lengths)
    documents = [d[:budget] for d in documents if len(d) >= budget]
    if not documents:
        raise ValueError(f"no evaluation document holds {budget} tokens (the longest length asked for)")
    plan = []  # (length, score_from, rows of one shape) per forward
    for length in lengths:
        by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
        for document in documents:
            for start, stop, score_from in windows(document, length, protocol):
                by_shape.setdefault((stop - start, score_from), []).append(document[start:stop])
        plan += [(length, score_from, rows[i : i + batch_size])
                 for (_, score_from), rows in by_shape.items() for i in range(0, len(rows), batch_size)]
    results = {length: Score(0.0, 0) for length in lengths}
    total = sum(len(row) for _, _, rows in plan for row in rows)
    with tqdm(total=total, desc=f"{protocol} {','.join(map(str, lengths))}", unit="token", unit_scale=True,
              disable=not progress) as bar:
        for length, score_from, rows in plan:
            nll, count = _window_nll(model, torch.stack(rows), score_from, bar)
            results[length] = Score(results[length].nll + nll, results[length].tokens + count)
    return results


def load_model(path: str, attention_mode: str | None, device: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    overrides = {"attention_mode": attention_mode} if attention_mode else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **overrides)
    return model.to(device).eval()


def tokenized_documents(tokenizer, texts: list[str]) -> list[torch.Tensor]:
    return [torch.tensor(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]


def evaluate_model(
    path: str, texts: list[str], lengths: list[int], modes: list[str], device: str = "cpu", batch_size: int = 8,
    protocols: tuple[str, ...] = PROTOCOLS, progress: bool = True, label: str | None = None,
) -> list[dict]:
    """Rows of {model, attention_mode, protocol, length, ppl, tokens} for one model folder."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    documents = tokenized_documents(tokenizer, texts)
    rows = []
    for mode in modes:
        model = load_model(path, mode, device)
        for protocol in protocols:
            scores = perplexity_by_length(model, documents, lengths, protocol, batch_size, progress)
            rows += [
                {"model": label or Path(path).name, "attention_mode": mode, "protocol": protocol, "length": length,
                 "training_length": model.config.max_position_embeddings, "ppl": s.ppl, "tokens": s.tokens}
                for length, s in scores.items()
            ]
    return rows


def table(rows: list[dict], protocol: str = "segments") -> str:
    """Markdown table: one row per (model, mode), one column per length."""
    selected = [r for r in rows if r["protocol"] == protocol]
    lengths = sorted({r["length"] for r in selected})
    keys = list(dict.fromkeys((r["model"], r["attention_mode"]) for r in selected))
    lines = [f"| model | attention | {' | '.join(str(n) for n in lengths)} |",
             "|---|---|" + "---|" * len(lengths)]
    for model, mode in keys:
        values = {r["length"]: r["ppl"] for r in selected if (r["model"], r["attention_mode"]) == (model, mode)}
        lines.append(f"| {model} | {mode} | " + " | ".join(f"{values[n]:.2f}" for n in lengths) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocols = sorted({r["protocol"] for r in rows})
    fig, axes = plt.subplots(1, len(protocols), figsize=(6 * len(protocols), 4), squeeze=False)
    for ax, protocol in zip(axes[0], protocols):
        selected = [r for r in rows if r["protocol"] == protocol]
        for key in dict.fromkeys((r["model"], r["attention_mode"]) for r in selected):
            points = sorted((r["length"], r["ppl"]) for r in selected if (r["model"], r["attention_mode"]) == key)
            ax.plot(*zip(*points), marker="o", label=f"{key[0]} / {key[1]}")
        training = {r["training_length"] for r in selected}
        for length in training:
            ax.axvline(length, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel("perplexity")
        ax.set_title(f"protocol: {protocol}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(rows: list[dict], output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(rows, indent=2))
    with (output_dir / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, output_dir / "ppl_vs_length.png")


def read_texts(pattern: str | None) -> list[str]:
    """Evaluation documents: files matching the globs (one per file), or the held-out KJV books."""
    from .data import expand_globs, load_documents

    if pattern:
        return [Path(f).read_text(encoding="utf-8") for f in expand_globs(pattern, "--files")]
    return list(load_documents()["validation"]["text"])


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="lex eval-length", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="+", help="model folders (a LEX folder, or any causal LM)")
    parser.add_argument("--files", help="globs of evaluation text files; default: the held-out KJV books")
    parser.add_argument("--lengths", default="256,512,1024,2048", help="comma-separated evaluation lengths")
    parser.add_argument("--attention_modes", default="full,blockwise", help="comma-separated: full,blockwise,sliding")
    parser.add_argument("--protocols", default="segments,strided")
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resolution", action="store_true", help="attention resolution per layer (paper eq. 3)")
    parser.add_argument("--passkey", action="store_true", help="passkey retrieval at several distances")
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.attention_modes = args.attention_modes.split(",")
    args.protocols = tuple(args.protocols.split(","))
    for mode in args.attention_modes:
        if mode not in ("full", "blockwise", "sliding"):
            parser.error(f"--attention_modes: {mode!r} is not one of full, blockwise, sliding")
    for protocol in args.protocols:
        if protocol not in PROTOCOLS:
            parser.error(f"--protocols: {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    texts = read_texts(args.files)
    rows = []
    for path in args.model:
        rows += evaluate_model(path, texts, args.lengths, args.attention_modes, args.device, args.batch_size,
                               args.protocols)
    write_results(rows, args.output_dir)
    for protocol in args.protocols:
        print(f"\nperplexity by evaluation length (protocol: {protocol})\n{table(rows, protocol)}")
    if args.resolution:
        from .resolution import resolution_report

        report = resolution_report(args.model, texts, args.output_dir, args.device)
        print("\nattention resolution (paper eq. 3), mean over layers\n" + report)
    if args.passkey:
        from .passkey import passkey_report

        print("\npasskey retrieval\n" + passkey_report(args.model, args.output_dir, args.device))
    print(f"\nwrote {args.output_dir}/results.csv, results.json, ppl_vs_length.png")
    return 0
