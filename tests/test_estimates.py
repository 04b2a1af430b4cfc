"""One time estimate per lab, the same in the README's chapter table, the lab's intro and the rule
the README states; the README's lesson times are the ones the lessons state; and the grader's
estimate of how long grading takes, a quiet machine's time scaled to the load it measures."""

from __future__ import annotations

import json
import math
import re

import pytest
from conftest import NOTEBOOKS, REPO, SOLUTIONS

from grading.notebook import BEGIN_SOLUTION, END_SOLUTION, grade_id, is_solution_cell, read_notebook

MINUTES_PER_TASK = 10
MINUTES_PER_LINE = 1
ROUND_TO = 15
_ROW = re.compile(r"^\| (\d\d) \|.*\| ([^|]+) \| (?:ready|planned|draft) \|$", re.M)
_TIMES = re.compile(r"^(\d+)(?: \+ (\d+))? min$")
_INTRO = re.compile(r"^Estimated time: (\d+) minutes\.$", re.M)
_LESSON = re.compile(r"^\*\*Time\*\*: about (an hour|\d+ minutes)\b", re.M)


def readme_times() -> dict[str, tuple[int, int | None]]:
    """Chapter number -> (lesson minutes, lab minutes or None), from the README's chapter table."""
    table = (REPO / "README.md").read_text(encoding="utf-8").split("## Chapters", 1)[1]
    times = {}
    for chapter, cell in _ROW.findall(table):
        found = _TIMES.match(cell.strip())
        assert found, f"README, chapter {chapter}: time {cell.strip()!r} is not 'N min' or 'N + M min'"
        times[chapter] = (int(found.group(1)), int(found.group(2)) if found.group(2) else None)
    return times


_COPIED = re.compile(r"^lab\d\d_\w+$")  # an answer cell named after a lab: the capstone's copy of its answers


def answer_lines(notebook) -> int:
    """Lines of the reference answer: between BEGIN and END SOLUTION, without blank lines and comments."""
    count, inside = 0, False
    for cell in notebook.cells:
        if not is_solution_cell(cell) or _COPIED.match(grade_id(cell) or ""):
            continue  # the capstone's copy of an earlier lab's answers: counted in that lab
        for line in cell.source.splitlines():
            stripped = line.strip()
            if stripped in (BEGIN_SOLUTION, END_SOLUTION):
                inside = stripped == BEGIN_SOLUTION
            elif inside and stripped and not stripped.startswith("#"):
                count += 1
    return count


def tasks(notebook) -> int:
    """The rows of the intro's task table (task or part, function, points)."""
    return len(re.findall(r"^\| \d+ \|", notebook.cells[0].source, re.M))


def rule_minutes(notebook) -> int:
    """The README's rule: 10 minutes per task plus 1 per line of the reference answer, rounded up
    to the next quarter hour."""
    minutes = MINUTES_PER_TASK * tasks(notebook) + MINUTES_PER_LINE * answer_lines(notebook)
    return ROUND_TO * math.ceil(minutes / ROUND_TO)


def intro_minutes(notebook) -> int | None:
    found = _INTRO.findall(notebook.cells[0].source)
    return int(found[0]) if len(found) == 1 else None


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_a_lab_states_one_estimate_everywhere_by_the_readme_rule(solution):
    notebook = read_notebook(solution)
    chapter = solution.stem[3:5]
    want = rule_minutes(notebook)
    lesson, lab = readme_times()[chapter]
    assert intro_minutes(notebook) == want, (
        f"{solution.relative_to(REPO)}: the intro's last line must be 'Estimated time: {want} minutes.' "
        f"({tasks(notebook)} tasks, {answer_lines(notebook)} lines of reference answer)"
    )
    assert lab == want, f"README, chapter {chapter}: the lab's time must be {want} min ('{lesson} + {want} min')"
    released = REPO / "labs" / solution.parent.name / solution.name
    assert intro_minutes(read_notebook(released)) == want, f"{released.relative_to(REPO)}: run `make labs`"


def test_the_readme_states_the_rule_it_is_checked_against():
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert (
        f"{MINUTES_PER_TASK} minutes per task plus {MINUTES_PER_LINE} minute per line of its reference answer" in readme
    )


def test_readme_lesson_times_are_the_lessons_own():
    times = readme_times()
    assert sorted(times) == sorted(p.stem[:2] for p in NOTEBOOKS), "one README row per lesson notebook"
    for path in NOTEBOOKS:
        found = _LESSON.search(read_notebook(path).cells[0].source)
        assert found, f"{path.name}: its first cell needs a '**Time**: about ...' paragraph"
        stated = 60 if found.group(1) == "an hour" else int(found.group(1).split()[0])
        lesson, lab = times[path.stem[:2]]
        assert lesson == stated, f"README, chapter {path.stem[:2]}: the lesson takes {stated} min, as {path.name} says"
        has_lab = any(p.stem[3:5] == path.stem[:2] for p in SOLUTIONS)
        assert (lab is not None) == has_lab, (
            f"README, chapter {path.stem[:2]}: 'lesson + lab' for a chapter with a lab, else the lesson's time alone"
        )


_HEADER_LAB = re.compile(r"lab: `(lab\d\d_\w+)`(?: \(with chapter \d+\))?, about (\d+) minutes\*")


@pytest.mark.parametrize(
    "lesson", [p for p in NOTEBOOKS if "· no lab*" not in p.read_text(encoding="utf-8")], ids=lambda p: p.stem
)
def test_a_lesson_names_its_lab_with_the_same_estimate(lesson):
    """The lesson's header line names its lab and that lab's one estimate (the README rule's)."""
    found = _HEADER_LAB.search(read_notebook(lesson).cells[0].source)
    assert found, f"{lesson.name}: the header must end 'lab: `labNN_topic`, about N minutes*'"
    lab = found.group(1)
    want = rule_minutes(read_notebook(REPO / "solutions" / lab / f"{lab}.ipynb"))
    assert int(found.group(2)) == want, f"{lesson.name}: {lab} takes about {want} minutes by the README's rule"


# --- how long grading takes: a quiet machine's time, scaled to the load the grader sees ----------------------


def test_a_grading_estimate_is_a_quiet_machines_and_scales_with_the_load_at_start(tmp_path):
    from grading.grading_times import Load, estimate, record

    table, grades = record({"lab15_serving_kernels": 7.0}, tmp_path / "times.json"), tmp_path / "grades"
    said = estimate("lab15_serving_kernels", grades, table)
    assert said == "about 7 s on a quiet machine (as measured for the course)"
    busy = estimate("lab15_serving_kernels", grades, table, load=Load(busy=4, cores=2))
    assert busy == f"{said}; about 21 s at this load (4.0 busy processes on 2 cores)"
    busier = estimate("lab15_serving_kernels", grades, table, load=Load(busy=8, cores=2))
    assert busier.endswith("about 35 s at this load (8.0 busy processes on 2 cores)")
    assert estimate("lab15_serving_kernels", grades, table, load=Load(busy=4, cores=16)).endswith(
        "about 9 s at this load (4.0 busy processes on 16 cores)"
    )  # the same processes weigh less on more cores
    quiet = estimate("lab15_serving_kernels", grades, table, load=Load(busy=0.2, cores=2))
    assert quiet == f"{said}; this machine is quiet now (0.2 busy processes on 2 cores)"


def test_a_time_measured_at_load_is_scaled_to_a_quiet_machine_and_the_table_says_how_busy_it_was(tmp_path):
    from grading.grading_times import Load, Measured, estimate, record

    table = record(
        {"lab16_capstone": Measured(120.0, Load(4, 2)), "lab02_roofline": Measured(8.0, Load(0.1, 2))},
        tmp_path / "times.json",
    )
    written = json.loads(table.read_text())
    assert written["seconds"] == {"lab02_roofline": 8.0, "lab16_capstone": 120.0}
    assert written["load"] == {
        "lab02_roofline": {"busy": 0.1, "cores": 2, "quiet": True},
        "lab16_capstone": {"busy": 4.0, "cores": 2, "quiet": False},
    }
    assert estimate("lab16_capstone", tmp_path, table) == "about 40 s on a quiet machine (as measured for the course)"
    assert estimate("lab02_roofline", tmp_path, table).startswith("about 8 s on a quiet machine")
    record({"lab16_capstone": 45.0}, table)  # a run without a recorded load drops the old run's load
    assert "lab16_capstone" not in json.loads(table.read_text())["load"]


def test_the_last_grading_here_is_scaled_by_the_load_it_began_at(tmp_path):
    from grading.grading_times import Load, estimate, record, remember_load

    table, lab = record({}, tmp_path / "times.json"), tmp_path / "grades" / "lab01_gemm"
    lab.mkdir(parents=True)
    results = {
        "execution_time": 60.0,
        "tests": [{"name": "test_task1", "tags": []}],
        "extra_data": {"graded_at": "2026-12-06T02:00:00+00:00"},
    }
    (lab / "results.json").write_text(json.dumps(results))
    assert estimate("lab01_gemm", lab.parent, table) == "about 60 s on a quiet machine (from its last grading here)"
    remember_load(lab, results, Load(2, 2))
    assert estimate("lab01_gemm", lab.parent, table).startswith("about 30 s on a quiet machine")
    newer = {**results, "extra_data": {"graded_at": "2026-12-06T03:00:00+00:00"}}
    (lab / "results.json").write_text(json.dumps(newer))  # a grading whose load was not kept: the old one's is not its
    assert estimate("lab01_gemm", lab.parent, table).startswith("about 60 s on a quiet machine")
    remember_load(lab, newer, None)
    assert not (lab / "grading-load.json").exists()


def test_machine_load_counts_the_other_running_processes(tmp_path, monkeypatch):
    import os

    from grading import grading_times
    from grading.grading_times import Load, machine_load

    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3 4\nprocs_running 5\nprocs_blocked 0\n")
    monkeypatch.setattr(grading_times, "PROC_STAT", stat)
    cores = len(os.sched_getaffinity(0))
    assert machine_load(sample_s=0, samples=3) == Load(4.0, cores)  # the process reading the count is not counted
    stat.write_text("procs_running 1\n")
    assert machine_load(sample_s=0).quiet
    monkeypatch.setattr(grading_times, "PROC_STAT", tmp_path / "absent")
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 2.0, 1.0))
    assert machine_load(sample_s=0) == Load(3.0, cores)  # where the count cannot be read: the load average
    for bad in (dict(busy=-1, cores=2), dict(busy=1, cores=0), dict(busy=float("nan"), cores=2)):
        with pytest.raises(ValueError, match="busy|cores"):
            Load(**bad)
    with pytest.raises(ValueError, match="samples"):
        machine_load(samples=0)
