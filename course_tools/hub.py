"""A class on one shared server: a JupyterHub with the learner edition, nbgrader's exchange and a
sandbox per learner (``make hub``, ``infra-lab hub``).

What the hub runs, all on this machine:

* **JupyterHub** (``jupyterhub`` from PyPI, pinned) behind **configurable-http-proxy** (from the npm
  registry, pinned in ``hub/package.json``, installed by ``make hub`` into ``hub/node_modules``), on
  127.0.0.1 unless told otherwise. Its configuration is ``hub/jupyterhub_config.py``, which calls
  :func:`configure`.
* **A roster authenticator** (:class:`RosterAuthenticator`): the learners of the roster file (the one
  ``infra-lab grade --roster`` and the gradebook read) and the instructor, each with a password the
  hub generates once and keeps in ``passwords.csv`` (readable by the instructor only), to hand out.
  A university's own sign-in replaces it from a configuration file (``--config``, see the README).
* **One sandboxed server per learner** (:class:`CourseSpawner`). Each learner's JupyterLab runs in
  bubblewrap, as a user id of its own (no account is needed on the machine), and sees:
  the system's programs and Python, read-only; the course's virtual environment, read-only; the
  learner edition (built once, every tracked file of the course but the answers) at the course's own
  path, read-only, so the library, the grader, the lessons and the labs' tests work unchanged; its
  own home, ``/home/<learner>``, the one folder it can write besides a private ``/tmp``; and
  nbgrader's exchange, where the file modes nbgrader sets let a learner read what was released,
  add a submission and read feedback whose name only they can compute, but not list what others
  submitted. Not in its view: the instructor's course (``solutions/``, the gradebook, ``submitted/``,
  the grades), the other learners' homes, the hub's database and passwords. It has its own process
  ids, so it cannot see or signal anyone else's processes.
* **The instructor's server** runs without a sandbox, as the user who started the hub, in the
  instructor's course folder with nbgrader's instructor tools (formgrader, Create Assignment).

What a hub on one machine cannot enforce: the learners share its cores and memory (one busy learner
slows the others; nothing caps a server's processor time or memory), its network (a learner's server
can open connections, to the internet where the machine can, and to the other servers' ports, which
answer only with their owner's token) and its disk (no quota). Beyond one machine, the same
configuration moves to Kubernetes (see the README's "Running a class on a JupyterHub").
"""

from __future__ import annotations

import csv
import hmac
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from course_tools.classroom import COURSE_ROOT_ENV, EXCHANGE_ENV, course_root, exchange_root
from grading.course import REPO_ROOT
from grading.roster import read_roster_file
from grading.run import bwrap

INSTRUCTOR = "instructor"
DEMO_LEARNERS = ("alice", "bob", "carol")
HUB_FOLDER = REPO_ROOT / "hub"
CONFIG_FILE = HUB_FOLDER / "jupyterhub_config.py"
PROXY = HUB_FOLDER / "node_modules" / ".bin" / "configurable-http-proxy"
DEFAULT_PORT = 8010
UID_BASE = 61000  # learners' user ids: the first free ones from here (free: no account holds them)
CLASS_ENV = "INFRA_HUB_CLASS"  # the class's folder, for hub/jupyterhub_config.py
TOKEN_ENV = "INFRA_HUB_API_TOKEN"  # when set, a service with this token may drive the hub's REST API
_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,31}$")
LEARNER_CONFIG = ("jupyter_config/hub_learner", "jupyter_config/course")
INSTRUCTOR_CONFIG = ("jupyter_config/course",)


class HubError(RuntimeError):
    """The hub cannot start as asked (a bad roster, a missing tool); the message says what to do."""


@dataclass(frozen=True)
class ClassFolder:
    """The folders of one class on the hub, all under ``root``."""

    root: Path

    @property
    def edition(self) -> Path:  # the learner edition every learner's server shows
        return self.root / "edition"

    @property
    def homes(self) -> Path:
        return self.root / "homes"

    @property
    def passwords(self) -> Path:
        return self.root / "passwords.csv"

    @property
    def users(self) -> Path:  # learner -> user id
        return self.root / "users.json"

    @property
    def state(self) -> Path:  # the hub's database, cookie secret, proxy's pid
        return self.root / "state"

    def home(self, learner: str) -> Path:
        return self.homes / learner

    def learners(self) -> dict[str, int]:
        return json.loads(self.users.read_text(encoding="utf-8")) if self.users.is_file() else {}


def roster_learners(roster: Path | None) -> list[str]:
    """The learners a hub admits: the roster file's ids (one per line, or the CSV roster the gradebook
    reads), or the demo class (alice, bob, carol) without one.

    Raises:
        HubError: the roster is missing or empty, or an id cannot be a user name on the hub.
    """
    if roster is None:
        return list(DEMO_LEARNERS)
    if not Path(roster).is_file():
        raise HubError(f"no roster at {roster}: give a file of learner ids, one per line")
    learners = list(read_roster_file(Path(roster)))
    if not learners:
        raise HubError(f"the roster {roster} lists no learner")
    bad = [name for name in learners if not _NAME.match(name) or name == INSTRUCTOR]
    if bad:
        raise HubError(
            f"the roster {roster} has ids the hub cannot use as user names: {', '.join(map(repr, bad))} "
            f"(lower-case letters, digits, '.', '_' or '-', starting with a letter, at most 32; not {INSTRUCTOR!r})"
        )
    return learners


def _free_uids(taken: set[int], count: int) -> list[int]:
    uids, uid = [], UID_BASE
    while len(uids) < count:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            if uid not in taken:
                uids.append(uid)
        uid += 1
    return uids


def read_passwords(path: Path) -> dict[str, str]:
    """user name -> password, from a hub's ``passwords.csv``."""
    if not Path(path).is_file():
        return {}
    with open(path, newline="", encoding="utf-8") as f:
        return {row["user"]: row["password"] for row in csv.DictReader(f)}


def prepare(folder: ClassFolder, learners: list[str], exchange: Path) -> dict[str, str]:
    """Make (or bring up to date) the class's folders: the learner edition, a home and a user id per
    learner, the exchange, and a password for everyone (kept across restarts; new learners get one).
    Returns user name -> password."""
    if os.geteuid() != 0:
        raise HubError(
            "the hub runs each learner's server as a user id of its own, which needs root: run "
            "`make hub` as root (or in a container where you are root)"
        )
    ok, why = bwrap.availability()
    if not ok:
        raise HubError(f"each learner's server runs in bubblewrap, which is unavailable here: {why}")
    for path in (folder.root, folder.homes, folder.state):
        path.mkdir(parents=True, exist_ok=True)
    os.chmod(folder.root, 0o711)
    from course_tools.release import learner_edition

    learner_edition(folder.edition, force=True)
    # mount points the learner's view puts inside the (read-only) edition
    for inside in (Path(sys.prefix), exchange):
        if inside.is_relative_to(REPO_ROOT):
            (folder.edition / inside.relative_to(REPO_ROOT)).mkdir(parents=True, exist_ok=True)
    exchange.mkdir(parents=True, exist_ok=True)
    os.chmod(exchange, 0o755)
    users = folder.learners()
    new = [name for name in learners if name not in users]
    users.update(zip(new, _free_uids(set(users.values()), len(new))))
    users = {name: users[name] for name in learners}
    folder.users.write_text(json.dumps(users, indent=1) + "\n", encoding="utf-8")
    accounts = folder.state / "accounts"
    accounts.mkdir(exist_ok=True)
    system = {name: Path(f"/etc/{name}").read_text(encoding="utf-8") for name in ("passwd", "group")}
    for name, uid in users.items():
        home = folder.home(name)
        home.mkdir(exist_ok=True)
        os.chown(home, uid, uid)
        os.chmod(home, 0o700)
        # the machine's accounts and the learner's own, shown in the learner's view (tools such as
        # nbgrader look the user up by id)
        (accounts / f"{name}.passwd").write_text(
            system["passwd"] + f"{name}:x:{uid}:{uid}:{name}:/home/{name}:/bin/bash\n", encoding="utf-8"
        )
        (accounts / f"{name}.group").write_text(system["group"] + f"{name}:x:{uid}:\n", encoding="utf-8")
    known = read_passwords(folder.passwords)
    passwords = {name: known.get(name) or secrets.token_urlsafe(9) for name in [INSTRUCTOR, *learners]}
    folder.passwords.touch(mode=0o600)
    os.chmod(folder.passwords, 0o600)
    with open(folder.passwords, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["user", "password"])
        writer.writerows(passwords.items())
    return passwords


# --- JupyterHub's side: imported by hub/jupyterhub_config.py only, where jupyterhub is installed ------


def configure(c, folder: ClassFolder) -> None:
    """Fill JupyterHub's configuration ``c`` for the class in ``folder`` (hub/jupyterhub_config.py)."""
    from jupyterhub.auth import Authenticator
    from jupyterhub.spawner import SimpleLocalProcessSpawner
    from traitlets import Unicode

    class RosterAuthenticator(Authenticator):
        """Signs in the roster's learners and the instructor with the passwords the hub generated."""

        passwords_file = Unicode(str(folder.passwords), config=True, help="the hub's passwords.csv")

        async def authenticate(self, handler, data):
            name = self.normalize_username(str(data.get("username", "")))
            known = read_passwords(Path(self.passwords_file)).get(name)
            given = str(data.get("password", ""))
            if known and hmac.compare_digest(known.encode(), given.encode()):
                return name
            return None

    class CourseSpawner(SimpleLocalProcessSpawner):
        """A learner's server in bubblewrap as their own user id; the instructor's in the course."""

        def make_preexec_fn(self, name):
            return None  # the sandbox makes the home and the working folder

        def user_env(self, env):
            return env

        async def start(self):
            name = self.user.name
            singleuser = str(Path(sys.prefix) / "bin" / "jupyterhub-singleuser")
            if name == INSTRUCTOR:
                self.cmd = [singleuser, "--allow-root"]
                self.popen_kwargs = {"cwd": str(course_root())}
            else:
                self.cmd = learner_command(folder, name, singleuser)
                self.popen_kwargs = {}
            return await super().start()

        def get_env(self):
            env = super().get_env()
            name = self.user.name
            # the instructor keeps the hub's own home; a learner's is the one in their view
            home = os.environ.get("HOME", str(course_root())) if name == INSTRUCTOR else f"/home/{name}"
            configs = INSTRUCTOR_CONFIG if name == INSTRUCTOR else LEARNER_CONFIG
            env.update(
                HOME=home,
                USER=name,
                PATH=f"{Path(sys.prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin",
                JUPYTER_CONFIG_PATH=":".join(str(REPO_ROOT / part) for part in configs),
                **{EXCHANGE_ENV: str(exchange_root())},
            )
            if name == INSTRUCTOR:
                env[COURSE_ROOT_ENV] = str(course_root())
            return env

    learners = folder.learners()
    c.JupyterHub.ip = os.environ.get("INFRA_HUB_IP", "127.0.0.1")
    c.JupyterHub.port = int(os.environ.get("INFRA_HUB_PORT", DEFAULT_PORT))
    c.JupyterHub.hub_ip = "127.0.0.1"
    c.JupyterHub.hub_port = int(os.environ["INFRA_HUB_INTERNAL_PORT"])
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{os.environ['INFRA_HUB_PROXY_API_PORT']}"
    c.ConfigurableHTTPProxy.command = [str(PROXY)]
    c.ConfigurableHTTPProxy.pid_file = str(folder.state / "proxy.pid")
    c.JupyterHub.db_url = f"sqlite:///{folder.state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(folder.state / "cookie_secret")
    c.JupyterHub.authenticator_class = RosterAuthenticator
    c.Authenticator.allowed_users = {INSTRUCTOR, *learners}
    c.Authenticator.admin_users = {INSTRUCTOR}
    c.JupyterHub.spawner_class = CourseSpawner
    c.Spawner.default_url = "/lab"
    c.Spawner.http_timeout = 120
    c.Spawner.start_timeout = 180
    c.JupyterHub.cleanup_servers = True
    c.JupyterHub.cleanup_proxy = True
    token = os.environ.get(TOKEN_ENV)
    if token:
        c.JupyterHub.services = [{"name": "course-admin", "api_token": token}]
        scopes = ["admin:users", "admin:servers", "tokens", "access:servers", "read:users"]
        c.JupyterHub.load_roles = [{"name": "course-admin", "scopes": scopes, "services": ["course-admin"]}]


def learner_command(folder: ClassFolder, learner: str, program: str) -> list[str]:
    """The command that runs ``program`` (a learner's server) in the learner's sandbox, as their id."""
    uid = folder.learners()[learner]
    home = f"/home/{learner}"
    exchange = exchange_root()
    system = bwrap.system_view(tmp_mode="1777")
    shown = [Path(system[i + 2]) for i, option in enumerate(system) if option == "--ro-bind"] + [Path("/tmp")]
    shown += [REPO_ROOT, exchange, Path(home)]
    # bubblewrap makes the folders above what it binds for root alone (mode 0700); the learner's
    # id must pass through them, so they are made first (those on the private /tmp once it exists),
    # open to all and empty
    above = sorted(
        {up for path in shown for up in path.parents if up != Path("/") and up not in shown}, key=lambda p: len(p.parts)
    )
    early = [arg for up in above if not up.is_relative_to("/tmp") for arg in ("--perms", "0755", "--dir", str(up))]
    late = [arg for up in above if up.is_relative_to("/tmp") for arg in ("--perms", "0755", "--dir", str(up))]
    argv = [
        shutil.which("bwrap") or "bwrap",
        "--die-with-parent",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--hostname",
        f"{learner}-server",
        *early,
        *system,
        *late,
        "--ro-bind",
        str(folder.state / "accounts" / f"{learner}.passwd"),
        "/etc/passwd",
        "--ro-bind",
        str(folder.state / "accounts" / f"{learner}.group"),
        "/etc/group",
        # the edition at the course's own path: the environment's editable install finds the
        # library, the grader and the tooling there, and every default path of the course holds
        "--ro-bind",
        str(folder.edition),
        str(REPO_ROOT),
        "--ro-bind",
        sys.prefix,
        sys.prefix,
        "--bind",
        str(exchange),
        str(exchange),
        "--bind",
        str(folder.home(learner)),
        home,
        "--chdir",
        home,
        "--remount-ro",
        "/",
        "--",
        shutil.which("setpriv") or "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
        program,
    ]
    return argv


# --- running it ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hub_environment(folder: ClassFolder, port: int, ip: str = "127.0.0.1") -> dict[str, str]:
    """The environment ``jupyterhub -f hub/jupyterhub_config.py`` runs in for this class."""
    return {
        **os.environ,
        CLASS_ENV: str(folder.root),
        "INFRA_HUB_IP": ip,
        "INFRA_HUB_PORT": str(port),
        "INFRA_HUB_INTERNAL_PORT": str(free_port()),
        "INFRA_HUB_PROXY_API_PORT": str(free_port()),
        COURSE_ROOT_ENV: str(course_root()),
        EXCHANGE_ENV: str(exchange_root()),
        "PATH": f"{Path(sys.prefix) / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }


def wait_until_up(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise HubError(f"JupyterHub exited with status {process.returncode} before it answered")
        try:
            if httpx.get(f"{url}/hub/api/", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise HubError(f"JupyterHub did not answer at {url} within {timeout_s:.0f} s")


def stop(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop the hub and everything it started (the proxy, every server and their kernels)."""
    import psutil

    try:
        below = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for child in below:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(below, timeout=10)


def _stop_with_parent() -> None:
    """In the hub's process before it runs: ask the kernel to send it SIGTERM (on which JupyterHub
    stops the proxy and every server) if ``infra-lab hub`` dies without stopping it (SIGKILL)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _interrupt(number, frame) -> None:
    raise KeyboardInterrupt


def main(args) -> int:
    """``infra-lab hub``: prepare the class and serve it until Ctrl-C."""
    if not PROXY.exists():
        raise HubError(f"configurable-http-proxy is not installed at {PROXY}: run `make hub`, which installs it")
    folder = ClassFolder(Path(args.dir or course_root() / "hub" / "class").resolve())
    learners = roster_learners(Path(args.roster) if args.roster else None)
    exchange = exchange_root()
    with socket.socket() as probe:
        if probe.connect_ex((args.ip, args.port)) == 0:
            raise HubError(f"something already listens on {args.ip}:{args.port}: stop it, or give the hub --port")
    print(f"preparing the class in {folder.root} (the learner edition, {len(learners)} homes, the exchange)...")
    passwords = prepare(folder, learners, exchange)
    env = hub_environment(folder, args.port, args.ip)
    if args.config:
        env["INFRA_HUB_EXTRA_CONFIG"] = str(Path(args.config).resolve())
    log = open(folder.state / "jupyterhub.log", "ab")
    process = subprocess.Popen(
        [str(Path(sys.prefix) / "bin" / "jupyterhub"), "-f", str(CONFIG_FILE)],
        cwd=folder.state,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_stop_with_parent,
    )
    # `kill` (or a closed terminal) stops the hub as Ctrl-C does, with everything it started; Ctrl-C
    # works even where this process was started with SIGINT ignored or blocked (both are inherited)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, _interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    url = f"http://{args.ip}:{args.port}"
    try:
        wait_until_up(url, process)
        roster = "the demo class" if not args.roster else f"the roster {args.roster}"
        print(
            f"\nThe class's JupyterHub is at {url}  ({roster}: {', '.join(learners)})\n"
            f"  sign-ins: {folder.passwords} (user, password; the instructor is {INSTRUCTOR!r},"
            f" e.g. {INSTRUCTOR} / {passwords[INSTRUCTOR]})\n"
            f"  the exchange: {exchange}; the hub's log: {folder.state / 'jupyterhub.log'}\n"
            f"Next: release a lab from the course folder (`nbgrader release_assignment lab01_gemm`);\n"
            f"each learner signs in and opens the Assignments tab (or, in a terminal,\n"
            f"`nbgrader fetch_assignment lab01_gemm`).\n"
            f"The README's 'Running a class on a JupyterHub' gives the whole round trip. Ctrl-C stops the hub.",
            flush=True,
        )
        process.wait()
        return process.returncode or 0
    except KeyboardInterrupt:
        print("\nstopping the hub, the proxy and every server...", flush=True)
        return 0
    finally:
        stop(process)
        log.close()


def _cmd_hub(args) -> int:
    try:
        return main(args)
    except HubError as exc:
        print(f"infra-lab hub: {exc}", file=sys.stderr)
        return 2


def _cmd_feedback(args) -> int:
    from course_tools.classroom import place_feedback

    root = course_root()
    grades = Path(args.grades) if args.grades else root / "grades" / args.lab
    try:
        placed, skipped = place_feedback(args.lab, grades, Path(args.submissions), Path(args.out))
    except FileNotFoundError as exc:
        print(f"infra-lab feedback: {exc}", file=sys.stderr)
        return 2
    for line in skipped:
        print(f"left out {line}", file=sys.stderr)
    print(
        f"placed the feedback of {len(placed)} learner(s) in {args.out}/<learner>/{args.lab}/; "
        f"`nbgrader release_feedback {args.lab}` returns it through the exchange"
    )
    return 0 if placed or not skipped else 1


def add_parsers(sub) -> None:
    """``infra-lab hub`` and ``infra-lab feedback``."""
    hub = sub.add_parser("hub", help="serve a class on this machine: JupyterHub, one sandboxed server per learner")
    hub.add_argument(
        "--roster",
        help="the class: one learner id per line, or the CSV roster the gradebook reads (default: a demo "
        "class of alice, bob and carol)",
    )
    hub.add_argument("--dir", help="the class's folders (default hub/class in the course folder)")
    hub.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the hub's port (default {DEFAULT_PORT})")
    hub.add_argument("--ip", default="127.0.0.1", help="the address the hub listens on (default 127.0.0.1)")
    hub.add_argument(
        "--config",
        help="a JupyterHub configuration file read after the course's (e.g. your university's authenticator)",
    )
    hub.set_defaults(func=_cmd_hub)
    feedback = sub.add_parser(
        "feedback", help="put the grader's feedback where `nbgrader release_feedback` returns it to each learner"
    )
    feedback.add_argument("lab", help="the lab id, e.g. lab01_gemm")
    feedback.add_argument("--grades", help="where `infra-lab grade --submissions` wrote (default grades/<lab>)")
    feedback.add_argument(
        "--submissions", default="submitted", help="what nbgrader collect gathered (default submitted)"
    )
    feedback.add_argument("--out", default="feedback", help="nbgrader's feedback folder (default feedback)")
    feedback.set_defaults(func=_cmd_feedback)
