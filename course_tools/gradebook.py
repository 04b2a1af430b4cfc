"""One gradebook for a class: every lab's ``scores.csv`` merged, and an export for an LMS.

``infra-lab grade --submissions DIR --lab LAB --out grades/LAB`` leaves ``grades/LAB/scores.csv``;
:func:`build_gradebook` reads every such file under a grades folder and writes

* ``gradebook.csv``: one row per learner and lab (score, maximum, status, seed, grading time,
  when, course version, flags, note); a learner with no row for a lab another learner has, or
  on the roster with none at all, is "not submitted" with 0;
* ``canvas.csv``: one row per learner, one column per lab, with Canvas's gradebook-import
  layout (``Student, ID, SIS User ID, SIS Login ID, Section``, then the labs, and a
  ``Points Possible`` row under the header). Learner ids fill ``Student``; the roster's
  Canvas id, SIS ids and section fill the other four (``SIS Login ID`` is the learner id
  where the roster gives none); a lab with no score for a learner is 0.

A roster (:func:`grading.roster.read_roster_file`) is either one learner id per line or a CSV whose header
starts with the learner column and names any of ``canvas_id``, ``sis_user_id``,
``sis_login_id`` and ``section``.

Standard library only.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from grading.roster import read_roster_file

FIELDS = (
    "learner",
    "lab",
    "score",
    "max_score",
    "status",
    "seed",
    "seconds",
    "graded_at",
    "course_version",
    "flags",
    "note",
)
CANVAS_FIXED = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")


@dataclass
class Gradebook:
    rows: list[dict[str, str]]  # FIELDS, one per learner and lab
    labs: list[str]
    learners: list[str]
    max_scores: dict[str, str]  # lab -> points possible
    skipped: list[str]  # scores.csv files that could not be read, and why
    ids: dict[str, dict[str, str]] = field(default_factory=dict)  # learner -> Canvas columns (the roster's)


def _read_scores(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and not {"learner", "score", "max_score", "status"} <= set(rows[0]):
        raise ValueError("not a scores.csv written by infra-lab grade --submissions (no learner/score/status columns)")
    return rows


def collect(grades: Path, roster: dict[str, dict[str, str]] | None = None) -> Gradebook:
    """Every lab's ``<grades>/<lab>/scores.csv``, one row per learner and lab. ``roster``
    (:func:`read_roster_file`): the class, in its order, with its Canvas ids; learners graded but
    not on it follow."""
    grades = Path(grades)
    if not grades.is_dir():
        raise FileNotFoundError(f"no grades folder at {grades}")
    by_lab: dict[str, list[dict[str, str]]] = {}
    skipped = []
    for path in sorted(grades.glob("*/scores.csv")):
        try:
            by_lab[path.parent.name] = _read_scores(path)
        except (OSError, ValueError, csv.Error, UnicodeDecodeError) as exc:
            skipped.append(f"{path}: {exc}")
    if not by_lab:
        raise FileNotFoundError(
            f"no <lab>/scores.csv under {grades}: grade a class first "
            f"(infra-lab grade --submissions DIR --lab LAB --out {grades}/LAB)"
        )
    labs = sorted(by_lab)
    graded = sorted({row["learner"] for rows in by_lab.values() for row in rows})
    learners = list(dict.fromkeys([*(roster or {}), *graded]))
    max_scores = {
        lab: max((row["max_score"] for row in rows), key=lambda v: float(v or 0), default="0")
        for lab, rows in by_lab.items()
    }
    merged = []
    for learner in learners:
        for lab in labs:
            row = next((r for r in by_lab[lab] if r["learner"] == learner), None)
            if row is None:
                merged.append(
                    {
                        **dict.fromkeys(FIELDS, ""),
                        "learner": learner,
                        "lab": lab,
                        "score": "0",
                        "max_score": max_scores[lab],
                        "status": "not submitted",
                        "note": "no submission graded for this lab",
                    }
                )
            else:
                merged.append({**{name: row.get(name, "") for name in FIELDS}, "learner": learner, "lab": lab})
    return Gradebook(merged, labs, learners, max_scores, skipped, dict(roster or {}))


def write_gradebook(book: Gradebook, out_dir: Path) -> list[Path]:
    """Write ``gradebook.csv`` and ``canvas.csv`` into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    long_path, canvas_path = out_dir / "gradebook.csv", out_dir / "canvas.csv"
    with open(long_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(book.rows)
    scores = {(row["learner"], row["lab"]): row["score"] or "0" for row in book.rows}
    with open(canvas_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([*CANVAS_FIXED, *book.labs])
        writer.writerow(["Points Possible", "", "", "", "", *(book.max_scores[lab] for lab in book.labs)])
        for learner in book.learners:
            ids = {"SIS Login ID": learner, **book.ids.get(learner, {})}
            writer.writerow(
                [
                    learner,
                    *(ids.get(column, "") for column in CANVAS_FIXED[1:]),
                    *(scores[(learner, lab)] for lab in book.labs),
                ]
            )
    return [long_path, canvas_path]


def build_gradebook(
    grades: Path, out_dir: Path | None = None, roster: Path | None = None
) -> tuple[Gradebook, list[Path]]:
    """:func:`collect` then :func:`write_gradebook` (into ``grades`` unless told); ``roster``: a
    roster file (:func:`read_roster_file`)."""
    book = collect(grades, read_roster_file(roster) if roster else None)
    return book, write_gradebook(book, Path(out_dir) if out_dir else Path(grades))
