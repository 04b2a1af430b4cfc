"""Checkpoints: the state after every step, so that a run can stop anywhere and resume.

After each node the runner saves a ``Checkpoint``: how many steps are done, which node ran,
which node runs next and the whole state. A run that crashes, is killed or waits for a human
resumes from the latest checkpoint of its thread (one conversation or job = one ``thread_id``):
the nodes already done are not run again. ``MemoryCheckpointer`` keeps them in a dict (one
process); ``SqliteCheckpointer`` writes them to a file as JSON, so they survive the process.
"""

from __future__ import annotations

import copy
import json
import sqlite3
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Checkpoint:
    """One saved step of a thread.

    Attributes:
        step: steps completed so far in this run.
        node: the node this checkpoint follows (or, while an interrupt waits, the node it stopped).
        next_node: the node to run on resume (``END``: the run is complete).
        state: the whole state after ``node``.
        pending_interrupt: the payload of an ``interrupt`` waiting for an answer, else None.
        resume_values: answers already given to earlier interrupts of ``next_node`` (a node may ask
            several questions; on resume each ``interrupt`` call gets its answer, in order).
    """

    step: int
    node: str
    next_node: str
    state: dict
    pending_interrupt: Any = None
    resume_values: tuple = field(default=())


class MemoryCheckpointer:
    """Checkpoints in a dict, per thread, deep-copied in and out (a node that mutates its state cannot change
    history)."""

    def __init__(self):
        self._threads: dict[str, list[Checkpoint]] = {}

    def put(self, thread_id: str, checkpoint: Checkpoint) -> None:
        """Append ``checkpoint`` to ``thread_id``'s history."""
        self._threads.setdefault(thread_id, []).append(copy.deepcopy(checkpoint))

    def latest(self, thread_id: str) -> Checkpoint | None:
        """The newest checkpoint of ``thread_id``, or None if it has none."""
        history = self._threads.get(thread_id)
        return copy.deepcopy(history[-1]) if history else None

    def history(self, thread_id: str) -> list[Checkpoint]:
        """Every checkpoint of ``thread_id``, oldest first."""
        return copy.deepcopy(self._threads.get(thread_id, []))

    def clear(self, thread_id: str) -> None:
        """Forget ``thread_id`` (its next run starts from the beginning)."""
        self._threads.pop(thread_id, None)


class SqliteCheckpointer:
    """Checkpoints in an SQLite file, one row per step, values as JSON.

    Every call opens its own connection and commits before returning, so a checkpoint that
    ``put`` returned from is on disk even if the process is killed right after.

    Args:
        path: the database file (created with its table if missing).
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        with closing(sqlite3.connect(self.path)) as db, db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS checkpoints (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                "thread_id TEXT NOT NULL, step INTEGER NOT NULL, node TEXT NOT NULL, next_node TEXT NOT NULL, "
                "state TEXT NOT NULL, pending_interrupt TEXT NOT NULL, resume_values TEXT NOT NULL)"
            )
            db.execute("CREATE INDEX IF NOT EXISTS by_thread ON checkpoints (thread_id, id)")

    def put(self, thread_id: str, checkpoint: Checkpoint) -> None:
        """Append ``checkpoint`` to ``thread_id``'s history (TypeError if a value does not survive JSON)."""
        row = (
            thread_id,
            checkpoint.step,
            checkpoint.node,
            checkpoint.next_node,
            _to_json(checkpoint.state, "state"),
            _to_json(checkpoint.pending_interrupt, "pending_interrupt"),
            _to_json(list(checkpoint.resume_values), "resume_values"),
        )
        with closing(sqlite3.connect(self.path)) as db, db:
            db.execute(
                "INSERT INTO checkpoints (thread_id, step, node, next_node, state, pending_interrupt, "
                "resume_values) VALUES (?, ?, ?, ?, ?, ?, ?)",
                row,
            )

    def latest(self, thread_id: str) -> Checkpoint | None:
        """The newest checkpoint of ``thread_id``, or None if it has none."""
        rows = self._rows(thread_id, "ORDER BY id DESC LIMIT 1")
        return rows[0] if rows else None

    def history(self, thread_id: str) -> list[Checkpoint]:
        """Every checkpoint of ``thread_id``, oldest first."""
        return self._rows(thread_id, "ORDER BY id")

    def clear(self, thread_id: str) -> None:
        """Forget ``thread_id`` (its next run starts from the beginning)."""
        with closing(sqlite3.connect(self.path)) as db, db:
            db.execute("DELETE FROM checkpoints WHERE thread_id = ?", (thread_id,))

    def _rows(self, thread_id: str, order: str) -> list[Checkpoint]:
        with closing(sqlite3.connect(self.path)) as db:
            rows = db.execute(
                "SELECT step, node, next_node, state, pending_interrupt, resume_values "
                f"FROM checkpoints WHERE thread_id = ? {order}",
                (thread_id,),
            ).fetchall()
        return [
            Checkpoint(
                step=step,
                node=node,
                next_node=next_node,
                state=json.loads(state),
                pending_interrupt=json.loads(pending),
                resume_values=tuple(json.loads(resumes)),
            )
            for step, node, next_node, state, pending, resumes in rows
        ]


def _to_json(value: Any, what: str) -> str:
    """``value`` as JSON text, or a TypeError naming the key that would not come back equal."""
    try:
        text = json.dumps(value, allow_nan=False)
        same = json.loads(text) == value
    except (TypeError, ValueError):
        same = False
    if same:
        return text
    parts = value.items() if isinstance(value, dict) else [("(the value)", value)]
    for key, item in parts:
        try:
            if json.loads(json.dumps(item, allow_nan=False)) == item:
                continue
            problem = "comes back changed from JSON (a tuple becomes a list, non-string dict keys become strings)"
        except (TypeError, ValueError) as error:
            problem = f"is not JSON-serialisable ({error})"
        raise TypeError(
            f"{what}[{key!r}] = {item!r:.80} {problem}: SqliteCheckpointer stores JSON; keep the "
            "state to dicts, lists, strings, finite numbers, booleans and None"
        )
    raise TypeError(f"{what} {value!r:.80} does not survive JSON: SqliteCheckpointer stores JSON")
