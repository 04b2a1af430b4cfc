"""One gradebook for a class: every lab's ``scores.csv`` merged, and an export for an LMS.

``infra-lab grade --submissions DIR --lab LAB --out grades/LAB`` leaves ``grades/LAB/scores.csv``;
:func:`build_gradebook` reads every such file under a grades folder and writes

* ``gradebook.csv``: one row per learner and lab (score, maximum, status, seed, grading time,
  when, course version, note); a learner with no row for a lab another learner has is
  "not submitted" with 0;
* ``canvas.csv``: one row per learner, one column per lab, with Canvas's gradebook-import
  layout (``Student, ID, SIS User ID, SIS Login ID, Section``, then the labs, and a
  ``Points Possible`` row under the header). Learner ids fill ``Student`` and
  ``SIS Login ID``; a lab with no score for a learner is 0.

Standard library only.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("learner", "lab", "score", "max_score", "status", "seed", "seconds", "graded_at", "course_version", "note")
CANVAS_FIXED = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")


@dataclass
class Gradebook:
    rows: list[dict[str, str]]  # FIELDS, one per learner and lab
    labs: list[str]
    learners: list[str]
    max_scores: dict[str, str]  # lab -> points possible
    skipped: list[str]  # scores.csv files that could not be read, and why


def _read_scores(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and not {"learner", "score", "max_score", "status"} <= set(rows[0]):
        raise ValueError("not a scores.csv written by infra-lab grade --submissions (no learner/score/status columns)")
    return rows


def collect(grades: Path) -> Gradebook:
    """Every lab's ``<grades>/<lab>/scores.csv``, one row per learner and lab."""
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
        raise FileNotFoundError(f"no <lab>/scores.csv under {grades}: grade a class first "
                                f"(infra-lab grade --submissions DIR --lab LAB --out {grades}/LAB)")
    labs = sorted(by_lab)
    learners = sorted({row["learner"] for rows in by_lab.values() for row in rows})
    max_scores = {lab: max((row["max_score"] for row in rows), key=lambda v: float(v or 0), default="0")
                  for lab, rows in by_lab.items()}
    merged = []
    for learner in learners:
        for lab in labs:
            row = next((r for r in by_lab[lab] if r["learner"] == learner), None)
            if row is None:
                merged.append({**dict.fromkeys(FIELDS, ""), "learner": learner, "lab": lab, "score": "0",
                               "max_score": max_scores[lab], "status": "not submitted",
                               "note": "no submission graded for this lab"})
            else:
                merged.append({**{name: row.get(name, "") for name in FIELDS}, "learner": learner, "lab": lab})
    return Gradebook(merged, labs, learners, max_scores, skipped)


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
            writer.writerow([learner, "", "", learner, "", *(scores[(learner, lab)] for lab in book.labs)])
    return [long_path, canvas_path]


def build_gradebook(grades: Path, out_dir: Path | None = None) -> tuple[Gradebook, list[Path]]:
    """:func:`collect` then :func:`write_gradebook` (into ``grades`` unless told)."""
    book = collect(grades)
    return book, write_gradebook(book, Path(out_dir) if out_dir else Path(grades))
