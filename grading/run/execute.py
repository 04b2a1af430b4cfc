"""Executing a notebook under limits, in a child process the grader can kill: the parent's side.

The child (``python -m grading.run.child IN OUT ...``, :mod:`grading.run.child`) runs papermill with a per-cell time-out
(the kernel is interrupted and the next cell runs), errors allowed (one broken answer does
not stop the rest) and a cap on each cell's output. The kernel is forked from the grading
process's template (``grading.run.warm``), or started through the sandbox launcher
(``grading.run.sandbox``); either way under the same limits (memory, file size, network). This parent process
watches the run: the whole-notebook budget, a cell that ignores its interrupt, and the
number of processes the kernel spawns; it kills the lot when one is exceeded and reports
which cell was running.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import psutil

from grading.run import warm
from grading.run.child import EXIT_COMPLETE, EXIT_KERNEL_DIED
from grading.run.sandbox import Limits, remove_cgroup, write_kernelspec

POLL_S = 0.25
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

    def cell_error(self, index: int) -> tuple[str, str] | None:
        """(exception name, message) of a cell that raised, else None."""
        if self.notebook is None or index >= len(self.notebook.cells):
            return None
        for output in self.notebook.cells[index].get("outputs", []):
            if output.get("output_type") == "error":
                return str(output.get("ename")), str(output.get("evalue"))[:400]
        return None


class _CellWatch:
    """Follows the child's progress file: which cell runs, and since when."""

    def __init__(self, progress: Path, cell_ids: list[str]):
        self.progress = progress
        self.index_of = {cell_id: i for i, cell_id in enumerate(cell_ids)}

    def running(self) -> tuple[int | None, float]:
        """(index of the cell that started last, seconds since it started)."""
        try:
            stat = self.progress.stat()
            cell_id = self.progress.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None, 0.0
        return self.index_of.get(cell_id), time.time() - stat.st_mtime


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


def _process_tree() -> dict[int, list[int]]:
    """pid -> its children's pids, from one pass over the process table: the watchdog counts two
    trees (the runner's, a forked kernel's) on every poll, and each pass costs milliseconds."""
    ppid_map = getattr(psutil, "_ppid_map", None)  # what Process.children reads: a third of process_iter's cost
    parents = ppid_map() if ppid_map else {proc.pid: proc.info["ppid"] for proc in psutil.process_iter(["ppid"])}
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    return children


def _count_descendants(tree: dict[int, list[int]], pid: int) -> int:
    count, stack, seen = 0, list(tree.get(pid, ())), {pid}
    while stack:
        child = stack.pop()
        if child not in seen:
            seen.add(child)
            count += 1
            stack.extend(tree.get(child, ()))
    return count


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
    hidden: dict[Path, Path] | None = None,
    first_cell: str = "",
) -> Execution:
    """Run ``notebook`` in ``workdir`` under ``limits`` and return what came back.

    Args:
        parameters: papermill parameters injected after the ``parameters`` cell.
        env: extra environment variables for the kernel.
        limits: the kernel's limits (cell time-out, memory, processes, output...).
        budget: seconds this run may take before it is killed.
        hidden: in bubblewrap, files the kernel sees replaced (real path -> file shown instead).
        first_cell: code the kernel runs before the notebook's first cell (the grader's watch on
            what the answers reach for, :func:`grading.tamper.watch`); it is not part of what comes back.

    The kernel works in ``kernel_folder(workdir, limits)``.
    """
    workdir = Path(workdir)
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
        "--cell-timeout",
        str(limits.cell_timeout),
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
        stop, reason, stuck = "", "", None
        while proc.poll() is None:
            index, running_for = watch.running()
            tree = _process_tree()
            in_template = forked.processes(tree)
            spawned = _count_descendants(tree, proc.pid) + in_template
            if time.monotonic() - started > budget:
                stop, reason = STOP_BUDGET, f"the notebook ran past its time budget of {budget:.0f} s"
            elif index is not None and running_for > limits.cell_timeout + INTERRUPT_GRACE_S:
                stop, reason, stuck = (
                    STOP_TIMEOUT,
                    (f"it ignored the interrupt sent after {limits.cell_timeout:.0f} s and was stopped"),
                    index,
                )
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
    result = Execution(executed, complete=not stop and code == EXIT_COMPLETE, sandbox=sandbox, truncated=truncated)
    if result.complete:
        return result
    result.stopped_at = stuck if stuck is not None else watch.running()[0]
    if stop:
        result.stop, result.reason = stop, reason
    elif code == EXIT_KERNEL_DIED:
        result.stop, result.reason = STOP_CRASH, "the kernel died (a crash, an exit, or a fatal signal)"
    else:
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
        result.stop, result.reason = STOP_OTHER, f"execution failed: {' | '.join(tail)}"
    return result
