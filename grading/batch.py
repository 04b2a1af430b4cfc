"""Grading a class: one notebook per learner, in parallel worker processes, with a cache.

A submissions folder holds either one sub-folder per learner (with the lab's notebook, or
a single .ipynb, inside) or one ``<learner>.ipynb`` per learner; a learner's folder with no
notebook, or a learner on the roster with nothing submitted, is "not submitted". Each learner
gets ``OUT/<learner>/results.json`` and ``feedback.md`` (earlier gradings move to
``OUT/<learner>/history/``); ``OUT/scores.csv`` has one row per learner: score, status (one of
:data:`grading.grader.STATUSES`), whether it came from the cache, the seed, the grading time,
when and against which course version, the flags and a note. The flags are what the instructor
should look at, each starting with its status's name: a protection that did not hold, what the
learner's code reached for while it ran (blocked or reached), an answer the static scan refused
or a check caught, and answers close to the solution, the reference or each other ("copy: ",
from :mod:`grading.similarity`, which also writes ``OUT/similarity.md``). A flag never changes a
score. A re-run skips learners whose submission, the lab's tests, the course's code
(:func:`grading.lab_version.lab_version_parts`) and the limits are unchanged, unless a seed is
given; a re-grade's note says which of them changed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grading.grader import STATUSES
from grading.lab_version import PART_NAMES, lab_version_parts
from grading.roster import read_roster_file
from grading.run.sandbox import Limits

CACHE_FILE = "cache-key"
FLAG_SEPARATOR = " | "  # between the flags of one row (a similarity flag holds "; " itself)
# What each part of the cache key covers, in a re-grade's note.
KEY_PARTS = {"submission": "the submission", **PART_NAMES, "limits": "the limits"}
__all__ = ["STATUSES", "BatchRow", "changed_parts", "find_submissions", "read_roster", "grade_batch", "write_csv"]


@dataclass
class BatchRow:
    learner: str
    score: float
    max_score: float
    status: str  # one of STATUSES
    seconds: float  # the grading's own time (kept when the row comes from the cache)
    tests: dict[str, float]
    note: str = ""
    flags: str = ""  # what the instructor should look at (FLAG_SEPARATOR between them); never in the score
    cached: bool = False  # the row is an earlier grading of the same submission and lab
    seed: int | None = None
    graded_at: str = ""
    course_version: str = ""
    measures: dict = field(default_factory=dict)  # the grading's measurements (the capstone's throughput ratio)


def find_submissions(folder: Path, lab_id: str) -> dict[str, Path | None]:
    """learner -> notebook, from a folder of per-learner folders or notebooks (None: a learner's
    folder holds no notebook)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no submissions folder at {folder}")
    found: dict[str, Path] = {}
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            preferred = entry / f"{lab_id}.ipynb"
            nested = entry / lab_id / f"{lab_id}.ipynb"  # nbgrader's submitted/<learner>/<lab>/ layout
            candidates = (
                [preferred]
                if preferred.is_file()
                else [nested]
                if nested.is_file()
                else sorted(p for p in entry.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            )
            found[entry.name] = candidates[0] if candidates else None
        elif entry.suffix == ".ipynb":
            found[entry.stem] = entry
    return found


def read_roster(path: Path) -> list[str]:
    """The class's learner ids, in the roster's order (:func:`grading.roster.read_roster_file`)."""
    return list(read_roster_file(path))


def _cache_key(notebook: Path, parts: dict[str, str], limits: Limits) -> str:
    """The key of one learner's grading, as JSON: a digest per part (``KEY_PARTS``), so that a
    re-grade can say which changed. ``parts``: :func:`grading.lab_version.lab_version_parts`."""
    try:
        submission = hashlib.sha256(notebook.read_bytes()).hexdigest()
    except OSError as exc:
        submission = hashlib.sha256(str(exc).encode()).hexdigest()
    limits_digest = hashlib.sha256(json.dumps(asdict(limits), sort_keys=True).encode()).hexdigest()
    return json.dumps(
        {"submission": submission, **{part: parts[part] for part in PART_NAMES}, "limits": limits_digest},
        sort_keys=True,
    )


def changed_parts(old: str, new: str) -> list[str]:
    """What differs between two cache keys, in words (``KEY_PARTS``); [] when they are equal, or
    when the old one cannot say (then ``["the earlier grading's record"]``)."""
    try:
        before, after = json.loads(old), json.loads(new)
        if not isinstance(before, dict):
            raise ValueError
    except ValueError:
        return ["the earlier grading's record"]
    return [words for part, words in KEY_PARTS.items() if before.get(part) != after.get(part)]


def _regrade_note(previous: tuple[float, str] | None, score: float, old_key: str, key: str, seed: int | None) -> str:
    """Why a learner with an earlier grading was graded again, and the score before if it moved."""
    if previous is None:
        return ""
    if seed is not None:
        why = f"seed {seed} as asked"
    elif not old_key:
        why = "the earlier grading failed or kept no key"
    else:
        why = " and ".join(changed_parts(old_key, key)) + " changed"
    if previous[0] != score:
        return f"re-graded: {previous[0]:g} before ({previous[1] or 'earlier'}, kept in history/); {why}"
    return f"re-graded, same score: {why}"


def _flag_text(flags) -> str:
    return FLAG_SEPARATOR.join(str(flag) for flag in flags) if isinstance(flags, list) else ""


def _grade_one(
    learner: str,
    notebook: str,
    lab_id: str,
    source_dir: str,
    out_dir: str,
    limits: Limits,
    seed: int | None,
    key: str,
    watched: dict[str, str] | None = None,
) -> dict:
    """Worker: grade one learner and write their reports; never raises."""
    from grading.grader import grade_notebook
    from grading.report import gradescope_results, keep_history, write_reports

    started = time.monotonic()
    target = Path(out_dir)
    previous = _previous(target)
    try:
        old_key = (target / CACHE_FILE).read_text(encoding="utf-8")
    except OSError:
        old_key = ""
    try:
        report = grade_notebook(
            notebook, lab_id=lab_id, source_dir=source_dir, seed=seed, limits=limits, watched=watched
        )
        write_reports(report, target)
        results = gradescope_results(report)
        status, note, seconds = report.status, report.unreadable, report.seconds
        if status == "earlier release":
            note = "made for an earlier release of this lab: map its old answer-cell ids in release_notes.json"
    except Exception as exc:  # one learner's failure must not stop the class
        results = {
            "score": 0.0,
            "max_score": 0.0,
            "output": f"grading failed: {type(exc).__name__}: {exc}",
            "tests": [],
            "extra_data": {},
        }
        target.mkdir(parents=True, exist_ok=True)
        keep_history(target)
        (target / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        (target / "feedback.md").write_text(f"# Feedback: {lab_id}\n\n{results['output']}\n", encoding="utf-8")
        status, note, seconds = "failed", results["output"], time.monotonic() - started
    if status != "failed":
        note = "; ".join(filter(None, [note, _regrade_note(previous, results["score"], old_key, key, seed)]))
    (target / CACHE_FILE).write_text(key if status != "failed" else "", encoding="utf-8")
    extra = results.get("extra_data", {})
    return asdict(
        BatchRow(
            learner,
            results["score"],
            results["max_score"],
            status,
            seconds,
            {t["name"]: t["score"] for t in results["tests"]},
            note,
            _flag_text(extra.get("flags")),
            seed=extra.get("seed"),
            graded_at=extra.get("graded_at", ""),
            course_version=extra.get("course_version", ""),
            measures=dict(extra.get("measures", {})),
        )
    )


def _previous(target: Path) -> tuple[float, str] | None:
    """The score and time of the last grading in ``target``, if any."""
    try:
        results = json.loads((target / "results.json").read_text(encoding="utf-8"))
        return float(results["score"]), str(results.get("extra_data", {}).get("graded_at", ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _cached(learner: str, target: Path, key: str) -> BatchRow | None:
    try:
        if (target / CACHE_FILE).read_text(encoding="utf-8") != key:
            return None
        results = json.loads((target / "results.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    extra = results.get("extra_data", {}) if isinstance(results.get("extra_data"), dict) else {}
    status = extra.get("status", "graded")
    note = extra.get("unreadable", "") if status == "unreadable" else ""
    return BatchRow(
        learner,
        results["score"],
        results["max_score"],
        status,
        float(results.get("execution_time", 0)),
        {t["name"]: t["score"] for t in results["tests"]},
        note,
        _flag_text(extra.get("flags")),
        cached=True,
        seed=extra.get("seed"),
        graded_at=extra.get("graded_at", ""),
        course_version=extra.get("course_version", ""),
        measures=dict(extra.get("measures", {})) if isinstance(extra.get("measures"), dict) else {},
    )


def grade_batch(
    submissions: Path,
    lab_id: str,
    out_dir: Path,
    *,
    source_dir: Path,
    limits: Limits,
    workers: int | None = None,
    seed: int | None = None,
    progress: bool = True,
    roster: list[str] | None = None,
) -> list[BatchRow]:
    """Grade every learner's notebook; returns one row per learner (also written to scores.csv).

    ``seed``: grade everyone with this seed, none from the cache (it reproduces a past run: the
    seed is in each results.json, feedback.md and scores.csv). ``roster``: every learner of the
    class; those who submitted nothing get a "not submitted" row.
    """
    from tqdm import tqdm

    submitted = find_submissions(submissions, lab_id)
    found = {learner: path for learner, path in submitted.items() if path is not None}
    missing = [learner for learner in [*submitted, *(roster or [])] if learner not in found]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = lab_version_parts(lab_id, source_dir)
    # Where only a cheat would look: the class's own submissions and grades (grading.tamper.watch).
    watched = {str(submissions): "classmates' submissions", str(out_dir): "the class's grades"}
    rows: dict[str, BatchRow] = {}
    todo = []
    for learner, notebook in found.items():
        key = _cache_key(notebook, parts, limits)
        cached = None if seed is not None else _cached(learner, out_dir / learner, key)
        if cached is not None:
            rows[learner] = cached
        else:
            todo.append(
                (learner, str(notebook), lab_id, str(source_dir), str(out_dir / learner), limits, seed, key, watched)
            )
    workers = max(1, min(workers or max(1, (os.cpu_count() or 2) // 2), len(todo) or 1))
    bar = tqdm(
        total=len(found),
        initial=len(rows),
        desc=f"grading {lab_id}",
        unit="notebook",
        disable=not progress,
        file=sys.stderr,
    )
    if todo and workers == 1:  # one at a time: in this process (its kernel template), no worker to start
        for job in todo:
            rows[job[0]] = BatchRow(**_grade_one(*job))
            bar.set_postfix_str(f"{job[0]}: {rows[job[0]].score:g}")
            bar.update(1)
    elif todo:
        # spawn, not fork: the caller may have threads (a test runner, a notebook kernel).
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            pending = {pool.submit(_grade_one, *job): job[0] for job in todo}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    learner = pending.pop(future)
                    try:
                        rows[learner] = BatchRow(**future.result())
                    except Exception as exc:  # the worker process itself died
                        rows[learner] = BatchRow(learner, 0.0, 0.0, "failed", 0.0, {}, f"worker died: {exc}", seed=seed)
                    bar.set_postfix_str(f"{learner}: {rows[learner].score:g}")
                    bar.update(1)
    bar.close()
    from grading.similarity import class_matches, flags, report

    matches = class_matches(found, lab_id, source_dir)
    (out_dir / "similarity.md").write_text(report(matches, lab_id, len(found)), encoding="utf-8")
    flagged = flags(matches)
    max_score = max((row.max_score for row in rows.values()), default=0.0)
    for learner in missing:
        rows[learner] = BatchRow(
            learner, 0.0, max_score, "not submitted", 0.0, {}, "no notebook in the submissions folder"
        )
    ordered = [rows[learner] for learner in dict.fromkeys([*(roster or []), *submitted])]  # the roster's order
    for row in ordered:
        if flagged.get(row.learner):
            row.flags = FLAG_SEPARATOR.join(filter(None, [row.flags, f"copy: {flagged[row.learner]}"]))
            if row.status == "graded":
                row.status = "flagged"  # a signal for the instructor; the score stands
    write_csv(ordered, out_dir / "scores.csv")
    return ordered


def write_csv(rows: list[BatchRow], path: Path) -> None:
    test_names = list(dict.fromkeys(name for row in rows for name in row.tests))
    measure_names = list(dict.fromkeys(name for row in rows for name in row.measures))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "learner",
                "score",
                "max_score",
                "status",
                "cached",
                "seed",
                "seconds",
                "graded_at",
                "course_version",
                *test_names,
                *measure_names,
                "flags",
                "note",
            ]
        )
        for row in rows:
            writer.writerow(
                [
                    row.learner,
                    f"{row.score:g}",
                    f"{row.max_score:g}",
                    row.status,
                    "yes" if row.cached else "no",
                    "" if row.seed is None else row.seed,
                    f"{row.seconds:.1f}",
                    row.graded_at,
                    row.course_version,
                    *(f"{row.tests[name]:g}" if name in row.tests else "" for name in test_names),
                    *(f"{row.measures[name]:.3f}" if name in row.measures else "" for name in measure_names),
                    row.flags,
                    row.note,
                ]
            )
