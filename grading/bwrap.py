"""The graded kernel inside bubblewrap: a view of the machine with only what a lab needs.

``kernel_prefix(scratch)`` is the ``bwrap`` command that the sandboxed kernelspec runs between the
launcher (:mod:`grading.sandbox`, which applies the limits and executes it) and the kernel.
Inside it the kernel sees:

* read-only: the system's programs and libraries (``/usr``, ``/etc`` and the ``/bin``, ``/lib``
  links), the Python installation and the virtual environment, and from the course only
  ``infra_lib/`` and ``grading/`` (the library and the check modules the lab's cells import);
* writable: one scratch folder, its working directory, where the answers are recorded and the
  kernel's sockets live; a private ``/tmp`` that vanishes with it;
* nothing else: not ``solutions/`` (the answer key), not the submissions folder (other learners'
  work), not the gradebook or the grades written so far, not the instructor's home. The course
  folder itself is a directory bubblewrap makes to hold the two read-only folders above (on the
  kernel's private ``/tmp`` when the course lives under ``/tmp``): what is written there stays
  in the sandbox;
* in place of the files that hold the graded lab's reference, stubs (``hide``, built by
  :mod:`grading.hidden_reference`).

It runs in namespaces of its own: no network (only a loopback device of its own), its own process
IDs (the kernel cannot see or signal the grader's processes, and every process it starts dies
with it), its own IPC and host name; it dies with the process that started it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# What the kernel needs from the course: the library and the checks. Everything else in the
# course folder (solutions/, labs/, tests/, grades...) is absent from its view.
COURSE_PARTS = ("infra_lib", "grading")
_SYSTEM = ("/usr", "/etc", "/opt")
_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: sudo apt-get install bubblewrap; Fedora: sudo dnf install "
                "bubblewrap) on a kernel that allows namespaces, or pass --no-sandbox to grade without it")


@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(whether bubblewrap can run a sandbox here, what was found or why not)."""
    if sys.platform != "linux":
        return False, f"bubblewrap runs on Linux only, not {sys.platform}"
    path = shutil.which("bwrap")
    if path is None:
        return False, "bwrap (bubblewrap) is not installed"
    probe = [path, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid", "--unshare-net",
             "--unshare-ipc", "--die-with-parent", "--", "true"]
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bwrap could not start: {exc}"
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or ["no message"])[-1]
        return False, f"bwrap cannot create namespaces here ({why})"
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
    return True, f"{version or 'bwrap'} at {path}, namespaces work"


def _bind_readonly(path: Path) -> list[str]:
    return ["--ro-bind", str(path), str(path)] if path.exists() else []


def kernel_prefix(scratch: Path, *, hide: dict[Path, Path] | None = None) -> list[str]:
    """The ``bwrap`` command (up to and including ``--``) that runs a graded kernel in ``scratch``.

    Args:
        scratch: the kernel's only writable folder and working directory (created if missing).
        hide: files of the view to replace, real path -> file shown in its place (read-only).
    """
    ok, why = availability()
    if not ok:
        raise RuntimeError(f"cannot sandbox the kernel: {why}; {INSTALL_HINT}")
    scratch = Path(scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    argv = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--new-session",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--hostname", "graded-kernel"]
    for path in _SYSTEM:
        argv += _bind_readonly(Path(path))
    for path in _LINKS:
        link = Path(path)
        if link.is_symlink():
            argv += ["--symlink", os.readlink(link), path]
        else:
            argv += _bind_readonly(link)
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    # The Python installation and the environment, wherever they live (a pyenv under the
    # instructor's home is bound on its own, not the home around it).
    prefixes = {Path(sys.base_prefix).resolve(), Path(sys.prefix)}
    for prefix in sorted(prefixes, key=lambda p: len(p.parts)):
        argv += _bind_readonly(prefix)
    for part in COURSE_PARTS:
        argv += _bind_readonly(REPO_ROOT / part)
    for real, shown in (hide or {}).items():
        argv += ["--ro-bind", str(shown), str(real)]
    argv += ["--bind", str(scratch), str(scratch), "--chdir", str(scratch),
             "--setenv", "HOME", str(scratch), "--setenv", "TMPDIR", "/tmp",
             # ipykernel shuts down when its parent's pid is not JPY_PARENT_PID; in a PID namespace
             # its parent is the namespace's first process. It dies with bubblewrap instead.
             "--unsetenv", "JPY_PARENT_PID",
             # The root that holds the mounts is a tmpfs of bubblewrap's: read-only too, so that the
             # scratch folder is the one place the kernel can write (besides its private /tmp).
             "--remount-ro", "/", "--"]
    return argv
