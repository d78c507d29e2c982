"""`lex train` on the HF Trainer: loss falls, folders load, DDP matches one process, resume is exact, errors are clean."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from lex.cli import main as lex
from lex.data import kjv_books

TINY = "hidden_size=64,num_hidden_layers=2,num_attention_heads=2,intermediate_size=128"
BASE = ["--block_size", "64", "--vocab_size", "512", "--learning_rate", "3e-3", "--use_cpu", "--report_to", "none",
        "--seed", "7", "--logging_steps", "1", "--eval_strategy", "no", "--per_device_train_batch_size", "8"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few books of the embedded KJV as text files, one document per file."""
    folder = tmp_path_factory.mktemp("corpus")
    for book in kjv_books()[:8]:
        (folder / f"{book['title'].replace(' ', '_')}.txt").write_text(book["text"][:20000])
    return folder


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "model"
    assert lex(["train", "--output_dir", str(out), "--train_files", f"{corpus}/*.txt", "--config_overrides", TINY,
                "--max_steps", "30", "--save_strategy", "no", *BASE]) == 0
    return out


def losses(folder: Path) -> list[float]:
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def test_thirty_steps_loss_falls_and_folder_is_complete(trained):
    history = losses(trained)
    assert len(history) == 30 and sum(history[-5:]) / 5 < sum(history[:5]) / 5 - 0.5
    for name in ("config.json", "model.safetensors", "tokenizer.json", "trainer_state.json", "loss_curve.png"):
        assert (trained / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(trained)
    tokenizer = AutoTokenizer.from_pretrained(trained)
    assert model.config.max_position_embeddings == 64 and model.config.model_type == "lex"
    ids = tokenizer("In the beginning God created", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=150, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=None)
    assert out.shape[1] == ids.shape[1] + 150 > 2 * model.config.max_position_embeddings


def test_fine_tune_a_saved_folder(trained, corpus, tmp_path):
    out = tmp_path / "tuned"
    assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(trained),
                "--train_files", f"{corpus}/*.txt", "--max_steps", "3", "--save_strategy", "no", *BASE]) == 0
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 512


def test_two_processes_match_one(trained, corpus, tmp_path):
    common = ["train", "--train_files", f"{corpus}/*.txt", "--config_overrides", TINY, "--tokenizer_name",
              str(trained), "--max_steps", "10", "--save_strategy", "no", *BASE]
    single = tmp_path / "single"
    assert lex([*common, "--output_dir", str(single)]) == 0
    ddp = tmp_path / "ddp"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    config = Path(__file__).resolve().parents[1] / "lex" / "accelerate_configs" / "ddp_cpu.yaml"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-m", "lex.cli"]
    # split_batches: each process takes half of the same global batch of 8, as one process would see it.
    run = subprocess.run([*launch, *common, "--output_dir", str(ddp), "--accelerator_config",
                          '{"split_batches": true}'], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert abs(losses(ddp)[9] - losses(single)[9]) < 1e-3


def test_resume_after_a_crash_equals_an_uninterrupted_run(trained, corpus, tmp_path, monkeypatch):
    common = ["train", "--train_files", f"{corpus}/*.txt", "--config_overrides", TINY, "--tokenizer_name",
              str(trained), "--max_steps", "10", "--save_steps", "5", *BASE]
    straight = tmp_path / "straight"
    assert lex([*common, "--output_dir", str(straight)]) == 0

    crashed = tmp_path / "crashed"
    original = transformers.Trainer.training_step
    steps = {"n": 0}

    def crash_at_step_seven(self, *args, **kwargs):
        steps["n"] += 1
        if steps["n"] == 7:
            raise KeyboardInterrupt("simulated kill")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "training_step", crash_at_step_seven)
    with pytest.raises(KeyboardInterrupt):
        lex([*common, "--output_dir", str(crashed)])
    monkeypatch.setattr(transformers.Trainer, "training_step", original)
    assert (crashed / "checkpoint-5").is_dir() and not (crashed / "checkpoint-10").exists()
    assert lex([*common, "--output_dir", str(crashed), "--resume_from_checkpoint", str(crashed / "checkpoint-5")]) == 0
    assert losses(crashed)[-1] == pytest.approx(losses(straight)[-1], abs=1e-6)
    assert losses(crashed)[-5:] == pytest.approx(losses(straight)[-5:], abs=1e-6)


@pytest.mark.parametrize("case, message", [
    ("no_files", "no file matches"),
    ("empty", "hold no text"),
    ("short", "fewer tokens than one block"),
    ("too_long", "exceeds"),
    ("unknown_key", "unknown LexConfig field 'hiden_size'"),
])
def test_bad_inputs_fail_clearly_and_keep_earlier_outputs(case, message, trained, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.txt").write_text("keep me")
    files, extra = f"{corpus}/*.txt", []
    if case == "no_files":
        files = str(tmp_path / "nothing" / "*.txt")
    elif case == "empty":
        (tmp_path / "empty.txt").write_text("  \n")
        files = str(tmp_path / "empty.txt")
    elif case == "short":
        for i in range(3):
            (tmp_path / f"short{i}.txt").write_text("Jesus wept.")
        files = str(tmp_path / "short*.txt")
    elif case == "too_long":
        extra = ["--model_name_or_path", str(trained), "--block_size", "128"]
    elif case == "unknown_key":
        extra = ["--config_overrides", "hiden_size=64"]
    args = ["train", "--output_dir", str(out), "--train_files", files, "--tokenizer_name", str(trained), *BASE,
            "--max_steps", "2", *extra]
    if case != "unknown_key" and case != "too_long":
        args += ["--config_overrides", TINY]
    assert lex(args) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["earlier.txt"]


def test_embedded_corpus_is_the_bible_split_by_book():
    from lex.data import load_documents

    books = kjv_books()
    assert len(books) == 66 and books[0]["title"] == "Genesis" and books[-1]["title"] == "Revelation"
    documents = load_documents()
    assert len(documents["train"]) + len(documents["validation"]) == 66
    assert set(documents["train"]["text"]).isdisjoint(documents["validation"]["text"])


def test_tokenizer_round_trips_text():
    from lex.data import train_tokenizer

    tokenizer = train_tokenizer([b["text"] for b in kjv_books()[:3]], vocab_size=400)
    text = "And God said, Let there be light: and there was light."
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert torch.tensor(tokenizer(text).input_ids).max() < 400


def test_fine_tune_a_converted_torchscale_folder(trained, corpus, tmp_path):
    """A folder made by `lex convert-torchscale` fine-tunes with `lex train` (embeddings resized to the new BPE)."""
    from tests.test_convert import BASE as DECODER, torchscale_decoder

    options = {**DECODER, "max_target_positions": 64}
    (tmp_path / "config.json").write_text(json.dumps(options))
    torch.save(torchscale_decoder(options, seed=0).state_dict(), tmp_path / "decoder.pt")
    converted = tmp_path / "converted"
    assert lex(["convert-torchscale", str(tmp_path / "decoder.pt"), str(converted), "--config",
                str(tmp_path / "config.json")]) == 0
    out = tmp_path / "tuned"
    assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(converted),
                "--train_files", f"{corpus}/*.txt", "--max_steps", "5", "--save_strategy", "no", *BASE]) == 0
    tuned = AutoModelForCausalLM.from_pretrained(out)
    assert tuned.config.hidden_size == 32 and tuned.config.vocab_size >= 512
    assert len(losses(out)) == 5 and all(math.isfinite(x) for x in losses(out))
