"""Replica processes: N copies of a server, each on its own port of 127.0.0.1, started and stopped together.

``ReplicaSet(command, count)`` runs ``command + ["--host", "127.0.0.1", "--port", PORT]`` ``count``
times (``infra-lab serve`` passes its own ``serve`` command with the options the replicas share),
waits until every one answers ``/health``, and stops every one on ``stop()`` (or leaving a
``with`` block). On Linux each replica also gets SIGTERM if the process that started it dies, so
no replica outlives a router that was killed (start the set from a thread that lives as long as it:
Linux signals a replica when the thread that started it ends). Each replica's output goes to its own log file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import httpx

from infra_lib.serving.server import free_port


class ReplicaStartError(RuntimeError):
    """A replica exited or did not answer while the set was starting."""


if sys.platform.startswith("linux"):
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True)

    def _die_with_parent() -> None:  # runs in the child between fork and exec
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the parent's death sends SIGTERM
else:
    _die_with_parent = None


class ReplicaSet:
    """``count`` server processes, one per port.

    Args:
        command: the server's command line without host and port, e.g.
            ``[sys.executable, "-m", "course_tools.cli", "serve", "--kv-blocks", "128"]``.
        count: how many replicas.
        log_dir: where ``replica-<i>.log`` files go (default: a new temporary folder).
        threads_per_replica: torch threads of each replica (default: this machine's cores shared out,
            at least one), given as ``OMP_NUM_THREADS`` unless the environment already sets it.
        startup_timeout_s: how long all of them may take to answer ``/health``.
    """

    def __init__(
        self,
        command: Sequence[str],
        count: int,
        *,
        log_dir: str | Path | None = None,
        threads_per_replica: int | None = None,
        startup_timeout_s: float = 300.0,
    ):
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        self.command, self.count, self.startup_timeout_s = list(command), count, startup_timeout_s
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="infra-lab-replicas-"))
        self.threads = threads_per_replica or max(1, (os.cpu_count() or 1) // count)
        self.ports: list[int] = []
        self.processes: list[subprocess.Popen] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def log_path(self, index: int) -> Path:
        return self.log_dir / f"replica-{index}.log"

    def start(self) -> ReplicaSet:
        """Start every replica and wait until all answer ``/health`` (``ReplicaStartError`` otherwise)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        try:
            for index in range(self.count):
                port = free_port()
                with open(self.log_path(index), "w") as log:
                    process = subprocess.Popen(
                        [*self.command, "--host", "127.0.0.1", "--port", str(port)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        preexec_fn=_die_with_parent,
                    )
                self.ports.append(port)
                self.processes.append(process)
            self._wait_until_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_serving(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        waiting = set(range(self.count))
        while waiting:
            for index in sorted(waiting):
                if self.processes[index].poll() is not None:
                    raise ReplicaStartError(
                        f"replica {index} exited with code {self.processes[index].returncode} while starting; "
                        f"the end of its log ({self.log_path(index)}):\n{self.log_tail(index)}"
                    )
                try:
                    if httpx.get(self.urls[index] + "/health", timeout=2).status_code == 200:
                        waiting.discard(index)
                except httpx.HTTPError:
                    pass
            if waiting and time.monotonic() > deadline:
                raise ReplicaStartError(
                    f"replicas {sorted(waiting)} did not answer /health within {self.startup_timeout_s:.0f} s; "
                    f"see their logs in {self.log_dir}"
                )
            if waiting:
                time.sleep(0.25)

    def log_tail(self, index: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path(index).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self, index: int) -> None:
        """Kill one replica at once (SIGKILL), as a crash would: a drill for the router."""
        self.processes[index].kill()
        self.processes[index].wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every replica: SIGTERM, then SIGKILL for any still running after ``timeout_s``."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)

    def __enter__(self) -> ReplicaSet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
