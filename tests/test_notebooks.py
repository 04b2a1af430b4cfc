"""Every lesson and instructor notebook runs top to bottom in a fresh kernel with QUICK=True."""

from __future__ import annotations

import json

import papermill
import pytest

from conftest import NOTEBOOKS, REPO, SOLUTIONS, run_benchmark
from grading.notebook import read_notebook


def _parameters_cell(path):
    cells = [c for c in read_notebook(path).cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{path} needs exactly one cell tagged 'parameters'"
    return cells[0].source


@pytest.mark.parametrize("path", NOTEBOOKS + SOLUTIONS, ids=[p.stem for p in NOTEBOOKS + SOLUTIONS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    source = _parameters_cell(path)
    assert "QUICK" in source and "DEVICE" in source
    out = tmp_path / path.name
    papermill.execute_notebook(str(path), str(out), parameters={"QUICK": True}, kernel_name="python3",
                               cwd=str(tmp_path), progress_bar=False, execution_timeout=600)
    executed = json.loads(out.read_text())
    errors = [o for c in executed["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


def test_chapter01_writes_a_chrome_trace(tmp_path):
    out = tmp_path / "01.ipynb"
    papermill.execute_notebook(str(REPO / "notebooks" / "01_gemm_profiling.ipynb"), str(out),
                               parameters={"QUICK": True}, kernel_name="python3", cwd=str(tmp_path),
                               progress_bar=False, execution_timeout=600)
    traces = list((tmp_path / "traces").glob("*.json"))
    assert traces, "chapter 01 should export a Chrome trace into traces/"
    trace = json.loads(traces[0].read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names or any(str(n).startswith(("sm", "ampere", "cutlass")) for n in names)
    text = out.read_text()
    assert "application/vnd.plotly.v1+json" in text, "the size sweep should be a plotly chart"


def test_gemm_sweep_benchmark_writes_json(tmp_path):
    result = run_benchmark("gemm_sweep", tmp_path / "sweep.json")
    peak = result["peak"]["peak_gflops"]
    assert [row["n"] for row in result["results"]] == result["sizes"]
    for row in result["results"]:
        assert row["gflops"] > 0
        assert row["fraction_of_peak"] == pytest.approx(row["gflops"] / peak)


def test_glossary_collects_every_lessons_terms():
    glossary = (REPO / "GLOSSARY.md").read_text()
    for path in NOTEBOOKS:
        cells = [c for c in read_notebook(path).cells if c.cell_type == "markdown" and c.source.startswith("## Glossary")]
        assert cells, f"{path.name} needs a '## Glossary' section with the Chinese terms"
        rows = [line for line in cells[0].source.splitlines() if line.startswith("| ") and "---" not in line][1:]
        assert rows
        for row in rows:
            assert row in glossary, f"GLOSSARY.md lacks {row!r} from {path.name}"
