"""The quickstart notebook runs headless, top to bottom, in a fresh kernel."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[2] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "reward per step" in outputs and "SFT loss" in outputs
    assert not any(o.get("output_type") == "error" for c in nb.cells
                   for o in c.get("outputs", []))
