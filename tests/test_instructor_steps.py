"""The README's nbgrader steps for instructors, run as written on a copy of the course with a class
of three: they record the labs, grade everyone, write feedback and export a gradebook."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess

from conftest import REPO, SOLUTION01, answer_cells, write_learner_notebook


def _instructor_steps() -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## As an instructor", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_readme_instructor_steps_grade_a_class(tmp_path):
    steps = _instructor_steps()
    assert "make labs" in steps and "nbgrader autograde lab01_gemm" in steps and "nbgrader export" in steps
    course = tmp_path / "course"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in filter(None, listed.stdout.split("\0")):
        if (REPO / name).is_file():
            (course / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, course / name)
    (course / ".venv").symlink_to(REPO / ".venv")
    # The copy's venv is the course's own, installed: its stamp is newer than what it was built from.
    installed = (REPO / ".venv" / ".installed").stat().st_mtime
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        os.utime(course / name, (installed - 1, installed - 1))
    # Never let the copy's make rebuild the shared venv (it would install the course from the copy).
    fresh = subprocess.run(["make", "-q", ".venv/.installed"], cwd=course, capture_output=True, text=True)
    assert fresh.returncode == 0, "the copy's make would rebuild the course's venv; run make in the course first"
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
