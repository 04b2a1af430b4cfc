"""`infra-lab progress` over a folder of labs, its chart, and the progress cell at the top of each lab."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAB01, REPO, write_learner_notebook

from grading.notebook import read_notebook
from grading.notebook import test_cells as graded_cells  # (not named test_*: pytest would collect it)
from grading.progress import failing_checks, from_results, progress_table
from grading.progress_panel import BUTTON_LABEL, progress_panel

# The tests share one graded course folder: keep them on one worker so it is graded once.
pytestmark = pytest.mark.xdist_group("progress")

LAB02 = REPO / "labs" / "lab02_roofline" / "lab02_roofline.ipynb"


def _progress(labs: Path, grades: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "course_tools.cli", "progress", "--labs", str(labs), "--out", str(grades)],
        cwd=labs.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _check_ids(lab: str) -> list[str]:
    trusted = read_notebook(REPO / "solutions" / lab / f"{lab}.ipynb")
    return [call.check_id for test in graded_cells(trusted) for call in test.checks]


@pytest.fixture(scope="module")
def course(tmp_path_factory, solution_answers):
    """A course folder: lab 01 solved, lab 02 untouched, and a notebook of no known lab; graded once."""
    root = tmp_path_factory.mktemp("course")
    labs = root / "labs"
    write_learner_notebook(labs / "lab01_gemm" / "lab01_gemm.ipynb", solution_answers)
    (labs / "lab02_roofline").mkdir(parents=True)
    shutil.copy(LAB02, labs / "lab02_roofline" / "lab02_roofline.ipynb")
    (labs / "lab99_unknown").mkdir()
    shutil.copy(LAB01, labs / "lab99_unknown" / "lab99_unknown.ipynb")
    return root, _progress(labs, root / "grades").stdout


def _panel_text(box) -> str:
    return "".join(o.get("text", "") for o in box.children[0].outputs)


def _panel_figure(box) -> dict | None:
    bundles = [o["data"] for o in box.children[0].outputs if o.get("output_type") == "display_data"]
    return bundles[0]["application/vnd.plotly.v1+json"] if bundles else None


def test_failing_checks_read_back_what_the_grader_wrote():
    from grading.check import Verdict
    from grading.grader import CheckResult, GradeReport, TestResult
    from grading.registry import get_check
    from grading.report import gradescope_results

    wrong = Verdict("lab01.gemm_flops", False, "gemm_flops(2, 3, 4) returned 24", "expected 48", "wrong result")
    crashed = Verdict("lab01.time_op_sync", False, "your code raised ValueError: no", kind="error")
    report = GradeReport(
        "lab01_gemm",
        "x.ipynb",
        0,
        [
            TestResult(
                "test_task1",
                0.0,
                2.0,
                [
                    CheckResult(
                        "lab01.gemm_flops",
                        False,
                        False,
                        wrong.message(get_check("lab01.gemm_flops"), hidden=False),
                        "wrong result",
                    )
                ],
            ),
            TestResult(
                "test_task2",
                0.0,
                3.0,
                [
                    CheckResult("lab01.time_op_warmup", False, True, "lab01.time_op_warmup passed"),
                    CheckResult(
                        "lab01.time_op_sync",
                        True,
                        False,
                        crashed.message(get_check("lab01.time_op_sync"), hidden=True),
                        "error",
                    ),
                ],
            ),
            TestResult("test_task4", 2.0, 2.0, [CheckResult("lab01.achieved_tflops", False, True, "passed")]),
        ],
    )
    failing = failing_checks(gradescope_results(report))
    assert [(f.check_id, f.test, f.reason) for f in failing] == [
        ("lab01.gemm_flops", "test_task1", "wrong result"),
        ("lab01.time_op_sync", "test_task2", "error"),
    ]
    assert failing[0].detail == "gemm_flops(2, 3, 4) returned 24"
    assert failing[0].line() == "lab01.gemm_flops (wrong result): gemm_flops(2, 3, 4) returned 24"
    assert len(failing[1].line(30)) == 30 and failing[1].line(30).endswith("...")
    progress = from_results("lab01_gemm", gradescope_results(report))
    assert (progress.score, progress.max_score, progress.tests_passed, progress.tests) == (2, 7, 1, 3)
    assert progress.fraction == pytest.approx(2 / 7)


def test_progress_prints_scores_and_the_checks_still_failing(course):
    root, out = course
    assert re.search(r"^lab01_gemm\s+10/10\s+4/4\s*$", out, re.M), out
    maximum = sum(
        t.points for t in graded_cells(read_notebook(REPO / "solutions" / "lab02_roofline" / "lab02_roofline.ipynb"))
    )
    # The untouched lab is one line: its checks all fail on the stubs, so none is listed.
    assert re.search(rf"^lab02_roofline\s+0/{maximum:g}\s+0/\d+\s+not started$", out, re.M), out
    assert re.search(r"^lab99_unknown\s+-\s+-\s+cannot grade: no lab named 'lab99_unknown'", out, re.M), out
    assert re.search(rf"^total\s+10/{10 + maximum:g}", out, re.M)
    assert "still failing:" not in out and "NotImplementedError" not in out
    assert f"chart: {root / 'grades' / 'progress.html'}" in out


def _lab_progress(lab: str, checks: list[tuple[str, str, str]], passed: int = 0):
    """A LabProgress as read back from results.json: one test per (check_id, reason, detail), then
    ``passed`` passing tests of 1 point each."""
    from grading.grader import CheckResult, GradeReport
    from grading.grader import TestResult as GradedTest
    from grading.report import gradescope_results

    tests = [
        GradedTest(
            f"test_{check_id}",
            0.0,
            2.0,
            [CheckResult(check_id, False, False, f"{check_id} failed [{lab} task] ({reason})\n  {detail}", reason)],
        )
        for check_id, reason, detail in checks
    ]
    tests += [
        GradedTest(f"test_done{i}", 1.0, 1.0, [CheckResult(f"done{i}", False, True, "passed")]) for i in range(passed)
    ]
    return from_results(lab, gradescope_results(GradeReport(lab, f"{lab}.ipynb", 0, tests)))


def test_a_lab_not_started_is_one_line_and_a_lab_begun_lists_what_fails():
    stub = "your code raised NotImplementedError: lab07 task {} (see the stub)"
    blank = _lab_progress("lab07_paged_kv", [(f"lab07.check{i}", "error", stub.format(i)) for i in range(30)])
    unrecorded = _lab_progress(
        "lab08_scheduler",
        [("lab08.a", "error", "no answer was recorded: its answer cell raised NotImplementedError: lab08 task 1")],
    )
    begun = _lab_progress(
        "lab01_gemm",
        [
            ("lab01.gemm_flops", "wrong result", "gemm_flops(2, 3, 4) returned 24"),
            ("lab01.time_op_sync", "error", stub.format(2)),
        ],
    )
    scored = _lab_progress("lab02_roofline", [("lab02.ai", "error", stub.format(1))], passed=1)
    assert (blank.not_started, unrecorded.not_started, begun.not_started, scored.not_started) == (
        True,
        True,
        False,
        False,
    )
    out = progress_table([blank, unrecorded, begun, scored])
    assert re.search(r"^lab07_paged_kv\s+0/60\s+0/30\s+not started$", out, re.M), out
    assert re.search(r"^lab08_scheduler\s+0/2\s+0/1\s+not started$", out, re.M), out
    failing = out.split("still failing:")[1]
    assert "lab07_paged_kv" not in failing and "lab08_scheduler" not in failing
    assert re.search(
        r"^  lab01_gemm\n    lab01\.gemm_flops \(wrong result\): gemm_flops\(2, 3, 4\) returned 24\n"
        r"    lab01\.time_op_sync \(error\): your code raised NotImplementedError",
        failing,
        re.M,
    ), failing
    assert re.search(r"^  lab02_roofline\n    lab02\.ai \(error\)", failing, re.M), failing


def test_progress_writes_a_self_contained_chart(course):
    root, _ = course
    page = (root / "grades" / "progress.html").read_text()
    assert len(page) > 1_000_000 and "<script src=" not in page  # plotly.js is inside, not fetched
    call = re.search(r"Plotly\.newPlot\(\s*\"[\w-]+\",\s*(\[.*?\]),\s*\{", page, re.S)
    bars = json.loads(call.group(1))[0]
    assert bars["type"] == "bar" and bars["x"] == ["lab01_gemm", "lab02_roofline", "lab99_unknown"]
    assert bars["y"] == [1.0, 0.0, 0.0] and bars["text"][0] == "10/10" and bars["text"][2] == "not graded"
    assert "every check passes" in bars["hovertext"][0]
    assert "not started" in bars["hovertext"][1] and _check_ids("lab02_roofline")[0] not in bars["hovertext"][1]


def test_lab_cell_shows_the_recorded_grade(course):
    root, _ = course
    solved = progress_panel("lab01_gemm", root / "labs" / "lab01_gemm" / "lab01_gemm.ipynb")
    text = _panel_text(solved)
    assert text.startswith("lab01_gemm: 10/10 points, 4/4 tests passed") and "every check passes" in text
    assert str(root / "grades" / "lab01_gemm" / "results.json") in text
    blank = progress_panel("lab02_roofline", root / "labs" / "lab02_roofline" / "lab02_roofline.ipynb")
    text = _panel_text(blank)
    assert re.match(r"lab02_roofline: 0/\d+ points", text) and "still failing:" in text
    for check_id in _check_ids("lab02_roofline"):
        assert f"  {check_id} (error): your code raised NotImplementedError" in text
    figure = _panel_figure(blank)
    assert [bar["type"] for bar in figure["data"]] == ["bar", "bar"]
    assert figure["data"][1]["y"] == [0.0] * len(figure["data"][1]["x"])
    button = blank.children[1]
    assert button.description == BUTTON_LABEL and not button.disabled


def test_lab_cell_without_a_grade_says_how_to_grade_and_grades_nothing(tmp_path):
    notebook = write_learner_notebook(tmp_path / "labs" / "lab01_gemm" / "lab01_gemm.ipynb", {})
    text = _panel_text(progress_panel("lab01_gemm", notebook))
    assert "no recorded grade yet" in text and "infra-lab grade labs/lab01_gemm/lab01_gemm.ipynb" in text
    assert BUTTON_LABEL in text
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["lab01_gemm", "lab01_gemm.ipynb", "labs"]


def test_button_grades_the_saved_notebook_and_progress_reuses_that_grade(course, tmp_path, solution_answers):
    root, _ = course
    labs = tmp_path / "labs"
    wrong = {**solution_answers, "task1_gemm_flops": "def gemm_flops(m, n, k):\n    return m * n * k\n"}
    notebook = write_learner_notebook(labs / "lab01_gemm" / "lab01_gemm.ipynb", wrong)
    shutil.copytree(root / "grades" / "lab01_gemm", tmp_path / "grades" / "lab01_gemm")  # the 10/10 of before
    panel = progress_panel("lab01_gemm", notebook)
    assert _panel_text(panel).startswith("lab01_gemm: 10/10 points")
    panel.children[1].click()  # grades the file on disk, in another process
    text = _panel_text(panel)
    assert text.startswith("lab01_gemm: 8/10 points, 3/4 tests passed"), text
    assert re.search(r"^  lab01\.gemm_flops \(wrong result\): ", text, re.M), text
    assert _panel_figure(panel)["data"][1]["y"][0] == 0.0  # task 1's bar is empty
    again = _progress(labs, tmp_path / "grades").stdout
    assert re.search(r"^lab01_gemm\s+8/10\s+3/4\s+\(unchanged since last grade\)", again, re.M), again


def test_progress_reuses_the_grading_infra_lab_grade_made_of_the_same_answers(tmp_path, monkeypatch):
    """`infra-lab grade` marks its grading as `infra-lab progress` does: progress right after it
    grades nothing while the answers and the lab are unchanged, and grades again once they change."""
    import nbformat

    import grading.grader
    from grading.notebook import is_solution_cell
    from grading.progress import UNCHANGED, course_progress
    from grading.run.sandbox import Limits

    notebook = tmp_path / "labs" / "lab02_roofline" / "lab02_roofline.ipynb"
    notebook.parent.mkdir(parents=True)
    shutil.copy(LAB02, notebook)
    graded = subprocess.run(
        [sys.executable, "-m", "course_tools.cli", "grade", "labs/lab02_roofline/lab02_roofline.ipynb"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert graded.returncode == 0, graded.stdout + graded.stderr
    assert "on a quiet machine" in graded.stderr, graded.stderr  # the estimate it printed first

    class Graded(Exception):
        """Raised by the stand-in grader: reaching it is what counts."""

    gradings = []

    def count_grading(*args, **kwargs):
        gradings.append(args)
        raise Graded

    monkeypatch.setattr(grading.grader, "grade_notebook", count_grading)
    (row,) = course_progress([notebook], tmp_path / "grades", limits=Limits(), progress=False)
    assert gradings == [] and row.note == UNCHANGED, row.note
    assert row.graded and row.tests > 0 and row.not_started  # the untouched lab's grade, read back

    changed = nbformat.read(notebook, as_version=4)
    next(cell for cell in changed.cells if is_solution_cell(cell)).source += "\n# edited\n"
    nbformat.write(changed, notebook)
    with pytest.raises(Graded):
        course_progress([notebook], tmp_path / "grades", limits=Limits(), progress=False)
    assert len(gradings) == 1, "changed answers are graded again"


def test_a_failed_grading_leaves_no_mark_of_an_earlier_one(tmp_path):
    """A grading that could not be done (its results.json says why) is never reused as the grading
    of the answers an earlier mark stood for."""
    from course_tools.cli import main
    from grading.progress import STAMP

    out = tmp_path / "out"
    out.mkdir()
    (out / STAMP).write_text("0" * 64)
    assert main(["grade", str(tmp_path / "missing.ipynb"), "--out", str(out)]) != 0
    assert json.loads((out / "results.json").read_text())["tests"] == [] and not (out / STAMP).exists()
