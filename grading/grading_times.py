"""How long grading a lab takes: its last grading here, else the course's measured table.

``infra-lab grade`` says how long to wait before it starts a kernel. The best guess is the
time this lab's last grading took in this working copy (``execution_time`` in the
results.json it wrote); before any, ``grading_times.json`` holds one measured time per lab
(its solution notebook graded), which ``measure`` and ``record`` refresh.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from grading.course import DEFAULT_SOURCE, UNREADABLE, lab_ids

TABLE = Path(__file__).with_name("grading_times.json")
ABOUT = ("seconds to grade each lab's solution notebook (the report's execution_time; the shortest of the runs made), "
         "measured on a shared, busy 2-core machine: approximate; refresh with "
         "grading.grading_times.record(grading.grading_times.measure())")


def last_grading_seconds(folders: list[Path]) -> float | None:
    """The ``execution_time`` of the newest results.json in ``folders`` that ran a notebook.

    Records of a refused grading (no tests) or of an unreadable notebook (graded without a
    kernel) are skipped: they say nothing about how long running the lab takes.
    """
    newest: tuple[float, float] | None = None
    for path in (folder / "results.json" for folder in folders):
        try:
            results = json.loads(path.read_text(encoding="utf-8"))
            seconds, modified = float(results["execution_time"]), path.stat().st_mtime
            ran = any(test.get("tags") != [UNREADABLE] for test in results["tests"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
        if ran and seconds > 0 and (newest is None or modified > newest[0]):
            newest = (modified, seconds)
    return newest[1] if newest else None


def measured_seconds(lab_id: str, table: Path = TABLE) -> float | None:
    """The lab's time in the committed table; None when the table has no entry for it."""
    try:
        return float(json.loads(table.read_text(encoding="utf-8"))["seconds"][lab_id])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def estimate(lab_id: str, grades: Path, table: Path = TABLE) -> str:
    """How long grading ``lab_id`` should take, and where that guess comes from, in words.

    Args:
        lab_id: the lab being graded.
        grades: the grades folder (this lab's earlier reports are in ``grades/<lab_id>/``
            and, for other files than the lab's own notebook, its sub-folders).
        table: the committed table of measured times.
    """
    folders = [grades / lab_id, *sorted(p for p in (grades / lab_id).glob("*") if p.is_dir())]
    last = last_grading_seconds(folders)
    if last is not None:
        return f"about {last:.0f} s, as its last grading here"
    measured = measured_seconds(lab_id, table)
    if measured is not None:
        return f"about {measured:.0f} s, as measured for the course"
    return f"no time recorded for {lab_id} yet"


def measure(labs: list[str] | None = None, source_dir: Path = DEFAULT_SOURCE) -> dict[str, float]:
    """Grade each lab's solution notebook once; seconds per lab (the report's ``seconds``)."""
    from grading.grader import grade_notebook

    return {lab: round(grade_notebook(Path(source_dir) / lab / f"{lab}.ipynb").seconds, 1)
            for lab in labs or lab_ids(source_dir)}


def record(seconds: dict[str, float], table: Path = TABLE) -> Path:
    """Merge measured seconds per lab into the table (other labs keep their entries)."""
    try:
        known = json.loads(table.read_text(encoding="utf-8"))["seconds"]
    except (OSError, ValueError, TypeError, KeyError):
        known = {}
    merged = {lab: round(float(value), 1) for lab, value in sorted({**known, **seconds}.items())}
    document = {"about": ABOUT, "measured": time.strftime("%Y-%m-%d"), "seconds": merged}
    table.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return table
