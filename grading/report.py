"""Reports of a graded notebook: a terminal table, markdown feedback and Gradescope's results.json."""

from __future__ import annotations

import json
from pathlib import Path

from grading.grader import GradeReport


def _points(value: float) -> str:
    return f"{value:g}"


def table(report: GradeReport) -> str:
    """A plain-text table, one row per graded test cell, then the total."""
    rows = [("test", "points", "checks", "why")]
    for test in report.tests:
        passed = sum(c.passed for c in test.checks)
        why = ", ".join(dict.fromkeys(c.reason for c in test.checks if not c.passed))
        rows.append(
            (
                test.grade_id,
                f"{_points(test.score)}/{_points(test.max_score)}",
                f"{passed}/{len(test.checks)} passed",
                why,
            )
        )
    rows.append(("total", f"{_points(report.score)}/{_points(report.max_score)}", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    line = "  ".join("-" * w for w in widths)
    out = [f"{report.lab_id}: {report.notebook}"]
    for i, row in enumerate(rows):
        if i in (1, len(rows) - 1):
            out.append(line)
        out.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    failures = [c for t in report.tests for c in t.checks if not c.passed]
    if failures:
        out.append("")
        out.append("What to fix (first failure of each test; all of them in feedback.md):")
        seen = set()
        for test in report.tests:
            first = next((c for c in test.checks if not c.passed), None)
            if first is not None and test.grade_id not in seen:
                seen.add(test.grade_id)
                out.append(first.message)
    for note in report.notes:
        out.append(f"note: {note}")
    return "\n".join(out)


def feedback_markdown(report: GradeReport) -> str:
    """Feedback for the learner: every check's verdict; hidden checks without inputs or answers."""
    lines = [
        f"# Feedback: {report.lab_id}",
        "",
        f"**Score: {_points(report.score)} / {_points(report.max_score)}**",
        "",
        f"Graded `{report.notebook}` in {report.seconds:.0f} s{_when(report)}.",
        "",
    ]
    for note in report.notes:
        lines.append(f"> note: {note}")
    if report.notes:
        lines.append("")
    for test in report.tests:
        mark = "passed" if test.passed else "failed"
        lines += [f"## {test.grade_id}: {_points(test.score)}/{_points(test.max_score)} ({mark})", ""]
        for c in test.checks:
            kind = "hidden check" if c.hidden else "check"
            if c.passed:
                lines.append(f"- {kind} `{c.check_id}`: passed")
            else:
                lines.append(f"- {kind} `{c.check_id}`: **failed** ({c.reason})")
                lines += ["", "  ```", *("  " + m for m in c.message.splitlines()), "  ```", ""]
    if report.sandbox:
        lines += ["## Limits applied while grading", ""]
        lines += [f"- {name}: {value}" for name, value in report.sandbox.items()]
    return "\n".join(lines).rstrip() + "\n"


def _when(report: GradeReport) -> str:
    """ ", seed 123, course 0.1.0+g1a2b3c4, 2026-12-03T06:00:00+00:00": what reproduces the run."""
    parts = [f"seed {report.seed}"] + ([f"course {report.course_version}"] if report.course_version else [])
    parts += [report.graded_at] if report.graded_at else []
    return " (" + ", ".join(parts) + ")"


def gradescope_results(report: GradeReport) -> dict:
    """Gradescope's autograder results: score, max_score and one entry per test cell."""
    return {
        "score": report.score,
        "max_score": report.max_score,
        "execution_time": round(report.seconds, 1),
        "output": f"{report.lab_id}: {_points(report.score)}/{_points(report.max_score)}",
        "tests": [
            {
                "name": test.grade_id,
                "score": test.score,
                "max_score": test.max_score,
                "status": "passed" if test.passed else "failed",
                "output": "\n".join(c.message for c in test.checks),
                "tags": sorted({c.reason for c in test.checks if not c.passed}),
                "visibility": "visible",
            }
            for test in report.tests
        ],
        # Which protections held while the notebook ran, and what reproduces the run (the seed, the
        # course and lab versions); Gradescope keeps extra_data as it is.
        "extra_data": {
            "protections": report.sandbox,
            "status": report.status,
            "seed": report.seed,
            "graded_at": report.graded_at,
            "course_version": report.course_version,
            "lab_version": report.lab_version,
            # what the instructor should look at (grading.grader.GradeReport.flags): never in the score
            **({"flags": report.flags} if report.flags else {}),
            **({"attempts": report.attempts} if report.attempts else {}),
            **({"measures": report.measures} if report.measures else {}),
            **({"unreadable": report.unreadable} if report.unreadable else {}),
        },
    }


def feedback_html(report: GradeReport) -> str:
    """The markdown feedback as a standalone HTML page (learner text is escaped)."""
    import html

    import mistune  # nbconvert's markdown renderer

    body = mistune.create_markdown(escape=True)(feedback_markdown(report))
    title = html.escape(f"Feedback: {report.lab_id}")
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{title}</title>'
        "<style>body{font-family:sans-serif;max-width:50em;margin:2em auto}"
        "pre{background:#f4f4f4;padding:.5em;white-space:pre-wrap}</style></head>\n"
        f"<body>\n{body}</body></html>\n"
    )


def default_out_dir(lab_id: str, notebook: Path, grades: Path) -> Path:
    """Where a grading's reports go unless told: the lab's own record, ``grades/<lab_id>/``
    (which the lab's progress cell and ``infra-lab progress`` read), for the lab's own
    notebook (``<lab_id>.ipynb``); ``grades/<lab_id>/<file stem>/`` for any other file, so
    that grading a copy or someone else's notebook never replaces that record."""
    return grades / lab_id if notebook.stem == lab_id else grades / lab_id / notebook.stem


REPORT_FILES = ("results.json", "feedback.md", "feedback.html")
HISTORY = "history"


def keep_history(out_dir: Path) -> Path | None:
    """Move the reports of the last grading in ``out_dir`` into ``out_dir/history/<when>/``, so a
    new grading never destroys an earlier one; returns that folder (None when there was none)."""
    previous = out_dir / "results.json"
    if not previous.is_file():
        return None
    try:
        when = json.loads(previous.read_text(encoding="utf-8")).get("extra_data", {}).get("graded_at", "")
    except (ValueError, AttributeError):
        when = ""
    if not when:
        from datetime import datetime, timezone

        when = datetime.fromtimestamp(previous.stat().st_mtime, timezone.utc).isoformat(timespec="seconds")
    name = when.replace(":", "").replace("+0000", "Z")
    target = out_dir / HISTORY / name
    suffix = 1
    while target.exists():
        suffix += 1
        target = out_dir / HISTORY / f"{name}-{suffix}"
    target.mkdir(parents=True)
    for file in REPORT_FILES:
        if (out_dir / file).is_file():
            (out_dir / file).replace(target / file)
    return target


def write_reports(report: GradeReport, out_dir: str | Path) -> list[Path]:
    """Write results.json (Gradescope), feedback.md and feedback.html into ``out_dir``; the
    previous grading's reports there move to ``out_dir/history/<when>/`` first."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    keep_history(out_dir)
    results = out_dir / "results.json"
    results.write_text(json.dumps(gradescope_results(report), indent=2) + "\n", encoding="utf-8")
    feedback = out_dir / "feedback.md"
    feedback.write_text(feedback_markdown(report), encoding="utf-8")
    page = out_dir / "feedback.html"
    page.write_text(feedback_html(report), encoding="utf-8")
    return [results, feedback, page]
