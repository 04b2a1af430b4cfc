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
from dataclasses import asdict, dataclass
from pathlib import Path

KERNEL_NAME = "infra-lab-sandbox"
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Limits:
    """What a learner's notebook may use while it is graded.

    Attributes:
        cell_timeout: seconds one cell may run before the kernel is interrupted.
        check_timeout: seconds one check may spend in the learner's code.
        budget: seconds for the whole notebook, restarts included.
        memory_mb: address space of the kernel.
        max_processes: processes the kernel may have alive at once (children included).
        file_size_mb: largest file the kernel may write.
        output_kb: output kept per cell; the rest is dropped with a note.
        isolate_network: run the kernel without network access (where the OS allows).
    """

    cell_timeout: float = 120.0
    check_timeout: float = 60.0
    budget: float = 600.0
    memory_mb: int = 4096
    max_processes: int = 32
    file_size_mb: int = 256
    output_kb: int = 1024
    isolate_network: bool = True

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name != "isolate_network" and not value > 0:
                raise ValueError(f"limit {name} must be > 0, got {value!r}")


def write_kernelspec(jupyter_dir: Path, limits: Limits, status_file: Path, warm: bool = False) -> str:
    """Install the sandboxed kernelspec under ``jupyter_dir/kernels``; returns its name.

    ``warm``: the kernel manager asks the grading process's template for a forked kernel
    (:mod:`grading.warm`), which applies the same limits; it runs this command when none answers.
    """
    spec_dir = Path(jupyter_dir) / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "grading.sandbox", "--status", str(status_file),
            "--memory-mb", str(limits.memory_mb), "--file-size-mb", str(limits.file_size_mb)]
    if limits.isolate_network:
        argv.append("--no-network")
    argv += ["--", sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m grading.sandbox")
    parser.add_argument("--status", required=True)
    parser.add_argument("--memory-mb", type=int, required=True)
    parser.add_argument("--file-size-mb", type=int, required=True)
    parser.add_argument("--no-network", action="store_true")
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
    status = apply_limits(args.memory_mb, args.file_size_mb, args.no_network)
    Path(args.status).write_text(json.dumps(status), encoding="utf-8")
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
