"""notebooks/quickstart.ipynb runs top to bottom on CPU in this interpreter's environment; any failing cell fails."""
import json
import pathlib
import sys

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
KERNEL = "jaxserve-test"
CELL_TIMEOUT_S = 600   # generous: the notebook takes about a minute, CI machines are busy

pytestmark = pytest.mark.slow


def this_python_kernel(kernel_dir: pathlib.Path) -> KernelManager:
    """A kernel on sys.executable (the venv running pytest), whatever `python3` kernelspec the machine has."""
    spec = kernel_dir / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxserve tests", "language": "python"}))
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))


def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, km=this_python_kernel(tmp_path / "kernels"), timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(ROOT)}})
    client.execute()   # raises CellExecutionError naming the cell that failed
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert any("image/png" in out.get("data", {}) for out in code[-1].outputs)   # the sweep's heat map
