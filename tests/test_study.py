"""`lex demo`: reproducible steps and perplexities across thread counts, progress bars, report.md's numbers
against perplexities computed here from the saved models, the llama variant (transformers' LlamaForCausalLM read
as published and converted with windows and sinks) against transformers under explicit masks, SIGTERM and
kill -9 during a run.

Two `lex demo --quick --variants xpos,rope,alibi,llama` runs (one torch thread, two threads) run side by side
once for the whole module.
"""

import json
import functools
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from tests import reference

from lex.cli import main as lex
from lex.data import load_documents
from lex.report import perplexity_figure
from lex.study import SETTINGS
from lex_base.staging import host_tag

VARIANTS = ("xpos", "rope", "alibi", "llama")  # the fixture's study: the paper's three and the llama
LEX_READINGS = {("full", 0), ("blockwise", 0)}
LLAMA_READINGS = {("full", 0), ("sliding", 0), ("sliding", 4), ("blockwise", 0), ("blockwise", 4)}

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory) -> dict[int, tuple[Path, str, str]]:
    """{threads: (output folder, stdout, stderr)} of `lex demo --quick --variants xpos,rope,alibi,llama` with
    OMP_NUM_THREADS=1 and 2, run concurrently.

    Beside each output lies, before the run, the staging folder a killed earlier run left (its process is gone).
    """
    base = tmp_path_factory.mktemp("demo")
    for threads in (1, 2):
        stale = base / f".threads{threads}.partial-{host_tag()}-{dead_pid()}-0123abcd"
        stale.mkdir()
        (stale / "half.bin").write_bytes(b"half")
    processes = {}
    for threads in (1, 2):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "lex.cli", "demo", "--quick", "--variants", ",".join(VARIANTS),
                   "--output_dir", str(base / f"threads{threads}")]
        processes[threads] = subprocess.Popen(command, env=env, cwd=base, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True)
    runs = {}
    for threads, process in processes.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
        runs[threads] = (base / f"threads{threads}", out, err)
    return runs


def study(folder: Path) -> dict:
    return json.loads((folder / "study.json").read_text())


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_same_steps_and_perplexities_on_one_and_two_threads(quick_runs):
    one, two = (study(quick_runs[n][0]) for n in (1, 2))
    assert (one["machine"]["torch_threads"], two["machine"]["torch_threads"]) == (1, 2)  # the runs really differ
    assert one["steps"] == two["steps"] == SETTINGS["quick"]["steps"]
    assert one["steps_from"].startswith("fixed") and one["settings"] == two["settings"]
    # (LEX models x 2 readings + the llama's 5) x protocols x lengths
    assert len(one["rows"]) == len(two["rows"]) == (3 * 2 + 5) * 2 * 7
    for a, b in zip(one["rows"], two["rows"]):
        assert {k: v for k, v in a.items() if k != "ppl"} == {k: v for k, v in b.items() if k != "ppl"}
        assert abs(a["ppl"] / b["ppl"] - 1) < 0.02, (a, b)
    # the models learned something, so the comparison is not between two uniform guessers
    assert max(r["ppl"] for r in one["rows"]) < 0.8 * SETTINGS["quick"]["vocab"]


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_progress_bars_show_steps_loss_and_evaluation(quick_runs):
    _, out, err = quick_runs[2]
    steps = SETTINGS["quick"]["steps"]
    lines = re.split(r"[\r\n]", err)
    for variant in VARIANTS:
        lengths = (5 if variant == "llama" else 2) * 2 * 7  # readings x protocols x lengths
        training = [line for line in lines if line.startswith(f"train {variant}:")]
        assert any(f"| {steps}/{steps} [" in line and re.search(r"loss=\d+\.\d{3}", line) for line in training)
        assert any(re.search(r"\| \d+/\d+ \[\d\d:\d\d<\d\d:\d\d", line) for line in training)  # elapsed < ETA
        evaluating = [line for line in lines if line.startswith(f"evaluate {variant}:")]
        assert any(f"| {lengths}/{lengths} [" in line for line in evaluating)
    folder = quick_runs[2][0]
    assert any(f"{folder / 'report.md'}" in line for line in out.splitlines()[-5:])  # the last lines say where


def markdown_tables(text: str) -> dict[str, list[list[str]]]:
    """{section title: rows of cells} of every '## title' followed by a Markdown table."""
    tables = {}
    for section in text.split("\n## ")[1:]:
        title, _, body = section.partition("\n")
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in body.splitlines() if line.startswith("|")]
        if rows:
            tables[title] = rows
    return tables


def spans(budget: int, length: int, protocol: str) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over a document's first `budget` tokens: the paper's
    non-overlapping segments, or HF's fixed-length recipe (windows every length/2, each token scored once)."""
    if protocol == "segments":
        return [(b, b + length, b + 1) for b in range(0, budget - length + 1, length)]
    out, previous_end = [], 0
    for begin in range(0, budget, length // 2):
        end = min(begin + length, budget)
        out.append((begin, end, max(previous_end, begin + 1)))
        previous_end = end
        if end == budget:
            break
    return out


def label(mode: str, sinks: int) -> str:
    """A reading as report.md's tables name it: "sliding + 4 sinks", or the mode alone without sinks."""
    return f"{mode} + {sinks} sinks" if sinks else mode


@functools.cache
def window_mask(mode: str, n: int, window: int, sinks: int) -> torch.Tensor | None:
    """DESIGN §3's window with sinks as an additive (1, 1, n, n) mask from tests/reference.py's rule (None: the
    model's own causal mask, full attention as published)."""
    if mode == "full":
        return None
    allowed = reference.visible(mode, window, n, pad=0, sinks=sinks)
    return torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


@torch.no_grad()
def window_perplexity(model, ids: list[torch.Tensor], budget: int, length: int, protocol: str,
                      mask_of=lambda n: None) -> float:
    """Perplexity of `length`'s windows over each document's first `budget` tokens, one plain forward per window
    (no cache, no streaming, none of lex.perplexity), each window read from a cold start under `mask_of(n)`."""
    nll, count, by_shape = 0.0, 0, {}
    for document in ids:  # windows of one shape go through the model as one batch
        for begin, end, first in spans(budget, length, protocol):
            by_shape.setdefault((end - begin, first - begin), []).append(document[begin:end])
    for (n, scored_from), rows in by_shape.items():
        batch, mask = torch.stack(rows), mask_of(n)
        mask = None if mask is None else mask.expand(len(rows), 1, n, n)
        log_probs = model(batch, attention_mask=mask).logits.double().log_softmax(-1)[:, scored_from - 1 : -1]
        picked = log_probs.gather(2, batch[:, scored_from:, None])
        nll, count = nll - picked.sum().item(), count + picked.numel()
    return math.exp(nll / count)


@torch.no_grad()
def independent_perplexities(folder: Path, study: dict) -> dict[tuple, float]:
    """{(model, reading, protocol, length): ppl} computed here from the saved models, one plain forward per window
    (no cache, no streaming, none of lex.perplexity), on the held-out documents the study read. A LEX model runs
    in each mode through its own class; the llama is transformers' own LlamaForCausalLM, as published (full),
    under an explicit 4D mask per window for each window (w = l) without sinks, and with 4 sinks under
    tests/reference.py's window attention that places them within the cache."""
    documents = load_documents(validation_fraction=0.1, seed=study["seed"])["validation"]["text"]
    budget, values, window = max(study["lengths"]), {}, study["settings"]["length"]
    for model_name in study["variants"]:
        tokenizer = AutoTokenizer.from_pretrained(folder / model_name)
        ids = [tokenizer(t, add_special_tokens=False).input_ids for t in documents]
        ids = [torch.tensor(d[:budget]) for d in ids if len(d) >= budget][: study["eval_documents"]]
        assert len(ids) == study["eval_documents"]
        if model_name == "llama":
            model = LlamaForCausalLM.from_pretrained(folder / model_name, attn_implementation="eager").eval()
            runs = [(mode, sinks, model) for mode, sinks in sorted(LLAMA_READINGS)]
        else:
            runs = [(mode, 0, AutoModelForCausalLM.from_pretrained(folder / model_name, attention_mode=mode).eval())
                    for mode, _ in sorted(LEX_READINGS)]
        for mode, sinks, model in runs:
            mask_of = (lambda n, mode=mode: window_mask(mode, n, window, 0)) \
                if model_name == "llama" and not sinks else (lambda n: None)
            if model_name == "llama":  # sinks placed within the cache, as the converted readings see them
                model.set_attn_implementation("eager")
                if sinks:
                    reference.use_window_attention(model, mode, window, sinks)
            for protocol in ("segments", "strided"):
                for length in study["lengths"]:
                    values[(model_name, label(mode, sinks), protocol, length)] = window_perplexity(
                        model, ids, budget, length, protocol, mask_of)
    return values


@pytest.fixture(scope="module")
def truth(quick_runs) -> dict[tuple, float]:
    """independent_perplexities of the two-thread study (computed once for the module)."""
    folder = quick_runs[2][0]
    return independent_perplexities(folder, study(folder))


def number(text: str) -> float:
    return float(text.replace(",", ""))


def shown(value: str, expected: float, decimals: int = 2) -> bool:
    """Whether `value`, a number as printed with `decimals`, is `expected` to its rounding."""
    return abs(number(value) - expected) <= 0.5 * 10 ** -decimals + 1e-4 * abs(expected)


def check_reading(reading: str, truth: dict[tuple, float], lengths: list[int], length: int, variants: list[str],
                  resolution: list[dict], passkey: list[dict] | None = None) -> None:
    """Every number and direction word of report.md's reading against `truth`, {(model, reading, protocol,
    length): ppl} computed by the caller, and `passkey` rows; nothing of lex.report is imported or its wording
    re-typed beyond the sentence shapes parsed here. Each model is read in the readings `truth` has for it."""
    longest = max(lengths)
    readings = {m: {key[1] for key in truth if key[0] == m} for m in variants}
    past_l = re.findall(r"- (\w+), ([\w +]+?) attention: perplexity (rises by|falls by|stays within) ([\d.]+)% "
                        r"past l \(([\d.]+) → ([\d.]+)\)\.", reading)
    assert sorted((model, mode) for model, mode, *_ in past_l) == sorted((m, r) for m in variants for r in readings[m])
    moves = {}
    for model, mode, word, percent, at_l, far in past_l:
        expected_l, expected_far = (truth[(model, mode, "segments", n)] for n in (length, longest))
        change = expected_far / expected_l - 1
        assert shown(at_l, expected_l) and shown(far, expected_far) and shown(percent, 100 * abs(change), 1)
        assert word == "stays within" or (word == "rises by") == (change > 0), (model, mode, word, change)
        moves.setdefault(word == "stays within", []).append(abs(change))
    # "stays" is said of smaller moves than any "rises"/"falls": one threshold separates them, whatever it is
    threshold = (max(moves.get(True, [0])), min(moves.get(False, [math.inf])))
    assert threshold[0] < threshold[1]

    bca = re.findall(r"- (\w+): ([\d.]+) with full attention, ([\d.]+) with BCA \(([+-][\d.]+)%\)\.", reading)
    assert [model for model, *_ in bca] == [m for m in variants if {"full", "blockwise"} <= readings[m]]
    for model, full, block, percent in bca:
        expected_full, expected_block = (truth[(model, mode, "segments", longest)] for mode in ("full", "blockwise"))
        assert shown(full, expected_full) and shown(block, expected_block)
        assert shown(percent, 100 * (expected_block / expected_full - 1))

    # a model read with sinks: each window against full attention as published, and whether it stays flat past l
    with_sinks = [m for m in variants if any("sinks" in r for r in readings[m])]
    heads = re.findall(r"\n(\w+): windows \(w = l\) with and without attention sinks against full attention as "
                       r"published, which (rises by|falls by|stays within) ([\d.]+)% past l \(([\d.]+) → ([\d.]+)\):"
                       r"((?:\n- .*)+)", reading)
    assert [model for model, *_ in heads] == with_sinks
    for model, word, percent, at_l, far, body in heads:
        full_l, full_far = (truth[(model, "full", "segments", n)] for n in (length, longest))
        assert shown(at_l, full_l) and shown(far, full_far) and shown(percent, 100 * abs(full_far / full_l - 1), 1)
        windows = re.findall(r"- ([\w +]+): ([\d.]+) at (\d+) tokens against ([\d.]+) as published "
                             r"\(([+-][\d.]+)%\); (flat|not flat) past l \((rises by|falls by|stays within) "
                             r"([\d.]+)%\)\.", body)
        assert sorted(w[0] for w in windows) == sorted(readings[model] - {"full"})
        for mode, value, n, published, percent, flat, word, move in windows:
            expected, expected_l = truth[(model, mode, "segments", longest)], truth[(model, mode, "segments", length)]
            assert int(n) == longest and shown(value, expected) and shown(published, full_far)
            assert shown(percent, 100 * (expected / full_far - 1))
            change = expected / expected_l - 1
            assert shown(move, 100 * abs(change), 1) and (flat == "flat") == (word == "stays within")
            assert word == "stays within" or (word == "rises by") == (change > 0)

    best = re.findall(r"Best at (\d+) tokens \((\w+) protocol\): (\w+) with ([\w +]+?) attention, perplexity "
                      r"([\d.]+)\.", reading)
    assert [(int(n), protocol) for n, protocol, *_ in best] == [(longest, "segments"), (longest, "strided")]
    for _, protocol, model, mode, value in best:
        candidates = {key: v for key, v in truth.items() if key[2:] == (protocol, longest)}
        assert min(candidates, key=candidates.get)[:2] == (model, mode) and shown(value, min(candidates.values()))

    protocols = re.findall(r"- at (\d+) tokens the strided protocol is ([\d.]+)% (lower|higher)\.", reading)
    assert [int(n) for n, *_ in protocols] == [min(lengths), length, longest]
    for n, percent, word in protocols:
        pairs = [(truth[(m, mode, "segments", int(n))], truth[(m, mode, "strided", int(n))])
                 for m in variants for mode in readings[m]]
        mean = sum(strided / segments - 1 for segments, strided in pairs) / len(pairs)
        assert shown(percent, 100 * abs(mean), 1) and word == ("lower" if mean < 0 else "higher")

    (highest,) = re.findall(r"Highest attention resolution: (\w+) \(([\d.]+)\)\.", reading)
    top = max(resolution, key=lambda r: r["resolution"])
    assert highest[0] == top["model"] and shown(highest[1], top["resolution"], 4)

    if passkey:
        probed = re.findall(r"- (\w+), ([\w +]+?) attention \(w = (\d+)\): ((?:[\d.]+ at \d+(?:, )?)+)\.", reading)
        expected = {}
        for r in passkey:
            expected.setdefault((r["model"], label(r["attention_mode"], r["attention_sinks"]), r["window"]), []).append(
                (r["distance"], r["accuracy"]))
        assert sorted((m, mode, int(w)) for m, mode, w, _ in probed) == sorted(expected)
        for model, mode, window, cells in probed:
            said = [(int(d), float(a)) for a, d in re.findall(r"([\d.]+) at (\d+)", cells)]
            truth_cells = expected[(model, mode, int(window))]
            assert [d for d, _ in said] == [d for d, _ in truth_cells]
            assert all(shown(f"{a}", acc) for (_, a), (_, acc) in zip(said, truth_cells))
        past = [r for r in passkey if r["distance"] > r["window"] and r["accuracy"] > 0]
        if not any(r["accuracy"] > 0 for r in passkey):
            assert "No reading retrieves the key at any distance" in reading
        elif past:
            (named,) = re.findall(r"Past the window the key is retrieved by: (.*)\.", reading)
            said = re.findall(r"(\w+), ([\w +]+?) attention \(([\d.]+) at (\d+)\)", named)
            assert sorted((m, mode, int(d)) for m, mode, _, d in said) == sorted(
                (r["model"], label(r["attention_mode"], r["attention_sinks"]), r["distance"]) for r in past)
        else:
            assert "No reading retrieves the key from farther back than its window" in reading
        assert not ("No reading retrieves" in reading and past)


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_report_numbers_equal_perplexities_computed_independently(quick_runs, truth):
    """Every perplexity of study.json, every cell of report.md's tables and every number of its reading, against
    perplexities computed here from the saved models (the llama's with transformers' LlamaForCausalLM, under
    explicit masks for its windows); the reading's words against the signs of those numbers; the passkey table
    and reading against passkey.json."""
    folder = quick_runs[2][0]
    data, text = study(folder), (folder / "report.md").read_text()
    assert len(truth) == len(data["rows"])
    for row in data["rows"]:
        assert row["ppl"] == pytest.approx(truth[(row["model"], label(row["attention_mode"], row["attention_sinks"]),
                                                  row["protocol"], row["length"])], rel=1e-4), row

    tables = markdown_tables(text)
    checked = 0
    for title, protocol in (("Table 2", "segments"), ("Table 5", "segments"), ("The same with the strided", "strided")):
        (rows,) = [rows for name, rows in tables.items() if name.startswith(title)]
        header, body = rows[0], rows[2:]
        assert header[2:] == [str(n) for n in data["lengths"]]
        for model, mode, *values in body:
            for length, value in zip(data["lengths"], values):
                assert shown(value, truth[(model.removesuffix(" + BCA"), mode, protocol, length)]), (title, model)
                checked += 1
    assert checked == (5 + 11 + 11) * 7  # Table 2: 4 models + xpos BCA; 5 and 6: 3 x 2 LEX readings + 5 llama
    (resolution,) = [rows for name, rows in tables.items() if name.startswith("Table 3")]
    assert [(r[0], r[2]) for r in resolution[2:]] == [(r["model"], f"{r['resolution']:.4f}") for r in data["resolution"]]
    settings = dict(tables["Settings"][2:])
    assert settings == {**{k: str(v) for k, v in data["settings"].items()}, "seed": str(data["seed"])}

    passkey = json.loads((folder / "passkey.json").read_text())
    assert data["passkey"] == passkey
    (probe,) = [rows for name, rows in tables.items() if name.startswith("Passkey retrieval")]
    assert probe[0] == ["model", "attention", "w", "w/4 back", "w/2 back", "w back", "2w back", "4w back"]
    assert len(probe[2:]) == 3 * 2 + 5
    for model, mode, window, *values in probe[2:]:
        w = int(window)
        for distance, value in zip((w // 4, w // 2, w, 2 * w, 4 * w), values):
            (row,) = [r for r in passkey if (r["model"], label(r["attention_mode"], r["attention_sinks"]),
                                              r["window"], r["distance"]) == (model, mode, w, distance)]
            accuracy, nll = re.fullmatch(r"([\d.]+) \(([\d.]+)\)", value).groups()
            assert shown(accuracy, row["accuracy"]) and shown(nll, row["key_nll_per_token"])

    reading = text.split("## Reading")[1].split("\n## ")[0]
    check_reading(reading, truth, data["lengths"], data["settings"]["length"], data["variants"], data["resolution"],
                  passkey)
    for image in ("ppl_vs_length.png", "loss.png", "resolution.png"):
        assert f"]({image})" in text and (folder / image).stat().st_size > 0


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_llama_read_as_published_and_in_windows_with_sinks(quick_runs, truth):
    """The llama variant is transformers' LlamaForCausalLM; its rows are exactly five readings at every length and
    protocol (the LEX variants' two); "full" is the saved folder as published, and "sliding + 4 sinks" at the
    longest length is LlamaForCausalLM under the window's explicit mask (w = l, one window per segment or strided
    window, each read cold), a mask whose perplexity differs from the unmasked and sink-less ones; passkey.json
    holds the five readings at w/4 .. 4w; report.md reads the llama's windows against it as published."""
    folder = quick_runs[2][0]
    data, text = study(folder), (folder / "report.md").read_text()
    length, longest = data["settings"]["length"], max(data["lengths"])
    config = json.loads((folder / "llama" / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["max_position_embeddings"]) == (
        "llama", ["LlamaForCausalLM"], length)
    for model in VARIANTS:
        expected = LLAMA_READINGS if model == "llama" else LEX_READINGS
        for protocol in ("segments", "strided"):
            for n in data["lengths"]:
                got = [(r["attention_mode"], r["attention_sinks"]) for r in data["rows"]
                       if (r["model"], r["protocol"], r["length"]) == (model, protocol, n)]
                assert sorted(got) == sorted(expected), (model, protocol, n)
    llama = {(label(r["attention_mode"], r["attention_sinks"]), r["protocol"], r["length"]): r["ppl"]
             for r in data["rows"] if r["model"] == "llama"}
    for protocol in ("segments", "strided"):
        for n in data["lengths"]:  # as published: transformers' own class, no mask
            assert llama[("full", protocol, n)] == pytest.approx(truth[("llama", "full", protocol, n)], rel=1e-4)
        sinks = truth[("llama", "sliding + 4 sinks", protocol, longest)]
        assert llama[("sliding + 4 sinks", protocol, longest)] == pytest.approx(sinks, rel=1e-4)
        for other in ("full", "sliding"):  # the mask matters: the check tells the readings apart
            assert abs(truth[("llama", other, protocol, longest)] / sinks - 1) > 1e-4, other

    passkey = json.loads((folder / "passkey.json").read_text())
    probed = {(r["attention_mode"], r["attention_sinks"]): [] for r in passkey if r["model"] == "llama"}
    for r in passkey:
        if r["model"] == "llama":
            probed[(r["attention_mode"], r["attention_sinks"])].append((r["window"], r["distance"]))
    assert set(probed) == LLAMA_READINGS
    w = length  # the window of the converted readings; the training length as published
    assert all(cells == [(w, d) for d in (w // 4, w // 2, w, 2 * w, 4 * w)] for cells in probed.values()), probed
    assert {(r["attention_mode"], r["attention_sinks"]) for r in passkey if r["model"] == "xpos"} == LEX_READINGS

    reading = text.split("## Reading")[1].split("\n## ")[0]
    for mode in ("sliding", "sliding + 4 sinks", "blockwise", "blockwise + 4 sinks"):
        (line,) = [x for x in reading.splitlines() if x.startswith(f"- {mode}: ")]
        value, published = re.match(r"- [\w +]+: ([\d.]+) at \d+ tokens against ([\d.]+) as published", line).groups()
        assert shown(value, llama[(mode, "segments", longest)])
        assert shown(published, llama[("full", "segments", longest)])
        (line,) = [x for x in reading.splitlines() if x.startswith(f"- llama, {mode} attention (w = {w}): ")]


def test_reading_of_rows_whose_numbers_are_known():
    """The reading of made-up rows with large moves (rises, falls, stays), checked against those numbers: the
    quick study's models move too little past l to exercise every word."""
    from lex.report import reading

    lengths, variants = [16, 64, 1024], ["xpos", "rope"]
    at = {("xpos", "full"): (60.0, 50.0, 45.0), ("xpos", "blockwise"): (60.0, 50.0, 49.0),
          ("rope", "full"): (61.0, 51.0, 80.0), ("rope", "blockwise"): (61.0, 51.0, 40.0)}
    truth = {}
    for (model, mode), values in at.items():
        for n, value in zip(lengths, values):
            truth[(model, mode, "segments", n)] = value
            truth[(model, mode, "strided", n)] = value * (0.9 if n == 16 else 1.02)
    rows = [{"model": m, "attention_mode": mode, "protocol": p, "length": n, "ppl": v}
            for (m, mode, p, n), v in truth.items()]
    resolution = [{"model": "xpos", "resolution": 0.25}, {"model": "rope", "resolution": 0.125}]
    text = "\n".join(reading(rows, resolution, 64))
    check_reading(text, truth, lengths, 64, variants, resolution)
    assert {"rises by", "falls by", "stays within"} <= set(re.findall(r"(rises by|falls by|stays within)", text))


def test_reading_of_a_llama_whose_windows_with_sinks_stay_flat():
    """Made-up rows where the llama's readings differ from the LEX model's (five against two): as published and
    windows without sinks rise past l, windows with sinks stay flat; passkey rows with a hit past the window and
    without one. The reading reads each model in its own readings, and says which reading retrieves past w."""
    from lex.report import reading

    lengths, variants = [16, 64, 1024], ["xpos", "llama"]
    at = {("xpos", "full"): (60.0, 50.0, 45.0), ("xpos", "blockwise"): (60.0, 50.0, 49.0),
          ("llama", "full"): (61.0, 51.0, 400.0), ("llama", "sliding"): (61.0, 51.0, 90.0),
          ("llama", "sliding + 4 sinks"): (61.0, 51.0, 51.5), ("llama", "blockwise"): (61.0, 51.0, 95.0),
          ("llama", "blockwise + 4 sinks"): (61.0, 51.0, 50.0)}
    truth = {}
    for (model, mode), values in at.items():
        for n, value in zip(lengths, values):
            truth[(model, mode, "segments", n)] = value
            truth[(model, mode, "strided", n)] = value * (0.9 if n == 16 else 1.02)
    rows = [{"model": m, "attention_mode": mode.split(" + ")[0], "attention_sinks": 4 if "sinks" in mode else 0,
             "protocol": p, "length": n, "ppl": v} for (m, mode, p, n), v in truth.items()]
    resolution = [{"model": "xpos", "resolution": 0.25}, {"model": "llama", "resolution": 0.125}]
    passkey = [{"model": "llama", "attention_mode": mode, "attention_sinks": sinks, "window": 64, "distance": d,
                "accuracy": 0.4 if (d == 16 or (mode == "full" and d == 128)) else 0.0, "key_nll_per_token": 2.5}
               for mode, sinks in (("full", 0), ("sliding", 4)) for d in (16, 32, 64, 128, 256)]
    text = "\n".join(reading(rows, resolution, 64, passkey))
    check_reading(text, truth, lengths, 64, variants, resolution, passkey)
    assert re.search(r"- sliding \+ 4 sinks: 51\.50 .*; flat past l", text)
    assert re.search(r"- sliding: 90\.00 .*; not flat past l", text)
    assert "Past the window the key is retrieved by: llama, full attention (0.40 at 128)." in text
    within = [dict(r, accuracy=0.4 if r["distance"] == 16 else 0.0) for r in passkey]
    text = "\n".join(reading(rows, resolution, 64, within))
    check_reading(text, truth, lengths, 64, variants, resolution, within)
    assert "No reading retrieves the key from farther back than its window" in text


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_trained_models_keep_use_cache(quick_runs):
    for variant in VARIANTS:
        assert json.loads((quick_runs[1][0] / variant / "config.json").read_text())["use_cache"] is True


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_trained_models_carry_model_cards(quick_runs):
    """Each model folder's card parses with huggingface_hub, says it was trained from scratch (no base_model, never
    a blank one) and reports that model's final train loss and its perplexities."""
    from huggingface_hub import ModelCard

    folder = quick_runs[1][0]
    rows = study(folder)["rows"]
    for variant in VARIANTS:
        text = (folder / variant / "README.md").read_text()
        card = ModelCard(text)
        assert "[More Information Needed]" not in text and card.data.base_model is None
        assert (card.data.library_name, card.data.pipeline_tag) == ("transformers", "text-generation")
        assert "trained from scratch by `lex demo`" in text and "| final train loss |" in text
        assert f"{next(r for r in rows if r['model'] == variant)['ppl']:.2f}" in text


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_plot_axes_are_plain_numbers(quick_runs):
    data = study(quick_runs[2][0])
    figure = perplexity_figure(data["rows"])
    figure.canvas.draw()
    for ax in figure.axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == [str(n) for n in data["lengths"]]
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels and all(re.fullmatch(r"[\d.,−-]+", label) for label in labels), labels


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_output_folder_appears_only_when_complete(quick_runs):
    """No work folder is left beside the outputs, and the stale one a killed earlier run left is gone."""
    assert not [p for p in quick_runs[1][0].parent.iterdir() if p.name.startswith(".")]


def test_refusals_leave_no_folder(tmp_path, lex_run):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("not a study")
    status, _, err = lex_run("demo", "--quick", "--output_dir", foreign)
    assert status == 2 and "--output_dir" in err and os.listdir(foreign) == ["mine.txt"]
    assert os.listdir(tmp_path) == ["notes"]
    corpus = tmp_path / "corpus"  # short documents: the study stops before training, after its work folder began
    corpus.mkdir()
    for i in range(20):
        (corpus / f"{i}.txt").write_text(f"and the lord spake unto moses saying {i} " * 40)
    status, _, err = lex_run("demo", "--quick", "--corpus", corpus, "--output_dir", tmp_path / "out")
    assert status == 2 and "no held-out document holds 1024 tokens" in err
    assert sorted(os.listdir(tmp_path)) == ["corpus", "notes"]  # neither out/ nor a work folder
    status, _, err = lex_run("demo", "--minutes", "0")
    assert status == 2 and "argument --minutes: 0 must be a positive number" in err


def start_demo(tmp_path: Path) -> subprocess.Popen:
    """`lex demo --quick` in a subprocess, once its hidden work folder exists (training under way)."""
    process = subprocess.Popen([sys.executable, "-m", "lex.cli", "demo", "--quick", "--output_dir",
                                str(tmp_path / "out")], env=ENV, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(".out.partial-*/xpos")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    return process


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_sigterm_leaves_no_partial_folder_and_a_rerun_cleans_after_kill_9(tmp_path):
    """SIGTERM (a scheduler's preemption, `timeout`) during `lex demo` unwinds like Ctrl-C: exit status 143, no
    work folder, no output. kill -9 leaves the work folder; the next `lex demo` into the same folder removes it."""
    process = start_demo(tmp_path)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("lex")] == ["lex demo: terminated (SIGTERM)"]
    assert "Traceback" not in err and os.listdir(tmp_path) == []

    process = start_demo(tmp_path)
    process.kill()
    process.communicate(timeout=120)
    assert process.returncode == -signal.SIGKILL and len(list(tmp_path.glob(".out.partial-*"))) == 1
    corpus = tmp_path / "corpus"  # a quick rerun: it fails on short documents after making its own work folder
    corpus.mkdir()
    for i in range(20):
        (corpus / f"{i}.txt").write_text(f"and the lord spake unto moses saying {i} " * 40)
    rerun = subprocess.run([sys.executable, "-m", "lex.cli", "demo", "--quick", "--corpus", str(corpus),
                            "--output_dir", str(tmp_path / "out")], env=ENV, cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert rerun.returncode == 2 and "no held-out document holds 1024 tokens" in rerun.stderr
    assert sorted(os.listdir(tmp_path)) == ["corpus"]


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_demo_does_not_import_the_metrics_extra():
    """`evaluate` is the extra `metrics` (setup.cfg): `pip install -e .` lacks it, so the demo must not import it."""
    code = ("import sys, lex.study, lex.report, lex.resolution, lex.training, lex.commands.demo; "
            "print(sorted(m for m in ('evaluate', 'aiohttp', 'requests') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
