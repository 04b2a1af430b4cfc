"""Warm kernels: graded kernels forked from a template process that has already imported torch.

A fresh kernel that imports torch costs about 3 s of CPU before the learner's first line runs
(2.3 s of it torch's own import), for every graded notebook. A grading process (``infra-lab
grade``, a batch worker, a test worker) therefore keeps one *template*: a child process that
imports ipykernel, IPython, numpy and torch once, runs nothing else, and forks a kernel for each
notebook it is asked for. The forked kernel

* applies the same sandbox as :mod:`grading.run.sandbox` (address space, file size, no network)
  and writes the same status file, with its pid;
* starts in a session of its own, in the notebook's folder, with the environment the kernel
  manager gave it, its random generators reseeded, stdin closed;
* runs ipykernel in place of the command ``grading.run.sandbox`` would have executed.

The same template serves *plain* kernels too: the lessons the suite and the site run, and the
kernels nbgrader starts for an instructor (``course_tools/nbgrader_config.py``). A plain kernel gets no
limits and no status file; it is what ``python -m ipykernel_launcher`` would have been, without
the wait for torch. :func:`plain_kernels` puts such a kernelspec first on the path.

Every kernel starts from the template's pristine state: the template never runs learner code,
and a fork shares nothing writable with its parent or its siblings. The kernel is the
template's child, not the runner's; the runner finds it through the status file to count and
kill its processes (:func:`grading.run.execute.execute`).

A process whose environment names a live template (its socket and token), such as a command a
test worker runs, uses that template rather than starting one of its own.

The kernel manager reaches the template through :class:`WarmProvisioner`, the provisioner the
sandboxed kernelspec names: it sends the kernel command it would have run, its cwd and its
environment, with a token, over the template's Unix socket (``INFRA_LAB_WARM_SOCKET`` and
``INFRA_LAB_WARM_TOKEN`` in the runner's environment, never the kernel's). Without a template
(another OS, ``INFRA_LAB_COLD_KERNELS=1``, or a template that failed to start) the kernel
starts the usual way, through ``grading.run.sandbox``.

A kernel outside bubblewrap runs as the grading user and can read other processes'
environments; the token keeps out other users, not such a kernel, which could ask the template
for another kernel under limits of its choosing. A kernel in bubblewrap is moved into the sandbox
bubblewrap builds for it (:func:`grading.run.bwrap.enter`) before it runs anything: the template's
socket, its folder and its processes are out of its view.
"""

from __future__ import annotations

import atexit
import contextlib
import hmac
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from grading.course import PACKAGES, REPO_ROOT
from grading.run.sandbox import WARM_PROVISIONER

SOCKET_ENV = "INFRA_LAB_WARM_SOCKET"
TOKEN_ENV = "INFRA_LAB_WARM_TOKEN"
COLD_ENV = "INFRA_LAB_COLD_KERNELS"
# Set by nbgrader_warm_kernels: the provisioner starts this process's template on its first kernel.
AUTO_ENV = "INFRA_LAB_WARM_AUTO"
PLAIN_KERNEL = "python3"  # the kernel the lessons and labs name in their metadata
# What a graded notebook imports before its first answer: imported once, by the template.
PRELOAD = [
    "numpy",
    "torch",
    "IPython",
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    "ipywidgets",
    "grading.check",
    "grading.progress_panel",
    # and what the runner that drives a graded notebook imports (grading.run.execute, papermill)
    "grading.run.child",
    "grading.run.papermill_ipc",
    "papermill.clientwrap",
    "nbclient.exceptions",
]
_READY_S = 60.0  # how long a runner waits for a template that is still importing
_MAX_REQUEST = 1 << 20
_PARENT_POLL_S = 1.0  # how often a template looks whether the grading process that started it is still there


# --- the grading process's side: one template per process -----------------------------------------


class Template:
    """The template process of this grading process, started on first use."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="infra-lab-warm-"))  # 0700: this user only
        self.socket_path = self.folder / "template.sock"
        self.token = secrets.token_hex(16)
        env = {**os.environ, TOKEN_ENV: self.token}
        env.pop(SOCKET_ENV, None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "grading.run.warm", str(self.socket_path), str(os.getpid())],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def env(self) -> dict[str, str]:
        """What a runner needs to reach the template."""
        return {SOCKET_ENV: str(self.socket_path), TOKEN_ENV: self.token}

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Stop the template (its stdin closes, it exits); kernels it forked exit with their runners."""
        try:
            if self.process.stdin:
                self.process.stdin.close()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


class _Inherited(Template):
    """A template another process started and named in this one's environment (a test worker's,
    for the commands it runs): used while its socket exists, never stopped from here."""

    def __init__(self, socket_path: str, token: str):  # not super().__init__: that would start a process
        self.socket_path, self.token, self.process = Path(socket_path), token, None
        self.folder = self.socket_path.parent

    def alive(self) -> bool:
        return self.socket_path.exists()

    def close(self) -> None:
        pass


_template: Template | None = None
_lock = threading.Lock()


def enabled() -> bool:
    """Whether graded kernels are forked from a template here (POSIX with fork, and not turned off)."""
    return (
        hasattr(os, "fork")
        and hasattr(socket, "AF_UNIX")
        and sys.platform != "win32"
        and os.environ.get(COLD_ENV, "") not in ("1", "true", "yes")
    )


def provisioner_installed() -> bool:
    """Whether jupyter_client can find :class:`WarmProvisioner` (the package's entry point)."""
    from importlib.metadata import entry_points

    return any(ep.name == WARM_PROVISIONER for ep in entry_points(group="jupyter_client.kernel_provisioners"))


def template() -> Template | None:
    """This process's template, started on first use, or the one its environment names; None where
    kernels start cold."""
    global _template
    if not enabled() or not provisioner_installed():
        return None
    with _lock:
        if _template is None or not _template.alive():
            inherited = _Inherited(os.environ.get(SOCKET_ENV, ""), os.environ.get(TOKEN_ENV, ""))
            if inherited.token and os.environ.get(SOCKET_ENV) and inherited.alive():
                _template = inherited
                return _template
            try:
                _template = Template()
            except OSError:
                _template = None
                return None
            atexit.register(_template.close)
        return _template


def write_plain_kernelspec(jupyter_dir: Path) -> Path:
    """A kernelspec named ``python3`` under ``jupyter_dir/kernels`` whose kernels the template forks
    (plain ones: no limits); the usual ``python -m ipykernel_launcher`` when no template answers.
    Returns ``jupyter_dir``, for ``JUPYTER_PATH``."""
    spec_dir = Path(jupyter_dir) / "kernels" / PLAIN_KERNEL
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (infra course)",
        "language": "python",
        "metadata": {"kernel_provisioner": {"provisioner_name": WARM_PROVISIONER}},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
    return Path(jupyter_dir)


def _with_jupyter_path(folder: Path, environ: dict[str, str]) -> str:
    return os.pathsep.join(p for p in (str(folder), environ.get("JUPYTER_PATH", "")) if p)


def plain_kernel_env() -> dict[str, str]:
    """Environment under which jupyter_client (papermill, nbgrader) starts ``python3`` kernels as forks
    of this process's template; empty where kernels start cold."""
    current = template()
    if current is None:
        return {}
    jupyter_dir = write_plain_kernelspec(current.folder / "jupyter")
    return {**current.env(), "JUPYTER_PATH": _with_jupyter_path(jupyter_dir, os.environ)}


@contextlib.contextmanager
def plain_kernels():
    """In this process, for the length of the block: ``python3`` kernels fork from the template."""
    env = plain_kernel_env()
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield bool(env)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_lesson(source: str | Path, out: str | Path, *, warm: bool = True, **kwargs):
    """:func:`grading.run.papermill_ipc.run_with_papermill`, its ``python3`` kernel forked from this
    process's template with torch already imported (about 3 s of CPU less per notebook) where the
    platform allows and ``warm`` is on (the suite's lessons, the site); otherwise started the usual
    way, as a learner's is. Returns the executed notebook."""
    from grading.run.papermill_ipc import run_with_papermill

    with plain_kernels() if warm else contextlib.nullcontext():
        return run_with_papermill(source, out, **kwargs)


def nbgrader_warm_kernels() -> bool:
    """For ``nbgrader_config.py``: the notebooks nbgrader executes get plain kernels forked from a
    template, which this process starts when it launches its first kernel (``generate_assignment``
    and the other commands that run no notebook start none). Returns whether it is on."""
    if not enabled() or not provisioner_installed():
        return False
    folder = Path(tempfile.mkdtemp(prefix="infra-lab-kernels-"))
    atexit.register(shutil.rmtree, folder, True)
    os.environ["JUPYTER_PATH"] = _with_jupyter_path(write_plain_kernelspec(folder), os.environ)
    os.environ[AUTO_ENV] = "1"
    return True


# --- the runner's side: the kernel provisioner -----------------------------------------------------


def _request(cmd: list[str], cwd: str, env: dict[str, str]) -> int | None:
    """Ask the template for a kernel; its pid, or None when no template answers."""
    if not os.environ.get(SOCKET_ENV) and os.environ.get(AUTO_ENV) == "1":
        current = template()
        if current is not None:
            os.environ.update(current.env())
    kernel_env = {k: v for k, v in env.items() if k not in (SOCKET_ENV, TOKEN_ENV, AUTO_ENV)}
    return _ask(os.environ.get(SOCKET_ENV), os.environ.get(TOKEN_ENV), {"cmd": cmd, "cwd": cwd, "env": kernel_env})


def _ask(path: str | None, token: str | None, request: dict) -> int | None:
    """Send one request to the template at ``path``; the pid it forked, or None."""
    if not path or not token:
        return None
    deadline = time.monotonic() + _READY_S
    while not os.path.exists(path):  # the template may still be importing torch
        if time.monotonic() > deadline or not os.path.isdir(os.path.dirname(path)):
            return None
        time.sleep(0.05)
    message = json.dumps({"token": token, **request}).encode() + b"\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(30)
            client.connect(path)
            client.sendall(message)
            answer = client.makefile("rb").readline(_MAX_REQUEST)
    except OSError:
        return None
    try:
        return int(json.loads(answer)["pid"])
    except (ValueError, KeyError, TypeError):
        return None


class _Forked:
    """A Popen-like handle on a kernel forked by the template (not this process's child)."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int):
        import psutil

        self.pid = pid
        self.returncode = None
        try:
            self._proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            self._proc, self.returncode = None, -1

    def poll(self) -> int | None:
        import psutil

        if self.returncode is None:
            try:
                if self._proc.status() == psutil.STATUS_ZOMBIE:
                    self.returncode = -1
            except psutil.NoSuchProcess:
                self.returncode = -1  # the template reaps its children; the exit code is gone with them
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkedRunner(_Forked):
    """A Popen-like handle on a notebook runner (``grading.run.child``) forked by the template: its exit
    code comes back through ``exit_file``, which the runner writes as it exits (-9 when it was killed
    before it could)."""

    def __init__(self, pid: int, exit_file: Path):
        self.exit_file, self._finished = Path(exit_file), False
        super().__init__(pid)

    def poll(self) -> int | None:
        if not self._finished:
            if super().poll() is None:
                return None
            self._finished = True
            try:
                self.returncode = int(self.exit_file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                self.returncode = -signal.SIGKILL
        return self.returncode


def fork_runner(argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> ForkedRunner | None:
    """``python -m grading.run.child ARGV``, forked by this process's template (papermill already
    imported) instead of started afresh: stdout and stderr to ``log``, in ``cwd`` with exactly ``env``.
    None where no template answers (start the runner as a process of its own then)."""
    current = template()
    if current is None:
        return None
    exit_file = Path(log).with_name(Path(log).name + ".exit")
    exit_file.unlink(missing_ok=True)
    pid = _ask(
        str(current.socket_path),
        current.token,
        {
            "runner": [str(a) for a in argv],
            "cwd": str(cwd),
            "env": dict(env),
            "log": str(log),
            "exit_file": str(exit_file),
        },
    )
    return None if pid is None else ForkedRunner(pid, exit_file)


try:
    from jupyter_client.provisioning import LocalProvisioner
except ImportError:  # jupyter_client is a dependency; this keeps the module importable without it
    LocalProvisioner = object


class WarmProvisioner(LocalProvisioner):
    """jupyter_client's local provisioner, with the kernel forked by the template when one answers."""

    async def launch_kernel(self, cmd: list[str], **kwargs):
        env = dict(kwargs.get("env") or os.environ)
        cwd = str(kwargs.get("cwd") or os.getcwd())
        pid = _request(cmd, cwd, env)
        if pid is None:
            if "env" in kwargs:
                kwargs["env"] = {k: v for k, v in env.items() if k not in (SOCKET_ENV, TOKEN_ENV, AUTO_ENV)}
            return await super().launch_kernel(cmd, **kwargs)
        self.process = _Forked(pid)
        self.pid, self.pgid, self.cwd = pid, pid, cwd  # the kernel leads a session of its own
        return self.connection_info


# --- the template process ---------------------------------------------------------------------------


def _kernel_command(cmd: list[str]) -> tuple[dict | None, list[str]]:
    """Split a kernelspec's command into the sandbox's options (None for a plain kernel) and
    ipykernel's arguments."""
    from grading.run.sandbox import parse_launcher

    if "grading.run.sandbox" not in cmd:
        if cmd[1:3] != ["-m", "ipykernel_launcher"]:
            raise ValueError(f"not an ipykernel command: {cmd}")
        return None, cmd[3:]
    args = parse_launcher(cmd[cmd.index("grading.run.sandbox") + 1 :])
    command = _kernel_command_line(vars(args))
    if "ipykernel_launcher" not in command:
        raise ValueError(f"not an ipykernel command: {command}")
    return vars(args), command[command.index("ipykernel_launcher") + 1 :]


def _enter_child(request: dict, log_path: Path) -> None:
    """In a forked child, before it becomes a kernel or a runner: a session of its own, its children's
    exit codes reported (the template ignores them), stdin closed, stdout and stderr to ``log_path``,
    the request's folder and exactly its environment."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.dup2(os.open(os.devnull, os.O_RDWR), 0)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


def _run_kernel(request: dict) -> None:
    """In the forked child: become the sandboxed kernel. Never returns."""
    code = 1
    try:
        options, kernel_args = _kernel_command(request["cmd"])
        # A sandboxed kernel logs beside its status file; a plain one in the template's folder.
        _enter_child(
            request,
            Path(options["status"]).with_name("kernel.log")
            if options
            else Path(request["folder"]) / f"kernel-{os.getpid()}.log",
        )
        if options is not None and options["bwrap"]:
            _enter_bwrap(options)  # returns in the kernel, a child born in the sandbox
        elif options is not None:
            from grading.run.sandbox import apply_limits

            status = apply_limits(options["memory_mb"], options["file_size_mb"], options["no_network"])
            status["pid"] = os.getpid()
            status["kernel"] = "forked from the grader's template (torch already imported)"
            Path(options["status"]).write_text(json.dumps(status), encoding="utf-8")
        _reseed()
        sys.argv = ["ipykernel_launcher", *kernel_args]
        from ipykernel.kernelapp import IPKernelApp

        IPKernelApp.launch_instance(argv=kernel_args)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException:  # noqa: BLE001 - say why in the kernel's log, then exit
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _enter_bwrap(options: dict) -> None:
    """In the forked child, for a kernel in bubblewrap: apply the launcher's limits, write its status
    (this process's pid: the watchdog counts and kills from here), move into the sandbox bubblewrap
    builds (grading.run.bwrap.enter), and fork the kernel inside it. This process stays outside the
    kernel's PID namespace, ignores interrupts (they are the kernel's), waits for the kernel and exits
    with its code, taking the sandbox with it. Returns only in the kernel."""
    from grading.run import bwrap
    from grading.run.sandbox import apply_limits, bwrap_status, limit_processes

    prefix, _, env, chdir = bwrap.split_command(_kernel_command_line(options))
    status = apply_limits(options["memory_mb"], options["file_size_mb"], False)
    if options["max_processes"]:
        status["processes"], status["cgroup"] = limit_processes(options["max_processes"])
    status.update(bwrap_status())
    status["pid"] = os.getpid()
    status["kernel"] = (
        "forked from the grader's template (torch already imported), then moved into the "
        "namespaces bubblewrap built for it"
    )
    Path(options["status"]).write_text(json.dumps(status), encoding="utf-8")
    holder = bwrap.enter(prefix, sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kernel = os.fork()
    if kernel:
        holder.stdout.close()
        try:
            _, wait_status = os.waitpid(kernel, 0)  # Python retries it after a signal (PEP 475)
        except ChildProcessError:
            os._exit(1)
        os._exit(os.waitstatus_to_exitcode(wait_status) & 0xFF)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.closerange(3, 1 << 16)  # nothing of the template's or the holder's
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if chdir:
        os.chdir(chdir)
    _forget_course_modules()


def _kernel_command_line(options: dict) -> list[str]:
    command = options["command"]
    return command[1:] if command[:1] == ["--"] else command


def _forget_course_modules() -> None:
    """Drop the course's modules the template imported, and any source it cached: the kernel imports
    them again from its own view, where the graded lab's reference is a stub."""
    import importlib
    import linecache

    root = str(REPO_ROOT) + os.sep
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if name.split(".")[0] in PACKAGES or (path.startswith(root) and ".venv" not in path):
            del sys.modules[name]
    linecache.clearcache()
    importlib.invalidate_caches()


def _run_runner(request: dict) -> None:
    """In the forked child: become ``python -m grading.run.child ARGV``. Never returns."""
    code = 1
    try:
        _enter_child(request, Path(request["log"]))  # the runner waits for the kernels it starts
        sys.argv = ["grading.run.child", *request["runner"]]
        from grading.run.child import main as run_child

        code = run_child(request["runner"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - say why in the runner's log, then exit
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            Path(request["exit_file"]).write_text(str(code), encoding="utf-8")
        finally:
            os._exit(code)


def _valid(request: dict) -> None:
    """Refuse a malformed request in the template, before any fork (ValueError, KeyError, TypeError)."""
    if "runner" in request:
        strings = [*request["runner"], request["log"], request["exit_file"], request["cwd"]]
        if not all(isinstance(value, str) for value in strings) or not isinstance(request["env"], dict):
            raise ValueError("a runner's arguments, paths and environment are strings")
    else:
        options, _ = _kernel_command(request["cmd"])
        if options is not None and options.get("user"):  # a fork would keep the template's user (root)
            raise ValueError(
                "a kernel run as another user starts cold, through grading.run.sandbox, never from the template"
            )
        if options is not None and options["bwrap"]:
            from grading.run import bwrap

            bwrap.split_command(_kernel_command_line(options))


def _reseed() -> None:
    """Fresh random state in each kernel, as a freshly started one has (torch's default seed is fixed
    at startup, so it stays as it is)."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _serve(socket_path: str, parent: int) -> int:
    """Fork kernels on request until the grading process (``parent``) closes this process's stdin or is
    gone."""
    import importlib
    import select

    token = os.environ.pop(TOKEN_ENV, "")
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the kernel imports it (or fails) itself
            pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked kernels are reaped by the system
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    scratch = socket_path + ".tmp"
    server.bind(scratch)
    server.listen(16)
    os.rename(scratch, socket_path)  # the socket appears only once it accepts connections
    try:
        while True:
            ready, _, _ = select.select([server, sys.stdin], [], [], _PARENT_POLL_S)
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
                return 0  # the grading process closed our stdin, or died
            if os.getppid() != parent:
                # The grading process was killed (perhaps before this process even started serving)
                # while a process forked from it still holds our stdin open: no end of file comes, but
                # this process has another parent.
                return 0
            if server not in ready:
                continue
            conn, _ = server.accept()
            with conn:
                conn.settimeout(10)
                try:
                    request = json.loads(conn.makefile("rb").readline(_MAX_REQUEST))
                    if not hmac.compare_digest(str(request.get("token", "")), token):
                        continue
                    _valid(request)  # refuse a malformed request here, not in the child
                except (OSError, ValueError, KeyError, TypeError, AttributeError):
                    continue
                request["folder"] = os.path.dirname(socket_path)
                pid = os.fork()
                if pid == 0:
                    server.close()
                    conn.close()
                    token = ""
                    if "runner" in request:
                        _run_runner(request)
                    _run_kernel(request)
                try:
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except OSError:
                    os.kill(pid, signal.SIGKILL)
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1], int(sys.argv[2])))
