"""A learner's progress over the labs: each lab's grade, the checks still failing, a chart.

Grading a lab is slow (a fresh kernel runs it), so each grade is kept next to the lab's
reports with a digest of what it depends on (the learner's answer cells and the trusted
source): an unchanged lab is not graded again, whether ``infra-lab progress`` or
``infra-lab grade`` graded it (both mark their grading with ``mark_graded``). Everything here returns data; the command
line (``infra-lab progress``) and each lab's progress cell only present it.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grading.run.sandbox import Limits

RESULTS = "results.json"
STAMP = "graded-answers.sha256"
UNCHANGED = "unchanged since last grade"
NOT_STARTED = "not started"
STUB_ERROR = "NotImplementedError"  # what every stub raises ("lab07 task 2: BlockPool.fork")
# The first line of a failed check's message, as grading.grader and grading.check write it.
_FAILED_LINE = re.compile(r"^(?P<check>\S+) failed \[[^\]]*\] \((?P<reason>[^)]*)\)$")


@dataclass(frozen=True)
class FailingCheck:
    """One check that did not pass: which, in which test cell, why, in one line."""

    check_id: str
    test: str
    reason: str  # "wrong result", "error", "time-out", "not run", ...
    detail: str  # the first line of what differed or what was raised

    def line(self, width: int = 110) -> str:
        """``check_id (reason): detail``, cut to ``width`` characters."""
        text = f"{self.check_id} ({self.reason}): {self.detail}" if self.detail else f"{self.check_id} ({self.reason})"
        return text if len(text) <= width else text[: width - 3] + "..."


@dataclass
class LabProgress:
    """One lab's standing: its score, its tests, and what still fails."""

    lab_id: str
    score: float = 0.0
    max_score: float = 0.0
    tests_passed: int = 0
    tests: int = 0
    failing: list[FailingCheck] = field(default_factory=list)
    note: str = ""  # UNCHANGED, or why the lab could not be graded
    graded: bool = True
    test_scores: list[tuple[str, float, float]] = field(default_factory=list)  # (test, score, max)
    # Each grading's measurements (the capstone's throughput ratio), oldest first: (graded_at, {name: value}).
    measured: list[tuple[str, dict]] = field(default_factory=list)

    @property
    def not_started(self) -> bool:
        """No point yet and every failing check still hits a stub (or recorded no answer because of one)."""
        return (
            self.graded
            and self.score == 0
            and self.tests_passed == 0
            and bool(self.failing)
            and all(STUB_ERROR in check.detail for check in self.failing)
        )

    @property
    def fraction(self) -> float:
        """Score as a fraction of the maximum (0 for a lab that could not be graded)."""
        return self.score / self.max_score if self.max_score > 0 else 0.0


def find_labs(labs_dir: str | Path) -> list[Path]:
    """The lab notebooks under ``labs_dir`` (``<lab>/<lab>.ipynb``), in lab order."""
    paths = sorted(Path(labs_dir).glob("*/*.ipynb"))
    return [p for p in paths if p.stem == p.parent.name]


def failing_checks(results: dict) -> list[FailingCheck]:
    """The failed checks of a Gradescope ``results.json``, in test order.

    Args:
        results: the parsed results.json (``tests[i]["output"]`` holds the checks' messages).

    Returns:
        One FailingCheck per failed check; a test that failed without a check message
        (an unreadable record) gives one entry named after the test.
    """
    found = []
    for test in results.get("tests", []):
        if test.get("status") == "passed":
            continue
        lines = str(test.get("output", "")).splitlines()
        before = len(found)
        for i, line in enumerate(lines):
            match = _FAILED_LINE.match(line)
            if match:
                detail = lines[i + 1].strip() if i + 1 < len(lines) else ""
                found.append(FailingCheck(match["check"], str(test.get("name")), match["reason"], detail))
        if len(found) == before:
            reason = ", ".join(test.get("tags", [])) or "failed"
            found.append(FailingCheck(str(test.get("name")), str(test.get("name")), reason, lines[0] if lines else ""))
    return found


def from_results(lab_id: str, results: dict, note: str = "") -> LabProgress:
    """A lab's progress from its results.json (as written by ``infra-lab grade``)."""
    tests = results.get("tests", [])
    if not tests and results.get("output"):  # the grader could not grade at all
        note = note or str(results["output"])
    return LabProgress(
        lab_id,
        float(results.get("score", 0.0)),
        float(results.get("max_score", 0.0)),
        sum(t.get("status") == "passed" for t in tests),
        len(tests),
        failing_checks(results),
        note,
        test_scores=[(str(t.get("name")), float(t.get("score", 0)), float(t.get("max_score", 0))) for t in tests],
    )


def read_recorded(lab_id: str, grades: str | Path) -> LabProgress | None:
    """The last grade recorded in ``grades/<lab_id>/results.json``; None when there is none."""
    path = Path(grades) / lab_id / RESULTS
    if not path.is_file():
        return None
    try:
        return from_results(lab_id, json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        return LabProgress(lab_id, graded=False, note=f"cannot read {path}: {exc}; grade the lab again")


def answers_digest(
    path: Path, limits: Limits | None = None, lab_id: str | None = None, source_dir: Path | None = None
) -> str:
    """A digest of what grading depends on: the learner's answer cells, the lab
    (:func:`grading.lab_version.lab_version`, the key `infra-lab grade --submissions` uses too:
    its notebook, its checks and the modules they run) and the limits.

    Args:
        path: the learner's notebook.
        limits: the grader's limits (default ``Limits()``).
        lab_id: the lab it is graded as (default: the one its file or folder names).
        source_dir: the instructor notebooks (default ``solutions/``).
    """
    from dataclasses import asdict

    from grading.course import DEFAULT_SOURCE
    from grading.grader import trusted_source
    from grading.lab_version import lab_version
    from grading.notebook import grade_id, is_solution_cell, read_notebook

    digest = hashlib.sha256()
    for cell in read_notebook(path).cells:
        if is_solution_cell(cell):
            digest.update(f"{grade_id(cell)}\0{cell.source}\0".encode())
    lab_id, source = trusted_source(path, lab_id, source_dir or DEFAULT_SOURCE)
    digest.update(lab_version(lab_id, source.parent.parent).encode())
    digest.update(json.dumps(asdict(limits or Limits()), sort_keys=True).encode())
    return digest.hexdigest()


def mark_graded(out_dir: str | Path, digest: str | None) -> None:
    """Mark the results.json in ``out_dir`` as the grading of the answers ``digest`` stands for, so
    that ``infra-lab progress`` reuses it while they are unchanged; None (answers not known, or no
    grade) removes the mark, so an earlier grading's mark is never taken for this one's."""
    stamp = Path(out_dir) / STAMP
    if digest is None:
        stamp.unlink(missing_ok=True)
    else:
        stamp.write_text(digest)


def grade_lab(
    path: str | Path, out_dir: str | Path, *, limits: Limits | None = None, regrade: bool = False
) -> LabProgress:
    """Grade one lab notebook into ``out_dir`` (its reports), unless it is unchanged since last time.

    Args:
        path: the learner's notebook (``<lab_id>.ipynb``).
        out_dir: where this lab's results.json, feedback and digest go.
        limits: the grader's limits (defaults: ``Limits()``).
        regrade: grade even when the answers are unchanged.

    Returns:
        The lab's progress; ``graded`` is False (with the reason in ``note``) when the
        notebook cannot be graded at all.
    """
    from grading.grader import GradingError, grade_notebook
    from grading.grading_times import machine_load, remember_load
    from grading.notebook import NotebookError
    from grading.report import gradescope_results, write_reports

    path, out_dir = Path(path), Path(out_dir)
    try:
        digest = answers_digest(path, limits)
        cache, stamp = out_dir / RESULTS, out_dir / STAMP
        if not regrade and cache.is_file() and stamp.is_file() and stamp.read_text() == digest:
            return from_results(path.stem, json.loads(cache.read_text(encoding="utf-8")), UNCHANGED)
        load = machine_load()
        report = grade_notebook(path, limits=limits or Limits())
        write_reports(report, out_dir)
        mark_graded(out_dir, digest)
        results = gradescope_results(report)
        remember_load(out_dir, results, load)
    except (GradingError, NotebookError) as exc:
        return LabProgress(path.stem, graded=False, note=f"cannot grade: {exc}")
    return from_results(report.lab_id, results)


def measure_history(lab_dir: str | Path) -> list[tuple[str, dict]]:
    """Every recorded grading's measurements in ``lab_dir`` (its history/ and its last results.json),
    oldest first; gradings that measured nothing are left out."""
    lab_dir = Path(lab_dir)
    found = []
    for path in [*sorted((lab_dir / "history").glob(f"*/{RESULTS}")), lab_dir / RESULTS]:
        try:
            extra = json.loads(path.read_text(encoding="utf-8")).get("extra_data", {})
        except (OSError, ValueError, AttributeError):
            continue
        measures = extra.get("measures") if isinstance(extra, dict) else None
        if isinstance(measures, dict) and measures:
            found.append((str(extra.get("graded_at", "")), measures))
    return sorted(found, key=lambda item: item[0])


def course_progress(
    notebooks: list[Path],
    out: str | Path,
    *,
    limits: Limits | None = None,
    regrade: bool = False,
    progress: bool = True,
) -> list[LabProgress]:
    """Grade (or reuse the grade of) every lab notebook; reports go to ``out/<lab_id>/``.

    Args:
        notebooks: lab notebooks, in the order to show them.
        out: the grades folder.
        limits: the grader's limits.
        regrade: grade even labs unchanged since their last grade.
        progress: show a progress bar (on stderr).

    Returns:
        One LabProgress per notebook, in the same order.
    """
    from tqdm.auto import tqdm

    rows = []
    bar = tqdm(notebooks, desc="labs", unit="lab", disable=not progress, file=sys.stderr)
    for path in bar:
        bar.set_postfix_str(path.stem)
        row = grade_lab(path, Path(out) / path.stem, limits=limits, regrade=regrade)
        row.measured = measure_history(Path(out) / path.stem)
        rows.append(row)
    bar.close()
    return rows


def progress_table(rows: list[LabProgress]) -> str:
    """The terminal table: one line per lab and a total, then the failing checks of each lab
    begun (a lab not started is one line: its checks all fail on the stubs)."""
    table = [("lab", "score", "tests passed", "")]
    for row in rows:
        if row.graded:
            note = " ".join(([NOT_STARTED] if row.not_started else []) + ([f"({row.note})"] if row.note else []))
            table.append((row.lab_id, f"{row.score:g}/{row.max_score:g}", f"{row.tests_passed}/{row.tests}", note))
        else:
            table.append((row.lab_id, "-", "-", row.note))
    total, maximum = sum(r.score for r in rows), sum(r.max_score for r in rows)
    table.append(("total", f"{total:g}/{maximum:g}", "", ""))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    out = []
    for i, row in enumerate(table):
        if i in (1, len(table) - 1):
            out.append("  ".join("-" * w for w in widths[:3]))
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    measured = [r for r in rows if r.measured]
    if measured:
        out += ["", "measured, oldest grading first:"]
        for row in measured:
            for name in dict.fromkeys(k for _, m in row.measured for k in m):
                values = [f"{m[name]:.2f}" for _, m in row.measured if name in m]
                out.append(f"  {row.lab_id} {name}: {' -> '.join(values[-8:])}")
    failing = [r for r in rows if r.failing and not r.not_started]
    if failing:
        out += ["", "still failing:"]
        for row in failing:
            out.append(f"  {row.lab_id}")
            out += [f"    {check.line()}" for check in row.failing]
    return "\n".join(out)


def _hover(row: LabProgress, limit: int = 12) -> str:
    lines = [f"<b>{row.lab_id}</b>", f"{row.score:g}/{row.max_score:g} points" if row.graded else row.note]
    if row.not_started:
        lines.append(f"{NOT_STARTED}: every check still raises the stubs' {STUB_ERROR}")
    elif row.failing:
        lines.append("still failing:")
        lines += [check.line(80) for check in row.failing[:limit]]
        if len(row.failing) > limit:
            lines.append(f"... and {len(row.failing) - limit} more (see feedback.md)")
    elif row.graded and row.max_score > 0:
        lines.append("every check passes")
    return "<br>".join(lines)


def progress_figure(rows: list[LabProgress]):
    """A bar per lab (lab order): score as a fraction of the maximum; hover lists the failing checks."""
    import plotly.graph_objects as go

    colours = ["#2e7d32" if r.fraction >= 1 else "#ef6c00" if r.fraction > 0 else "#9e9e9e" for r in rows]
    total, maximum = sum(r.score for r in rows), sum(r.max_score for r in rows)
    fig = go.Figure(
        go.Bar(
            x=[r.lab_id for r in rows],
            y=[r.fraction for r in rows],
            marker_color=colours,
            text=[f"{r.score:g}/{r.max_score:g}" if r.graded else "not graded" for r in rows],
            textposition="outside",
            hovertext=[_hover(r) for r in rows],
            hoverinfo="text",
        )
    )
    fig.update_layout(
        title=f"Lab progress: {total:g}/{maximum:g} points",
        yaxis_title="fraction of the lab's points",
        yaxis=dict(range=[0, 1.15], tickformat=".0%"),
        xaxis_title="lab",
        template="plotly_white",
    )
    return fig


def write_chart(rows: list[LabProgress], path: str | Path) -> Path:
    """Write the progress chart as one self-contained HTML file (plotly.js inside: works offline)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    progress_figure(rows).write_html(path, include_plotlyjs=True, full_html=True)
    return path
