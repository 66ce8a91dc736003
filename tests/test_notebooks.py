"""Execute the colab notebooks headless on CPU in tiny mode (network cells skipped); the install
cell's search for the project (folder or uploaded zip) runs on its own, without its shell lines."""
import os
import zipfile

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(name, tmp_path):
    nb = nbformat.read(os.path.join(ROOT, "colab", name), as_version=4)
    cells = []
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if "network" in tags:
            continue
        if "parameters" in tags:  # switch to tiny mode, outputs under tmp
            cell.source += f"\nTINY = True\nWORKDIR = {str(tmp_path / 'work')!r}"
        cells.append(cell)
    nb.cells = cells
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}})
    client.execute()
    return nb


def _outputs(nb):
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["quickstart.ipynb", "qwen3_sparse_rollout.ipynb"])
def test_notebook_runs_headless(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nb = _run(name, tmp_path)
    text = _outputs(nb)
    if name == "quickstart.ipynb":
        assert '"rollout_speedup"' in text and os.path.exists(tmp_path / "work" / "report.json")
    else:
        assert "scorer vs sampler max |dlogp|" in text and "bin " in text
        assert "text prompts:" in text and "completion 0:" in text  # the tokenizer's path, not random ids


def _find_project_code(name):
    """The install cell's Python lines (IPython ``%`` / ``!`` lines dropped)."""
    nb = nbformat.read(os.path.join(ROOT, "colab", name), as_version=4)
    cell = next(c for c in nb.cells if "network" in c.get("metadata", {}).get("tags", []))
    return "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))


@pytest.mark.parametrize("name", ["quickstart.ipynb", "qwen3_sparse_rollout.ipynb"])
def test_install_cell_finds_the_project(name, tmp_path, monkeypatch):
    code = _find_project_code(name).split("from huggingface_hub")[0]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="sparrow-jax.zip"):  # nothing here: says what to upload
        exec(code, {})
    with zipfile.ZipFile(tmp_path / "sparrow-jax.zip", "w") as z:  # an uploaded `git archive --prefix` copy
        z.writestr("sparrow-jax/setup.py", "")
        z.writestr("sparrow-jax/sparrow_jax/__init__.py", "")
    scope = {}
    exec(code, scope)
    assert scope["PROJECT"] == str(tmp_path / "sparrow-jax-unzipped" / "sparrow-jax")
    monkeypatch.chdir(tmp_path / "sparrow-jax-unzipped" / "sparrow-jax" / "sparrow_jax")  # opened inside it
    scope = {}
    exec(code, scope)
    assert scope["PROJECT"] == str(tmp_path / "sparrow-jax-unzipped" / "sparrow-jax")
