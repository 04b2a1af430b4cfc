"""The learner edition (`infra-lab release --edition learner DIR`): the course without its answers,
whose own grader still grades a lab to full marks and a blank one to zero."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import REPO, SOLUTION01, SOLUTIONS, answer_cells, write_learner_notebook

from grading.notebook import grade_id, is_test_cell, nbgrader_meta, read_notebook
from grading.run import warm

INFRA_LAB = [sys.executable, "-m", "course_tools.cli"]
# The edition's files are built once and graded once, on one worker.
pytestmark = pytest.mark.xdist_group("learner_edition")


def _release(out: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*INFRA_LAB, "release", "--edition", "learner", str(out), *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("edition") / "course"
    result = _release(out)
    assert result.returncode == 0, result.stderr
    assert f"wrote the learner edition (no answers) to {out}" in result.stdout
    return out


# The repository's editable install would answer for any module of grading/ or infra_lib/ that the
# edition lacks. This start-up hook, on the path of every process the edition's grader starts (its
# template and kernels too), takes that finder away: the edition runs on its own files or fails.
ONLY_THE_EDITION = """\
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
"""


def _edition_env(edition: Path) -> dict[str, str]:
    """The repository's environment with the edition's packages first and the repository's install out of
    reach, and no warm template of the test process (the edition's grader starts its own)."""
    hook = edition.parent / "only_the_edition"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(ONLY_THE_EDITION)
    env = {name: value for name, value in os.environ.items() if name not in (warm.SOCKET_ENV, warm.TOKEN_ENV)}
    return {**env, "PYTHONPATH": os.pathsep.join((str(edition), str(hook)))}


@pytest.fixture(scope="module")
def gradings(edition, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Inside the edition, side by side: an honest lab 01 (the instructor's answers, kept outside the
    edition so that the scan below never meets them) and the blank released lab, as a learner grades it."""
    honest = write_learner_notebook(
        tmp_path_factory.mktemp("learner") / "lab01_gemm.ipynb",
        answer_cells(SOLUTION01),
        base=edition / "labs" / "lab01_gemm" / "lab01_gemm.ipynb",
    )
    commands = {
        "honest": ["grade", str(honest), "--out", str(honest.parent / "grades"), "--seed", "5"],
        "blank": ["grade", "labs/lab01_gemm/lab01_gemm.ipynb", "--seed", "5"],
    }
    running = {
        name: subprocess.Popen(
            [*INFRA_LAB, *args],
            cwd=edition,
            env=_edition_env(edition),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, args in commands.items()
    }
    done = {}
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return done


def _solution_regions() -> list[tuple[str, list[str]]]:
    """(lab, stripped non-blank lines) of each solution region of 2+ such lines in the repository's solutions."""
    regions = []
    for path in SOLUTIONS:
        for cell in read_notebook(path).cells:
            lines = None
            for line in cell.source.splitlines():
                if "BEGIN SOLUTION" in line:
                    lines = []
                elif "END SOLUTION" in line:
                    if lines and len(lines) >= 2:
                        regions.append((path.stem, lines))
                    lines = None
                elif lines is not None and line.strip():
                    lines.append(line.strip())
    return regions


def _searchable(path: Path) -> str:
    """A file as its stripped non-blank lines between newlines; a notebook as its cells' sources and outputs."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        parts = [json.dumps(cell.get("outputs", [])) for cell in cells]
        text = "\n".join("".join(cell["source"]) for cell in cells) + "\n" + "\n".join(parts)
    return "\n" + "\n".join(line.strip() for line in text.splitlines() if line.strip()) + "\n"


def test_no_file_of_the_edition_holds_solution_code(edition):
    regions = _solution_regions()
    assert len(regions) > 30, "every lab's answers are scanned for"
    files = sorted(p for p in edition.rglob("*") if p.is_file())
    for path in files:
        name = path.relative_to(edition).as_posix()
        raw = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".ipynb":
            assert "BEGIN SOLUTION" not in raw, f"{name} holds a solution region"
        else:  # only the marker's name, quoted (the grader's constants, the README's prose)
            for line in raw.splitlines():
                if "BEGIN SOLUTION" in line:
                    assert re.search(r"[\"'`](### )?BEGIN SOLUTION[\"'`]", line), (
                        f"{name} holds a solution region: {line}"
                    )
        text = _searchable(path)
        for lab, lines in regions:
            region = "\n" + "\n".join(lines) + "\n"
            assert region not in text, f"{name} holds {lab}'s answer starting {lines[0]!r}"


def test_no_function_of_the_edition_is_equivalent_to_an_answer(edition):
    """Every function of the edition's Python files and notebooks outside the library, the check modules'
    included, against every answer cell by the similarity report's measure: none holds an answer."""
    from course_tools.release import equivalent_code, solution_prints

    solutions = solution_prints()
    assert len(solutions) > 40, "every lab's answer cells are scanned for"
    found = equivalent_code(edition, solutions)
    assert found == [], found


# A course-side retry loop the check modules once held in place of lab 13's task 2: it scores between the edition's
# threshold and the class report's, so only the edition's stricter measure finds it.
NEAR_ANSWER = '''
import time


def course_call_with_retry(fn, state: dict, policy, sleep=time.sleep):
    """Task 2 as the course answers it: fn(state), tried again with capped exponential backoff."""
    attempts = 1 if policy is None else policy.max_attempts
    for attempt in range(attempts):
        try:
            return fn(state)
        except Exception as error:
            if attempt == attempts - 1 or not policy.should_retry(error):
                raise
            sleep(min(policy.initial_interval * policy.backoff_factor ** attempt, policy.max_interval))
    raise AssertionError("unreachable: the last attempt returns or raises")
'''


def test_the_edition_finds_a_near_answer_the_class_report_would_let_pass(tmp_path):
    from course_tools.release import EDITION_THRESHOLD, equivalent_code, solution_prints
    from grading.similarity import THRESHOLD

    (tmp_path / "grading" / "checks").mkdir(parents=True)
    (tmp_path / "grading" / "checks" / "lab13.py").write_text(NEAR_ANSWER)
    solutions = solution_prints()
    found = equivalent_code(tmp_path, solutions)
    assert [(name, label) for name, label, _ in found] == [
        ("grading/checks/lab13.py", "lab13_agents:task2_call_with_retry")
    ]
    score = float(found[0][2].rsplit(" ", 1)[1])
    assert EDITION_THRESHOLD <= score < THRESHOLD, found
    assert equivalent_code(tmp_path, solutions, threshold=THRESHOLD) == []


def _dressed(source: str) -> str:
    """An answer's code with its names, comments and layout changed, as a copy would be."""
    for old, new in (
        ("budget", "room"),
        ("victim", "last"),
        ("cached", "hit"),
        ("seq", "item"),
        ("out", "plan"),
        ("n", "take"),
    ):
        source = re.sub(rf"\b{old}\b", new, source)
    return "\n".join(
        line.split("  #")[0] + ("  # one more step" if "while" in line else "") for line in source.splitlines()
    )


def test_the_scan_finds_a_dressed_copy_of_an_answer_in_a_python_file_and_a_notebook(tmp_path):
    from course_tools.release import equivalent_code, solution_prints

    region = answer_cells(REPO / "solutions" / "lab08_scheduler" / "lab08_scheduler.ipynb")["schedule"]
    region = region.split("### BEGIN SOLUTION\n")[1].split("    ### END SOLUTION")[0]
    copy = _dressed(
        "class Planner:\n    def plan_step(self):\n        budget = self.config.max_num_batched_tokens\n"
        "        out = SchedulerOutput(self.num_steps, budget)\n"
        + "\n".join("    " + line for line in region.splitlines())
        + "\n"
    )
    (tmp_path / "grading" / "checks").mkdir(parents=True)
    (tmp_path / "grading" / "checks" / "helpers.py").write_text("import math\n\n\n" + copy)
    (tmp_path / "infra_lib").mkdir()
    (tmp_path / "infra_lib" / "scheduler.py").write_text(copy)  # the library's reference code is not scanned
    (tmp_path / "grading" / "checks" / "lab08").mkdir()
    for module in (REPO / "grading" / "checks" / "lab08").glob("*.py"):
        (tmp_path / "grading" / "checks" / "lab08" / module.name).write_text(module.read_text())
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("%matplotlib inline\n" + copy)])
    nbformat.write(notebook, tmp_path / "lesson.ipynb")
    # The capstone's lab 08 cell holds the scheduler step and the engine step: a copy of that whole cell is
    # the capstone's answer (and lab 08's), a copy of the scheduler step alone is lab 08's answer.
    capstone = answer_cells(REPO / "solutions" / "lab16_capstone" / "lab16_capstone.ipynb")["lab08_scheduler"]
    (tmp_path / "grading" / "checks" / "engine_copy.py").write_text(
        _dressed("\n".join(line for line in capstone.splitlines() if not line.strip().startswith("### ")))
    )
    found = {(name, label): unit for name, label, unit in equivalent_code(tmp_path, solution_prints())}
    assert {(name, label) for name, label in found if name != "grading/checks/engine_copy.py"} == {
        (name, "lab08_scheduler:schedule") for name in ("grading/checks/helpers.py", "lesson.ipynb")
    }, found
    assert {label for name, label in found if name == "grading/checks/engine_copy.py"} >= {
        "lab16_capstone:lab08_scheduler",
        "lab08_scheduler:schedule",
    }, found
    assert found[("grading/checks/helpers.py", "lab08_scheduler:schedule")].startswith("Planner.plan_step ~ schedule")


def test_the_edition_is_the_tracked_course_less_its_answer_key_and_suite(edition):
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    copied = {
        name for name in tracked if (REPO / name).is_file() and not name.startswith(("solutions/", "tests/", ".ci/"))
    }
    labs = [path.stem for path in SOLUTIONS]
    written = {"EDITION.md", "solutions/TESTS_ONLY.md", *(f"solutions/{lab}/{lab}.ipynb" for lab in labs)}
    # a lab's tracked data files beside its notebook (release notes the grader reads) go in as they are
    written |= {name for name in tracked if re.fullmatch(r"solutions/lab\d\d_\w+/[^/]+\.json", name)}
    present = {p.relative_to(edition).as_posix() for p in edition.rglob("*") if p.is_file()}
    present = {name for name in present if not name.startswith("grades/")}  # the blank lab's grading writes there
    assert present == copied | written, f"unexpected or missing: {sorted(present ^ (copied | written))[:8]}"
    for folder in ("labs", "notebooks", "infra_lib", "grading", "course_tools", "benchmarks"):
        assert any(name.startswith(f"{folder}/") for name in present), f"the edition lacks {folder}/"
    note = (edition / "EDITION.md").read_text()
    assert note.startswith("# The learner edition") and "infra-lab grade labs/lab01_gemm/lab01_gemm.ipynb" in note


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[path.stem for path in SOLUTIONS])
def test_the_tests_only_source_keeps_every_test_and_the_released_stubs(edition, solution):
    lab = solution.stem
    instructor = read_notebook(solution).cells
    stripped = read_notebook(edition / "solutions" / lab / f"{lab}.ipynb").cells
    released = {grade_id(cell): cell.source for cell in read_notebook(REPO / "labs" / lab / f"{lab}.ipynb").cells}
    assert [grade_id(c) for c in stripped] == [grade_id(c) for c in instructor]
    for before, after in zip(instructor, stripped):
        assert after.metadata == before.metadata, f"{lab} {grade_id(before)}: metadata changed"
        if nbgrader_meta(before).get("solution"):
            assert after.source == released[grade_id(before)], f"{lab} {grade_id(before)} is not the released stub"
        else:
            assert after.source == before.source, f"{lab} {grade_id(before)} changed"
    assert any("BEGIN HIDDEN TESTS" in cell.source for cell in stripped if is_test_cell(cell)), (
        f"{lab} kept no hidden tests"
    )


@pytest.mark.slow
def test_the_edition_grades_with_its_own_grader(edition):
    """Every module the grader and a lab's checks import comes from the edition (none is missing from it)."""
    probe = (
        "import sys, course_tools.cli, grading.grader, grading.checks.lab01, grading.progress_panel, infra_lib\n"
        "from grading.course import DEFAULT_SOURCE\n"
        "print(DEFAULT_SOURCE)\n"
        "print(*sorted({m.__file__ for n, m in sys.modules.items() if n.split('.')[0] in ('grading', 'infra_lib')"
        " and getattr(m, '__file__', None)}), sep='\\n')"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=edition,
        env=_edition_env(edition),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    source, *modules = result.stdout.splitlines()
    assert Path(source) == edition / "solutions"
    assert len(modules) > 20 and all(Path(module).is_relative_to(edition) for module in modules), modules


@pytest.mark.slow
def test_an_honest_lab_scores_full_marks_in_the_edition(gradings):
    result = gradings["honest"]
    assert result.returncode == 0, result.stderr
    assert "total                       10/10" in result.stdout, result.stdout


@pytest.mark.slow
def test_the_blank_lab_scores_zero_with_its_tasks_named_in_the_edition(edition, gradings):
    result = gradings["blank"]
    assert result.returncode == 0, result.stderr
    assert "total                       0/10" in result.stdout, result.stdout
    assert "NotImplementedError: lab01 task 1: gemm_flops" in result.stdout
    results = json.loads((edition / "grades" / "lab01_gemm" / "results.json").read_text())
    assert results["score"] == 0 and results["max_score"] == 10
    assert (edition / "grades" / "lab01_gemm" / "feedback.md").read_text().startswith("# Feedback: lab01_gemm")


def test_release_refuses_a_folder_that_is_not_empty_unless_forced(tmp_path):
    out = tmp_path / "course"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused = _release(out)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "is not empty" in refused.stderr and "--force" in refused.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    forced = _release(out, "--force")
    assert forced.returncode == 0, forced.stderr
    assert not (out / "notes.txt").exists() and (out / "EDITION.md").is_file()
    again = subprocess.run(
        [*INFRA_LAB, "release", "lab01_gemm", "--out", str(tmp_path / "labs")],
        cwd=out,
        env=_edition_env(out),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and "tests without answers" in again.stderr, "the edition cannot regenerate its labs"
