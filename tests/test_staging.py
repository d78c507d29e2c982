"""Outputs appear only when complete: a killed `lex export` or `lex convert-torchscale` (SIGKILL in a real
process: no `finally`, no cleanup) leaves the previous output folder exactly as it was."""

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configuration_lex import LexConfig
from convert.staging import atomic_directory, atomic_files
from convert.torchscale import convert_to_torchscale
from modeling_lex import LexForCausalLM

ROOT = Path(__file__).resolve().parents[1]

# Runs `lex ARGS...` with one function patched to die by SIGKILL: WHERE names it, WHEN says before or after it
# does its work. A half-written weights file is left behind first, as a real crash would.
KILLED = """
import os, signal, sys
from pathlib import Path
import convert.staging, transformers

where, when, args = sys.argv[1], sys.argv[2], sys.argv[3:]
owner, name = (transformers.PreTrainedModel, "save_pretrained") if where == "save" else (convert.staging, "_exchange")
real = getattr(owner, name)

def dies(*a, **k):
    if when == "before":
        folder = Path(a[1])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"half a file")
        (folder / "config.json").write_text("{")
        os.kill(os.getpid(), signal.SIGKILL)
    result = real(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)

setattr(owner, name, dies)
from lex.cli import main
sys.exit(main(args))
"""


def snapshot(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def killed(where: str, when: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", KILLED, where, when, *args], env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = LexConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, max_position_embeddings=16)
    path = tmp_path_factory.mktemp("model") / "lex"
    LexForCausalLM(config).save_pretrained(path)
    return path


def torchscale_checkpoint(model_dir: Path, folder: Path) -> list[str]:
    """A TorchScale Decoder state dict and its DecoderConfig JSON, written from the LEX folder."""
    convert_to_torchscale(model_dir, folder / "decoder.pt")
    return [str(folder / "decoder.pt"), "--config", str(folder / "decoder.json")]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("command", ["export", "convert-torchscale"])
def test_killed_while_writing_or_swapping_leaves_a_complete_folder(command, when, model_dir, tmp_path):
    """Killed while writing: the previous folder is untouched. Killed right after the swap that puts the new
    folder in place: the new folder is complete. Never a mix, never no folder."""
    source = [str(model_dir)] if command == "export" else torchscale_checkpoint(model_dir, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"previous": true}')
    (out / "weights.bin").write_bytes(b"previous weights")
    previous = snapshot(out)

    result = killed("save" if when == "before" else "swap", when, command, *source[:1], str(out), *source[1:],
                    "--force")
    assert result.returncode == -signal.SIGKILL, result.stderr
    if when == "before":
        assert snapshot(out) == previous
    else:
        assert "weights.bin" not in snapshot(out)
        assert LexForCausalLM.from_pretrained(out).config.hidden_size == 32
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]  # what a kill leaves: hidden


def test_failed_block_leaves_no_trace_and_existing_output_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous")
    with pytest.raises(FileExistsError, match="--force"):
        with atomic_directory(out):
            pass
    with pytest.raises(RuntimeError):
        with atomic_directory(out, force=True) as staging:
            (staging / "half.txt").write_text("half")
            raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [p.name for p in out.iterdir()] == ["keep.txt"]
    with atomic_files(out, ("keep.txt",)) as staging:
        (staging / "keep.txt").write_text("new")
        (staging / "config.json").write_text("{}")
    assert (out / "keep.txt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(FileExistsError, match="--force"):
        with atomic_files(out, ("keep.txt",), force=False):
            pass
