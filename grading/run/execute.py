"""Executing a notebook under limits, in a child process the grader can kill: the parent's side.

The child (``python -m grading.run.child IN OUT ...``, :mod:`grading.run.child`) runs papermill with a per-cell time-out
(the kernel is interrupted and the next cell runs), errors allowed (one broken answer does
not stop the rest) and a cap on each cell's output. The kernel is forked from the grading
process's template (``grading.run.warm``), or started through the sandbox launcher
(``grading.run.sandbox``); either way under the same limits (memory, file size, network). This parent process
watches the run: each cell's time, the whole-notebook budget, a cell that ignores its interrupt,
and the number of processes the kernel spawns; it kills the lot when one is exceeded and reports
which cell was running.

A cell's time is the processor time of the kernel and everything it started (``CellClock``), so
that a graded notebook gets the same verdicts on a busy machine as on a quiet one; a cell that
waits instead of computing (a sleep, a lock, input) is interrupted after ``WALL_FACTOR`` times the
limit of waiting, where time spent waiting for a core does not count. The run's wall-clock budget
is the backstop behind both.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import psutil

from grading.run import warm
from grading.run.child import EXIT_COMPLETE, EXIT_KERNEL_DIED
from grading.run.sandbox import WALL_FACTOR, Limits, remove_cgroup, waiting, write_kernelspec

POLL_S = 0.25
# After its interrupt a cell has this long to stop, in processor time (or WALL_FACTOR times as long
# waiting) before the kernel is killed.
INTERRUPT_GRACE_S = 5.0

# Why a run stopped early; the grader turns these into per-check failure reasons.
STOP_CRASH = "crash"
STOP_TIMEOUT = "time-out"
STOP_PROCESSES = "process limit"
STOP_BUDGET = "not run"
STOP_OTHER = "error"
FIRST_CELL_ID = "infra-lab-first-cell"


@dataclass
class Execution:
    """What one execution produced."""

    notebook: nbformat.NotebookNode | None  # executed cells, aligned with the input notebook
    complete: bool  # every cell ran (some may have raised)
    stop: str = ""  # STOP_* kind when not complete
    reason: str = ""  # why it stopped early, in words
    stopped_at: int | None = None  # index of the cell running when it stopped
    sandbox: dict = field(default_factory=dict)  # which kernel limits the OS let us apply
    truncated: list[int] = field(default_factory=list)  # cells whose output was cut
    cpu_seconds: float = 0.0  # processor time the kernel and its processes used in this run
    interrupted: dict[int, str] = field(default_factory=dict)  # cells the grader interrupted, and why

    def cell_error(self, index: int) -> tuple[str, str] | None:
        """(exception name, message) of a cell that raised, else None."""
        if self.notebook is None or index >= len(self.notebook.cells):
            return None
        for output in self.notebook.cells[index].get("outputs", []):
            if output.get("output_type") == "error":
                ename, evalue = str(output.get("ename")), str(output.get("evalue"))[:400]
                if ename == "KeyboardInterrupt" and index in self.interrupted:
                    evalue = f"the grader interrupted it {self.interrupted[index]}"
                return ename, evalue
        return None


class _CellWatch:
    """Follows the child's progress file: which cell runs, and since when."""

    def __init__(self, progress: Path, cell_ids: list[str]):
        self.progress = progress
        self.index_of = {cell_id: i for i, cell_id in enumerate(cell_ids)}

    def current(self) -> tuple[str, int] | None:
        """The cell that started last: its id and when it started (the progress file's time), or None."""
        try:
            stat = self.progress.stat()
            return self.progress.read_text(encoding="utf-8").strip(), stat.st_mtime_ns
        except FileNotFoundError:
            return None

    def index(self, cell: tuple[str, int] | None) -> int | None:
        """The notebook index of a cell ``current()`` named (None for a cell of the grader's own)."""
        return None if cell is None else self.index_of.get(cell[0])


# Processes of the sandbox itself, not the learner's: (bubblewrap, a kernel forked from the template).
# Cold: the kernel and its launcher; bubblewrap adds two of its own (its monitor and the namespace's
# first process). Forked: the fork that runs the kernel, and in bubblewrap also the sandbox's
# holder (bubblewrap's monitor, the namespace's first process, the idle holder).
_OVERHEAD = {(False, False): 2, (True, False): 4, (False, True): 2, (True, True): 6}


class _ForkedKernel:
    """A kernel forked by the template (grading.run.warm) is not the runner's descendant: its pid comes
    from the sandbox status file, and its processes count and die with the runner's."""

    def __init__(self, status: Path):
        self.status, self.proc = status, None

    def _find(self) -> psutil.Process | None:
        if self.proc is None:
            try:
                self.proc = psutil.Process(int(json.loads(self.status.read_text(encoding="utf-8"))["pid"]))
            except (OSError, ValueError, KeyError, TypeError, psutil.Error):
                return None
        return self.proc if self.proc.is_running() else None  # is_running: never a reused pid

    def processes(self, tree: dict[int, list[int]]) -> int:
        """The kernel and its descendants in ``tree`` (a ``_process_tree()``); 0 when the kernel is
        the runner's own child."""
        proc = self._find()
        return 0 if proc is None else 1 + _count_descendants(tree, proc.pid)

    def kill(self) -> None:
        proc = self._find()
        if proc is not None:
            _kill_tree(proc.pid)


def _cpu_and_runnable(pids: list[int]) -> tuple[float, bool]:
    """Processor time of these processes (and of the children they reaped), and whether any of them
    is running or waiting for a core (or in an uninterruptible wait, such as disk I/O)."""
    total, runnable = 0.0, False
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            t = proc.cpu_times()
            runnable = runnable or proc.status() in (psutil.STATUS_RUNNING, psutil.STATUS_DISK_SLEEP)
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total, runnable


class CellClock:
    """The running cell's time: the kernel's processor time since the cell started (the kernel's
    process and every process below it), and the time it spent waiting (no process of the kernel's
    running or ready to run, and little processor time used: a sleep, a lock, input). Time spent
    waiting for a core on a busy machine is neither. When either passes its limit, the kernel is
    interrupted as jupyter_client interrupts it (SIGINT to the process group it leads).

    The kernel's top process is the forked kernel (``grading.run.warm``), else the runner's child
    (the sandbox launcher, bubblewrap, or the kernel itself), which jupyter_client starts in a
    session of its own.
    """

    def __init__(self, runner_pid: int, forked: _ForkedKernel, limit: float):
        self.runner_pid, self.forked, self.limit = runner_pid, forked, limit
        self.cell: tuple | None = None
        self.cpu_start = self.waited = 0.0
        self.interrupted: tuple[float, float, str] | None = None  # (waited, cpu) when sent, and why
        self.total = 0.0  # the kernel's processor time in this run, as last seen
        self.reasons: dict[str, str] = {}  # cell id -> why it was interrupted
        self.last: tuple[float, float] | None = None  # (monotonic time, processor time) at the last poll

    def _tops(self, tree: dict[int, list[int]]) -> list[int]:
        proc = self.forked._find()
        return [proc.pid] if proc is not None else list(tree.get(self.runner_pid, ()))

    def _interrupt(self, tree: dict[int, list[int]]) -> None:
        own = {os.getpgid(0)}
        try:
            own.add(os.getpgid(self.runner_pid))
        except (ProcessLookupError, PermissionError):
            pass
        for top in self._tops(tree):
            try:
                group = os.getpgid(top)
                if group not in own:
                    os.killpg(group, signal.SIGINT)
                else:
                    os.kill(top, signal.SIGINT)
            except (ProcessLookupError, PermissionError):
                pass

    def tick(self, cell: tuple | None, tree: dict[int, list[int]]) -> str:
        """Follow the running cell; returns why the run must stop ('' while it may go on)."""
        now = time.monotonic()
        cpu, runnable = _cpu_and_runnable([pid for top in self._tops(tree) for pid in _tree_of(tree, top)])
        cpu = self.total = max(self.total, cpu)
        if self.last is not None and waiting(cpu - self.last[1], now - self.last[0], runnable):
            self.waited += now - self.last[0]
        self.last = (now, cpu)
        if cell is None:
            return ""
        if cell != self.cell:  # a new cell started: its clocks start now
            self.cell, self.cpu_start, self.waited, self.interrupted = cell, cpu, 0.0, None
            return ""
        used = max(0.0, cpu - self.cpu_start)
        if self.interrupted is None:
            if used > self.limit:
                why = f"after {self.limit:g} s of processor time"
            elif self.waited > WALL_FACTOR * self.limit:
                why = f"after {WALL_FACTOR * self.limit:g} s of waiting (it used little processor time)"
            else:
                return ""
            self._interrupt(tree)
            self.interrupted = (self.waited, used, why)
            self.reasons[cell[0]] = why
            return ""
        waited, cpu_then, why = self.interrupted
        if used - cpu_then > INTERRUPT_GRACE_S or self.waited - waited > WALL_FACTOR * INTERRUPT_GRACE_S:
            return f"it ignored the interrupt sent {why} and was stopped"
        return ""


def _process_tree() -> dict[int, list[int]]:
    """pid -> its children's pids, from one pass over the process table: the watchdog counts two
    trees (the runner's, a forked kernel's) on every poll, and each pass costs milliseconds."""
    ppid_map = getattr(psutil, "_ppid_map", None)  # what Process.children reads: a third of process_iter's cost
    parents = ppid_map() if ppid_map else {proc.pid: proc.info["ppid"] for proc in psutil.process_iter(["ppid"])}
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    return children


def _tree_of(tree: dict[int, list[int]], pid: int) -> list[int]:
    """``pid`` and its descendants in ``tree`` (a ``_process_tree()``)."""
    found, stack, seen = [], [pid], set()
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            found.append(current)
            stack.extend(tree.get(current, ()))
    return found


def _count_descendants(tree: dict[int, list[int]], pid: int) -> int:
    return len(_tree_of(tree, pid)) - 1


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_tree(pid: int) -> None:
    """Kill a process, its descendants, and the process groups they lead (the kernel's session)."""
    procs = _descendants(pid)
    try:
        procs.append(psutil.Process(pid))
    except psutil.NoSuchProcess:
        pass
    groups = set()
    for proc in procs:
        try:
            groups.add(os.getpgid(proc.pid))
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    for group in groups - {os.getpgid(0)}:
        try:
            os.killpg(group, 9)
        except (ProcessLookupError, PermissionError):
            pass
    psutil.wait_procs(procs, timeout=5)


def kernel_folder(workdir: Path, limits: Limits) -> Path:
    """The kernel's working directory. In bubblewrap it is the only folder of the grader's the
    kernel can see, so it is a folder of its own: the notebooks, the progress and status files and
    the log in ``workdir`` stay out of its reach."""
    return Path(workdir) / "kernel" if limits.bwrap else Path(workdir)


def execute(
    notebook: nbformat.NotebookNode,
    workdir: Path,
    *,
    parameters: dict,
    env: dict[str, str],
    limits: Limits,
    budget: float,
    wall_budget: float | None = None,
    hidden: dict[Path, Path] | None = None,
    first_cell: str = "",
) -> Execution:
    """Run ``notebook`` in ``workdir`` under ``limits`` and return what came back.

    Args:
        parameters: papermill parameters injected after the ``parameters`` cell.
        env: extra environment variables for the kernel.
        limits: the kernel's limits (cell time-out, memory, processes, output...).
        budget: seconds of processor time the kernel (and every process it started) may use in this
            run before it is killed.
        wall_budget: seconds of wall time this run may take (``WALL_FACTOR`` times ``budget`` if None).
        hidden: in bubblewrap, files the kernel sees replaced (real path -> file shown instead).
        first_cell: code the kernel runs before the notebook's first cell (the grader's watch on
            what the answers reach for, :func:`grading.tamper.watch`); it is not part of what comes back.

    The kernel works in ``kernel_folder(workdir, limits)``.
    """
    workdir = Path(workdir)
    wall = WALL_FACTOR * budget if wall_budget is None else wall_budget
    source, output = workdir / "graded.ipynb", workdir / "graded.out.ipynb"
    progress, status = workdir / "progress", workdir / "sandbox.json"
    notebook = copy.deepcopy(notebook)
    notebook.nbformat_minor = max(notebook.get("nbformat_minor", 0), 5)  # cell ids exist from 4.5
    for index, cell in enumerate(notebook.cells):
        cell.setdefault("id", f"cell-{index}")
    to_run = notebook
    if first_cell:  # the executed notebook is aligned by cell id below, which leaves this cell out
        to_run = copy.copy(notebook)
        to_run.cells = [nbformat.v4.new_code_cell(first_cell, id=FIRST_CELL_ID), *notebook.cells]
    nbformat.write(to_run, source)
    for stale in (output, progress, status):
        stale.unlink(missing_ok=True)
    jupyter_dir = workdir / "jupyter"
    kernel_dir = kernel_folder(workdir, limits)
    kernel_dir.mkdir(parents=True, exist_ok=True)
    # Graded kernels fork from the template, torch already imported (grading.run.warm); one in
    # bubblewrap is then moved into the sandbox bubblewrap builds for it (grading.run.bwrap.enter).
    template = warm.template()
    kernel = write_kernelspec(
        jupyter_dir,
        limits,
        status,
        warm=template is not None,
        scratch=kernel_dir if limits.bwrap else None,
        hide=hidden,
    )
    command = [
        sys.executable,
        "-m",
        "grading.run.child",
        str(source),
        str(output),
        "--kernel",
        kernel,
        "--cell-timeout",  # papermill's wall clock: no cell outlives the run (the cell clock below times it)
        str(int(wall) + 1),
        "--output-kb",
        str(limits.output_kb),
        "--cwd",
        str(kernel_dir),
        "--progress",
        str(progress),
    ]
    for name, value in parameters.items():
        command += ["-p", name, repr(value)]
    jupyter_path = os.pathsep.join(p for p in (str(jupyter_dir), os.environ.get("JUPYTER_PATH", "")) if p)
    child_env = {
        **os.environ,
        **env,
        "JUPYTER_PATH": jupyter_path,
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        **(template.env() if template else {}),
    }
    if limits.bwrap:
        # The kernel manager writes the connection file with mkstemp: into the one folder the
        # kernel can read (its own /tmp is empty).
        (kernel_dir / ".runtime").mkdir(exist_ok=True)
        child_env["TMPDIR"] = child_env["JUPYTER_RUNTIME_DIR"] = str(kernel_dir / ".runtime")
    started = time.monotonic()
    log_path = workdir / "runner.log"
    with open(log_path, "w", encoding="utf-8") as log_file:
        # The runner itself forks from the template too (papermill imported), else starts afresh.
        proc = warm.fork_runner(command[3:], workdir, child_env, log_path)
        if proc is None:
            proc = subprocess.Popen(command, env=child_env, stdout=log_file, stderr=subprocess.STDOUT, cwd=workdir)
        watch = _CellWatch(progress, [cell["id"] for cell in notebook.cells])
        forked = _ForkedKernel(status)
        clock = CellClock(proc.pid, forked, limits.cell_timeout)
        stop, reason, stuck = "", "", None
        while proc.poll() is None:
            cell = watch.current()
            index = watch.index(cell)
            tree = _process_tree()
            in_template = forked.processes(tree)
            spawned = _count_descendants(tree, proc.pid) + in_template
            ignored = clock.tick(cell, tree)
            if clock.total > budget:
                stop, reason = STOP_BUDGET, f"the notebook used its budget of {budget:g} s of processor time"
            elif time.monotonic() - started > wall:
                stop, reason = STOP_BUDGET, f"the notebook ran past its budget of {wall:.0f} s of wall time"
            elif index is not None and ignored:
                stop, reason, stuck = STOP_TIMEOUT, ignored, index
            elif spawned > limits.max_processes + _OVERHEAD[limits.bwrap, bool(in_template)]:
                stop, reason = STOP_PROCESSES, f"it started more than {limits.max_processes} processes"
            if stop:
                _kill_tree(proc.pid)
                forked.kill()
                break
            time.sleep(POLL_S)
        proc.wait()
        forked.kill()  # shut down already unless the runner was stopped or died
    code = proc.returncode
    executed = nbformat.read(output, as_version=4) if output.exists() else None
    truncated = []
    if executed is not None:
        # Papermill adds cells (injected parameters, error banners): align by cell id, so
        # cell indices match the notebook we were given.
        by_id = {cell.get("id"): cell for cell in executed.cells}
        executed.cells = [by_id.get(cell["id"], nbformat.v4.new_code_cell()) for cell in notebook.cells]
        truncated = [
            i
            for i, cell in enumerate(executed.cells)
            if cell.get("metadata", {}).get("infra_lab", {}).get("output_truncated")
        ]
    sandbox = json.loads(status.read_text()) if status.exists() else {}
    remove_cgroup(sandbox.get("cgroup", ""))  # its processes are gone: the cgroup goes too
    result = Execution(
        executed,
        complete=not stop and code == EXIT_COMPLETE,
        sandbox=sandbox,
        truncated=truncated,
        cpu_seconds=clock.total,
        interrupted={watch.index_of[c]: why for c, why in clock.reasons.items() if c in watch.index_of},
    )
    if result.complete:
        return result
    result.stopped_at = stuck if stuck is not None else watch.index(watch.current())
    if stop:
        result.stop, result.reason = stop, reason
    elif code == EXIT_KERNEL_DIED:
        result.stop, result.reason = STOP_CRASH, "the kernel died (a crash, an exit, or a fatal signal)"
    else:
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
        result.stop, result.reason = STOP_OTHER, f"execution failed: {' | '.join(tail)}"
    return result
