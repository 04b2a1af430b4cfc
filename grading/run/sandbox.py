"""Limits on the learner's kernel, and the launcher that applies them before the kernel starts.

The grader runs the learner's kernel through a kernelspec whose command is
``python -m grading.run.sandbox [limits] -- <the real kernel command>``: the launcher sets
resource limits, moves the process into an empty network namespace where the OS allows,
writes which limits it could apply to a status file, then replaces itself with the kernel.
The kernel talks to the grader over Unix sockets (IPC transport), so it needs no network.

Where bubblewrap cannot run and the grader runs as root (a Gradescope bundle built to grade without
bubblewrap), the launcher can also run the kernel as an unprivileged user (``Limits.kernel_user``,
``--user``): the files only root may read (the answer key, locked by :mod:`grading.gradescope`), the
grader's processes and the course's own files are then out of the kernel's reach.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import pwd
import resource
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KERNEL_NAME = "infra-lab-sandbox"
# A limit counted in processor time (a check's, a cell's) also stops what waits instead of computing (a
# sleep, a lock, input) after this many times the limit of such waiting (``waiting``); a notebook's run
# also ends at this many times its budget in wall time.
WALL_FACTOR = 3
IDLE_SHARE = 0.05  # an interval in which the code watched used less of a core than this may be waiting


def waiting(cpu_seconds: float, seconds: float, working: bool) -> bool:
    """Whether an interval of ``seconds`` counts as waiting: the code watched used under ``IDLE_SHARE`` of
    a core (``cpu_seconds``) and nothing of it ran or was ready to run (``working``). A process waiting
    for a core on a busy machine is working: such time never counts."""
    return not working and cpu_seconds < IDLE_SHARE * seconds


# The kernel provisioner that forks graded kernels from a template (grading.run.warm), by the name
# pyproject.toml registers it under.
WARM_PROVISIONER = "infra-lab-warm"
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Limits:
    """What a learner's notebook may use while it is graded.

    Attributes:
        cell_timeout: seconds of processor time one cell may use (the kernel and every process it
            started) before the kernel is interrupted, or ``WALL_FACTOR`` times as long waiting
            (``waiting``). Processor time, as for a check: a cell that waits for a core on a busy
            machine gets the verdict it gets on a quiet one.
        check_timeout: seconds of processor time one check may spend in the learner's code
            (``WALL_FACTOR`` times as long waiting).
        budget: seconds of processor time for the whole notebook, restarts included (``WALL_FACTOR``
            times as long in wall time).
        memory_mb: address space of the kernel.
        max_processes: processes the kernel may have alive at once (children included).
        file_size_mb: largest file the kernel may write.
        output_kb: output kept per cell; the rest is dropped with a note.
        isolate_network: run the kernel without network access (where the OS allows).
        bwrap: run the kernel inside bubblewrap (:mod:`grading.run.bwrap`): a read-only view of only
            what the lab needs, one writable scratch folder, no network, its own process IDs.
        kernel_user: without bubblewrap, the user the kernel runs as ("" for the grader's own);
            the grader must run as root. Such a kernel always starts cold, through the launcher
            (a kernel forked from the template would keep the template's user).
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
    kernel_user: str = ""

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name not in ("isolate_network", "bwrap", "kernel_user") and not value > 0:
                raise ValueError(f"limit {name} must be > 0, got {value!r}")
        if self.kernel_user and self.bwrap:
            raise ValueError(
                "kernel_user is for a kernel without bubblewrap; bubblewrap's view already keeps "
                "the grader's files out of reach"
            )


def write_kernelspec(
    jupyter_dir: Path,
    limits: Limits,
    status_file: Path,
    warm: bool = False,
    scratch: Path | None = None,
    hide: dict[Path, Path] | None = None,
) -> str:
    """Install the sandboxed kernelspec under ``jupyter_dir/kernels``; returns its name.

    ``warm``: the kernel manager asks the grading process's template for a forked kernel
    (:mod:`grading.run.warm`), which applies the same limits; it runs this command when none answers.
    ``scratch``: with ``limits.bwrap``, the kernel's only writable folder. The launcher runs
    outside bubblewrap (it writes the status file where the kernel cannot, and puts the kernel in
    a process-count cgroup where the OS lets it), then executes ``bwrap``, which runs the kernel.
    ``hide``: with ``limits.bwrap``, files of the kernel's view replaced (real path -> file shown).
    With ``limits.kernel_user`` the launcher runs the kernel as that user, and ``warm`` is ignored.
    """
    spec_dir = Path(jupyter_dir) / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "grading.run.sandbox",
        "--status",
        str(status_file),
        "--memory-mb",
        str(limits.memory_mb),
        "--file-size-mb",
        str(limits.file_size_mb),
    ]
    kernel = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    if limits.bwrap:
        from grading.run import bwrap

        if scratch is None:
            raise ValueError("a kernel in bubblewrap needs its scratch folder")
        argv += ["--max-processes", str(limits.max_processes), "--bwrap", "--"]
        argv += bwrap.kernel_prefix(scratch, hide=hide) + kernel
    else:
        if limits.isolate_network:
            argv.append("--no-network")
        if limits.kernel_user:
            argv += ["--user", limits.kernel_user]
        argv += ["--"] + kernel
    spec = {"argv": argv, "display_name": "Python 3 (graded, sandboxed)", "language": "python"}
    if warm and not limits.kernel_user:
        spec["metadata"] = {"kernel_provisioner": {"provisioner_name": WARM_PROVISIONER}}
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
    return KERNEL_NAME


def _isolate_network() -> str:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET) == 0:
            return "isolated: the kernel runs in an empty network namespace"
        code = ctypes.get_errno()
        return (
            f"NOT isolated: unshare(CLONE_NEWNET) failed with {errno.errorcode.get(code, code)} "
            "(needs root or user namespaces; run the grader in a container without network)"
        )
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
    return (
        f"at most {max_processes} (the grader's watchdog), and at most {tasks} tasks, threads included, "
        f"enforced by the OS (a pids cgroup: a fork past it fails)",
        str(group),
    )


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
    return {
        "network": "isolated: bubblewrap gives the kernel an empty network namespace",
        "view": (
            "bubblewrap: the system, Python, the environment, infra_lib/ and grading/ read-only; "
            "one scratch folder writable; solutions/, submissions and grades absent"
        ),
        "processes ids": "bubblewrap: a PID namespace of its own (it sees and signals only its own processes)",
    }


def _connection_file_index(command: list[str]) -> int | None:
    """Where the kernel command names its connection file (the argument after ``-f``), if it does."""
    flag = command.index("-f", 1) if "-f" in command[1:] else None
    return flag + 1 if flag is not None and flag + 1 < len(command) else None


def _user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"no user named {name!r} to run the kernel as") from None


def prepare_for_user(name: str, command: list[str]) -> tuple[list[str], str]:
    """Prepare the kernel's folder (this process's working directory) and ``command`` for a kernel
    run as the user ``name``, while this process is still root; (the command to execute, what holds).

    The folder becomes writable to that user without being listed (mode 1733, sticky like /tmp):
    the kernel creates its sockets and records there, and cannot remove or rewrite what the grader
    wrote. The connection file, which the kernel manager wrote for root alone, is copied there for
    the user (ipykernel writes it back). HOME becomes a folder of the user's own inside it.
    """
    user = _user(name)
    if os.geteuid() != 0:
        raise PermissionError(f"only root can run the kernel as {name!r} (the launcher runs as uid {os.geteuid()})")
    folder = Path.cwd()
    os.chmod(folder, 0o1733)
    command = list(command)
    index = _connection_file_index(command)
    if index is not None:
        copy = folder / Path(command[index]).name
        if copy != Path(command[index]):
            shutil.copyfile(command[index], copy)
        os.chown(copy, user.pw_uid, user.pw_gid)
        os.chmod(copy, 0o600)
        command[index] = str(copy)
    home = folder / f"home-{name}"  # the kernel's own, for the caches and settings programs keep there
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, user.pw_uid, user.pw_gid)
    os.environ.update(HOME=str(home), USER=name, LOGNAME=name)
    return command, (
        f"the kernel ran as {name} (uid {user.pw_uid}), not as the grader's root: files only root "
        f"may read (the answer key) and the grader's processes were out of its reach"
    )


def drop_privileges(name: str) -> None:
    """Become the user ``name`` for good: no groups, its group and user ids (real, effective and
    saved), and no way back (no_new_privs: a setuid program runs without its privileges)."""
    user = _user(name)
    os.setgroups([])
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)  # from root: real, effective and saved ids alike
    if os.getuid() != user.pw_uid or os.geteuid() != user.pw_uid or os.getgroups():
        raise PermissionError(f"could not become {name!r}")
    if ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise PermissionError(f"could not forbid {name!r} new privileges")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m grading.run.sandbox")
    parser.add_argument("--status", required=True)
    parser.add_argument("--memory-mb", type=int, required=True)
    parser.add_argument("--file-size-mb", type=int, required=True)
    parser.add_argument("--no-network", action="store_true")
    parser.add_argument("--max-processes", type=int, default=0, help="a pids cgroup for the kernel (0: none)")
    parser.add_argument("--bwrap", action="store_true", help="the command is bubblewrap's (it isolates the network)")
    parser.add_argument("--user", default="", help="run the command as this user (the launcher must run as root)")
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
    if args.user:
        command, status["user"] = prepare_for_user(args.user, command)
    Path(args.status).write_text(json.dumps(status), encoding="utf-8")  # still root: the kernel cannot rewrite it
    if args.user:
        try:
            drop_privileges(args.user)
        except OSError as exc:  # start no kernel, and say why where this process still can
            status["user"] = f"NOT dropped: {exc}; the kernel was not started"
            with contextlib.suppress(OSError):
                Path(args.status).write_text(json.dumps(status), encoding="utf-8")
            raise
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
