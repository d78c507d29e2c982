"""The quickstart notebook runs top to bottom (few training steps)."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("LEX_NOTEBOOK_STEPS", "5")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(str(o.get("text", "")) for cell in notebook.cells for o in cell.get("outputs", []))
    assert "cache holds" in outputs
    assert not any(o.get("output_type") == "error" for cell in notebook.cells for o in cell.get("outputs", []))
