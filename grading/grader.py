"""Grading one lab notebook: rebuild from the trusted source, execute, judge, report.

Verdicts are computed here, in the grader's process: the learner's kernel only records
what the learner's code produced for grade-time inputs. A test earns its points only on
positive evidence: every check in it has a recorded answer and every answer matches the
reference. Each failed check carries a reason: wrong result, error, time-out, memory
limit, crash, process limit, reference shortcut, tampering detected, or not run.
"""

from __future__ import annotations

import copy
import json
import secrets
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grading import tamper
from grading.check import (
    CHECK_TIMEOUT_ENV,
    ERROR,
    INPUTS_ENV,
    MAX_PROCESSES_ENV,
    MEMORY,
    PROCESSES,
    RECORD_ENV,
    SEED_ENV,
    SHORTCUT,
    TAMPERING,
    TIMEOUT,
    WALL_FACTOR,
    WRONG,
    Outcome,
    drive,
    judge,
    needs_reference,
)
from grading.course import DEFAULT_SOURCE, UNREADABLE, lab_ids
from grading.hidden_reference import hidden_files
from grading.lab_version import course_version, lab_version, renamed_cells
from grading.notebook import NotebookError, Spliced, TestCell, grade_id, read_notebook, splice, test_cells
from grading.registry import answer_lab, get_check, shortcut_modules
from grading.run.execute import STOP_BUDGET, STOP_CRASH, Execution, execute, kernel_folder
from grading.run.sandbox import Limits

MAX_RESTARTS = 6
NOT_RUN = "not run"
EARLIER_RELEASE = "earlier release"  # the notebook was made for an earlier release of the lab
NOT_HELD = "NOT "  # how a protection's line in GradeReport.sandbox starts when it did not hold
NOT_RUN_BY_SCAN = "was not run: it"  # the failure text of a check whose answer the static scan refused

# Every status a graded notebook (GradeReport.status) or a class's row (grading.batch) can have, in
# the order of precedence: a row shows the first that applies, and its flags every one found.
STATUSES = {
    "failed": "the grader itself failed on this notebook (the note says how); grade it again",
    "unreadable": "the file is not a notebook this lab can read (the note says why); 0",
    "not submitted": "on the roster, or a folder in the submissions, with no notebook; 0",
    "unprotected": "a protection the grader asked for did not hold while the notebook ran (the flags "
    "say which): the score may rest on what the learner's code could reach; grade it "
    "again where it holds",
    "reached": "the learner's code looked for, opened or wrote something only a cheat would want "
    "(the answer key, classmates' submissions, the class's grades, another process, the "
    "course's files) and found it: graded without a sandbox that hides it",
    "refused": "the static scan refused an answer before it ran (it reached into the grader, the "
    "notebook machinery or the lab's reference); that task scored 0, the rest were graded",
    "caught": "a check caught an answer, while it ran, calling the lab's reference or leaving the "
    "check machinery altered; that task scored 0",
    "blocked": "the learner's code reached for something only a cheat would want, and the sandbox "
    "refused it or did not have it (the flags say what and where); the score stands",
    "earlier release": "made for an earlier release of the lab: a task whose answer cell was renamed is "
    "not graded until release_notes.json maps the old id",
    "flagged": "graded; an answer is close to the course's solution, the lab's reference or a "
    "classmate's (similarity.md): the score stands, look at it",
    "graded": "graded; nothing for the instructor to look at",
}
_OUTCOME_KINDS = {ERROR, TIMEOUT, MEMORY, PROCESSES, SHORTCUT, TAMPERING, WRONG}


class GradingError(RuntimeError):
    """Grading itself could not be done (bad path, unknown lab, broken trusted source)."""


@dataclass
class CheckResult:
    check_id: str
    hidden: bool
    passed: bool
    message: str
    reason: str = "passed"  # why it failed, one word or two; "passed" when it passed
    measures: dict = field(default_factory=dict)  # the check's measurements (Check.measure), e.g. a speed ratio


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
    sandbox: dict = field(default_factory=dict)
    unreadable: str = ""  # why the notebook could not be read, if it could not
    graded_at: str = ""  # when, UTC, ISO 8601
    course_version: str = ""  # the course's version and commit
    lab_version: str = ""  # digest of everything this lab's grade depends on (grading.lab_version)
    # answer grade_id -> why the static scan refused to run it
    refused: dict[str, str] = field(default_factory=dict)
    # what the learner's code reached for while it ran (grading.tamper.watch), each a dict with
    # what, op, path and outcome: signals for the instructor, never part of a verdict
    attempts: list[dict[str, str]] = field(default_factory=list)
    # The notebook as the grading run left it (outputs of every cell, hidden checks included):
    # for the instructor's eyes and the course's own tests, never written into learner feedback.
    executed: Any = field(default=None, repr=False, compare=False)

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def measures(self) -> dict[str, float]:
        """Every check's measurements by name; the best (largest) where several checks measure one."""
        found: dict[str, float] = {}
        for test in self.tests:
            for check in test.checks:
                for name, value in check.measures.items():
                    found[name] = max(value, found.get(name, value))
        return found

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)

    @property
    def unprotected(self) -> list[str]:
        """The protections that did not hold while the notebook ran ("network: NOT isolated: ...")."""
        return [
            f"{name}: {value}"
            for name, value in self.sandbox.items()
            if isinstance(value, str) and value.startswith(NOT_HELD)
        ]

    @property
    def caught(self) -> list[str]:
        """Tests whose checks caught a reference call or altered check machinery while the answer ran
        (not an answer the static scan refused: that one never ran)."""
        found = []
        for test in self.tests:
            reasons = sorted(
                {
                    c.reason
                    for c in test.checks
                    if c.reason in (SHORTCUT, TAMPERING) and NOT_RUN_BY_SCAN not in c.message
                }
            )
            if reasons:
                found.append(f"{test.grade_id} ({', '.join(reasons)})")
        return found

    @property
    def flags(self) -> list[str]:
        """One line per thing the instructor should look at, each starting with its status's name."""
        lines = [f"unprotected: {line}" for line in self.unprotected]
        by_what: dict[str, list[dict[str, str]]] = {}
        for attempt in self.attempts:
            by_what.setdefault(attempt["what"], []).append(attempt)
        for what, attempts in by_what.items():  # one line per thing reached for: what was done, and where
            got = [a for a in attempts if a["outcome"] in (tamper.FOUND, tamper.ALLOWED)]
            done = Counter(f"{a['op']} {a['outcome']}" for a in attempts)
            counts = ", ".join(f"{action} x{n}" if n > 1 else action for action, n in done.items())
            where = (
                f"{got[0]['outcome']}: {got[0]['path']}"
                if got
                else f"{'e.g. ' if len(attempts) > 1 else ''}{attempts[0]['path']}"
            )
            lines.append(f"{'reached' if got else 'blocked'}: {what} ({counts}; {where})")
        lines += [f"refused: {answer} ({why})" for answer, why in self.refused.items()]
        lines += [f"caught: {line}" for line in self.caught]
        return lines

    @property
    def status(self) -> str:
        """The first of :data:`STATUSES` that applies to this notebook on its own ("flagged", "not
        submitted" and "failed" are the class's: grading.batch)."""
        if self.unreadable:
            return "unreadable"
        kinds = {line.split(":", 1)[0] for line in self.flags}
        if any(c.reason == EARLIER_RELEASE for t in self.tests for c in t.checks):
            kinds.add(EARLIER_RELEASE)
        return next((status for status in STATUSES if status in kinds), "graded")


def trusted_source(notebook: Path, lab_id: str | None = None, source_dir: Path = DEFAULT_SOURCE) -> tuple[str, Path]:
    """The lab id and the instructor notebook that a learner notebook is graded against."""
    source_dir = Path(source_dir)
    candidates = [lab_id] if lab_id else [notebook.stem, notebook.parent.name]
    for candidate in candidates:
        path = source_dir / candidate / f"{candidate}.ipynb"
        if path.is_file():
            return candidate, path
    wanted = lab_id or notebook.stem
    raise GradingError(f"no lab named {wanted!r} in {source_dir} (labs: {_known(source_dir)}); pass --lab LAB_ID")


def _known(source_dir: Path) -> str:
    return ", ".join(lab_ids(source_dir)) or "none"


def infer_lab(notebook: Path, source_dir: Path = DEFAULT_SOURCE) -> str:
    """The lab a notebook belongs to, from its cells' grade_ids (nbgrader metadata).

    A lab matches when the notebook carries one of the grade_ids that only this lab's
    instructor notebook uses (ids such as "setup" or "progress", shared by labs, say nothing).

    Raises:
        GradingError: the notebook cannot be read, or it matches no lab or several.
    """
    source_dir = Path(source_dir)
    try:
        carried = {grade_id(cell) for cell in read_notebook(notebook).cells} - {None}
    except NotebookError as exc:
        raise GradingError(
            f"{notebook} names no lab, and its cells cannot be read to infer one ({exc}); pass --lab LAB_ID"
        ) from exc
    ids_of = {
        lab: {grade_id(cell) for cell in read_notebook(source_dir / lab / f"{lab}.ipynb").cells} - {None}
        for lab in lab_ids(source_dir)
    }
    labs_using = Counter(gid for ids in ids_of.values() for gid in ids)
    matches = [lab for lab, ids in ids_of.items() if any(labs_using[gid] == 1 for gid in ids & carried)]
    if len(matches) == 1:
        return matches[0]
    found = (
        f"its cells' grade_ids belong to several labs ({', '.join(matches)})"
        if matches
        else f"none of its cells' grade_ids belong to a lab (labs: {_known(source_dir)})"
    )
    raise GradingError(f"{notebook} names no lab and {found}; pass --lab LAB_ID")


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
        error, kind = row.get("error"), row.get("kind")
        error = error if isinstance(error, str) or error is None else str(error)
        kind = kind if kind in _OUTCOME_KINDS else (ERROR if error is not None else None)
        records.setdefault(row["check_id"], []).append(Outcome(data=row.get("data"), error=error, kind=kind))
    return records


def _roundtrip(outcome: Outcome) -> Outcome:
    """The reference's data as it would look after the learner's trip through JSON."""
    return Outcome(data=json.loads(json.dumps(outcome.data)), error=outcome.error)


def _failed(check_id: str, task: str, reason: str, text: str) -> str:
    return f"{check_id} failed [{task}] ({reason})\n  {text}"


def _write_inputs(tests: list[TestCell], seed: int, folder: Path) -> Path:
    """One pickle per check the test cells call, of the inputs its grade-time seed draws; a check
    whose inputs cannot be pickled is left out (the kernel then draws them itself)."""
    import pickle

    folder.mkdir(parents=True, exist_ok=True)
    for check_id in dict.fromkeys(call.check_id for test in tests for call in test.checks):
        try:
            data = pickle.dumps(get_check(check_id).inputs(seed))
        except Exception:  # noqa: BLE001 - an unknown check or unpicklable inputs: the kernel makes them
            continue
        (folder / f"{check_id}.pickle").write_bytes(data)
    return folder


def evaluate(
    tests: list[TestCell],
    records: dict[str, list[Outcome]],
    seed: int,
    missing: dict[int, tuple[str, str]],
    findings: dict[str, tamper.Finding],
    earlier: set[str] = frozenset(),
) -> list[TestResult]:
    """Judge every check of every test cell against the reference, in this process.

    Args:
        missing: test cell index -> (reason, text) for cells that may have recorded nothing.
        findings: answer grade_id -> what the static scan found (the answer was not run).
        earlier: answer grade_ids the notebook lacks because it was made for an earlier release.
    """
    expected_cache: dict[str, Outcome] = {}
    results = []
    for test in tests:
        checks = []
        finding = findings.get(test.answer) if test.answer else None
        for call in test.checks:
            registered = get_check(call.check_id)
            answers = records.get(call.check_id, [])
            if test.answer in earlier:
                text = (
                    f"not graded: your notebook was made for an earlier release of this lab and has no answer "
                    f"cell {test.answer!r} (not your mistake; your instructor can map the old cell)"
                )
                checks.append(
                    CheckResult(
                        call.check_id,
                        call.hidden,
                        False,
                        _failed(call.check_id, registered.task, EARLIER_RELEASE, text),
                        EARLIER_RELEASE,
                    )
                )
                continue
            if finding is not None:
                text = f"answer {test.answer} {NOT_RUN_BY_SCAN} {finding.detail} (line {finding.line})"
                checks.append(
                    CheckResult(
                        call.check_id,
                        call.hidden,
                        False,
                        _failed(call.check_id, registered.task, finding.kind, text),
                        finding.kind,
                    )
                )
                continue
            if not answers:
                reason, text = missing.get(test.index, (NOT_RUN, "the test cell did not run"))
                checks.append(
                    CheckResult(
                        call.check_id,
                        call.hidden,
                        False,
                        _failed(call.check_id, registered.task, reason, f"no answer was recorded: {text}"),
                        reason,
                    )
                )
                continue
            inputs = registered.inputs(seed)
            # The reference runs only when some answer produced data to compare with it.
            if call.check_id not in expected_cache and any(needs_reference(answer) for answer in answers):
                expected_cache[call.check_id] = _roundtrip(drive(registered, registered.reference(), inputs))
            verdicts = [judge(registered, answer, expected_cache.get(call.check_id), inputs) for answer in answers]
            verdict = next((v for v in verdicts if not v.passed), verdicts[0])
            checks.append(
                CheckResult(
                    call.check_id,
                    call.hidden,
                    verdict.passed,
                    verdict.message(registered, hidden=call.hidden),
                    verdict.kind,
                    _measures(registered, answers[0], expected_cache.get(call.check_id)),
                )
            )
        passed = all(c.passed for c in checks)
        results.append(TestResult(test.grade_id, test.points if passed else 0.0, test.points, checks))
    return results


def _measures(registered, answer: Outcome, expected: Outcome | None) -> dict:
    """The check's measurements of the learner's data against the reference's (empty when either has none)."""
    if registered.measure is None or answer.kind is not None or expected is None or expected.kind is not None:
        return {}
    try:
        found = registered.measure(answer.data, expected.data)
    except Exception:  # noqa: BLE001 - the learner's data may be any shape; a measurement is optional
        return {}
    return {str(k): float(v) for k, v in found.items() if isinstance(v, (int, float))}


def _error_reason(ename: str, evalue: str) -> str:
    if ename == "KeyboardInterrupt":
        return TIMEOUT
    if ename == "MemoryError" or "can't allocate memory" in evalue:
        return MEMORY
    return ERROR


def _why_missing(spliced: Spliced, runs: list[Execution]) -> dict[int, tuple[str, str]]:
    """For each test cell, why it may have produced no answer: its own error, its answer
    cell's failure, a time-out, a crash, a limit, or the end of the budget."""
    reasons: dict[int, tuple[str, str]] = {}
    answer_of = {t.index: t.answer for t in spliced.tests}
    for run in runs:
        if not run.complete and run.stopped_at is not None:
            stopped = run.stopped_at
            for test in spliced.tests:
                if test.index == stopped or (test.answer and spliced.answers.get(test.answer) == stopped):
                    reasons.setdefault(test.index, (run.stop, run.reason))
        for test in spliced.tests:
            error = run.cell_error(test.index)
            if error and test.index not in reasons:
                reasons[test.index] = (_error_reason(*error), f"the test cell raised {error[0]}: {error[1]}")
            answer_index = spliced.answers.get(answer_of[test.index] or "")
            answer_error = run.cell_error(answer_index) if answer_index is not None else None
            if answer_error and test.index not in reasons:
                reasons[test.index] = (
                    _error_reason(*answer_error),
                    f"its answer cell raised {answer_error[0]}: {answer_error[1]}",
                )
    last = runs[-1] if runs else None
    if last is not None and not last.complete:
        for test in spliced.tests:
            if last.stopped_at is None or test.index > last.stopped_at:
                reasons.setdefault(
                    test.index, (NOT_RUN if last.stop != STOP_CRASH else STOP_CRASH, f"not reached: {last.reason}")
                )
    if last is not None and last.notebook is not None:
        for test in spliced.tests:
            cell = last.notebook.cells[test.index]
            ran = cell.get("execution_count") is not None and spliced.notebook.cells[test.index].source.strip()
            if ran and test.index not in reasons and last.cell_error(test.index) is None:
                reasons[test.index] = (
                    TAMPERING,
                    "the test cell ran without error but recorded nothing "
                    "(the check machinery in the kernel was altered)",
                )
    return reasons


def scan_answers(spliced: Spliced, lab_id: str) -> dict[str, tamper.Finding]:
    """Static findings per answer cell (the first one found), before anything runs."""
    trusted_code = [
        c.source
        for i, c in enumerate(spliced.notebook.cells)
        if c.cell_type == "code" and i not in spliced.answers.values()
    ]
    aliases = tamper.module_aliases(trusted_code)
    findings = {}
    for answer, index in spliced.answers.items():
        modules, names = shortcut_modules(answer_lab(lab_id, answer))
        found = tamper.scan(spliced.notebook.cells[index].source, modules, names, aliases)
        if found:
            findings[answer] = found[0]
    return findings


def grade_notebook(
    notebook: str | Path,
    *,
    lab_id: str | None = None,
    source_dir: str | Path = DEFAULT_SOURCE,
    seed: int | None = None,
    limits: Limits | None = None,
    parameters: dict | None = None,
    watched: dict[str, str] | None = None,
) -> GradeReport:
    """Grade a learner's lab notebook (never modified) against its trusted source.

    Args:
        notebook: the learner's .ipynb.
        lab_id: which lab it is; by default taken from the file or folder name.
        source_dir: the instructor notebooks (nbgrader's source directory).
        seed: the grade-time seed for the checks' inputs; random when None.
        limits: time, memory, process, file and output limits (defaults: ``Limits()``).
        parameters: papermill parameters (default ``{"QUICK": True}``).
        watched: more folders only a cheat would look in (folder -> what it holds: the class's
            submissions, its grades), beside the answer key and the names :data:`WATCHED_NAMES` gives.

    Raises:
        GradingError: the lab cannot be found.
        NotebookError: the learner's notebook cannot be read.
    """
    started = time.monotonic()
    limits = limits or Limits()
    notebook = Path(notebook)
    lab_id, source_path = trusted_source(notebook, lab_id, Path(source_dir))
    trusted = read_notebook(source_path)
    seed = secrets.randbits(31) if seed is None else int(seed)
    stamp = _stamp(lab_id, Path(source_dir))
    try:
        learner = read_notebook(notebook)
    except NotebookError as exc:
        return unreadable_report(lab_id, notebook, trusted, str(exc), time.monotonic() - started, seed, **stamp)
    try:
        renamed = renamed_cells(lab_id, source_dir)
    except ValueError as exc:
        raise GradingError(str(exc)) from exc
    spliced = splice(trusted, learner, renamed)
    findings = scan_answers(spliced, lab_id)
    for answer, finding in findings.items():
        spliced.neutralise(answer)
        spliced.notes.append(f"answer {answer} was not run: it {finding.detail} ({finding.kind})")
    params = {"QUICK": True} if parameters is None else parameters
    cpu_left = limits.budget  # processor time, restarts included; the wall clock only stops what waits
    deadline = started + WALL_FACTOR * limits.budget
    runs: list[Execution] = []
    with tempfile.TemporaryDirectory(prefix=f"grade-{lab_id}-") as work:
        record_path = kernel_folder(Path(work), limits) / "answers.jsonl"  # where the kernel can write
        env = {
            RECORD_ENV: str(record_path),
            SEED_ENV: str(seed),
            CHECK_TIMEOUT_ENV: str(limits.check_timeout),
            MAX_PROCESSES_ENV: str(limits.max_processes),
            tamper.WATCH_ENV: _watch_config(record_path, Path(source_dir), watched or {}, limits.bwrap),
        }
        to_run = spliced.notebook
        # In bubblewrap the kernel sees the lab's reference functions as stubs (grading.hidden_reference),
        # so the grader makes the checks' inputs (some are runs of the course's own code) and hands them over.
        hidden = hidden_files(lab_id, Path(work) / "hidden") if limits.bwrap else None
        if limits.bwrap:
            env[INPUTS_ENV] = str(_write_inputs(spliced.tests, seed, kernel_folder(Path(work), limits) / "inputs"))
        for _ in range(MAX_RESTARTS + 1):
            run = execute(
                to_run,
                Path(work),
                parameters=params,
                env=env,
                limits=limits,
                budget=cpu_left,
                wall_budget=deadline - time.monotonic(),
                hidden=hidden,
                first_cell=WATCH_CELL,
            )
            runs.append(run)
            cpu_left -= run.cpu_seconds
            if run.complete or run.stopped_at is None or run.stop == STOP_BUDGET or time.monotonic() >= deadline - 1:
                break
            # One cell stopped the run: skip it and the tests already answered, then run the
            # rest again, so that one crashing answer cannot cost the others.
            culprit = grade_id(to_run.cells[run.stopped_at]) or f"cell {run.stopped_at + 1}"
            spliced.notes.append(f"{culprit} stopped the run ({run.stop}: {run.reason}); grading went on without it")
            to_run = _without_cells(to_run, run, {t.index for t in spliced.tests})
        records = read_records(record_path)
        attempts = read_attempts(record_path)
    for index in sorted({i for run in runs for i in run.truncated}):
        spliced.notes.append(
            f"{grade_id(spliced.notebook.cells[index]) or f'cell {index + 1}'}: output past "
            f"{limits.output_kb} KiB was dropped"
        )
    tests = evaluate(spliced.tests, records, seed, _why_missing(spliced, runs), findings, spliced.earlier_release)
    sandbox = {
        "processes": f"at most {limits.max_processes}, enforced by the grader's watchdog",
        **{key: value for key, value in (runs[0].sandbox if runs else {}).items() if key != "cgroup"},
        "time": f"processor time: {limits.check_timeout:g} s per check, {limits.cell_timeout:g} s per cell, "
        f"{limits.budget:g} s per notebook; code that waits is stopped after {WALL_FACTOR} times its limit of "
        f"waiting, and the notebook after {WALL_FACTOR * limits.budget:g} s in all",
    }
    if hidden:
        modules = sum(path.suffix == ".py" for path in hidden)
        sandbox["reference"] = (
            f"absent: the kernel saw the {modules} module(s) holding this lab's reference with "
            f"its bodies replaced by stubs"
        )
    if not limits.bwrap:
        sandbox.setdefault(
            "view",
            "no sandbox: the kernel could read and write whatever the grading user can "
            "(fine for grading your own work; grade others' work in bubblewrap)",
        )
    elif runs and runs[0].sandbox and not str(sandbox.get("view", "")).startswith("bubblewrap"):
        sandbox["view"] = (
            f"{NOT_HELD}sandboxed: bubblewrap was asked for, but the kernel's launcher says it ran without it"
        )
    attempts += _reference_calls(lab_id, records, spliced, runs)
    return GradeReport(
        lab_id,
        str(notebook),
        seed,
        tests,
        spliced.notes,
        time.monotonic() - started,
        sandbox,
        executed=runs[-1].notebook if runs else None,
        refused={answer: f"{f.kind}: it {f.detail}, line {f.line}" for answer, f in findings.items()},
        attempts=attempts,
        **stamp,
    )


# Names of folders and files that the learner's code has no business looking for while it is graded
# (nbgrader's course layout, the course's grades); any path with such a part is watched.
WATCHED_NAMES = {
    "solutions": "the answer key",
    "submitted": "classmates' submissions",
    "autograded": "classmates' submissions",
    "submissions": "classmates' submissions",
    "grades": "the class's grades",
    "gradebook.db": "the class's grades",
}
# The kernel's first cell: the watch goes on before any answer runs.
WATCH_CELL = "from grading.tamper import watch as _infra_lab_watch\n_infra_lab_watch()\ndel _infra_lab_watch\n"


def _watch_config(record: Path, source_dir: Path, watched: dict[str, str], sandboxed: bool) -> str:
    from grading.course import REPO_ROOT

    paths = {
        str(source_dir.resolve()): "the answer key",
        **{str(Path(p).resolve()): what for p, what in watched.items()},
    }
    # The course's files are watched for writes, unless the kernel's own folder lies inside it.
    course = {} if record.resolve().is_relative_to(REPO_ROOT) else {str(REPO_ROOT): "the course's files"}
    return tamper.watch_config(str(record), WATCHED_NAMES, paths, course, sandboxed=sandboxed)


def read_attempts(path: Path) -> list[dict[str, str]]:
    """What the watch in the kernel recorded (:func:`grading.tamper.read_attempts`)."""
    try:
        return tamper.read_attempts(path.read_text(encoding="utf-8", errors="replace").splitlines())
    except OSError:
        return []


def _reference_calls(
    lab_id: str, records: dict[str, list[Outcome]], spliced: Spliced, runs: list[Execution]
) -> list[dict[str, str]]:
    """The learner's code called one of the lab's reference functions that the sandbox shows as a stub
    (re-running or copying its module, say): one attempt per function, refused."""
    import re

    from grading.hidden_reference import STUB_MESSAGE

    pattern = re.compile(
        re.escape(STUB_MESSAGE).replace(re.escape("{name}"), r"([\w.]+)").replace(re.escape("{lab}"), re.escape(lab_id))
    )
    texts = [outcome.error or "" for outcomes in records.values() for outcome in outcomes]
    texts += [" ".join(run.cell_error(index) or ()) for run in runs for index in spliced.answers.values()]
    names = dict.fromkeys(match.group(1) for text in texts for match in pattern.finditer(text))
    return [
        {"what": "the lab's reference, hidden in the sandbox", "op": "called", "path": name, "outcome": tamper.REFUSED}
        for name in names
    ]


def _stamp(lab_id: str, source_dir: Path) -> dict[str, str]:
    """When, and against which course and lab version, a notebook is graded."""
    from datetime import datetime, timezone

    return {
        "graded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "course_version": course_version(),
        "lab_version": lab_version(lab_id, source_dir),
    }


def unreadable_report(
    lab_id: str, notebook: Path, trusted, problem: str, seconds: float, seed: int = 0, **stamp: str
) -> GradeReport:
    """A zero report for a notebook that cannot be read: the reason is said once (in the notes),
    and every check fails pointing at it."""
    tests = []
    for test in test_cells(trusted):
        checks = [
            CheckResult(
                call.check_id,
                call.hidden,
                False,
                _failed(
                    call.check_id,
                    get_check(call.check_id).task,
                    UNREADABLE,
                    "not graded: the notebook could not be read (the reason is above)",
                ),
                UNREADABLE,
            )
            for call in test.checks
        ]
        tests.append(TestResult(test.grade_id, 0.0, test.points, checks))
    return GradeReport(
        lab_id,
        str(notebook),
        seed,
        tests,
        [f"the notebook could not be graded: {problem}"],
        seconds,
        unreadable=problem,
        **stamp,
    )


def _without_cells(nb, run: Execution, test_indices: set[int]):
    """The notebook to run again: the cell that stopped the run, and the tests before it, emptied."""
    again = copy.deepcopy(nb)
    for index, cell in enumerate(again.cells):
        if index == run.stopped_at or (index in test_indices and index < run.stopped_at):
            cell.source = ""
    return again
