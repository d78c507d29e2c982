"""Outputs appear only when complete: a killed `lex export` or `lex convert-torchscale` (SIGKILL in a real
process: no `finally`, no cleanup) leaves the previous output folder exactly as it was, and the next run removes
the hidden folder it left; SIGTERM cleans up as Ctrl-C does; a live process's staging folder is never touched;
written files get umask modes."""

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configuration_lex import LexConfig
from convert.torchscale import convert_to_torchscale
from lex_base.staging import atomic_directory, atomic_files, host_tag, make_staging, process_exists
from modeling_lex import LexForCausalLM

ROOT = Path(__file__).resolve().parents[1]

# Runs `lex ARGS...` with one function patched to die by SIGKILL: WHERE names it, WHEN says before or after it
# does its work. A half-written weights file is left behind first, as a real crash would.
KILLED = """
import os, signal, sys
from pathlib import Path
import lex_base.staging, transformers

where, when, args = sys.argv[1], sys.argv[2], sys.argv[3:]
owner, name = (transformers.PreTrainedModel, "save_pretrained") if where == "save" else (lex_base.staging, "_exchange")
real = getattr(owner, name)

def dies(*a, **k):
    if when == "sigterm":  # half written, then SIGTERM (a scheduler's preemption, `timeout`)
        folder = Path(a[1])
        (folder / "model.safetensors").write_bytes(b"half a file")
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)
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


@pytest.mark.slow
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

    # the next run (same command, no patch) removes it: its process no longer exists
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    again = subprocess.run([sys.executable, "-m", "lex.cli", command, *source[:1], str(out), *source[1:], "--force"],
                           env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert LexForCausalLM.from_pretrained(out).config.hidden_size == 32


@pytest.mark.slow
@pytest.mark.parametrize("command", ["export", "convert-torchscale"])
def test_sigterm_while_writing_cleans_up_like_ctrl_c(command, model_dir, tmp_path):
    source = [str(model_dir)] if command == "export" else torchscale_checkpoint(model_dir, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"previous": true}')
    previous = snapshot(out)
    listing = sorted(p.name for p in tmp_path.iterdir())

    result = killed("save", "sigterm", command, *source[:1], str(out), *source[1:], "--force")
    assert result.returncode == 143, result.stderr
    assert result.stderr.splitlines()[-1] == f"lex {command}: terminated (SIGTERM)"
    assert snapshot(out) == previous and sorted(p.name for p in tmp_path.iterdir()) == listing  # no partial left


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


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_staging_of_dead_processes_is_removed_and_live_ones_are_kept(tmp_path):
    """Staging folders name their host and PID: a dead process's is removed by the next staging for the same
    output; this live process's, another host's, another output's and an old unnamed one are left alone."""
    host, target = host_tag(), tmp_path / "out"
    dead = tmp_path / f".out.partial-{host}-{dead_pid()}-0123abcd"
    dead_old = tmp_path / f".out.partial-{host}-{dead_pid()}-0123abcd-old"  # an interrupted swap's old folder
    live = tmp_path / f".out.partial-{host}-{os.getpid()}-0123abcd"
    elsewhere = tmp_path / f".out.partial-{'0' * 8 if host != '0' * 8 else '1' * 8}-{dead_pid()}-0123abcd"
    other_output = tmp_path / f".other.partial-{host}-{dead_pid()}-0123abcd"
    legacy = tmp_path / ".out.partial-0123456789ab"
    for folder in (dead, dead_old, live, elsewhere, other_output, legacy):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    assert not process_exists(int(dead.name.split("-")[2])) and process_exists(os.getpid())

    staging = make_staging(target)
    assert staging.name.startswith(f".out.partial-{host}-{os.getpid()}-")
    assert not dead.exists() and not dead_old.exists()
    assert live.exists() and elsewhere.exists() and other_output.exists() and legacy.exists()


def test_written_files_get_the_users_modes(model_dir, tmp_path):
    """Whatever mode a writer gave its temporary files, what appears follows the umask (0644 under 022)."""
    for umask in (0o022, 0o027):
        previous = os.umask(umask)
        try:
            with atomic_directory(tmp_path / f"dir{umask:o}") as staging:
                (staging / "private").write_text("x")
                os.chmod(staging / "private", 0o600)  # as a tempfile-based writer leaves it
                (staging / "sub").mkdir(mode=0o700)
                (staging / "sub" / "tool").write_text("#!/bin/sh\n")
                os.chmod(staging / "sub" / "tool", 0o700)
            with atomic_files(tmp_path / f"files{umask:o}") as staging:
                (staging / "config.json").write_text("{}")
                os.chmod(staging / "config.json", 0o600)
        finally:
            os.umask(previous)
        folder = tmp_path / f"dir{umask:o}"
        assert {p.relative_to(folder).as_posix(): p.stat().st_mode & 0o777 for p in [folder, *folder.rglob("*")]} == {
            ".": 0o777 & ~umask, "private": 0o666 & ~umask, "sub": 0o777 & ~umask, "sub/tool": 0o777 & ~umask}
        assert (tmp_path / f"files{umask:o}" / "config.json").stat().st_mode & 0o777 == 0o666 & ~umask
