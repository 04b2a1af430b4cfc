"""How long each lesson takes to run, measured, and the run-time line each lesson states.

The test suite times every lesson it executes with ``QUICK=True`` and writes one JSON file per
lesson under ``build/notebook_times/``; ``measure`` times full runs the same way. ``update``
merges those measurements into ``notebooks/run_times.json`` (committed) and rewrites the
"**Run time**" paragraph of each lesson's first cell from it, so that a stated time is always
a measured one. Each run records the machine's load (``grading.grading_times.machine_load``):
a lesson states a quiet machine's time, and a run made while other programs were busy replaces
it only when it is slower even scaled to a quiet machine. Nothing here asserts a time: a slow
run only changes what the lessons say.

    python -m course_tools.lesson_times measure --full 06 09   # full runs of two lessons, recorded
    python -m course_tools.lesson_times update                  # measurements -> run_times.json -> lessons
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from grading.course import REPO_ROOT
from grading.grading_times import Load, machine_load

NOTEBOOKS = REPO_ROOT / "notebooks"
TIMES_FILE = NOTEBOOKS / "run_times.json"
MEASURED_DIR = REPO_ROOT / "build" / "notebook_times"
MODES = ("quick", "full")
RUN_TIME_PREFIX = "**Run time**"
_RUN_TIME_PARAGRAPH = re.compile(r"^\*\*Run time\*\*.*?(?=\n\n|\Z)", re.S | re.M)
_TIME_PARAGRAPH = re.compile(r"^\*\*Time\*\*.*?(?=\n\n|\Z)", re.S | re.M)


def describe(seconds: float) -> str:
    """A duration as a person would say it: "about 25 s", "about 3 min"."""
    if seconds < 0:
        raise ValueError(f"a run time cannot be negative, got {seconds}")
    if seconds < 60:
        return f"about {max(5, 5 * round(seconds / 5))} s"
    return f"about {max(1, round(seconds / 60))} min"


def _run_load(entry: dict, mode: str) -> Load | None:
    """The load a mode's stated run began at; None when it was quiet or not recorded."""
    if entry.get(f"{mode}_quiet", True):
        return None
    return Load.from_dict({"busy": entry.get(f"{mode}_busy"), "cores": entry.get("cores", 2)})


def run_time_paragraph(entry: dict) -> str:
    """The lesson's stated run times, from its entry in run_times.json: a quiet machine's, and how
    much longer other programs make it; a time measured while the machine was busy says so."""
    cores = entry.get("cores", 2)
    times = f"{describe(entry['quick_s'])} with `QUICK = True`, {describe(entry['full_s'])} with the full settings"
    busy = {mode: _run_load(entry, mode) for mode in MODES}
    if not any(busy.values()):
        stretched = Load(2.0 * cores, cores).slowdown()
        return (
            f"{RUN_TIME_PREFIX} on a quiet machine with {cores} CPU cores: {times}. Other programs running at the "
            f"same time make it longer: with {2 * cores} of them busy, about {stretched:.0f} times as long."
        )
    measured = "; ".join(
        f"{'`QUICK`' if mode == 'quick' else 'full'} with {load.describe()}" for mode, load in busy.items() if load
    )
    quiet = [
        describe(entry[f"{mode}_s"] / load.slowdown()) if load else describe(entry[f"{mode}_s"])
        for mode, load in busy.items()
    ]
    return (
        f"{RUN_TIME_PREFIX} on {cores} CPU cores while other programs were busy ({measured}): {times}; "
        f"on a quiet machine, {quiet[0]} and {quiet[1]}."
    )


def record(stem: str, mode: str, seconds: float, out_dir: Path = MEASURED_DIR, load: Load | None = None) -> Path:
    """Write one measured run of a notebook (``build/notebook_times/<stem>.<mode>.json``), with the
    machine's load (``load``, else measured now) and whether that load left the machine quiet."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.{mode}.json"
    load = load or machine_load()
    load_1min = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    row = {
        "notebook": stem,
        "mode": mode,
        "seconds": round(seconds, 1),
        "date": date.today().isoformat(),
        "cores": os.cpu_count(),
        "load_1min": load_1min,
        "under_pytest_xdist": bool(os.environ.get("PYTEST_XDIST_WORKER")),
        **({"busy": load.as_dict()["busy"], "quiet": load.quiet} if load else {}),
    }
    path.write_text(json.dumps(row, indent=1) + "\n", encoding="utf-8")
    return path


def measured(out_dir: Path = MEASURED_DIR) -> dict[str, dict[str, dict]]:
    """Every recorded run under ``out_dir``: notebook stem -> mode -> the recorded row."""
    rows: dict[str, dict[str, dict]] = {}
    for path in sorted(out_dir.glob("*.json")):
        try:
            row = json.loads(path.read_text(encoding="utf-8"))
            rows.setdefault(row["notebook"], {})[row["mode"]] = row
        except (json.JSONDecodeError, KeyError, TypeError):
            print(f"skipping {path}: not a recorded run", file=sys.stderr)
    return rows


def read_times(path: Path = TIMES_FILE) -> dict[str, dict]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _replaces(entry: dict, mode: str, row: dict) -> bool:
    """Whether a recorded run takes the place of the entry's time for ``mode``.

    A quiet run (or one whose load was not recorded) always does, as does any run for a mode
    with no time yet or whose time was itself measured on a busy machine. A run on a busy
    machine replaces a quiet machine's time only when, scaled to a quiet machine, it is still
    longer (the lesson has grown slower): otherwise the quiet figure is the better one.
    """
    if f"{mode}_s" not in entry or row.get("quiet", True) or entry.get(f"{mode}_quiet") is False:
        return True
    load = Load.from_dict({"busy": row.get("busy"), "cores": row.get("cores")})
    quiet_seconds = row["seconds"] / load.slowdown() if load else row["seconds"]
    return quiet_seconds > entry[f"{mode}_s"]


def merge(times: dict[str, dict], runs: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """``times`` with each notebook's newest measurements in place of the old ones, a quiet
    machine's kept over a busy one's (``_replaces``); each mode records whether it was quiet."""
    merged = {stem: dict(entry) for stem, entry in times.items()}
    for stem, modes in runs.items():
        entry = merged.setdefault(stem, {})
        for mode, row in modes.items():
            if not _replaces(entry, mode, row):
                continue
            entry[f"{mode}_s"] = row["seconds"]
            entry[f"{mode}_date"] = row["date"]
            entry["cores"] = row["cores"]
            entry[f"{mode}_quiet"] = row.get("quiet", True)
            if "busy" in row:
                entry[f"{mode}_busy"] = row["busy"]
            else:
                entry.pop(f"{mode}_busy", None)
    return dict(sorted(merged.items()))


def stamp(path: Path, entry: dict) -> bool:
    """Rewrite the lesson's run-time paragraph from ``entry``; True when the file changed."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "markdown")
    paragraph = run_time_paragraph(entry)
    if _RUN_TIME_PARAGRAPH.search(cell.source):
        source = _RUN_TIME_PARAGRAPH.sub(paragraph, cell.source, count=1)
    elif _TIME_PARAGRAPH.search(cell.source):
        found = _TIME_PARAGRAPH.search(cell.source)
        source = cell.source[: found.end()] + "\n\n" + paragraph + cell.source[found.end() :]
    else:
        raise ValueError(f"{path.name}: its first cell has no '**Time**' paragraph to put the run time after")
    if source == cell.source:
        return False
    cell.source = source
    nbformat.write(nb, path)
    return True


def stated_paragraph(path: Path) -> str | None:
    """The run-time paragraph a lesson states now, or None."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    cell = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    found = _RUN_TIME_PARAGRAPH.search(cell.source) if cell is not None else None
    return found.group(0) if found else None


def lessons(names: list[str] | None = None, folder: Path = NOTEBOOKS) -> list[Path]:
    """Lesson notebooks by chapter number or stem ("06", "06_request_journey"); all when empty.

    Raises:
        ValueError: a name matches no lesson.
    """
    from course_tools.site.build import find_lessons

    only = {name.split("_", 1)[0] for name in names} if names else None
    return [lesson.path for lesson in find_lessons(folder, only)]


def run_and_record(path: Path, quick: bool, out_dir: Path = MEASURED_DIR, timeout_s: int = 1800) -> float:
    """Run one lesson top to bottom in a scratch folder (papermill) and record how long it took."""
    from grading.run.papermill_ipc import run_with_papermill

    with tempfile.TemporaryDirectory(prefix=f"run-{path.stem}-") as work:
        started = time.monotonic()
        run_with_papermill(
            path,
            Path(work) / path.name,
            parameters={"QUICK": quick},
            kernel_name="python3",
            cwd=work,
            progress_bar=False,
            execution_timeout=timeout_s,
        )
        seconds = time.monotonic() - started
    record(path.stem, "quick" if quick else "full", seconds, out_dir)
    return seconds


def update(out_dir: Path = MEASURED_DIR, times_file: Path = TIMES_FILE, folder: Path = NOTEBOOKS) -> list[str]:
    """Merge the measurements into run_times.json and restate every lesson's run time from it."""
    times = merge(read_times(times_file), measured(out_dir))
    times_file.write_text(json.dumps(times, indent=1) + "\n", encoding="utf-8")
    changed = []
    for path in lessons(folder=folder):
        entry = times.get(path.stem, {})
        if "quick_s" in entry and "full_s" in entry and stamp(path, entry):
            changed.append(path.name)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_tools.lesson_times", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("measure", help="run lessons top to bottom and record their run times")
    run.add_argument("names", nargs="*", help="chapter numbers or stems (default: every lesson)")
    run.add_argument("--full", action="store_true", help="QUICK=False (default: QUICK=True)")
    sub.add_parser("update", help="merge build/notebook_times/ into notebooks/run_times.json and restate the lessons")
    args = parser.parse_args(argv)
    if args.command == "measure":
        try:
            paths = lessons(args.names)
        except ValueError as exc:
            print(f"run_times: {exc}", file=sys.stderr)
            return 2
        for path in paths:
            seconds = run_and_record(path, quick=not args.full)
            print(f"{path.stem}: {seconds:.0f} s ({'QUICK' if not args.full else 'full'})", flush=True)
        return 0
    changed = update()
    print(f"wrote {TIMES_FILE}; restated {len(changed)} lesson(s): {', '.join(changed) or 'none changed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
