"""notebooks/quickstart.ipynb runs top to bottom (code cells in one namespace), on the tiny tool model; and the
committed notebook carries the outputs of `python notebooks/execute.py` (the run's table, the reward curve, a tree)."""

import base64
import importlib.util
from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"
EXECUTE = NOTEBOOK.parent / "execute.py"


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
    assert (tmp_path / "run" / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"


def png_outputs(cell) -> list[bytes]:
    return [base64.b64decode(o["data"]["image/png"]) for o in cell.outputs if "image/png" in o.get("data", {})]


def test_committed_notebook_carries_outputs():
    """A reader on GitHub sees the outputs: an edit that strips them (or saves a failed run) fails here; rerun
    `python notebooks/execute.py` to refresh them."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "not executed top to bottom"
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]

    def cell_with(text: str):
        return next(cell for cell in code if text in cell.source)

    for picture in ("reward_curve.png", "render_tree_png"):  # the reward curve and a rollout tree, embedded
        pngs = png_outputs(cell_with(picture))
        assert pngs and all(png[:4] == b"\x89PNG" and len(png) > 5000 for png in pngs), picture
    tables = [o["data"]["text/markdown"] for o in cell_with("markdown_table").outputs
              if "text/markdown" in o.get("data", {})]
    assert len(tables) == 1 and tables[0].startswith("| step | reward |")
    rows = tables[0].splitlines()[2:]
    assert rows and all(row.startswith("| ") and row.count("|") == 7 for row in rows)
    tree_text = "".join(o.get("text", "") for o in cell_with("format_tree").outputs if o.output_type == "stream")
    assert tree_text.startswith("step ") and "prompt:" in tree_text
    assert "**Saved outputs**: `python notebooks/execute.py" in notebook.cells[0].source
    assert NOTEBOOK.stat().st_size < 1_000_000

    spec = importlib.util.spec_from_file_location("notebook_execute", EXECUTE)  # its check: no absolute path,
    execute = importlib.util.module_from_spec(spec)  # ANSI escape or token value in the outputs
    spec.loader.exec_module(execute)
    execute.check(notebook)
