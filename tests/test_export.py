"""`lex export`: a folder that loads with trust_remote_code where this package is not installed."""

import hashlib
import json
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from configuration_lex import LexConfig
from lex.cli import main as lex
from lex.data import kjv_books, train_tokenizer
from lex.export import push
from modeling_lex import LexForCausalLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    tokenizer = train_tokenizer([b["text"] for b in kjv_books()[:2]], vocab_size=300)
    torch.manual_seed(0)
    config = LexConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=16, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    model = LexForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "results.json").write_text(json.dumps([
        {"model": "m", "attention_mode": "blockwise", "protocol": "segments", "length": n, "training_length": 16,
         "ppl": 10.0 + n / 100, "tokens": 100} for n in (16, 64, 256)]))
    return path


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "lex-tiny"
    assert lex(["export", str(model_dir), str(out)]) == 0
    return out


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_folder_contents_and_auto_map(exported):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md",
            "configuration_lex.py", "modeling_lex.py", "attention.py", "cache.py", "xpos.py"} <= names
    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_lex.LexConfig", "AutoModel": "modeling_lex.LexModel",
                                  "AutoModelForCausalLM": "modeling_lex.LexForCausalLM"}
    assert "from .configuration_lex import LexConfig" in (exported / "modeling_lex.py").read_text()


def test_model_card_front_matter_and_training_length(exported):
    import yaml

    text = (exported / "README.md").read_text()
    assert text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert "lex" in front["tags"] and front["license"] == "mit"
    assert "| training length | 16 tokens |" in text and "| attention mode | blockwise |" in text
    assert "Perplexity by evaluation length" in text and "| 256 |" in text


def test_export_is_deterministic_and_refuses_to_overwrite(model_dir, exported, tmp_path, capsys):
    again = tmp_path / "second" / exported.name  # the card names the folder: same name, same bytes
    assert lex(["export", str(model_dir), str(again)]) == 0
    assert digests(again) == digests(exported)
    assert lex(["export", str(model_dir), str(again)]) == 2
    assert "--force" in capsys.readouterr().err
    assert lex(["export", str(model_dir), str(again), "--force"]) == 0


def test_shards_above_the_size_limit(model_dir, tmp_path):
    out = tmp_path / "sharded"
    assert lex(["export", str(model_dir), str(out), "--max-shard-size", "20KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 1


def test_dry_run_lists_the_folder_and_push_calls_the_hub_api(exported, capsys):
    report = push(exported, "someone/lex-tiny", private=True, dry_run=True)
    listed = {line.strip() for line in report.splitlines()[1:]}
    assert listed == {p.name for p in exported.iterdir()} and "private repo someone/lex-tiny" in report

    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs))
            return type("Info", (), {"commit_url": "https://hub/commit/1"})()

    message = push(exported, "someone/lex-tiny", private=True, dry_run=False, api=FakeApi())
    assert calls[0] == ("create_repo", "someone/lex-tiny", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert calls[1][1]["folder_path"] == str(exported) and calls[1][1]["repo_id"] == "someone/lex-tiny"
    assert "https://hub/commit/1" in message


def test_loads_with_remote_code_where_the_package_is_absent(model_dir, exported, tmp_path):
    """A fresh virtual environment that sees torch/transformers/safetensors but not this project."""
    venv = tmp_path / "isolated"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    child_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    # A path entry (not a site dir): the project's editable-install .pth/finder there is never processed.
    parent_site = [p for p in site.getsitepackages() if (Path(p) / "transformers").is_dir()][0]
    (Path(child_site) / "parent.pth").write_text(parent_site + "\n")

    model = LexForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(1, 250, (1, 40))
    with torch.no_grad():
        expected_logits = model(ids).logits
    expected_tokens = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    torch.save({"ids": ids, "logits": expected_logits, "tokens": expected_tokens}, tmp_path / "expected.pt")

    script = textwrap.dedent(f"""
        import importlib.util, torch
        for name in ("modeling_lex", "configuration_lex", "lex"):
            assert importlib.util.find_spec(name) is None, name + " is importable"
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
        model = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True).eval()
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            logits = model(expected["ids"]).logits
        torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=1e-5)
        tokens = model.generate(expected["ids"], max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, expected["tokens"]), (tokens, expected["tokens"])
        assert type(model.generate(expected["ids"], max_new_tokens=2, return_dict_in_generate=True,
                                   pad_token_id=0).past_key_values).__name__ == "LexCache"
        tokenizer = AutoTokenizer.from_pretrained({str(exported)!r})
        text = pipeline("text-generation", model=model, tokenizer=tokenizer)("In the beginning", max_new_tokens=8,
                                                                              do_sample=False)[0]["generated_text"]
        assert text.startswith("In the beginning")
        print("remote code ok")
    """)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([str(python), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "remote code ok" in run.stdout
