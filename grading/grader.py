"""Grading one lab notebook: rebuild from the trusted source, execute, judge, report.

Verdicts are computed here, in the grader's process: the learner's kernel only records
what the learner's code produced for grade-time inputs. A test earns its points only on
positive evidence: every check in it has a recorded answer and every answer matches the
reference.
"""

from __future__ import annotations

import copy
import json
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from grading.check import RECORD_ENV, SEED_ENV, Outcome, drive, judge
from grading.notebook import Spliced, TestCell, grade_id, read_notebook, splice
from grading.registry import get_check
from grading.runner import Execution, execute

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO_ROOT / "solutions"
MAX_RESTARTS = 5


class GradingError(RuntimeError):
    """Grading itself could not be done (bad path, unknown lab, broken trusted source)."""


@dataclass
class CheckResult:
    check_id: str
    hidden: bool
    passed: bool
    message: str


@dataclass
class TestResult:
    grade_id: str
    score: float
    max_score: float
    checks: list[CheckResult]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


@dataclass
class GradeReport:
    lab_id: str
    notebook: str
    seed: int
    tests: list[TestResult]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)


def available_labs(source_dir: Path = DEFAULT_SOURCE) -> list[str]:
    return sorted(p.parent.name for p in Path(source_dir).glob("*/*.ipynb") if p.stem == p.parent.name)


def trusted_source(notebook: Path, lab_id: str | None = None, source_dir: Path = DEFAULT_SOURCE) -> tuple[str, Path]:
    """The lab id and the instructor notebook that a learner notebook is graded against."""
    source_dir = Path(source_dir)
    candidates = [lab_id] if lab_id else [notebook.stem, notebook.parent.name]
    for candidate in candidates:
        path = source_dir / candidate / f"{candidate}.ipynb"
        if path.is_file():
            return candidate, path
    known = ", ".join(available_labs(source_dir)) or "none"
    wanted = lab_id or notebook.stem
    raise GradingError(f"no lab named {wanted!r} in {source_dir} (labs: {known}); pass --lab LAB_ID")


def read_records(path: Path) -> dict[str, list[Outcome]]:
    """Answers the learner's kernel recorded, by check id; malformed lines are ignored."""
    records: dict[str, list[Outcome]] = {}
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("check_id"), str):
            continue
        error = row.get("error")
        records.setdefault(row["check_id"], []).append(
            Outcome(data=row.get("data"), error=error if isinstance(error, str) or error is None else str(error)))
    return records


def _roundtrip(outcome: Outcome) -> Outcome:
    """The reference's data as it would look after the learner's trip through JSON."""
    return Outcome(data=json.loads(json.dumps(outcome.data)), error=outcome.error)


def evaluate(tests: list[TestCell], records: dict[str, list[Outcome]], seed: int,
             why_missing: dict[int, str]) -> list[TestResult]:
    """Judge every check of every test cell against the reference, in this process."""
    expected_cache: dict[str, Outcome] = {}
    results = []
    for test in tests:
        checks = []
        for call in test.checks:
            registered = get_check(call.check_id)
            inputs = registered.inputs(seed)
            answers = records.get(call.check_id, [])
            if not answers:
                reason = why_missing.get(test.index, "the test cell did not run")
                checks.append(CheckResult(call.check_id, call.hidden, False,
                                          f"{call.check_id} failed [{registered.task}]\n  no answer was recorded: {reason}"))
                continue
            if call.check_id not in expected_cache:
                expected_cache[call.check_id] = _roundtrip(drive(registered, registered.reference(), inputs))
            verdicts = [judge(registered, answer, expected_cache[call.check_id], inputs) for answer in answers]
            verdict = next((v for v in verdicts if not v.passed), verdicts[0])
            checks.append(CheckResult(call.check_id, call.hidden, verdict.passed,
                                      verdict.message(registered, hidden=call.hidden)))
        passed = all(c.passed for c in checks)
        results.append(TestResult(test.grade_id, test.points if passed else 0.0, test.points, checks))
    return results


def _why_missing(spliced: Spliced, runs: list[Execution]) -> dict[int, str]:
    """For each test cell, why it may have produced no answer (its error, a time-out, a crash)."""
    reasons: dict[int, str] = {}
    for run in runs:
        for test in spliced.tests:
            error = run.cell_error(test.index)
            if error and test.index not in reasons:
                reasons[test.index] = f"the test cell raised {error}"
        if not run.complete and run.stopped_at is not None:
            reasons.setdefault(run.stopped_at, run.reason)
    last = runs[-1] if runs else None
    if last is not None and not last.complete:
        for test in spliced.tests:
            if last.stopped_at is None or test.index > last.stopped_at:
                reasons.setdefault(test.index, f"not reached: {last.reason}")
    return reasons


def grade_notebook(
    notebook: str | Path,
    *,
    lab_id: str | None = None,
    source_dir: str | Path = DEFAULT_SOURCE,
    seed: int | None = None,
    cell_timeout: float = 120.0,
    budget: float = 600.0,
    memory_mb: int = 4096,
    parameters: dict | None = None,
) -> GradeReport:
    """Grade a learner's lab notebook (never modified) against its trusted source.

    Args:
        notebook: the learner's .ipynb.
        lab_id: which lab it is; by default taken from the file or folder name.
        source_dir: the instructor notebooks (nbgrader's source directory).
        seed: the grade-time seed for the checks' inputs; random when None.
        cell_timeout: seconds one cell may run before it is interrupted.
        budget: seconds the whole notebook may run, restarts included.
        memory_mb: memory limit of the kernel.
        parameters: papermill parameters (default ``{"QUICK": True}``).
    """
    started = time.monotonic()
    notebook = Path(notebook)
    lab_id, source_path = trusted_source(notebook, lab_id, Path(source_dir))
    spliced = splice(read_notebook(source_path), read_notebook(notebook))
    seed = secrets.randbits(31) if seed is None else int(seed)
    params = {"QUICK": True} if parameters is None else parameters
    deadline = started + budget
    runs: list[Execution] = []
    with tempfile.TemporaryDirectory(prefix=f"grade-{lab_id}-") as work:
        record_path = Path(work) / "answers.jsonl"
        env = {RECORD_ENV: str(record_path), SEED_ENV: str(seed)}
        to_run = spliced.notebook
        for _ in range(MAX_RESTARTS + 1):
            run = execute(to_run, Path(work), parameters=params, env=env, cell_timeout=cell_timeout,
                          budget=deadline - time.monotonic(), memory_mb=memory_mb)
            runs.append(run)
            if run.complete or run.stopped_at is None or time.monotonic() >= deadline - 1:
                break
            # The kernel died in one cell: skip that cell and the tests already answered,
            # then run the rest again so one crashing answer cannot cost the others.
            to_run = _without_cells(to_run, run, {t.index for t in spliced.tests})
            culprit = grade_id(to_run.cells[run.stopped_at]) or f"cell {run.stopped_at + 1}"
            spliced.notes.append(f"{culprit} stopped the run: {run.reason}; grading went on without it")
        records = read_records(record_path)
    tests = evaluate(spliced.tests, records, seed, _why_missing(spliced, runs))
    return GradeReport(lab_id, str(notebook), seed, tests, spliced.notes, time.monotonic() - started)


def _without_cells(nb, run: Execution, test_indices: set[int]):
    """The notebook to run again: the cell that stopped the run, and the tests before it, emptied."""
    again = copy.deepcopy(nb)
    for index, cell in enumerate(again.cells):
        if index == run.stopped_at or (index in test_indices and index < run.stopped_at):
            cell.source = ""
    return again
