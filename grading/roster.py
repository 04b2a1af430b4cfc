"""A class's roster: the learners, in order, and the ids an LMS knows them by.

One learner id per line, or a CSV whose header starts with the learner column and names any of
``canvas_id``, ``sis_user_id``, ``sis_login_id`` and ``section``. Batch grading reads it for the
class's learners (:mod:`grading.batch`), the gradebook for the Canvas columns. Standard library only.
"""

from __future__ import annotations

import csv
from pathlib import Path

# A roster's column (lower case, spaces as underscores) -> the Canvas column it fills.
ROSTER_COLUMNS = {"canvas_id": "ID", "sis_user_id": "SIS User ID", "sis_login_id": "SIS Login ID", "section": "Section"}
_LEARNER_HEADERS = ("learner", "id", "student")


def read_roster_file(path: Path) -> dict[str, dict[str, str]]:
    """learner id -> the Canvas columns the roster gives for them (``ID``, ``SIS User ID``,
    ``SIS Login ID``, ``Section``; empty for a one-id-per-line roster), in the roster's order.

    One id per line, or the first column of a CSV; a first line whose first column is "learner",
    "id" or "student" is a header, and then its columns named in ``ROSTER_COLUMNS`` (any case,
    spaces or underscores) fill the ids; blank lines and lines starting with # are skipped.

    Raises:
        ValueError: a learner is listed twice with different ids.
    """
    lines = [
        line
        for line in Path(path).read_text(encoding="utf-8-sig").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    rows = list(csv.reader(lines))
    header = [cell.strip().lower().replace(" ", "_") for cell in rows[0]] if rows else []
    if header and header[0] in _LEARNER_HEADERS:
        rows = rows[1:]
    else:
        header = []
    columns = {index: ROSTER_COLUMNS[name] for index, name in enumerate(header) if name in ROSTER_COLUMNS}
    roster: dict[str, dict[str, str]] = {}
    for number, row in enumerate(rows, start=2 if header else 1):
        learner = row[0].strip() if row else ""
        if not learner:
            continue
        ids = {
            column: row[index].strip() for index, column in columns.items() if index < len(row) and row[index].strip()
        }
        if learner in roster and roster[learner] != ids:
            raise ValueError(f"{path}: {learner} is listed twice with different ids (row {number})")
        roster[learner] = ids
    return roster
