"""Grading a class: one notebook per learner, in parallel worker processes, with a cache.

A submissions folder holds either one sub-folder per learner (with the lab's notebook, or
a single .ipynb, inside) or one ``<learner>.ipynb`` per learner. Each learner gets
``OUT/<learner>/results.json`` and ``feedback.md``; ``OUT/scores.csv`` has one row per
learner, and ``OUT/similarity.md`` lists answers close to the solution, the reference or each
other (:mod:`grading.similarity`; the ``flags`` column repeats them per learner). A re-run skips
learners whose submission and grader are unchanged.
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
from dataclasses import asdict, dataclass
from pathlib import Path

from grading.sandbox import Limits

CACHE_FILE = "cache-key"


@dataclass
class BatchRow:
    learner: str
    score: float
    max_score: float
    status: str  # "graded", "cached" or "failed"
    seconds: float
    tests: dict[str, float]
    note: str = ""
    flags: str = ""  # close matches (grading.similarity), for the instructor to look at


def find_submissions(folder: Path, lab_id: str) -> dict[str, Path]:
    """learner -> notebook, from a folder of per-learner folders or notebooks."""
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
            candidates = [preferred] if preferred.is_file() else [nested] if nested.is_file() else \
                sorted(p for p in entry.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            if candidates:
                found[entry.name] = candidates[0]
        elif entry.suffix == ".ipynb":
            found[entry.stem] = entry
    return found


def grader_version(lab_id: str, source_dir: Path) -> str:
    """A digest of everything a grade depends on besides the submission."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    files = [Path(source_dir) / lab_id / f"{lab_id}.ipynb"]
    files += sorted((root / "grading").rglob("*.py")) + sorted((root / "infra_lib").rglob("*.py"))
    for path in files:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _cache_key(notebook: Path, version: str, limits: Limits) -> str:
    digest = hashlib.sha256(version.encode())
    digest.update(json.dumps(asdict(limits), sort_keys=True).encode())
    try:
        digest.update(notebook.read_bytes())
    except OSError as exc:
        digest.update(str(exc).encode())
    return digest.hexdigest()


def _grade_one(learner: str, notebook: str, lab_id: str, source_dir: str, out_dir: str,
               limits: Limits, seed: int | None, key: str) -> dict:
    """Worker: grade one learner and write their reports; never raises."""
    from grading.grader import grade_notebook
    from grading.report import gradescope_results, write_reports

    started = time.monotonic()
    target = Path(out_dir)
    try:
        report = grade_notebook(notebook, lab_id=lab_id, source_dir=source_dir, seed=seed, limits=limits)
        write_reports(report, target)
        results = gradescope_results(report)
        status, note = "graded", ""
    except Exception as exc:  # one learner's failure must not stop the class
        results = {"score": 0.0, "max_score": 0.0, "output": f"grading failed: {type(exc).__name__}: {exc}",
                   "tests": []}
        target.mkdir(parents=True, exist_ok=True)
        (target / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        (target / "feedback.md").write_text(f"# Feedback: {lab_id}\n\n{results['output']}\n", encoding="utf-8")
        status, note = "failed", results["output"]
    (target / CACHE_FILE).write_text(key if status == "graded" else "", encoding="utf-8")
    return asdict(BatchRow(learner, results["score"], results["max_score"], status, time.monotonic() - started,
                           {t["name"]: t["score"] for t in results["tests"]}, note))


def _cached(learner: str, target: Path, key: str) -> BatchRow | None:
    try:
        if (target / CACHE_FILE).read_text(encoding="utf-8") != key:
            return None
        results = json.loads((target / "results.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return BatchRow(learner, results["score"], results["max_score"], "cached", 0.0,
                    {t["name"]: t["score"] for t in results["tests"]})


def grade_batch(submissions: Path, lab_id: str, out_dir: Path, *, source_dir: Path, limits: Limits,
                workers: int | None = None, seed: int | None = None, progress: bool = True) -> list[BatchRow]:
    """Grade every learner's notebook; returns one row per learner (also written to scores.csv)."""
    from tqdm import tqdm

    found = find_submissions(submissions, lab_id)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    version = grader_version(lab_id, source_dir)
    rows: dict[str, BatchRow] = {}
    todo = []
    for learner, notebook in found.items():
        key = _cache_key(notebook, version, limits)
        cached = _cached(learner, out_dir / learner, key)
        if cached is not None:
            rows[learner] = cached
        else:
            todo.append((learner, str(notebook), lab_id, str(source_dir), str(out_dir / learner), limits, seed, key))
    workers = max(1, min(workers or max(1, (os.cpu_count() or 2) // 2), len(todo) or 1))
    bar = tqdm(total=len(found), initial=len(rows), desc=f"grading {lab_id}", unit="notebook",
               disable=not progress, file=sys.stderr)
    if todo:
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
                        rows[learner] = BatchRow(learner, 0.0, 0.0, "failed", 0.0, {}, f"worker died: {exc}")
                    bar.set_postfix_str(f"{learner}: {rows[learner].score:g}")
                    bar.update(1)
    bar.close()
    from grading.similarity import class_matches, flags, report

    matches = class_matches(found, lab_id, source_dir)
    (out_dir / "similarity.md").write_text(report(matches, lab_id, len(found)), encoding="utf-8")
    flagged = flags(matches)
    ordered = [rows[learner] for learner in found]
    for row in ordered:
        row.flags = flagged.get(row.learner, "")
    write_csv(ordered, out_dir / "scores.csv")
    return ordered


def write_csv(rows: list[BatchRow], path: Path) -> None:
    test_names = list(dict.fromkeys(name for row in rows for name in row.tests))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["learner", "score", "max_score", "status", "seconds", *test_names, "flags", "note"])
        for row in rows:
            writer.writerow([row.learner, f"{row.score:g}", f"{row.max_score:g}", row.status, f"{row.seconds:.1f}",
                             *(f"{row.tests[name]:g}" if name in row.tests else "" for name in test_names),
                             row.flags, row.note])
