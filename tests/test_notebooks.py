"""Every lesson runs top to bottom in a fresh kernel with QUICK=True. (Each instructor notebook
runs top to bottom as it is graded, in tests/test_labs.py.)"""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import NOTEBOOKS, REPO, error_outputs, parameters_cell, run_benchmark

from course_tools import lesson_times
from grading.notebook import read_notebook
from grading.run.warm import run_lesson


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    source = parameters_cell(path)
    assert "QUICK" in source and "DEVICE" in source
    out = tmp_path / path.name
    started = time.monotonic()
    run_lesson(
        path,
        out,
        parameters={"QUICK": True},
        kernel_name="python3",
        cwd=str(tmp_path),
        progress_bar=False,
        execution_timeout=600,
    )
    # the lessons state their run time from these measurements (course_tools.lesson_times)
    assert lesson_times.record(path.stem, "quick", time.monotonic() - started).is_file()
    assert not error_outputs(json.loads(out.read_text()))
    if path.stem == "01_gemm_profiling":
        _chapter01_wrote_a_chrome_trace(tmp_path, out)


def _chapter01_wrote_a_chrome_trace(tmp_path, out):
    traces = list((tmp_path / "traces").glob("*.json"))
    assert traces, "chapter 01 should export a Chrome trace into traces/"
    trace = json.loads(traces[0].read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names or any(str(n).startswith(("sm", "ampere", "cutlass")) for n in names)
    text = out.read_text()
    assert "application/vnd.plotly.v1+json" in text, "the size sweep should be a plotly chart"


def test_every_lesson_states_its_measured_run_times():
    """Each lesson's "Run time" paragraph is the one course_tools.lesson_times writes from run_times.json
    (the figures come from measurement; this checks they were carried over, not how fast anything ran)."""
    times = lesson_times.read_times()
    for path in NOTEBOOKS:
        entry = times.get(path.stem)
        assert entry and "quick_s" in entry and "full_s" in entry, f"notebooks/run_times.json lacks {path.stem}"
        assert lesson_times.stated_paragraph(path) == lesson_times.run_time_paragraph(entry), (
            f"{path.name} does not state the run times in run_times.json: run `python -m course_tools.lesson_times "
            f"update`"
        )
        params = parameters_cell(path)
        assert not re.search(r"\b(minute|seconds?)\b", params), (
            f"{path.name}'s parameters cell states a time of its own; the Run time paragraph is the one place"
        )


def test_update_restates_a_lesson_from_the_measurements(tmp_path):
    """record -> update rewrites run_times.json and the lesson's Run time paragraph, and only that."""
    import shutil

    lesson = tmp_path / "notebooks" / NOTEBOOKS[1].name
    lesson.parent.mkdir()
    shutil.copy(NOTEBOOKS[1], lesson)
    before = read_notebook(lesson)
    measured, times_file = tmp_path / "measured", tmp_path / "notebooks" / "run_times.json"
    lesson_times.record(lesson.stem, "quick", 24.0, measured)
    lesson_times.record(lesson.stem, "full", 201.0, measured)
    assert lesson_times.update(measured, times_file, lesson.parent) == [lesson.name]
    entry = lesson_times.read_times(times_file)[lesson.stem]
    assert entry["quick_s"] == 24.0 and entry["full_s"] == 201.0
    stated = lesson_times.stated_paragraph(lesson)
    assert "about 25 s with `QUICK = True`, about 3 min with the full settings" in stated
    after = read_notebook(lesson)
    assert [c.source for c in after.cells[1:]] == [c.source for c in before.cells[1:]]
    assert lesson_times.update(measured, times_file, lesson.parent) == [], "a second update changes nothing"


def test_run_time_descriptions():
    assert lesson_times.describe(3) == "about 5 s"
    assert lesson_times.describe(24) == "about 25 s"
    assert lesson_times.describe(201) == "about 3 min"
    assert lesson_times.describe(75) == "about 1 min"
    with pytest.raises(ValueError):
        lesson_times.describe(-1)


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
        cells = [
            c for c in read_notebook(path).cells if c.cell_type == "markdown" and c.source.startswith("## Glossary")
        ]
        assert cells, f"{path.name} needs a '## Glossary' section with the Chinese terms"
        rows = [line for line in cells[0].source.splitlines() if line.startswith("| ") and "---" not in line][1:]
        assert rows
        for row in rows:
            assert row in glossary, f"GLOSSARY.md lacks {row!r} from {path.name}"
