"""Perplexity by length (evaluate module and CLI), attention resolution, passkey, and `lex demo --quick`."""

import json
import math
from pathlib import Path

import evaluate
import pytest
import torch

from configuration_lex import LexConfig
from lex.cli import main as lex
from lex.data import kjv_books, train_tokenizer
from lex.resolution import analytic_curve, resolution
from modeling_lex import LexForCausalLM

METRIC = Path(__file__).resolve().parents[1] / "lex" / "metrics" / "length_perplexity"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny random LEX model (w = 32) with a BPE tokenizer, saved like any trained folder."""
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = train_tokenizer([b["text"] for b in kjv_books()[:2]], vocab_size=300)
    torch.manual_seed(0)
    config = LexConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, max_position_embeddings=32)
    LexForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [b["text"][:3000] for b in kjv_books()[40:43]]


def hand_computed(folder: Path, texts: list[str], length: int, protocol: str, budget: int) -> float:
    """The two protocols written out token by token, independently of lex.eval_length."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    nll, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids[:budget]
        if protocol == "segments":
            spans = [(s, s + length, s + 1) for s in range(0, budget - length + 1, length)]
        else:  # HF's fixed-length recipe: windows every length/2, each token scored once
            spans, previous_end = [], 0
            for begin in range(0, budget, length // 2):
                end = min(begin + length, budget)
                spans.append((begin, end, max(previous_end, begin + 1)))
                previous_end = end
                if end == budget:
                    break
        for begin, end, first_scored in spans:
            with torch.no_grad():
                log_probs = model(torch.tensor([ids[begin:end]])).logits[0].log_softmax(-1)
            for position in range(first_scored, end):
                nll -= log_probs[position - 1 - begin, ids[position]].item()
                count += 1
    return math.exp(nll / count)


@pytest.mark.parametrize("protocol", ["segments", "strided"])
def test_evaluate_module_matches_hand_computation(folder, texts, protocol, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    metric = evaluate.load(str(METRIC))
    result = metric.compute(predictions=texts, model_id=str(folder), lengths=[16, 64], protocol=protocol)
    assert result["lengths"] == [16, 64]
    for length, ppl in zip(result["lengths"], result["perplexities"]):
        assert ppl == pytest.approx(hand_computed(folder, texts, length, protocol, budget=64), rel=1e-5)


def test_resolution_is_equation_3():
    s = torch.tensor([3.0, 2.5, 1.0, 0.2, -1.0], dtype=torch.float64)
    e = [math.exp(x) for x in s.tolist()]
    direct = sum(e[i] * (e[i] - e[i + 1]) for i in range(len(e) - 1)) / sum(e) ** 2
    assert resolution(s) == pytest.approx(direct, rel=1e-12)
    assert resolution(s + 7.0) == pytest.approx(direct, rel=1e-9)
    assert resolution(torch.zeros(10)) == 0.0
    assert resolution(torch.tensor([0.0, -100.0])) == pytest.approx(1.0)


def test_analytic_curve_xpos_decays_where_rope_oscillates():
    rope, xpos = analytic_curve(64, 4096, "rope"), analytic_curve(64, 4096, "xpos")
    assert rope[0] == pytest.approx(1.0) and xpos[0] == pytest.approx(1.0)
    assert xpos[1000:].abs().max() < rope[1000:].abs().max()


def test_eval_length_cli_writes_everything(folder, texts, tmp_path, capsys):
    files = tmp_path / "docs"
    files.mkdir()
    for i, text in enumerate(texts):
        (files / f"doc{i}.txt").write_text(text)
    out = tmp_path / "eval"
    assert lex(["eval-length", str(folder), "--files", f"{files}/*.txt", "--lengths", "8,16,64",
                "--attention_modes", "full,blockwise,sliding", "--output_dir", str(out), "--resolution",
                "--passkey"]) == 0
    printed = capsys.readouterr().out
    assert "| model | attention | 8 | 16 | 64 |" in printed and "resolution" in printed and "passkey" in printed
    rows = json.loads((out / "results.json").read_text())
    assert {r["attention_mode"] for r in rows} == {"full", "blockwise", "sliding"} and len(rows) == 3 * 2 * 3
    assert (out / "results.csv").read_text().startswith("model,attention_mode,protocol,length")
    for name in ("ppl_vs_length.png", "resolution.png", "resolution.json", "passkey.json"):
        assert (out / name).stat().st_size > 0, name


def test_demo_quick_runs_end_to_end(tmp_path, capsys):
    assert lex(["demo", "--quick", "--minutes", "0.4", "--output_dir", str(tmp_path / "demo")]) == 0
    printed = capsys.readouterr().out
    for title in ("Table 2", "Table 5", "Table 3"):
        assert title in printed
    rows = json.loads((tmp_path / "demo" / "results.json").read_text())
    assert {r["model"] for r in rows} == {"xpos", "rope", "alibi"}
    assert (tmp_path / "demo" / "ppl_vs_length.png").stat().st_size > 0
