"""The graded kernel inside bubblewrap: a view of the machine with only what a lab needs.

``kernel_prefix(scratch)`` is the ``bwrap`` command that the sandboxed kernelspec runs between the
launcher (:mod:`grading.run.sandbox`, which applies the limits and executes it) and the kernel.
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

import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from grading.course import GRADER_PACKAGES, REPO_ROOT

# What the kernel needs from the course: the library and the checks (GRADER_PACKAGES). Everything
# else in the course folder (solutions/, labs/, tests/, the tooling, grades...) is absent from its view.
COURSE_PARTS = GRADER_PACKAGES
_SYSTEM = ("/usr", "/etc", "/opt")
_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: sudo apt-get install bubblewrap; Fedora: sudo dnf install "
    "bubblewrap) on a kernel that allows namespaces, or pass --no-sandbox to grade without it"
)


@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(whether bubblewrap can run a sandbox here, what was found or why not)."""
    if sys.platform != "linux":
        return False, f"bubblewrap runs on Linux only, not {sys.platform}"
    path = shutil.which("bwrap")
    if path is None:
        return False, "bwrap (bubblewrap) is not installed"
    probe = [
        path,
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--die-with-parent",
        "--",
        "true",
    ]
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


def system_view(tmp_mode: str = "0755") -> list[str]:
    """bubblewrap's options for the machine's programs and libraries and the Python installation,
    read-only, with a ``/proc``, a ``/dev`` and a private ``/tmp`` (its mode ``tmp_mode``: ``"1777"``
    where the view's process runs as another user than root): the part of a view every process the
    course sandboxes needs. The virtual environment is not in it (bind ``sys.prefix`` where the view
    wants it)."""
    argv: list[str] = []
    for path in _SYSTEM:
        argv += _bind_readonly(Path(path))
    for path in _LINKS:
        link = Path(path)
        if link.is_symlink():
            argv += ["--symlink", os.readlink(link), path]
        else:
            argv += _bind_readonly(link)
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", tmp_mode, "--tmpfs", "/tmp"]
    # The Python installation, wherever it lives (a pyenv under the instructor's home is bound on
    # its own, not the home around it).
    base = Path(sys.base_prefix).resolve()
    if base != Path(sys.prefix):
        argv += _bind_readonly(base)
    return argv


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
    argv = [
        shutil.which("bwrap") or "bwrap",
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--hostname",
        "graded-kernel",
    ]
    argv += system_view()
    argv += _bind_readonly(Path(sys.prefix))
    for part in COURSE_PARTS:
        argv += _bind_readonly(REPO_ROOT / part)
    for real, shown in (hide or {}).items():
        argv += ["--ro-bind", str(shown), str(real)]
    argv += [
        "--bind",
        str(scratch),
        str(scratch),
        "--chdir",
        str(scratch),
        "--setenv",
        "HOME",
        str(scratch),
        "--setenv",
        "TMPDIR",
        "/tmp",
        # ipykernel shuts down when its parent's pid is not JPY_PARENT_PID; in a PID namespace
        # its parent is the namespace's first process. It dies with bubblewrap instead.
        "--unsetenv",
        "JPY_PARENT_PID",
        # The root that holds the mounts is a tmpfs of bubblewrap's: read-only too, so that the
        # scratch folder is the one place the kernel can write (besides its private /tmp).
        "--remount-ro",
        "/",
        "--",
    ]
    return argv


# --- a kernel forked warm, moved into a sandbox that bubblewrap built -------------------------------
#
# A cold kernel is bubblewrap's command: it pays for importing torch in every sandbox (about 2 s of
# CPU). A warm one (grading.run.warm) is forked from the grader's template, which imported torch once
# and runs outside any sandbox. ``enter`` puts such a fork into exactly the sandbox the cold kernel
# would have had: bubblewrap builds it as usual (the same command, up to ``--``) around an idle
# holder process, and the fork joins the holder's namespaces (user where bubblewrap made one, IPC,
# host name, network, PID and mount), takes its root and working folder, its groups and
# capabilities and no-new-privileges, then forks once more so that the kernel is born inside the
# PID namespace. From there the kernel sees what the cold kernel sees: the same view, the same
# empty network, its namespace's processes only. Modules of the course that the template imported
# are dropped (the kernel imports them again from its view, where the lab's reference is a stub).

_ARITY = {
    "--ro-bind": 2,
    "--bind": 2,
    "--dev-bind": 2,
    "--symlink": 2,
    "--setenv": 2,
    "--hostname": 1,
    "--proc": 1,
    "--dev": 1,
    "--tmpfs": 1,
    "--chdir": 1,
    "--unsetenv": 1,
    "--remount-ro": 1,
    "--perms": 1,
    "--dir": 1,
}
_FLAGS = {
    "--die-with-parent",
    "--new-session",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-user",
}
_NAMESPACES = ("user", "ipc", "uts", "net", "pid", "mnt")
_NS_GET_USERNS = 0xB701  # ioctl: the user namespace that owns a namespace
_HOLD = ["/bin/sh", "-c", "echo ready; exec sleep infinity"]
_READY_S = 30.0


def split_command(command: list[str]) -> tuple[list[str], list[str], dict[str, str | None], str | None]:
    """(bubblewrap's options, the command it runs, the environment it sets (None: unset), its working
    folder) for a command ``kernel_prefix`` built; ValueError for anything else."""
    if not command or Path(command[0]).name != "bwrap" or "--" not in command:
        raise ValueError(f"not a bubblewrap command: {command[:3]}")
    split = command.index("--")
    options, env, chdir, i = command[1:split], {}, None, 0
    while i < len(options):
        name = options[i]
        if name in _FLAGS:
            i += 1
            continue
        if name not in _ARITY:
            raise ValueError(f"bubblewrap option the warm sandbox does not know: {name}")
        args = options[i + 1 : i + 1 + _ARITY[name]]
        if len(args) != _ARITY[name]:
            raise ValueError(f"bubblewrap option {name} lacks its arguments")
        if name == "--setenv":
            env[args[0]] = args[1]
        elif name == "--unsetenv":
            env[args[0]] = None
        elif name == "--chdir":
            chdir = args[0]
        i += 1 + _ARITY[name]
    return command[:split], command[split + 1 :], env, chdir


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _read_ready(holder: subprocess.Popen, info_fd: int) -> int:
    """The holder's pid once bubblewrap has built its sandbox (the holder printed "ready")."""
    import select

    deadline, info, out = time.monotonic() + _READY_S, b"", b""
    streams = {info_fd, holder.stdout.fileno()}
    while b"\n" not in out:
        left = deadline - time.monotonic()
        if left <= 0 or holder.poll() is not None:
            raise OSError(f"bubblewrap did not build the sandbox (exit {holder.poll()})")
        ready, _, _ = select.select(list(streams), [], [], left)
        for fd in ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                streams.discard(fd)
            elif fd == info_fd:
                info += chunk
            else:
                out += chunk
    child = json.loads(info.decode().split("\n\n")[0] or "{}").get("child-pid")  # the namespace's first process
    if not isinstance(child, int):
        raise OSError(f"bubblewrap reported no child pid: {info[:200]!r}")
    try:  # its child is the holder, the command bubblewrap runs
        kids = Path(f"/proc/{child}/task/{child}/children").read_text().split()
    except OSError:
        kids = []
    return int(kids[0]) if kids else child


def _status_fields(pid: int) -> dict[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    return fields


def _take_credentials(fields: dict[str, str]) -> None:
    """This process's groups, capability sets and no-new-privileges made the holder's (``fields``,
    its /proc status), as bubblewrap gave them to the command it runs."""
    import ctypes

    libc = _libc()
    groups = [int(g) for g in fields.get("Groups", "").split()]
    if sorted(os.getgroups()) != sorted(groups):
        os.setgroups(groups)
    bounding = int(fields["CapBnd"], 16)
    for cap in range(64):
        if not bounding >> cap & 1 and libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            if ctypes.get_errno() == 22:  # EINVAL: past the last capability this kernel knows
                break
            _check(-1, f"dropping capability {cap}")
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    eff, prm, inh = (int(fields[k], 16) for k in ("CapEff", "CapPrm", "CapInh"))
    data = (Data * 2)(Data(eff & 0xFFFFFFFF, prm & 0xFFFFFFFF, inh & 0xFFFFFFFF), Data(eff >> 32, prm >> 32, inh >> 32))
    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "setting capabilities")  # v3
    if fields.get("NoNewPrivs") == "1":
        _check(libc.prctl(38, 1, 0, 0, 0), "no new privileges")  # PR_SET_NO_NEW_PRIVS


def enter(prefix: list[str], log) -> subprocess.Popen:
    """Build bubblewrap's sandbox from ``prefix`` (``split_command``'s first part) around an idle
    holder, and move this process, which must be single-threaded (a fork), into it. Returns the
    holder's bubblewrap: it dies with this process (``--die-with-parent``) and takes the sandbox
    with it. Children this process forks afterwards are born in the sandbox's PID namespace."""
    info_read, info_write = os.pipe()
    holder = subprocess.Popen(
        [*prefix, "--info-fd", str(info_write), "--", *_HOLD],
        pass_fds=(info_write,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        start_new_session=True,
    )  # an interrupt for the kernel never reaches it
    os.close(info_write)
    try:
        pid = _read_ready(holder, info_read)
    finally:
        os.close(info_read)
    fields = _status_fields(pid)
    libc = _libc()
    handles = {ns: os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY) for ns in _NAMESPACES}
    root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY)
    cwd = os.open(f"/proc/{pid}/cwd", os.O_RDONLY | os.O_DIRECTORY)
    # Without privileges bubblewrap makes a user namespace that owns the others, and may run its
    # command in a second one nested inside: join the owner first (its capabilities let this process
    # join the rest), the command's own last.
    handles["owner"] = fcntl.ioctl(handles["mnt"], _NS_GET_USERNS)
    ident = lambda st: (st.st_dev, st.st_ino)  # noqa: E731
    current = {ns: ident(os.stat(f"/proc/self/ns/{ns}")) for ns in _NAMESPACES}  # before /proc changes
    try:
        for ns in ("owner", *_NAMESPACES[1:], "user"):
            kind = "user" if ns == "owner" else ns
            target = ident(os.fstat(handles[ns]))
            if current[kind] != target:
                _check(libc.setns(handles[ns], 0), f"joining the sandbox's {kind} namespace")
                current[kind] = target
        os.fchdir(root)
        os.chroot(".")
        os.fchdir(cwd)
    finally:
        for fd in (*handles.values(), root, cwd):
            os.close(fd)
    _take_credentials(fields)
    return holder
