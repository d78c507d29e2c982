"""`lex export`: a folder that loads with trust_remote_code where this package is not installed."""

import copy
import hashlib
import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from transformers import AutoTokenizer
from transformers.dynamic_module_utils import get_imports, get_relative_import_files

from configuration_lex import LexConfig
from lex.cli import main as lex
from lex.data import kjv_books, train_tokenizer
from lex.export import ExportError, export, flatten, push_to_hub
from modeling_lex import LexForCausalLM

pytestmark = pytest.mark.oldest  # also run on the oldest transformers we declare

ROOT = Path(__file__).resolve().parents[1]
PROJECT_ENTRIES = ("configuration_lex", "modeling_lex", "lex", "convert", "lex_base")
CODE_FILES = {"configuration_lex.py", "positions.py", "reading.py", "memory.py", "stream.py", "cache.py", "kernels.py",
              "generation.py", "modeling_lex.py"}
TRAINING_LENGTH = 16


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([b["text"][:20_000] for b in kjv_books()[:2]], vocab_size=300)


@pytest.fixture(scope="module")
def model(tokenizer) -> LexForCausalLM:
    torch.manual_seed(0)
    config = LexConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=TRAINING_LENGTH,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LexForCausalLM(config)
    with torch.no_grad():  # an untrained model's logits are nearly flat: make greedy choices clear-cut
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def model_dir(model, tokenizer, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "results.json").write_text(json.dumps([  # the records `lex eval-length` writes
        {"model": "m", "attention_mode": mode, "protocol": "segments", "length": n, "training_length": 16,
         "ppl": ppl + n / 100, "tokens": 100} for mode, ppl in (("full", 20.0), ("blockwise", 10.0))
        for n in (16, 64, 256)]))
    return path


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "lex-tiny"
    assert lex(["export", str(model_dir), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def sharded(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "lex-sharded"
    assert lex(["export", str(model_dir), str(out), "--max_shard_size", "20KB"]) == 0
    return out


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_folder_contents_and_auto_map(exported, model_dir):
    names = {p.name for p in exported.iterdir()}
    assert names == CODE_FILES | {"config.json", "model.safetensors", "generation_config.json", "README.md",
                                  "tokenizer.json", "tokenizer_config.json"}
    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_lex.LexConfig", "AutoModel": "modeling_lex.LexModel",
                                  "AutoModelForCausalLM": "modeling_lex.LexForCausalLM"}
    assert config["architectures"] == ["AutoModelForCausalLM"]  # a transformers class: what transformers serve looks up
    for path in exported.glob("*.json"):  # nothing of this machine is published
        assert str(model_dir) not in path.read_text() and "/tmp/" not in path.read_text(), path.name


def test_flat_code_is_what_transformers_fetches(exported):
    """transformers' own resolver finds every flat file from modeling_lex.py, and nothing of this project."""
    fetched = {Path(f).name for f in get_relative_import_files(exported / "modeling_lex.py")}
    assert fetched == CODE_FILES - {"modeling_lex.py"}
    for name in CODE_FILES:
        assert not set(get_imports(exported / name)) & set(PROJECT_ENTRIES), name
    originals = {"configuration_lex.py": ROOT / "configuration_lex" / "configuration_lex.py"}
    for name in CODE_FILES:
        original = (originals.get(name) or ROOT / "modeling_lex" / name).read_text().splitlines()
        flat = (exported / name).read_text().splitlines()
        changed = [(a, b) for a, b in zip(original, flat, strict=True) if a != b]
        rewritten = {"modeling_lex.py": "LexConfig",  # the config's imports, now of the flat file beside them
                     "reading.py": "(ATTENTION_MODES, SINK_POSITIONS, WINDOW_RULE, AttentionMode,"}
        assert changed == ([(f"from configuration_lex.configuration_lex import {rewritten[name]}",
                             f"from .configuration_lex import {rewritten[name]}")] if name in rewritten else [])


@pytest.mark.parametrize("line", [
    "from configuration_lex import LexConfig",  # the package, whose __init__ is not exported
    "from .helpers import something",  # a module nobody mapped: it would not be fetched
    "import modeling_lex.cache",
    "from lex.data import END_OF_TEXT",
    "from . import positions",  # transformers does not follow this form
    "from ..configuration_lex import configuration_lex",
])
def test_flatten_refuses_what_it_cannot_map(line):
    with pytest.raises(ExportError, match="FLAT_MODULES"):
        flatten(f"import torch\n\n\ndef f():\n    {line}\n", "modeling_lex", "modeling_lex/new.py")


def test_flatten_rewrites_mapped_imports_anywhere():
    text = ("from configuration_lex.configuration_lex import LexConfig\n"
            "def f():\n    from configuration_lex.configuration_lex import (\n        LexConfig,\n    )\n"
            "from .cache import LexCache\nfrom transformers import AutoModel\n")
    assert flatten(text, "modeling_lex", "x.py") == (
        "from .configuration_lex import LexConfig\n"
        "def f():\n    from .configuration_lex import (\n        LexConfig,\n    )\n"
        "from .cache import LexCache\nfrom transformers import AutoModel\n")


def test_model_card_front_matter_training_length_and_results(exported):
    text = (exported / "README.md").read_text()
    front = front_matter(text)
    assert front == {"library_name": "transformers", "pipeline_tag": "text-generation", "license": "mit",
                     "tags": ["lex", "xpos", "length-extrapolation", "custom_code"]}
    assert f"| training length | {TRAINING_LENGTH} tokens |" in text and "| attention mode | blockwise |" in text
    assert "| attention window | 16 tokens |" in text and "blocks of 8 tokens" in text
    assert "| attention sinks | 0 |" in text and "a cache of at most 15 positions per layer" in text
    assert 'from_pretrained("lex-tiny", trust_remote_code=True)' in text
    assert "| model | attention | protocol | 16 | 64 | 256 |" in text
    assert "| m | blockwise | segments | 10.16 | 10.64 | 12.56 |" in text
    assert "| m | full | segments | 20.16 | 20.64 | 22.56 |" in text


def test_model_card_for_full_attention_and_other_results_files(model, tmp_path):
    model.config.attention_mode = "full"
    try:
        results = tmp_path / "study.json"  # `lex demo` writes {"rows": [...]}; fields beyond length/ppl optional
        results.write_text(json.dumps({"rows": [{"length": 32, "ppl": 5.0}, {"length": 8, "ppl": 4.0},
                                                {"length": "bad"}]}))
        out = export(model, tmp_path / "full", results=results, license_name="apache-2.0")
    finally:
        model.config.attention_mode = "blockwise"
    text = (out / "README.md").read_text()
    assert front_matter(text)["license"] == "apache-2.0"
    assert "| attention mode | full |" in text and 'attention_mode="blockwise"' in text
    assert "| 8 | 32 |\n|---|---|\n| 4.00 | 5.00 |" in text
    assert "tokenizer" not in text.split("## How to load")[1]  # none was given
    model.config.attention_mode, model.config.attention_sinks = "sliding", 4
    try:
        text = (export(model, tmp_path / "sinks") / "README.md").read_text()
    finally:
        model.config.attention_mode, model.config.attention_sinks = "blockwise", 0
    assert "| attention sinks | 4 |" in text and "first 4 tokens (attention sinks)" in text
    assert "a cache of at most 19 positions per layer" in text  # w - 1 + S
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ExportError, match="'length' and 'ppl'"):
        export(model, tmp_path / "no-results", results=tmp_path / "empty.json")


def test_export_is_deterministic_and_matches_the_in_memory_path(model, model_dir, exported, tmp_path):
    again = tmp_path / "second" / exported.name  # the card names the folder: same name, same bytes
    assert lex(["export", str(model_dir), str(again)]) == 0
    assert digests(again) == digests(exported)
    # (a tokenizer loaded from a folder saves two more loader keys in tokenizer_config.json than a fresh one)
    in_memory = export(model, tmp_path / "third" / exported.name, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                       results=model_dir / "results.json")
    assert digests(in_memory) == digests(exported)
    assert getattr(model.config, "auto_map", None) is None  # the caller's model is left as it was


def test_refusals(model_dir, exported, tmp_path, capsys):
    again = tmp_path / "again"
    assert lex(["export", str(model_dir), str(again)]) == 0
    assert lex(["export", str(model_dir), str(again)]) == 2
    assert "--force" in capsys.readouterr().err
    assert lex(["export", str(model_dir), str(again), "--force"]) == 0
    assert lex(["export", str(model_dir), str(model_dir.parent), "--force"]) == 2
    assert "would replace the model folder" in capsys.readouterr().err and (model_dir / "config.json").is_file()
    assert lex(["export", str(model_dir), str(tmp_path / "x"), "--license", "MIT License"]) == 2
    assert lex(["export", str(model_dir), str(tmp_path / "x"), "--max-shard-size", "big"]) == 2
    assert lex(["export", str(exported / "nothing"), str(tmp_path / "x")]) == 2
    assert "--license" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert lex(["export", str(model_dir), str(tmp_path / "x"), "--dry-run"]) == 2


def test_exported_config_keeps_use_cache_and_files_follow_the_umask(model_dir, tmp_path):
    """A folder saved with use_cache false (a Trainer's) exports with use_cache true; every file and folder gets
    the user's modes (0644/0755 under umask 022, 0640/0750 under 027), model.safetensors included."""
    trained = tmp_path / "trained"
    config = json.loads((model_dir / "config.json").read_text())
    trained.mkdir()
    for path in model_dir.iterdir():
        (trained / path.name).write_bytes(path.read_bytes())
    (trained / "config.json").write_text(json.dumps({**config, "use_cache": False}))
    for umask in (0o022, 0o027):
        previous = os.umask(umask)
        try:
            assert lex(["export", str(trained), str(tmp_path / f"out{umask:o}")]) == 0
        finally:
            os.umask(previous)
        out = tmp_path / f"out{umask:o}"
        assert json.loads((out / "config.json").read_text())["use_cache"] is True
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
        assert modes == {name: 0o666 & ~umask for name in modes} and "model.safetensors" in modes
        assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_shards_above_the_size_limit(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = {p.name for p in sharded.glob("model-*.safetensors")}
    assert len(shards) > 1 and set(index["weight_map"].values()) == shards
    assert not (sharded / "model.safetensors").exists()


class OfflineHub(huggingface_hub.HfApi):
    """The real HfApi with its three network calls recorded instead of sent."""

    calls: list = []
    remote_files = [".gitattributes", "README.md", "model-00001-of-00002.safetensors"]

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def list_repo_files(self, repo_id, **kwargs):
        self.calls.append(("list_repo_files", repo_id, kwargs))
        return list(self.remote_files)

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, operations, kwargs))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0"})()


def test_dry_run_lists_the_folder_and_touches_no_network(model_dir, tmp_path, monkeypatch, capsys):
    def no_network(*args, **kwargs):
        raise AssertionError("the dry run used HfApi")

    monkeypatch.setattr(huggingface_hub, "HfApi", no_network)
    out = tmp_path / "lex-tiny"
    assert lex(["export", str(model_dir), str(out), "--push-to-hub", "someone/lex-tiny", "--private",
                "--dry-run"]) == 0
    report = capsys.readouterr().out
    listed = {line.strip() for line in report.splitlines() if line.startswith("  ")}
    assert listed == {p.name for p in out.iterdir()}
    assert "private model repo someone/lex-tiny" in report and "Upload LEX model" in report
    assert 'from_pretrained("someone/lex-tiny", trust_remote_code=True)' in (out / "README.md").read_text()
    with pytest.raises(ExportError, match="--push_to_hub"):
        push_to_hub(out, "not a repo id", dry_run=True)


def test_push_makes_one_commit_of_exactly_the_folder(exported, monkeypatch):
    OfflineHub.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", OfflineHub)
    message = push_to_hub(exported, "someone/lex-tiny", private=True)
    create, listing, (name, repo_id, operations, kwargs) = OfflineHub.calls
    assert create == ("create_repo", "someone/lex-tiny", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert listing[:2] == ("list_repo_files", "someone/lex-tiny") and name == "create_commit"
    added = {op.path_in_repo: op.path_or_fileobj for op in operations
             if isinstance(op, huggingface_hub.CommitOperationAdd)}
    deleted = [op.path_in_repo for op in operations if isinstance(op, huggingface_hub.CommitOperationDelete)]
    assert added == {p.name: str(p) for p in exported.iterdir()}
    assert deleted == ["model-00001-of-00002.safetensors"]  # stale; .gitattributes kept, README.md replaced
    assert repo_id == "someone/lex-tiny" and kwargs["repo_type"] == "model"
    assert "https://huggingface.co/someone/lex-tiny/commit/0" in message


def isolated_python(tmp_path: Path) -> Path:
    """A fresh venv that sees the installed packages but not this project, however it is installed.

    Its site-packages gets one path entry: a folder of links to every entry of ours except the project's
    packages, its dist-info and the .pth files/finders of an editable install (never processed from there).
    """
    venv = tmp_path / "isolated"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    child_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    parent_site = Path([p for p in site.getsitepackages() if (Path(p) / "transformers").is_dir()][0])
    links = tmp_path / "site-links"
    links.mkdir()
    for entry in parent_site.iterdir():
        name = entry.name
        if (name.split(".")[0] in PROJECT_ENTRIES or name.startswith(("lex_transformer", "__editable__"))
                or name.endswith((".pth", ".egg-link"))):
            continue
        (links / name).symlink_to(entry)
    (Path(child_site) / "parent.pth").write_text(f"{links}\n")
    return python


@pytest.mark.slow
def test_loads_with_remote_code_where_the_package_is_absent(model, exported, sharded, tmp_path):
    """Logits, greedy tokens past the training length, the bounded cache and pipeline(), without the package."""
    ids = torch.randint(1, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected_logits = model(ids).logits
    expected_tokens = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert expected_tokens.shape[1] == 64 == 4 * TRAINING_LENGTH
    memory = copy.deepcopy(model)  # the same weights with a block memory past the window
    memory.config.attention_mode, memory.config.attention_memory_blocks = "sliding", 2
    memory.config.attention_memory_block_size = 4
    with torch.no_grad():
        memory_logits = memory(ids).logits
    torch.save({"ids": ids, "logits": expected_logits, "tokens": expected_tokens, "memory": memory_logits},
               tmp_path / "expected.pt")

    script = textwrap.dedent(f"""
        import importlib.util, sys, torch
        for name in ("modeling_lex", "configuration_lex", "lex", "convert"):
            assert importlib.util.find_spec(name) is None, name + " is importable"
        assert not any("{ROOT}" in p for p in sys.path), sys.path
        from transformers import AutoConfig, AutoModelForCausalLM, pipeline
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        for folder in ({str(exported)!r}, {str(sharded)!r}):
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
            assert type(AutoConfig.from_pretrained(folder, trust_remote_code=True)).__name__ == "LexConfig"
            with torch.no_grad():
                logits = model(expected["ids"]).logits
            torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=1e-5)
        full = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True,
                                                    attention_mode="full").eval()
        with torch.no_grad():  # the window is really applied: beyond it, full attention differs
            assert (full(expected["ids"]).logits[0, 16:] - logits[0, 16:]).abs().max() > 1e-3
        memory = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True,
                                                      attention_mode="sliding", attention_memory_blocks=2,
                                                      attention_memory_block_size=4).eval()
        with torch.no_grad():  # the block memory (memory.py) comes with the remote code
            torch.testing.assert_close(memory(expected["ids"]).logits, expected["memory"], atol=1e-5, rtol=1e-5)
        out = model.generate(expected["ids"], max_new_tokens=24, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected["tokens"]), (out.sequences, expected["tokens"])
        cache = out.past_key_values
        assert type(cache).__name__ == "LexCache" and cache.get_seq_length() == 63
        assert all(layer.keys.shape[-2] <= 16 for layer in cache.layers), [l.keys.shape for l in cache.layers]
        generator = pipeline("text-generation", model={str(exported)!r}, trust_remote_code=True)
        text = generator("In the beginning", max_new_tokens=8, do_sample=False)[0]["generated_text"]
        assert text.startswith("In the beginning") and len(text) > len("In the beginning"), text
        model.save_pretrained("resaved")  # what the loaded model's own push_to_hub would upload
        import os
        assert set({sorted(CODE_FILES)!r}) <= set(os.listdir("resaved")), os.listdir("resaved")
        print("remote code ok")
    """)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    run = subprocess.run([str(isolated_python(tmp_path)), "-s", "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "remote code ok" in run.stdout


@pytest.mark.slow
def test_remote_code_and_the_package_in_one_process(exported, tmp_path):
    """Importing the package after loading the remote code (or before) breaks neither: registration is harmless."""
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModel, AutoModelForCausalLM
        remote = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True).eval()
        assert type(remote).__module__.startswith("transformers_modules.")
        sys.path.insert(0, {str(ROOT)!r})
        import modeling_lex
        local = AutoModelForCausalLM.from_pretrained({str(exported)!r}).eval()
        assert type(local) is modeling_lex.LexForCausalLM
        base = AutoModel.from_config(remote.config, trust_remote_code=True)
        assert type(base).__module__.startswith("transformers_modules.")
        assert type(AutoModel.from_config(local.config)) is modeling_lex.LexModel
        ids = torch.randint(1, 250, (1, 40))
        with torch.no_grad():
            torch.testing.assert_close(remote(ids).logits, local(ids).logits, atol=0, rtol=0)
        print("both ok")
    """)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "both ok" in run.stdout
