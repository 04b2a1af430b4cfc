"""Limits on the learner's kernel, and the launcher that applies them before the kernel starts.

The grader runs the learner's kernel through a kernelspec whose command is
``python -m grading.sandbox [limits] -- <the real kernel command>``: the launcher sets
resource limits, moves the process into an empty network namespace where the OS allows,
writes which limits it could apply to a status file, then replaces itself with the kernel.
The kernel talks to the grader over Unix sockets (IPC transport), so it needs no network.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KERNEL_NAME = "infra-lab-sandbox"
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Limits:
    """What a learner's notebook may use while it is graded.

    Attributes:
        cell_timeout: seconds one cell may run before the kernel is interrupted.
        check_timeout: seconds of processor time one check may spend in the learner's code
            (``grading.check.WALL_FACTOR`` times as long in wall time).
        budget: seconds for the whole notebook, restarts included.
        memory_mb: address space of the kernel.
        max_processes: processes the kernel may have alive at once (children included).
        file_size_mb: largest file the kernel may write.
        output_kb: output kept per cell; the rest is dropped with a note.
        isolate_network: run the kernel without network access (where the OS allows).
        bwrap: run the kernel inside bubblewrap (:mod:`grading.bwrap`): a read-only view of only
            what the lab needs, one writable scratch folder, no network, its own process IDs.
    """

    cell_timeout: float = 120.0
    check_timeout: float = 60.0
    budget: float = 600.0
    memory_mb: int = 4096
    max_processes: int = 32
    file_size_mb: int = 256
    output_kb: int = 1024
    isolate_network: bool = True
    bwrap: bool = False

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name not in ("isolate_network", "bwrap") and not value > 0:
                raise ValueError(f"limit {name} must be > 0, got {value!r}")


def write_kernelspec(jupyter_dir: Path, limits: Limits, status_file: Path, warm: bool = False,
                     scratch: Path | None = None, hide: dict[Path, Path] | None = None) -> str:
    """Install the sandboxed kernelspec under ``jupyter_dir/kernels``; returns its name.

    ``warm``: the kernel manager asks the grading process's template for a forked kernel
    (:mod:`grading.warm`), which applies the same limits; it runs this command when none answers.
    ``scratch``: with ``limits.bwrap``, the kernel's only writable folder. The launcher runs
    outside bubblewrap (it writes the status file where the kernel cannot, and puts the kernel in
    a process-count cgroup where the OS lets it), then executes ``bwrap``, which runs the kernel.
    ``hide``: with ``limits.bwrap``, files of the kernel's view replaced (real path -> file shown).
    """
    spec_dir = Path(jupyter_dir) / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "grading.sandbox", "--status", str(status_file),
            "--memory-mb", str(limits.memory_mb), "--file-size-mb", str(limits.file_size_mb)]
    kernel = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    if limits.bwrap:
        from grading import bwrap

        if scratch is None:
            raise ValueError("a kernel in bubblewrap needs its scratch folder")
        argv += ["--max-processes", str(limits.max_processes), "--bwrap", "--"]
        argv += bwrap.kernel_prefix(scratch, hide=hide) + kernel
    else:
        if limits.isolate_network:
            argv.append("--no-network")
        argv += ["--"] + kernel
    spec = {"argv": argv, "display_name": "Python 3 (graded, sandboxed)", "language": "python"}
    if warm:
        from grading.warm import PROVISIONER

        spec["metadata"] = {"kernel_provisioner": {"provisioner_name": PROVISIONER}}
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
    return KERNEL_NAME


def _isolate_network() -> str:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET) == 0:
            return "isolated: the kernel runs in an empty network namespace"
        code = ctypes.get_errno()
        return f"NOT isolated: unshare(CLONE_NEWNET) failed with {errno.errorcode.get(code, code)} " \
               "(needs root or user namespaces; run the grader in a container without network)"
    except (OSError, AttributeError) as exc:
        return f"NOT isolated: {exc} (run the grader in a container without network)"


def _pids_cgroup_base() -> Path | None:
    """The pids-controller cgroup this process is in, if this process may create cgroups under it."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):  # cgroup v1: its own pids hierarchy
            base = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
            return base if os.access(base, os.W_OK) else None
    for line in lines:
        if line.startswith("0::"):  # cgroup v2: one hierarchy, pids delegated to the subtree
            base = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            try:
                delegated = "pids" in (base / "cgroup.subtree_control").read_text().split()
            except OSError:
                return None
            return base if delegated and os.access(base, os.W_OK) else None
    return None


def limit_processes(max_processes: int) -> tuple[str, str]:
    """Move this process into a new pids cgroup, which the OS enforces on it and everything it
    starts; (what held, the cgroup's path or "").

    A pids cgroup counts tasks, threads included: the cap leaves room for the threads of
    ``max_processes`` processes' worth of kernel (ipykernel's, torch's pool of one per core), while
    the grader's watchdog holds the processes themselves to ``max_processes``. A fork bomb meets
    the cap at once, whatever the watchdog's polling interval.
    """
    tasks = max_processes + 128 + 2 * (os.cpu_count() or 1)
    base = _pids_cgroup_base()
    if base is None:
        return ("not enforced by the OS (no writable pids cgroup here); the grader's watchdog counts them", "")
    group = base / f"infra-lab-kernel-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "pids.max").write_text(str(tasks))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        try:
            group.rmdir()
        except OSError:
            pass
        return (f"not enforced by the OS ({exc.strerror or exc}); the grader's watchdog counts them", "")
    return (f"at most {max_processes} (the grader's watchdog), and at most {tasks} tasks, threads included, "
            f"enforced by the OS (a pids cgroup: a fork past it fails)", str(group))


def remove_cgroup(path: str, wait_s: float = 5.0) -> None:
    """Remove a cgroup made by ``limit_processes`` once its processes are gone (best effort).

    The kernel releases a cgroup a moment after its last task has exited: a kernel that started
    thousands of threads can still hold some of them (exiting, not yet released) when its process
    has been reaped. Until then the removal fails with EBUSY, so it is retried for up to ``wait_s``.
    """
    if not path:
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            Path(path).rmdir()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return  # gone already, not ours to remove, or still busy: leave it
        time.sleep(0.02)


def apply_limits(memory_mb: int, file_size_mb: int, no_network: bool) -> dict[str, str]:
    """Apply the limits to this process (inherited by what it executes); say what held."""
    status = {}
    memory = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    status["memory"] = f"address space limited to {memory_mb} MiB"
    size = file_size_mb << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    status["file size"] = f"files limited to {file_size_mb} MiB"
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    status["network"] = _isolate_network() if no_network else "not requested"
    return status


def bwrap_status() -> dict[str, str]:
    """What bubblewrap adds to a kernel's sandbox, as its status file says it."""
    return {"network": "isolated: bubblewrap gives the kernel an empty network namespace",
            "view": ("bubblewrap: the system, Python, the environment, infra_lib/ and grading/ read-only; "
                     "one scratch folder writable; solutions/, submissions and grades absent"),
            "processes ids": "bubblewrap: a PID namespace of its own (it sees and signals only its own processes)"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m grading.sandbox")
    parser.add_argument("--status", required=True)
    parser.add_argument("--memory-mb", type=int, required=True)
    parser.add_argument("--file-size-mb", type=int, required=True)
    parser.add_argument("--no-network", action="store_true")
    parser.add_argument("--max-processes", type=int, default=0, help="a pids cgroup for the kernel (0: none)")
    parser.add_argument("--bwrap", action="store_true", help="the command is bubblewrap's (it isolates the network)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def parse_launcher(argv: list[str]) -> argparse.Namespace:
    """The launcher's options and the kernel command, as ``main`` reads them; ValueError if malformed."""
    try:
        return _parser().parse_args(argv)
    except SystemExit:
        raise ValueError(f"not a sandbox launcher command: {argv}") from None


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no kernel command after --")
    status = apply_limits(args.memory_mb, args.file_size_mb, args.no_network and not args.bwrap)
    if args.max_processes:
        status["processes"], status["cgroup"] = limit_processes(args.max_processes)
    if args.bwrap:
        status.update(bwrap_status())
    Path(args.status).write_text(json.dumps(status), encoding="utf-8")
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
