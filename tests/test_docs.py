"""The documentation site builds without a warning: `mkdocs build --strict`, as docs/index.md prints it (a broken
link or anchor, a page missing from the nav, a docstring mkdocstrings cannot render, a command whose --help the
build cannot make all fail it), into a temporary folder; and the reference holds every command's --help."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import DOCS, ROOT, commands, marked_blocks

INDEX = DOCS / "index.md"
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None
    or importlib.util.find_spec("material") is None,
    reason="the docs need mkdocs, mkdocs-material and mkdocstrings[python]: pip install -e '.[test]'")


def test_the_site_builds_without_warnings(tmp_path):
    (block,) = marked_blocks(INDEX, "tests/test_docs.py::test_the_site_builds_without_warnings")
    (command,) = commands(block)
    assert command == ["mkdocs", "build", "--strict"]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "COLUMNS": "110"}
    run = subprocess.run([sys.executable, "-m", *command, "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "WARNING" not in run.stderr, run.stderr[-4000:]
    site = tmp_path / "site"
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    from lex.cli import COMMANDS

    for name in COMMANDS:
        assert f"usage: lex {name}" in cli, f"the reference lacks `lex {name} --help`"
    assert "--attention_memory_blocks" in cli
    config = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    assert "attention_memory_block_size" in config and "max_position_embeddings" in config
    caches = (site / "reference" / "caches" / "index.html").read_text(encoding="utf-8")
    assert "LexCache" in caches and "LexStaticCache" in caches
    converters = (site / "reference" / "converters" / "index.html").read_text(encoding="utf-8")
    assert "lex_from_hf" in converters and "convert_from_torchscale" in converters
    for page in ("results", "concepts/retrieval-rule", "concepts/attention", "guides/convert"):
        assert (site / page / "index.html").exists(), page
