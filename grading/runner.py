"""Executing a notebook with papermill under limits, in a child process the grader can kill.

The child (``python -m grading.runner IN OUT ...``) runs papermill with a per-cell time-out
(the kernel is interrupted and the next cell runs) and errors allowed (one broken answer
does not stop the rest). The parent enforces the whole-notebook budget and a memory
limit, and reports which cell was running if the kernel died or the budget ran out.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil

POLL_S = 0.25
INTERRUPT_GRACE_S = 5.0
EXIT_COMPLETE = 0
EXIT_KERNEL_DIED = 3
EXIT_OTHER = 4


@dataclass
class Execution:
    """What one execution produced."""

    notebook: nbformat.NotebookNode | None  # executed (possibly partly) notebook
    complete: bool  # every cell ran (some may have raised)
    reason: str = ""  # why it stopped early
    stopped_at: int | None = None  # index of the cell running when it stopped

    def cell_error(self, index: int) -> str | None:
        """'ExceptionName: message' of a cell that raised, else None."""
        if self.notebook is None or index >= len(self.notebook.cells):
            return None
        for output in self.notebook.cells[index].get("outputs", []):
            if output.get("output_type") == "error":
                return f"{output.get('ename')}: {output.get('evalue')}"[:400]
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


def _kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


def execute(
    notebook: nbformat.NotebookNode,
    workdir: Path,
    *,
    parameters: dict,
    env: dict[str, str],
    cell_timeout: float,
    budget: float,
    memory_mb: int,
) -> Execution:
    """Run ``notebook`` in ``workdir`` and return what came back.

    Args:
        parameters: papermill parameters injected after the ``parameters`` cell.
        env: extra environment variables for the kernel.
        cell_timeout: seconds one cell may run before the kernel is interrupted.
        budget: seconds the whole run may take before it is killed.
        memory_mb: address-space limit of the kernel, in MiB.
    """
    workdir = Path(workdir)
    source, output = workdir / "graded.ipynb", workdir / "graded.out.ipynb"
    progress = workdir / "progress"
    notebook = copy.deepcopy(notebook)
    notebook.nbformat_minor = max(notebook.get("nbformat_minor", 0), 5)  # cell ids exist from 4.5
    for index, cell in enumerate(notebook.cells):
        cell.setdefault("id", f"cell-{index}")
    nbformat.write(notebook, source)
    output.unlink(missing_ok=True)
    progress.unlink(missing_ok=True)
    command = [sys.executable, "-m", "grading.runner", str(source), str(output),
               "--cell-timeout", str(cell_timeout), "--cwd", str(workdir), "--progress", str(progress)]
    for name, value in parameters.items():
        command += ["-p", name, repr(value)]
    limit = memory_mb << 20

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    child_env = {**os.environ, **env, "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    started = time.monotonic()
    log_path = workdir / "runner.log"
    with open(log_path, "w", encoding="utf-8") as log_file:
        proc = subprocess.Popen(command, env=child_env, stdout=log_file, stderr=subprocess.STDOUT,
                                preexec_fn=limit_memory)
        watch = _CellWatch(progress, [cell.get("id", "") for cell in notebook.cells])
        stuck, over_budget = None, False
        while proc.poll() is None:
            over_budget = time.monotonic() - started > budget
            index, running_for = watch.running()
            if index is not None and running_for > cell_timeout + INTERRUPT_GRACE_S:
                stuck = index
            if over_budget or stuck is not None:
                _kill_tree(proc.pid)
                break
            time.sleep(POLL_S)
        proc.wait()
    log = log_path.read_text(encoding="utf-8", errors="replace")
    code = None if (stuck is not None or over_budget) else proc.returncode
    executed = nbformat.read(output, as_version=4) if output.exists() else None
    if executed is not None:
        # Papermill adds cells (injected parameters, error banners): align by cell id, so
        # cell indices match the notebook we were given.
        by_id = {cell.get("id"): cell for cell in executed.cells}
        executed.cells = [by_id.get(cell["id"], nbformat.v4.new_code_cell()) for cell in notebook.cells]
    result = Execution(executed, complete=code == EXIT_COMPLETE)
    if result.complete:
        return result
    result.stopped_at = watch.running()[0]
    if stuck is not None:
        result.reason = f"the cell ignored the interrupt sent after {cell_timeout:.0f} s and was stopped"
    elif code is None:
        result.reason = f"the notebook ran past its time budget of {budget:.0f} s"
    elif code == EXIT_KERNEL_DIED:
        result.reason = "the kernel died (a crash, exit or running out of memory)"
    else:
        tail = (log or "").strip().splitlines()[-3:]
        result.reason = f"execution failed after {time.monotonic() - started:.0f} s: {' | '.join(tail)}"
    return result


def _child(argv: list[str] | None = None) -> int:
    import ast
    import logging

    import papermill
    from nbclient.exceptions import DeadKernelError
    from papermill.clientwrap import PapermillNotebookClient
    from papermill.exceptions import PapermillExecutionError

    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("output")
    parser.add_argument("--cell-timeout", type=float, required=True)
    parser.add_argument("--cwd", required=True)
    parser.add_argument("--progress", required=True, help="file that gets the id of each cell as it starts")
    parser.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    args = parser.parse_args(argv)
    logging.getLogger("papermill").setLevel(logging.ERROR)
    progress = Path(args.progress)
    execute_cell = PapermillNotebookClient.execute_cell

    def tracked_execute_cell(self, cell, cell_index, *more, **kwargs):
        progress.write_text(cell.get("id", ""), encoding="utf-8")
        return execute_cell(self, cell, cell_index, *more, **kwargs)

    PapermillNotebookClient.execute_cell = tracked_execute_cell
    try:
        papermill.execute_notebook(
            args.source, args.output,
            parameters={name: ast.literal_eval(value) for name, value in args.p},
            kernel_name="python3", cwd=args.cwd, progress_bar=False,
            request_save_on_cell_execute=True, execution_timeout=args.cell_timeout,
            allow_errors=True, interrupt_on_timeout=True,
        )
    except PapermillExecutionError:
        pass  # a cell raised: allowed, the verdicts read it from the output notebook
    except DeadKernelError as exc:
        print(f"dead kernel: {exc}", file=sys.stderr)
        return EXIT_KERNEL_DIED
    except Exception as exc:
        if "dead" in str(exc).lower() or "died" in str(exc).lower():
            print(f"dead kernel: {exc}", file=sys.stderr)
            return EXIT_KERNEL_DIED
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_OTHER
    return EXIT_COMPLETE


if __name__ == "__main__":
    sys.exit(_child())
