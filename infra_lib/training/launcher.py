"""Run a function on N processes that form a ``torch.distributed`` group on this machine.

    results = run_workers(fn, world_size=4, args=(...), timeout_s=120)

Each worker is a new Python process, one per rank, as ``torchrun`` starts one process per
device. They come from multiprocessing's ``forkserver``: a clean server process, started once
per interpreter with torch already imported, forks each worker. That is as safe with torch's
thread pools as ``spawn`` (the server has imported torch but never started its threads) without
paying torch's import, seconds on a laptop CPU, for every worker of every call; where there is
no forkserver (Windows) the workers are spawned. Each joins a gloo process group on 127.0.0.1,
calls ``fn(rank, world_size, *args)``, and sends back what it returned.
``fn`` must be importable by the workers (defined in a module, not in a notebook cell). On an
error or a time-out every worker is killed and the error names the rank and its traceback, so
no worker outlives the call (the fork server stays, one per interpreter, for the next call).

On a GPU cluster the same code runs with ``backend="nccl"`` and one process per GPU; only the
launcher (``torchrun``, a scheduler) and the transport change.

``run_torchrun`` is that launcher for real: it runs ``python -m torch.distributed.run --standalone`` on a
script module (by default ``torchrun_train``) with a time-out, and gives back each rank's JSON and, when a rank
failed, torchrun's own report of it (which rank, its exit code, its traceback).
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A worker raised, died or ran past the time-out."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed"]  # what the fork server imports once, so that no worker pays for it


def also_preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too (FSDP2's and DCP's modules take a second per worker to import).
    Call it before this process's first ``run_workers``: the server reads the list when it first starts."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server first starts
    return ctx


class _GroupDidNotForm(Exception):
    """The workers could not connect to each other (for example a port taken by another program)."""


def _worker(rank: int, world_size: int, port: int, backend: str, fn, args, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N processes share this machine's cores
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    except BaseException:  # noqa: BLE001 - the group did not form: the parent may start it again
        results.put((rank, "no group", traceback.format_exc()))
        return
    try:
        try:
            # Pickled here, by value: a tensor put on the queue as it is travels as a file descriptor of
            # shared memory, which the parent can only pick up while this process still lives.
            results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        results.put((rank, "error", traceback.format_exc()))


def run_workers(fn, world_size: int, args: tuple = (), timeout_s: float = 120.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns their results by rank.

    Raises ``WorkerError`` if a worker raises or exits without a result, or if the whole group
    takes longer than ``timeout_s``; every worker is stopped before it returns or raises. A group
    that cannot form (its port taken by another program) is started again on a new port, up to
    three times.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, _GROUP_ATTEMPTS + 1):
        try:
            return _run_once(fn, world_size, args, deadline, timeout_s, backend)
        except _GroupDidNotForm as exc:
            # The port is chosen free, then released for rank 0 to bind: on a busy machine
            # another program can take it in between, or connect to it. Start the group again on
            # a new port; whatever a rank that did connect had begun is discarded with it.
            if attempt == _GROUP_ATTEMPTS or time.monotonic() > deadline:
                raise WorkerError(
                    f"the {world_size} workers could not form a process group ({attempt} attempt(s)):\n{exc}"
                ) from None
    raise AssertionError("unreachable")


_GROUP_ATTEMPTS = 3


def _run_once(fn, world_size: int, args: tuple, deadline: float, timeout_s: float, backend: str) -> list:
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, backend, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out and p.exitcode != 0]
                if dead:
                    raise WorkerError(
                        f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise WorkerError(
                        f"ranks {missing} did not finish within {timeout_s} s (a collective waiting "
                        "for a rank that never joins it hangs: check every rank calls it)"
                    ) from None
                continue
            if status == "no group":
                raise _GroupDidNotForm(f"rank {rank}: {value.strip().splitlines()[-1]}")
            if status == "error":
                raise WorkerError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)  # noqa: S301 - bytes from our own worker
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    return [out[r] for r in range(world_size)]


TORCHRUN_SCRIPT = "infra_lib.training.torchrun_train"
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class TorchrunResult:
    """What one ``torchrun`` run left: its exit code, its output, and the JSON each rank wrote (by rank)."""

    returncode: int
    output: str
    ranks: list[dict] = field(default_factory=list)
    command: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def error_report(self) -> str:
        """torchrun's summary of the failure (its "Root Cause" block: rank, exit code, traceback), or the output's
        last lines when it printed none."""
        lines = self.output.splitlines()
        starts = [
            i
            for i, line in enumerate(lines)
            if line.startswith("torch.distributed.elastic") and "ChildFailedError" in line
        ]
        return "\n".join(lines[starts[-1] :] if starts else lines[-30:])


def _stop_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop torchrun and every worker it started. torchrun puts each worker in a session of its own, so its
    process group alone is not enough: it is asked to stop (it then stops its workers), and whatever is left of
    its descendants after ``grace_s`` is killed."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    for p in [*family, proc]:
        try:
            p.kill()
        except (psutil.Error, ProcessLookupError):
            pass
    psutil.wait_procs([p for p in family if p.is_running()], timeout=grace_s)
    proc.wait()


def run_torchrun(
    script_args: list[str],
    nproc: int = 2,
    timeout_s: float = 120.0,
    module: str = TORCHRUN_SCRIPT,
    out_dir: str | os.PathLike | None = None,
) -> TorchrunResult:
    """Run ``torchrun --standalone --nproc-per-node nproc -m module *script_args --out DIR``; the ranks' results.

    Each rank writes ``DIR/rank{r}.json`` (``out_dir``, or a temporary folder read back and removed here).
    A rank that fails makes torchrun stop the others and exit non-zero: the result's ``error_report()`` is
    torchrun's account of it. Past ``timeout_s`` every process of the run is stopped and ``WorkerError`` raised.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    with tempfile.TemporaryDirectory(prefix="torchrun-") as scratch:
        out = Path(out_dir) if out_dir is not None else Path(scratch)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--max-restarts=0",
            "-m",
            module,
            *map(str, script_args),
            "--out",
            str(out),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_tree(proc)
            output = proc.stdout.read() if proc.stdout else ""
            tail = "\n".join(output.splitlines()[-20:])
            raise WorkerError(
                f"torchrun with {nproc} ranks did not finish within {timeout_s} s; every process of it was stopped. "
                f"Its last output:\n{tail}"
            ) from None
        ranks = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(out.glob("rank*.json"))]
    ranks.sort(key=lambda r: r.get("rank", 0))
    return TorchrunResult(proc.returncode, output, ranks, command)
