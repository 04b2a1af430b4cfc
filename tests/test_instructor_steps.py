"""The README's nbgrader steps for instructors, run as written on a copy of the course with a class
of three: they record the labs, grade everyone, write feedback and export a gradebook."""

from __future__ import annotations

import csv
import re
import subprocess

from conftest import REPO, SOLUTION01, answer_cells, course_copy, write_learner_notebook


def _instructor_steps() -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## As an instructor", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_readme_instructor_steps_grade_a_class(tmp_path):
    steps = _instructor_steps()
    assert "make labs" in steps and "nbgrader autograde lab01_gemm" in steps and "nbgrader export" in steps
    course = course_copy(tmp_path / "course")
    answers = answer_cells(SOLUTION01)
    learners = {
        "alice": answers,  # honest
        "bob": {**answers, "task1_gemm_flops": "def gemm_flops(m, n, k):\n    return m * n * k\n"},
        "carol": {},
    }  # the lab as handed out
    for learner, cells in learners.items():  # "collect submissions into submitted/<student>/lab01_gemm/..."
        write_learner_notebook(course / "submitted" / learner / "lab01_gemm" / "lab01_gemm.ipynb", cells)

    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", steps], cwd=course, capture_output=True, text=True, timeout=900
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "No assignment with ID" not in log and "Skipping existing assignment" not in log, log[-4000:]
    with open(course / "grades.csv", newline="", encoding="utf-8") as f:
        grades = {
            row["student_id"]: float(row["score"]) for row in csv.DictReader(f) if row["assignment"] == "lab01_gemm"
        }
    assert grades == {"alice": 10.0, "bob": 8.0, "carol": 0.0}, log[-4000:]
    for learner in learners:
        assert (course / "feedback" / learner / "lab01_gemm" / "lab01_gemm.html").is_file()
    # every lab was recorded, not only the one graded
    listing = subprocess.run(
        [str(course / ".venv" / "bin" / "nbgrader"), "db", "assignment", "list"],
        cwd=course,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        "lab08_scheduler" in listing.stdout + listing.stderr
        and "lab15_serving_kernels" in listing.stdout + listing.stderr
    )
