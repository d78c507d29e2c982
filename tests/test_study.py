"""`lex demo`: reproducible steps and perplexities across thread counts, progress bars, report.md's numbers
against perplexities computed here from the saved models, SIGTERM and kill -9 during a run.

Two `lex demo --quick` runs (one torch thread, two threads) run side by side once for the whole module.
"""

import json
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
from transformers import AutoModelForCausalLM, AutoTokenizer

from convert.staging import host_tag
from lex.cli import main as lex
from lex.data import load_documents
from lex.report import perplexity_figure
from lex.study import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory) -> dict[int, tuple[Path, str, str]]:
    """{threads: (output folder, stdout, stderr)} of `lex demo --quick` with OMP_NUM_THREADS=1 and 2, run concurrently.

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
        command = [sys.executable, "-m", "lex.cli", "demo", "--quick", "--output_dir", str(base / f"threads{threads}")]
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
    assert len(one["rows"]) == len(two["rows"]) == 3 * 2 * 2 * 7  # models x modes x protocols x lengths
    for a, b in zip(one["rows"], two["rows"]):
        assert {k: v for k, v in a.items() if k != "ppl"} == {k: v for k, v in b.items() if k != "ppl"}
        assert abs(a["ppl"] / b["ppl"] - 1) < 0.02, (a, b)
    # the models learned something, so the comparison is not between two uniform guessers
    assert max(r["ppl"] for r in one["rows"]) < 0.8 * SETTINGS["quick"]["vocab"]


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_progress_bars_show_steps_loss_and_evaluation(quick_runs):
    _, out, err = quick_runs[2]
    steps, lengths = SETTINGS["quick"]["steps"], 2 * 2 * 7  # modes x protocols x lengths
    lines = re.split(r"[\r\n]", err)
    for variant in ("xpos", "rope", "alibi"):
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


@torch.no_grad()
def independent_perplexities(folder: Path, study: dict) -> dict[tuple, float]:
    """{(model, mode, protocol, length): ppl} computed here from the saved models, one plain forward per window
    (no cache, no streaming, none of lex.perplexity), on the held-out documents the study read."""
    documents = load_documents(validation_fraction=0.1, seed=study["seed"])["validation"]["text"]
    budget, values = max(study["lengths"]), {}
    for model_name in study["variants"]:
        tokenizer = AutoTokenizer.from_pretrained(folder / model_name)
        ids = [tokenizer(t, add_special_tokens=False).input_ids for t in documents]
        ids = [torch.tensor(d[:budget]) for d in ids if len(d) >= budget][: study["eval_documents"]]
        assert len(ids) == study["eval_documents"]
        for mode in ("full", "blockwise"):
            model = AutoModelForCausalLM.from_pretrained(folder / model_name, attention_mode=mode).eval()
            for protocol in ("segments", "strided"):
                for length in study["lengths"]:
                    nll, count, by_shape = 0.0, 0, {}
                    for document in ids:  # windows of one shape go through the model as one batch
                        for begin, end, first in spans(budget, length, protocol):
                            by_shape.setdefault((end - begin, first - begin), []).append(document[begin:end])
                    for (_, scored_from), rows in by_shape.items():
                        batch = torch.stack(rows)
                        log_probs = model(batch).logits.double().log_softmax(-1)[:, scored_from - 1 : -1]
                        picked = log_probs.gather(2, batch[:, scored_from:, None])
                        nll, count = nll - picked.sum().item(), count + picked.numel()
                    values[(model_name, mode, protocol, length)] = math.exp(nll / count)
    return values


def number(text: str) -> float:
    return float(text.replace(",", ""))


def shown(value: str, expected: float, decimals: int = 2) -> bool:
    """Whether `value`, a number as printed with `decimals`, is `expected` to its rounding."""
    return abs(number(value) - expected) <= 0.5 * 10 ** -decimals + 1e-4 * abs(expected)


def check_reading(reading: str, truth: dict[tuple, float], lengths: list[int], length: int, variants: list[str],
                  resolution: list[dict]) -> None:
    """Every number and direction word of report.md's reading against `truth`, {(model, mode, protocol, length):
    ppl} computed by the caller; nothing of lex.report is imported or its wording re-typed beyond the sentence
    shapes parsed here."""
    longest = max(lengths)
    past_l = re.findall(r"- (\w+), (\w+) attention: perplexity (rises by|falls by|stays within) ([\d.]+)% past l "
                        r"\(([\d.]+) → ([\d.]+)\)\.", reading)
    assert len(past_l) == len(variants) * 2
    moves = {}
    for model, mode, word, percent, at_l, far in past_l:
        expected_l, expected_far = (truth[(model, mode, "segments", n)] for n in (length, longest))
        change = expected_far / expected_l - 1
        assert shown(at_l, expected_l) and shown(far, expected_far) and shown(percent, 100 * abs(change), 1)
        assert word == "stays within" or (word == "rises by") == (change > 0), (model, mode, word, change)
        moves.setdefault(word == "stays within", []).append(abs(change))
    # "stays" is said of smaller moves than any "rises"/"falls": one threshold separates them, whatever it is
    assert max(moves.get(True, [0])) < min(moves.get(False, [math.inf]))

    bca = re.findall(r"- (\w+): ([\d.]+) with full attention, ([\d.]+) with BCA \(([+-][\d.]+)%\)\.", reading)
    assert len(bca) == len(variants)
    for model, full, block, percent in bca:
        expected_full, expected_block = (truth[(model, mode, "segments", longest)] for mode in ("full", "blockwise"))
        assert shown(full, expected_full) and shown(block, expected_block)
        assert shown(percent, 100 * (expected_block / expected_full - 1))

    best = re.findall(r"Best at (\d+) tokens \((\w+) protocol\): (\w+) with (\w+) attention, perplexity ([\d.]+)\.",
                      reading)
    assert [(int(n), protocol) for n, protocol, *_ in best] == [(longest, "segments"), (longest, "strided")]
    for _, protocol, model, mode, value in best:
        candidates = {key: v for key, v in truth.items() if key[2:] == (protocol, longest)}
        assert min(candidates, key=candidates.get)[:2] == (model, mode) and shown(value, min(candidates.values()))

    protocols = re.findall(r"- at (\d+) tokens the strided protocol is ([\d.]+)% (lower|higher)\.", reading)
    assert [int(n) for n, *_ in protocols] == [min(lengths), length, longest]
    for n, percent, word in protocols:
        pairs = [(truth[(m, mode, "segments", int(n))], truth[(m, mode, "strided", int(n))])
                 for m in variants for mode in ("full", "blockwise")]
        mean = sum(strided / segments - 1 for segments, strided in pairs) / len(pairs)
        assert shown(percent, 100 * abs(mean), 1) and word == ("lower" if mean < 0 else "higher")

    (highest,) = re.findall(r"Highest attention resolution: (\w+) \(([\d.]+)\)\.", reading)
    top = max(resolution, key=lambda r: r["resolution"])
    assert highest[0] == top["model"] and shown(highest[1], top["resolution"], 4)


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_report_numbers_equal_perplexities_computed_independently(quick_runs):
    """Every perplexity of study.json, every cell of report.md's tables and every number of its reading, against
    perplexities computed here from the saved models; the reading's words against the signs of those numbers."""
    folder = quick_runs[2][0]
    data, text = study(folder), (folder / "report.md").read_text()
    truth = independent_perplexities(folder, data)
    for row in data["rows"]:
        assert row["ppl"] == pytest.approx(truth[(row["model"], row["attention_mode"], row["protocol"],
                                                  row["length"])], rel=1e-4), row

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
    assert checked == (4 + 6 + 6) * 7
    (resolution,) = [rows for name, rows in tables.items() if name.startswith("Table 3")]
    assert [(r[0], r[2]) for r in resolution[2:]] == [(r["model"], f"{r['resolution']:.4f}") for r in data["resolution"]]
    settings = dict(tables["Settings"][2:])
    assert settings == {**{k: str(v) for k, v in data["settings"].items()}, "seed": str(data["seed"])}

    reading = text.split("## Reading")[1].split("\n## ")[0]
    check_reading(reading, truth, data["lengths"], data["settings"]["length"], data["variants"], data["resolution"])
    for image in ("ppl_vs_length.png", "loss.png", "resolution.png"):
        assert f"]({image})" in text and (folder / image).stat().st_size > 0


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


@pytest.mark.slow  # `lex demo` runs or a subprocess
def test_trained_models_keep_use_cache(quick_runs):
    for variant in ("xpos", "rope", "alibi"):
        assert json.loads((quick_runs[1][0] / variant / "config.json").read_text())["use_cache"] is True


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
