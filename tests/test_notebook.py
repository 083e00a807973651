"""notebooks/quickstart.ipynb runs top to bottom (code cells in one namespace), on the tiny tool model."""

from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(tool_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ARPO_NOTEBOOK_MODEL", str(tool_model_dir))
    monkeypatch.setenv("ARPO_NOTEBOOK_STEPS", "1")
    monkeypatch.setenv("ARPO_NOTEBOOK_OUTPUT", str(tmp_path / "run"))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    namespace: dict = {}
    for cell in notebook.cells:
        if cell.cell_type == "code":
            exec(compile(cell.source, f"{NOTEBOOK.name}", "exec"), namespace)
    assert namespace["trainer"].state.global_step == 1
    assert len(namespace["tree"]) == 4 and {r["step"] for r in namespace["tree"]} == {0}
    assert (tmp_path / "run" / "tree.png").read_bytes()[:4] == b"\x89PNG"
