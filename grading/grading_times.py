"""How long grading a lab takes on a quiet machine, and how much longer at the load the grader sees.

``infra-lab grade`` says how long to wait before it starts a kernel. Its guess is a quiet
machine's time: this lab's last grading in this working copy (``execution_time`` in the
results.json it wrote, with the load it began at, kept beside it in ``grading-load.json``), else
``grading_times.json``, one measured time per lab (its solution notebook graded) with the load
of that run, which ``measure`` and ``record`` refresh. Other programs running at the same time
stretch a grading; ``Load.slowdown`` turns a quiet machine's time into one at the load measured
now, and the estimate gives both.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from grading.course import DEFAULT_SOURCE, UNREADABLE, lab_ids

TABLE = Path(__file__).with_name("grading_times.json")
LOAD_FILE = "grading-load.json"  # beside a grading's results.json: the load that grading began at
ABOUT = (
    "seconds to grade each lab's solution notebook (the report's execution_time), with the machine's load when "
    "each run began ('load': other processes running or waiting for a core; 'quiet' when they slowed it by "
    "less than a quarter); estimates scale a run that was not quiet down to a quiet machine's time, and take a "
    "run without a recorded load as a quiet machine's; refresh on a quiet machine with "
    "grading.grading_times.record(grading.grading_times.measure())"
)
QUIET_SLOWDOWN = 1.25  # a load that stretches a run by less than this counts as a quiet machine
PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class Load:
    """How busy the machine is: processes other than this one that run or wait for a core.

    Attributes:
        busy: other processes running or waiting for a core (on average over a short sample).
        cores: the cores this process may run on.
    """

    busy: float
    cores: int

    def __post_init__(self):
        if not self.busy >= 0:
            raise ValueError(f"busy processes must be >= 0, got {self.busy!r}")
        if not (isinstance(self.cores, int) and self.cores >= 1):
            raise ValueError(f"cores must be an integer >= 1, got {self.cores!r}")

    def slowdown(self) -> float:
        """How many times a quiet machine's time a run takes at this load.

        On a quiet machine a grading's threads have every core; with ``busy`` other processes
        wanting a core, the scheduler shares the cores among them all, so the run gets about
        ``cores / (cores + busy)`` of what it had: ``1 + busy / cores`` times as long. A rough
        guess: seen on 2 cores at a load of 4 to 5, gradings took 1.7 to 4.7 times as long; torch's
        threads wait for each other on a busy machine, so a heavy lab can take longer still (lab 16,
        2026-12-06: 364 s at 6 to 10 busy processes, 9 times the table's 40 s).
        """
        return 1.0 + self.busy / self.cores

    @property
    def quiet(self) -> bool:
        """Other programs slow a run by less than a quarter (``QUIET_SLOWDOWN``)."""
        return self.slowdown() < QUIET_SLOWDOWN

    def describe(self) -> str:
        """E.g. '4.5 busy processes on 2 cores'."""
        return f"{self.busy:.1f} busy processes on {self.cores} cores"

    def as_dict(self) -> dict:
        return {"busy": round(self.busy, 2), "cores": self.cores, "quiet": self.quiet}

    @classmethod
    def from_dict(cls, row: object) -> Load | None:
        """The load a row recorded; None when the row holds none (or not a valid one)."""
        try:
            return cls(float(row["busy"]), int(row["cores"]))  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            return None


def _running_processes() -> int:
    """Linux's count of processes running or waiting for a core right now (``procs_running``)."""
    for line in PROC_STAT.read_text().splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    raise OSError(f"{PROC_STAT} has no procs_running line")


def machine_load(sample_s: float = 0.2, samples: int = 5) -> Load | None:
    """The machine's load now: other processes running or waiting for a core, over ``sample_s`` seconds.

    Samples Linux's running-process count ``samples`` times (this process, running while it
    reads, is not counted); elsewhere the 1-minute load average. None where neither exists.
    """
    if sample_s < 0 or samples < 1:
        raise ValueError(f"sample_s must be >= 0 and samples >= 1, got {sample_s} and {samples}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        counts = []
        for i in range(samples):
            counts.append(_running_processes() - 1)
            if i + 1 < samples:
                time.sleep(sample_s / (samples - 1))
        return Load(max(0.0, sum(counts) / samples), cores)
    except (OSError, ValueError):
        if hasattr(os, "getloadavg"):
            return Load(os.getloadavg()[0], cores)
        return None


def _about(seconds: float) -> str:
    return f"about {seconds:.0f} s"


@dataclass(frozen=True)
class Measured:
    """One timed run: its seconds and the load it began at (None: not recorded)."""

    seconds: float
    load: Load | None = None

    def quiet_seconds(self) -> float:
        """The run's time on a quiet machine: as measured when it was quiet (or its load is unknown),
        else scaled down by the slowdown of the load it ran at."""
        return self.seconds if self.load is None or self.load.quiet else self.seconds / self.load.slowdown()


def remember_load(out_dir: Path, results: dict, load: Load | None) -> None:
    """Keep the load a grading began at beside its results.json, tied to it by ``graded_at``;
    with no load known, remove an earlier grading's so it is not taken for this one's."""
    path = Path(out_dir) / LOAD_FILE
    graded_at = (results.get("extra_data") or {}).get("graded_at")
    if load is None or not graded_at:
        path.unlink(missing_ok=True)
        return
    path.write_text(json.dumps({"graded_at": graded_at, **load.as_dict()}) + "\n", encoding="utf-8")


def _load_of(folder: Path, results: dict) -> Load | None:
    try:
        row = json.loads((folder / LOAD_FILE).read_text(encoding="utf-8"))
        same = row.get("graded_at") == results.get("extra_data", {}).get("graded_at")
    except (OSError, ValueError, AttributeError):
        return None
    return Load.from_dict(row) if same else None


def last_grading(folders: list[Path]) -> Measured | None:
    """The newest results.json in ``folders`` that ran a notebook: its ``execution_time`` and the
    load it began at (from ``grading-load.json`` beside it, when that belongs to it).

    Records of a refused grading (no tests) or of an unreadable notebook (graded without a
    kernel) are skipped: they say nothing about how long running the lab takes.
    """
    newest: tuple[float, Measured] | None = None
    for folder in folders:
        path = folder / "results.json"
        try:
            results = json.loads(path.read_text(encoding="utf-8"))
            seconds, modified = float(results["execution_time"]), path.stat().st_mtime
            ran = any(test.get("tags") != [UNREADABLE] for test in results["tests"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
        if ran and seconds > 0 and (newest is None or modified > newest[0]):
            newest = (modified, Measured(seconds, _load_of(folder, results)))
    return newest[1] if newest else None


def measured_run(lab_id: str, table: Path = TABLE) -> Measured | None:
    """The lab's run in the committed table, with its load when recorded; None when the table has no entry."""
    try:
        document = json.loads(table.read_text(encoding="utf-8"))
        seconds = float(document["seconds"][lab_id])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    loads = document.get("load") if isinstance(document.get("load"), dict) else {}
    return Measured(seconds, Load.from_dict(loads.get(lab_id)))


def estimate(lab_id: str, grades: Path, table: Path = TABLE, load: Load | None = None) -> str:
    """How long grading ``lab_id`` should take on a quiet machine and at ``load``, and where the guess comes from.

    Args:
        lab_id: the lab being graded.
        grades: the grades folder (this lab's earlier reports are in ``grades/<lab_id>/``
            and, for other files than the lab's own notebook, its sub-folders).
        table: the committed table of measured times.
        load: the machine's load now (``machine_load()``); None: the quiet machine's time alone.

    Returns:
        E.g. "about 7 s on a quiet machine (as measured for the course); about 23 s at this load
        (4.5 busy processes on 2 cores)".
    """
    folders = [grades / lab_id, *sorted(p for p in (grades / lab_id).glob("*") if p.is_dir())]
    run, source = last_grading(folders), "from its last grading here"
    if run is None:
        run, source = measured_run(lab_id, table), "as measured for the course"
    if run is None:
        return f"no time recorded for {lab_id} yet"
    quiet = run.quiet_seconds()
    said = f"{_about(quiet)} on a quiet machine ({source})"
    if load is None:
        return said
    if load.quiet:
        return f"{said}; this machine is quiet now ({load.describe()})"
    return f"{said}; {_about(quiet * load.slowdown())} at this load ({load.describe()})"


def measure(labs: list[str] | None = None, source_dir: Path = DEFAULT_SOURCE) -> dict[str, Measured]:
    """Grade each lab's solution notebook once: per lab, the report's seconds and the load it began at."""
    from grading.grader import grade_notebook

    runs = {}
    for lab in labs or lab_ids(source_dir):
        load = machine_load()
        runs[lab] = Measured(round(grade_notebook(Path(source_dir) / lab / f"{lab}.ipynb").seconds, 1), load)
    return runs


def record(runs: Mapping[str, float | Measured], table: Path = TABLE) -> Path:
    """Merge measured runs into the table (other labs keep their entries); a plain number of
    seconds is a run whose load was not recorded."""
    try:
        document = json.loads(table.read_text(encoding="utf-8"))
        known, loads = dict(document["seconds"]), dict(document.get("load") or {})
    except (OSError, ValueError, TypeError, KeyError):
        known, loads = {}, {}
    for lab, run in runs.items():
        run = run if isinstance(run, Measured) else Measured(float(run))
        known[lab] = run.seconds
        if run.load is None:
            loads.pop(lab, None)
        else:
            loads[lab] = run.load.as_dict()
    merged = {lab: round(float(value), 1) for lab, value in sorted(known.items())}
    document = {
        "about": ABOUT,
        "measured": time.strftime("%Y-%m-%d"),
        "seconds": merged,
        "load": dict(sorted(loads.items())),
    }
    table.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return table
