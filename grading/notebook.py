"""Reading lab notebooks, the nbgrader cell conventions, and rebuilding a notebook for grading."""

from __future__ import annotations

import ast
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat import NotebookNode

BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
BEGIN_HIDDEN = "### BEGIN HIDDEN TESTS"
END_HIDDEN = "### END HIDDEN TESTS"
CODE_STUB = "# YOUR CODE HERE"


class NotebookError(ValueError):
    """A notebook that cannot be read or does not have the shape a lab needs."""


def read_notebook(path: str | Path) -> NotebookNode:
    """Read a notebook, turning every way it can be broken into one clear error."""
    path = Path(path)
    if not path.is_file():
        raise NotebookError(f"no notebook at {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NotebookError(f"cannot read {path}: {exc}") from exc
    try:
        nb = nbformat.reads(text, as_version=4)
    except (json.JSONDecodeError, nbformat.reader.NotJSONError) as exc:
        raise NotebookError(
            f"{path} is not valid notebook JSON ({exc}); restore it from a checkpoint "
            "(File > Revert) or re-copy the lab"
        ) from exc
    except Exception as exc:  # nbformat raises several types for wrong structure
        raise NotebookError(f"{path} is not a Jupyter notebook: {exc}") from exc
    if not isinstance(nb.get("cells"), list):
        raise NotebookError(f"{path} has no list of cells")
    for cell in nb.cells:
        if not isinstance(cell, dict) or cell.get("cell_type") not in ("code", "markdown", "raw"):
            raise NotebookError(f"{path} has a malformed cell: {str(cell)[:80]}")
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
    return nb


def nbgrader_meta(cell: dict) -> dict:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return meta if isinstance(meta, dict) else {}


def grade_id(cell: dict) -> str | None:
    value = nbgrader_meta(cell).get("grade_id")
    return value if isinstance(value, str) else None


def is_solution_cell(cell: dict) -> bool:
    return cell.get("cell_type") == "code" and nbgrader_meta(cell).get("solution") is True


def is_test_cell(cell: dict) -> bool:
    meta = nbgrader_meta(cell)
    return cell.get("cell_type") == "code" and meta.get("grade") is True and not meta.get("solution")


def clear_solutions(source: str) -> str:
    """What a learner receives: each solution region replaced by the stub comment."""
    out, inside = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN_SOLUTION:
            inside = True
            out.append(line[: len(line) - len(line.lstrip())] + CODE_STUB)
        elif stripped == END_SOLUTION:
            inside = False
        elif not inside:
            out.append(line)
    return "\n".join(out)


@dataclass(frozen=True)
class CheckCall:
    check_id: str
    hidden: bool


def check_calls(source: str) -> list[CheckCall]:
    """The ``check("...", impl)`` calls of a test cell, in order, each marked hidden or visible."""
    hidden_lines, inside = set(), False
    for number, line in enumerate(source.splitlines(), start=1):
        if line.strip() == BEGIN_HIDDEN:
            inside = True
        elif line.strip() == END_HIDDEN:
            inside = False
        elif inside:
            hidden_lines.add(number)
    calls = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "check"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            calls.append((node.lineno, node.col_offset, CheckCall(node.args[0].value, node.lineno in hidden_lines)))
    return [call for _, _, call in sorted(calls, key=lambda item: item[:2])]


@dataclass
class TestCell:
    grade_id: str
    points: float
    checks: list[CheckCall]
    index: int  # position in the trusted notebook
    answer: str | None = None  # grade_id of the answer cell it tests (the nearest one above)


@dataclass
class Spliced:
    notebook: NotebookNode
    tests: list[TestCell]
    notes: list[str] = field(default_factory=list)
    answers: dict[str, int] = field(default_factory=dict)  # answer grade_id -> cell index
    trusted_sources: dict[str, str] = field(default_factory=dict)  # answer grade_id -> solution source
    # Answer ids of the current lab that the notebook lacks because it was made for an earlier
    # release (it carries answer cells the current lab does not have): not the learner's fault.
    earlier_release: set[str] = field(default_factory=set)

    def neutralise(self, answer: str) -> None:
        """Grade an answer as the untouched stub (its code never runs)."""
        cell = self.notebook.cells[self.answers[answer]]
        cell.source = clear_solutions(self.trusted_sources[answer])


def test_cells(trusted: NotebookNode) -> list[TestCell]:
    tests, answer = [], None
    for index, cell in enumerate(trusted.cells):
        if is_solution_cell(cell):
            answer = grade_id(cell)
        if not is_test_cell(cell):
            continue
        gid = grade_id(cell) or f"cell {index}"
        calls = check_calls(cell.source)
        if not calls:
            raise NotebookError(f"test cell {gid} calls no check(); the grader scores checks only")
        tests.append(TestCell(gid, float(nbgrader_meta(cell).get("points", 0)), calls, index, answer))
    return tests


def splice(trusted: NotebookNode, learner: NotebookNode, renamed: dict[str, str] | None = None) -> Spliced:
    """The notebook to grade: the trusted source with only the learner's answer cells in it.

    Answer cells are matched by grade_id; everything else the learner changed (other
    cells, tags, metadata, outputs) is ignored. A missing answer is graded as the
    untouched stub.

    ``renamed``: the lab's release notes' ``{old grade_id: current grade_id}``; an answer cell
    under an old id is graded under the current one. A notebook that carries answer cells the
    current lab does not have, and lacks some of the current lab's, was made for an earlier
    release: those answers are listed in ``earlier_release`` (graded as not done, and said to be
    no fault of the learner's).
    """
    answers: dict[str, str] = {}
    notes: list[str] = []
    renamed = renamed or {}
    trusted_ids = {grade_id(c) for c in trusted.cells if grade_id(c)}
    extra = 0
    solution_ids = {grade_id(c) for c in trusted.cells if is_solution_cell(c)}
    stale: list[str] = []  # the notebook's answer cells that no release note maps to this lab
    stale_extra = 0  # how many of them are code cells with code (counted in ``extra`` too)
    for cell in learner.cells:
        gid = grade_id(cell)
        if gid in renamed and gid not in solution_ids and renamed[gid] in solution_ids:
            notes.append(f"answer cell {gid!r} was graded as {renamed[gid]!r} (renamed in a later release of this lab)")
            gid = renamed[gid]
        outside = gid not in trusted_ids and cell.get("cell_type") == "code" and str(cell.get("source", "")).strip()
        extra += bool(outside)
        if gid not in trusted_ids and gid and is_solution_cell(cell):
            stale.append(gid)
            stale_extra += bool(outside)
            continue
        if gid not in solution_ids or not isinstance(cell.get("source"), str):
            continue
        if gid in answers:
            notes.append(f"your notebook has more than one cell with grade_id {gid!r}; the first one was graded")
            continue
        if cell.get("cell_type") != "code":
            notes.append(
                f"answer cell {gid!r} had been changed to a {cell.get('cell_type')} cell; it was graded as code"
            )
        answers[gid] = cell.source
    graded = copy.deepcopy(trusted)
    positions, sources = {}, {}
    for index, cell in enumerate(graded.cells):
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        if not is_solution_cell(cell):
            continue
        gid = grade_id(cell)
        positions[gid], sources[gid] = index, cell.source
        if gid in answers:
            cell.source = answers[gid]
        else:
            cell.source = clear_solutions(cell.source)
    # An earlier release shares answer or test cells with this lab; another lab's notebook does not.
    tests = test_cells(trusted)
    shared = bool(answers) or bool({t.grade_id for t in tests} & {grade_id(c) for c in learner.cells})
    stale = stale if shared else []
    extra -= stale_extra if stale else 0  # an earlier release's answers are not extra cells
    if extra:
        notes.append(
            f"your notebook has {extra} code cell(s) that are not part of the lab; they were not run "
            "(keep helpers inside the answer cells)"
        )
    earlier = set(positions) - set(answers) if stale else set()
    if not stale:
        notes += [
            f"answer cell {gid!r} is missing from your notebook; it was graded as the empty stub"
            for gid in positions
            if gid not in answers
        ]
    if earlier:
        notes.append(
            f"this notebook was made for an earlier release of this lab: it has answer cell(s) "
            f"{', '.join(map(repr, stale))} that the current lab does not, and lacks "
            f"{', '.join(map(repr, sorted(earlier)))}; those tasks were not graded. This is not your "
            "mistake: your instructor can map the old cell ids in the lab's release notes "
            "(release_notes.json) and grade it again"
        )
    if tests:  # cells after the last test cannot change a score: grading does not run them
        graded.cells = graded.cells[: tests[-1].index + 1]
    if positions and not set(positions) & set(answers) and not stale:
        notes.append("none of this lab's answer cells were found: is this the right lab's notebook?")
    return Spliced(graded, tests, notes, positions, sources, earlier)
