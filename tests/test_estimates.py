"""One time estimate per lab, the same in the README's chapter table, the lab's intro and the rule
the README states; and the README's lesson times are the ones the lessons state."""

from __future__ import annotations

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
        f"({tasks(notebook)} tasks, {answer_lines(notebook)} lines of reference answer)")
    assert lab == want, f"README, chapter {chapter}: the lab's time must be {want} min ('{lesson} + {want} min')"
    released = REPO / "labs" / solution.parent.name / solution.name
    assert intro_minutes(read_notebook(released)) == want, f"{released.relative_to(REPO)}: run `make labs`"


def test_the_readme_states_the_rule_it_is_checked_against():
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert (f"{MINUTES_PER_TASK} minutes per task plus {MINUTES_PER_LINE} minute per line of its reference answer"
            in readme)


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
            f"README, chapter {path.stem[:2]}: 'lesson + lab' for a chapter with a lab, else the lesson's time alone")


_HEADER_LAB = re.compile(r"lab: `(lab\d\d_\w+)`(?: \(with chapter \d+\))?, about (\d+) minutes\*")


@pytest.mark.parametrize("lesson", [p for p in NOTEBOOKS if "· no lab*" not in p.read_text(encoding="utf-8")],
                         ids=lambda p: p.stem)
def test_a_lesson_names_its_lab_with_the_same_estimate(lesson):
    """The lesson's header line names its lab and that lab's one estimate (the README rule's)."""
    found = _HEADER_LAB.search(read_notebook(lesson).cells[0].source)
    assert found, f"{lesson.name}: the header must end 'lab: `labNN_topic`, about N minutes*'"
    lab = found.group(1)
    want = rule_minutes(read_notebook(REPO / "solutions" / lab / f"{lab}.ipynb"))
    assert int(found.group(2)) == want, f"{lesson.name}: {lab} takes about {want} minutes by the README's rule"
