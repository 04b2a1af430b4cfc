"""Course-wide lab contract: every solution scores full marks under both graders, every
untouched lab scores zero with its tasks named, and labs/ is exactly what nbgrader releases."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    LAB01,
    LABS,
    NOTEBOOKS,
    REPO,
    SOLUTIONS,
    answer_cells,
    error_outputs,
    parameters_cell,
    size_for_ci,
    write_learner_notebook,
)

from course_tools.release import CONFIG, generate_all, lab_ids
from grading.grader import grade_notebook
from grading.notebook import read_notebook
from grading.readings import READINGS, not_started_hint
from grading.registry import all_checks
from grading.run import warm

# What code looks like in a message: a call or an index (a name right before "(" or "["), an
# assignment, a Triton or torch attribute, a Python keyword that starts a statement. The lesson
# sections a blank task is sent to are quoted by title and left out.
CODE = re.compile(r"\w[(\[]|\s=\s|[-+*/]=|\b(tl|torch|np|self)\.\w|\b(return|def|lambda|import)\s|\bfor \w+ in\b")


def _ids(paths):
    return [p.stem for p in paths]


def test_every_solution_has_a_released_lab():
    assert lab_ids() == [p.stem for p in LABS], "run `make labs` to regenerate labs/ from solutions/"
    assert LABS, "no labs found"


@contextlib.contextmanager
def cpu_hogs(n: int):
    """``n`` processes that keep a core busy each, for as long as the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)


@pytest.mark.notebook
@pytest.mark.parametrize("solution", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_solution_runs_top_to_bottom_and_scores_full_marks(solution):
    """Grading runs the instructor notebook top to bottom with QUICK=True (hidden checks too):
    no cell may fail and every check passes. The capstone, whose throughput tiers are graded as a ratio
    to the course's engine, is graded with two processes keeping both cores busy beside it (and the
    rest of the suite at work): its grade may not depend on the load."""
    source = parameters_cell(solution)
    assert "QUICK" in source and "DEVICE" in source
    with cpu_hogs(2 if solution.stem == "lab16_capstone" else 0) as hogs:
        report = grade_notebook(solution)
        assert all(hog.poll() is None for hog in hogs), "a hog stopped before the grading ended"
    assert report.executed is not None and not error_outputs(report.executed), error_outputs(report.executed or {})
    failed = [c.message for t in report.tests for c in t.checks if not c.passed]
    assert report.score == report.max_score > 0, failed
    if solution.stem == "lab16_capstone":  # its measurement reaches the report (scores.csv, progress history)
        assert report.measures["throughput_ratio"] >= 0.5, report.measures
    assert len(report.tests) >= 4
    assert any(c.hidden for t in report.tests for c in t.checks), "a lab needs hidden checks"
    assert any(not c.hidden for t in report.tests for c in t.checks), "a lab needs visible checks"


@pytest.mark.parametrize("lab", LABS, ids=_ids(LABS))
def test_untouched_lab_scores_zero_naming_each_task(lab):
    """...and each failure says where to read before starting, never the hint written for a wrong
    answer (on a blank lab that hint would be the recipe)."""
    report = grade_notebook(lab)
    assert report.score == 0 and report.max_score > 0
    prefix = lab.stem.split("_")[0]  # "lab01"
    checks = all_checks()
    for test in report.tests:
        for c in test.checks:
            assert not c.passed
            stub = re.search(rf"NotImplementedError: ({prefix} task \d+: [\w. ]+)", c.message)
            assert stub, c.message
            task = stub.group(1).strip()
            hint = c.message.split("hint: ", 1)[1]
            assert hint == not_started_hint(task, own=task == checks[c.check_id].task), c.message
            assert checks[c.check_id].hint not in c.message, f"{c.check_id} gives its wrong-answer hint to a blank lab"
            code = CODE.search(re.sub(r"“[^”]*”", "“…”", c.message))  # a section's title may name torch.fx
            assert not code, f"{c.check_id} shows code to a blank lab ({code.group(0)!r}): {c.message}"


def test_every_task_says_where_its_idea_is_taught():
    """Each task of each lab has a reading, and each section it names is a heading of that lesson."""
    tasks = {c.task for c in all_checks().values()}
    assert tasks <= set(READINGS), f"tasks without a reading in grading/readings.py: {sorted(tasks - set(READINGS))}"
    assert set(READINGS) <= tasks, f"readings for tasks no check exercises: {sorted(set(READINGS) - tasks)}"
    for task, (lesson, sections) in READINGS.items():
        headings = {
            line[3:].strip()
            for cell in read_notebook(REPO / "notebooks" / f"{lesson}.ipynb").cells
            if cell.cell_type == "markdown"
            for line in cell.source.splitlines()
            if line.startswith("## ")
        }
        missing = [s for s in sections if s not in headings]
        assert not missing, f"{task}: {lesson} has no section {missing}"


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """Every lab as nbgrader generates it now, in one run."""
    out = tmp_path_factory.mktemp("released")
    generate_all([lab.stem for lab in LABS], out)
    return out


@pytest.mark.xdist_group("released")  # one worker: nbgrader generates every lab once, not once per worker
@pytest.mark.parametrize("lab", LABS, ids=_ids(LABS))
def test_labs_equal_what_nbgrader_generates(lab, released):
    fresh = released / lab.stem / lab.name
    assert json.loads(fresh.read_text()) == json.loads(lab.read_text()), (
        f"{lab} differs from nbgrader's output: run `make labs`"
    )
    assert "BEGIN HIDDEN TESTS" not in lab.read_text()
    assert "BEGIN SOLUTION" not in lab.read_text()


@pytest.mark.parametrize("path", NOTEBOOKS + SOLUTIONS + LABS, ids=_ids(NOTEBOOKS + SOLUTIONS + LABS))
def test_notebooks_are_committed_without_outputs(path):
    nb = read_notebook(path)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path} has outputs in cells {dirty}; clear them before committing"


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    # nbgrader runs `alembic` by name: the venv's bin must be on PATH, as it is once activated.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    # nbgrader's kernels fork from this worker's template (grading.run.warm), as nbgrader_config.py
    # has them fork from a template of nbgrader's own.
    env = {**os.environ, **warm.plain_kernel_env(), "INFRA_COURSE_ROOT": str(course), "PATH": path}
    result = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args, "--log-level=WARN"],
        cwd=course,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_nbgrader_autograde_agrees_with_the_course_grader(tmp_path):
    """An instructor's nbgrader run and `infra-lab grade` give the same scores on the same submissions."""
    from nbgrader.api import Gradebook

    course = tmp_path / "course"
    (course / "solutions").mkdir(parents=True)
    shutil.copytree(REPO / "solutions" / "lab01_gemm", course / "solutions" / "lab01_gemm")
    (course / "nbgrader_config.py").write_text(f"load_subconfig({str(CONFIG)!r})\n")
    _nbgrader(course, "generate_assignment", "lab01_gemm", "--force")

    answers = answer_cells(REPO / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb")
    wrong = dict(answers)
    wrong["task3_dominant_op"] = answers["task3_dominant_op"].replace("self_cpu_time_total", "cpu_time_total")
    submissions = {"complete": answers, "untouched": {}, "one_wrong": wrong}
    for student, filled in submissions.items():
        write_learner_notebook(course / "submitted" / student / "lab01_gemm" / "lab01_gemm.ipynb", filled, base=LAB01)
    _nbgrader(course, "autograde", "lab01_gemm", "--create", "--force")

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id="infra-course") as gradebook:
        nbgrader_scores = {s: gradebook.find_submission("lab01_gemm", s).score for s in submissions}
    ours = {
        s: grade_notebook(course / "submitted" / s / "lab01_gemm" / "lab01_gemm.ipynb", lab_id="lab01_gemm").score
        for s in submissions
    }
    assert nbgrader_scores == {"complete": 10, "untouched": 0, "one_wrong": 7}
    assert ours == nbgrader_scores


@pytest.mark.parametrize(
    "lab", ["lab05_parallel", "lab15_serving_kernels", "lab17_distributed_serving", "lab18_resilient_training"]
)
def test_nbgrader_grades_a_lab_as_the_course_grader_does(tmp_path, lab):
    """Lab 15's Triton kernels, lab 05's trainer (the learner's autograd, DDP and ZeRO on threads),
    lab 17's router, KV handoff and tensor-parallel MLP and lab 18's ring attention, killed-and-resumed training
    loop and LoRA layer under nbgrader's own run (the learner's code in
    nbgrader's kernel, the hidden checks included): the instructor's answers get full marks and an
    untouched lab zero, the scores the course's grader gives them
    (test_solution_runs_top_to_bottom_and_scores_full_marks and
    test_untouched_lab_scores_zero_naming_each_task)."""
    from nbgrader.api import Gradebook

    course = tmp_path / "course"
    (course / "solutions").mkdir(parents=True)
    shutil.copytree(REPO / "solutions" / lab, course / "solutions" / lab)
    size_for_ci(course / "solutions" / lab / f"{lab}.ipynb")  # the cells after the tests at CI's size
    (course / "nbgrader_config.py").write_text(f"load_subconfig({str(CONFIG)!r})\n")
    _nbgrader(course, "generate_assignment", lab, "--force")
    solution = REPO / "solutions" / lab / f"{lab}.ipynb"
    submissions = {"complete": answer_cells(solution), "untouched": {}}
    for student, filled in submissions.items():
        write_learner_notebook(
            course / "submitted" / student / lab / f"{lab}.ipynb", filled, base=REPO / "labs" / lab / f"{lab}.ipynb"
        )
    _nbgrader(course, "autograde", lab, "--create", "--force")

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id="infra-course") as gradebook:
        scores = {s: gradebook.find_submission(lab, s).score for s in submissions}
    points = sum(c.metadata.get("nbgrader", {}).get("points", 0) for c in read_notebook(solution).cells)
    assert points > 0 and scores == {"complete": points, "untouched": 0}, scores
