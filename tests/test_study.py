"""`lex demo`: reproducible steps and perplexities across thread counts, progress bars, report.md = study.json.

Two `lex demo --quick` runs (one torch thread, two threads) run side by side once for the whole module.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lex.cli import main as lex
from lex.report import FLAT, perplexity_figure
from lex.study import SETTINGS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory) -> dict[int, tuple[Path, str, str]]:
    """{threads: (output folder, stdout, stderr)} of `lex demo --quick` with OMP_NUM_THREADS=1 and 2, run concurrently."""
    base = tmp_path_factory.mktemp("demo")
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


def test_report_numbers_equal_study_json(quick_runs):
    folder = quick_runs[2][0]
    data, text = study(folder), (folder / "report.md").read_text()
    tables = markdown_tables(text)
    ppl = {(r["model"], r["attention_mode"], r["protocol"], r["length"]): r["ppl"] for r in data["rows"]}
    checked = 0
    for title, protocol in (("Table 2", "segments"), ("Table 5", "segments"), ("The same with the strided", "strided")):
        (rows,) = [rows for name, rows in tables.items() if name.startswith(title)]
        header, body = rows[0], rows[2:]
        assert header[2:] == [str(n) for n in data["lengths"]]
        for model, mode, *values in body:
            for length, value in zip(data["lengths"], values):
                assert value == f"{ppl[(model.removesuffix(' + BCA'), mode, protocol, length)]:.2f}", (title, model)
                checked += 1
    assert checked == (4 + 6 + 6) * 7
    (resolution,) = [rows for name, rows in tables.items() if name.startswith("Table 3")]
    assert [(r[0], r[2]) for r in resolution[2:]] == [(r["model"], f"{r['resolution']:.4f}") for r in data["resolution"]]
    settings = dict(tables["Settings"][2:])
    assert settings == {**{k: str(v) for k, v in data["settings"].items()}, "seed": str(data["seed"])}
    # the reading is computed from the same numbers
    length, longest = data["settings"]["length"], max(data["lengths"])
    for model in data["variants"]:
        for mode in ("full", "blockwise"):
            at_l, far = ppl[(model, mode, "segments", length)], ppl[(model, mode, "segments", longest)]
            change = far / at_l - 1
            word = "stays within" if abs(change) < FLAT else "rises by" if change > 0 else "falls by"
            assert f"- {model}, {mode} attention: perplexity {word} {abs(change):.1%} past l ({at_l:.2f} → {far:.2f})." in text
        full, block = ppl[(model, "full", "segments", longest)], ppl[(model, "blockwise", "segments", longest)]
        assert f"- {model}: {full:.2f} with full attention, {block:.2f} with BCA ({block / full - 1:+.2%})." in text
    for image in ("ppl_vs_length.png", "loss.png", "resolution.png"):
        assert f"]({image})" in text and (folder / image).stat().st_size > 0


def test_plot_axes_are_plain_numbers(quick_runs):
    data = study(quick_runs[2][0])
    figure = perplexity_figure(data["rows"])
    figure.canvas.draw()
    for ax in figure.axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == [str(n) for n in data["lengths"]]
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels and all(re.fullmatch(r"[\d.,−-]+", label) for label in labels), labels


def test_output_folder_appears_only_when_complete(quick_runs, tmp_path, capsys):
    assert not [p for p in quick_runs[1][0].parent.iterdir() if p.name.startswith(".")]  # no work folder left
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("not a study")
    assert lex(["demo", "--quick", "--output_dir", str(foreign)]) == 2
    assert "--output_dir" in capsys.readouterr().err and os.listdir(foreign) == ["mine.txt"]
    assert os.listdir(tmp_path) == ["notes"]
    corpus = tmp_path / "corpus"  # short documents: the study stops before training, after its work folder began
    corpus.mkdir()
    for i in range(20):
        (corpus / f"{i}.txt").write_text(f"and the lord spake unto moses saying {i} " * 40)
    assert lex(["demo", "--quick", "--corpus", str(corpus), "--output_dir", str(tmp_path / "out")]) == 2
    assert "no held-out document holds 1024 tokens" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["corpus", "notes"]  # neither out/ nor a work folder
    with pytest.raises(SystemExit):
        lex(["demo", "--minutes", "0"])
    assert "--minutes must be a positive number" in capsys.readouterr().err


def test_demo_does_not_import_the_metrics_extra():
    """`evaluate` is the extra `metrics` (setup.cfg): `pip install -e .` lacks it, so the demo must not import it."""
    code = ("import sys, lex.study, lex.report, lex.resolution, lex.training, lex.commands.demo; "
            "print(sorted(m for m in ('evaluate', 'aiohttp', 'requests') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
