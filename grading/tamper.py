"""A static look at a learner's answer cells before they run: reaching into the grader,
the notebook machinery or the reference implementation.

An answer flagged here is not run at all (the grader substitutes the empty stub), so a
tampering answer cannot disturb the grading of the others; its own checks fail with the
reason found. The list is deliberately strict: a lab's answers never need any of it.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass

SHORTCUT = "reference shortcut"
TAMPERING = "tampering detected"

# Modules whose only use in an answer is to reach the notebook, the grader or the interpreter.
_FORBIDDEN_MODULES = {
    "grading",
    "IPython",
    "ipykernel",
    "jupyter_client",
    "nbclient",
    "nbformat",
    "papermill",
    "traitlets",
    "zmq",
    "importlib",
    "builtins",
    "gc",
    "inspect",
    "signal",
    "atexit",
    "sysconfig",
    "site",
}
_FORBIDDEN_CALLS = {
    "exec",
    "eval",
    "compile",
    "__import__",
    "get_ipython",
    "globals",
    "vars",
    "locals",
    "exit",
    "quit",
    "breakpoint",
    "setattr",
    "delattr",
}
_FORBIDDEN_SYS = {
    "modules",
    "excepthook",
    "displayhook",
    "settrace",
    "setprofile",
    "exit",
    "meta_path",
    "path_hooks",
    "addaudithook",
    "breakpointhook",
    "unraisablehook",
    "_getframe",
}
_FORBIDDEN_THREADING = {"settrace", "setprofile", "settrace_all_threads", "setprofile_all_threads", "excepthook"}
_ALLOWED_DUNDERS = {
    "__init__",
    "__name__",
    "__doc__",
    "__len__",
    "__iter__",
    "__next__",
    "__getitem__",
    "__setitem__",
    "__contains__",
    "__repr__",
    "__str__",
    "__enter__",
    "__exit__",
    "__call__",
    "__post_init__",
    "__slots__",
    "__future__",
    "__all__",
    "__hash__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__add__",
    "__mul__",
    "__bool__",
}
_COMMON_MODULES = {
    "torch",
    "np",
    "numpy",
    "math",
    "statistics",
    "time",
    "os",
    "sys",
    "json",
    "random",
    "functools",
    "operator",
    "itertools",
    "collections",
    "threading",
    "typing",
    "re",
    "F",
    "nn",
}


@dataclass(frozen=True)
class Finding:
    kind: str  # SHORTCUT or TAMPERING
    detail: str  # what was found, for the feedback
    line: int


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def scan(
    source: str, shortcut_modules: set[str], shortcut_names: set[str], module_names: set[str] = frozenset()
) -> list[Finding]:
    """Findings in one answer cell's source, in line order.

    Args:
        source: the cell's code.
        shortcut_modules: modules that hold (or re-export) the lab's reference functions.
        shortcut_names: the names of those functions.
        module_names: names other cells of the notebook bind to modules (``import torch``).
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # it will fail when it runs, with the learner's own syntax error
    findings: list[Finding] = []
    modules = set(module_names) | _COMMON_MODULES
    # names bound in this cell to modules outside the course's library: ``np.percentile`` is numpy's
    outside = {name for name in _COMMON_MODULES}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("infra_lib"):
                    outside.add((alias.asname or alias.name).split(".")[0])

    # names this cell binds to values (arguments, assignment targets): ``cp.next_node`` on a
    # checkpoint is a field, not the reference function; a module needs an import to get a name
    values = {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    values |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

    def flag(kind: str, detail: str, node: ast.AST) -> None:
        findings.append(Finding(kind, detail, getattr(node, "lineno", 0)))

    def check_module(name: str, node: ast.AST) -> None:
        top = name.split(".")[0]
        if name in shortcut_modules or any(m.startswith(name + ".") for m in shortcut_modules if name):
            flag(SHORTCUT, f"imports {name}, which holds the reference implementation", node)
        elif top in _FORBIDDEN_MODULES:
            flag(TAMPERING, f"imports {name}", node)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check_module(alias.name, node)
                modules.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            check_module(node.module, node)
            for alias in node.names:
                if f"{node.module}.{alias.name}" in shortcut_modules or (
                    node.module.startswith("infra_lib") and alias.name in shortcut_names
                ):
                    flag(SHORTCUT, f"imports {alias.name} from {node.module}", node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FORBIDDEN_CALLS:
            flag(TAMPERING, f"calls {node.func.id}()", node)
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted.startswith("sys.") and node.attr in _FORBIDDEN_SYS and dotted.count(".") == 1:
                flag(TAMPERING, f"uses {dotted}", node)
            elif dotted.startswith("threading.") and node.attr in _FORBIDDEN_THREADING:
                flag(TAMPERING, f"uses {dotted}", node)
            elif (
                node.attr in shortcut_names
                and _root(node) not in outside
                and not (_root(node) in values and _root(node) not in modules)
            ):
                flag(SHORTCUT, f"uses {dotted or '...'}.{node.attr}" if not dotted else f"uses {dotted}", node)
            elif node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in _ALLOWED_DUNDERS:
                flag(TAMPERING, f"reaches into {node.attr}", node)
        elif isinstance(node, ast.Name):
            if node.id in ("__builtins__", "SystemExit", "get_ipython", "__import__"):
                flag(TAMPERING, f"uses {node.id}", node)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for part in _written(target):
                    if isinstance(part, ast.Attribute) and _root(part) in modules:
                        flag(TAMPERING, f"replaces {_dotted(part) or part.attr} (monkeypatching)", node)
                        break
    unique, seen = [], set()
    for finding in sorted(findings, key=lambda f: f.line):
        if (finding.kind, finding.detail) not in seen:
            seen.add((finding.kind, finding.detail))
            unique.append(finding)
    return unique


def _written(target: ast.AST):
    """The nodes an assignment to ``target`` writes into: the target itself, the containers of a subscript
    (``torch.table[i] = x`` writes into ``torch.table``) and the parts of a tuple, never the index read to
    find the place (``probs[torch.arange(n), ids] -= 1`` writes into ``probs`` only)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _written(element)
    elif isinstance(target, ast.Starred):
        yield from _written(target.value)
    elif isinstance(target, ast.Subscript):
        yield from _written(target.value)
    else:
        yield target


def module_aliases(sources: list[str]) -> set[str]:
    """Names that the given cells bind to imported modules."""
    names = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


# --- While the answers run: what they reach for ----------------------------------------------------
#
# The scan above reads an answer before it runs; a route it cannot see (a path computed at run time)
# still shows when it is taken. ``watch`` runs in the graded kernel before any answer: an audit hook
# (``sys.addaudithook``: it cannot be removed) and a wrapper of ``os.stat`` and ``os.lstat`` (which
# raise no audit event, and are how code looks for a file: ``Path.is_file``, ``os.path.exists``) note
# each time the learner's own code looks for, opens, lists or writes a path only a cheat would want
# (the answer key, classmates' submissions, the class's grades, another process's ``/proc`` entry) or
# writes where it may not. Each is one line in the file the checks record their answers in. These are
# signals for the instructor: the grader never changes a verdict for them, and a kernel that removes
# its own lines only hides itself from the signal, never earns a point.

WATCH_ENV = "INFRA_LAB_WATCH"
ATTEMPT = "attempt"  # the key of an attempt's line in the record file
MAX_ATTEMPTS = 40  # distinct attempts recorded per kernel; the rest are counted in the last one
# what a line says was done, and whether the sandbox let it happen
LOOKED, OPENED, LISTED, WROTE = "looked for", "opened", "listed", "wrote"
NOT_FOUND, FOUND, REFUSED, ALLOWED = "not found", "found", "refused", "allowed"
SANDBOX_ONLY = "only the sandbox's own"  # a /proc entry of the kernel's PID namespace, a file of its private /tmp
PROCESS = "another process"
UNWRITABLE = "a place it may not write"


def watch_config(
    record: str, names: dict[str, str], paths: dict[str, str], write_paths: dict[str, str], sandboxed: bool = False
) -> str:
    """The value of ``WATCH_ENV`` for a graded kernel.

    Args:
        record: the file the checks record their answers in (the kernel's view of it).
        names: a folder or file name -> what it holds ("solutions" -> "the answer key"): any path
            with such a part is watched.
        paths: a folder -> what it holds: any path inside it is watched.
        write_paths: as ``paths``, for writes only (the course's own files).
        sandboxed: the kernel runs in bubblewrap. Its PID namespace is its own, so another process
            it finds in ``/proc`` is one of the sandbox's, never the grader's; and its only writable
            places (its working folder and its private ``/tmp``) are its own, so a watched path it
            finds or writes there (a course that lives under ``/tmp`` has its paths there too) is a
            file the kernel made in its own copy, never the course's.
    """
    return json.dumps(
        {"record": record, "names": names, "paths": paths, "write_paths": write_paths, "sandboxed": sandboxed}
    )


def watch(config: str | None = None) -> bool:
    """Install the watch in this process (the graded kernel), from ``config`` or ``WATCH_ENV``;
    False when there is nothing to watch for."""
    import os
    import sys
    import sysconfig
    import threading

    config = config if config is not None else os.environ.get(WATCH_ENV)
    if not config:
        return False
    settings = json.loads(config)
    names: dict[str, str] = settings.get("names", {})
    paths = {os.path.abspath(p): what for p, what in settings.get("paths", {}).items()}
    write_paths = {os.path.abspath(p): what for p, what in settings.get("write_paths", {}).items()}
    fd = os.open(settings["record"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    from grading.course import GRADER_PACKAGES, REPO_ROOT

    course = str(REPO_ROOT)
    folders = lambda *keys: tuple(
        dict.fromkeys(
            os.path.join(resolve(sysconfig.get_paths()[key]), "")
            for key in keys
            for resolve in (os.path.abspath, os.path.realpath)
        )
    )
    stdlib, library = folders("stdlib", "platstdlib"), folders("stdlib", "platstdlib", "purelib", "platlib")
    ours = tuple(os.path.join(course, package, "") for package in GRADER_PACKAGES)
    real_stat, real_lstat, getpid = os.stat, os.lstat, os.getpid
    sandboxed = bool(settings.get("sandboxed"))
    private = tuple(os.path.join(os.path.realpath(folder), "") for folder in ("/tmp", os.getcwd()))
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    state = threading.local()
    seen: dict[tuple, int] = {}
    lock = threading.Lock()

    def learners(frame, skip: tuple[str, ...]) -> bool:
        """Whether the first frame outward from ``frame`` whose file is not under ``skip`` is the
        learner's: not the course's, not an installed package's (an import is never the learner's
        doing)."""
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(("<frozen importlib", "<grading")):
                return False
            if not name.startswith("<frozen") and not name.startswith(skip):
                return not name.startswith(ours) and not name.startswith(library)
            frame = frame.f_back
        return False

    def descends(pid: int) -> bool:
        """Whether process ``pid`` is this kernel or one of its descendants."""
        me = getpid()
        for _ in range(64):
            if pid == me:
                return True
            if pid <= 1:
                return False
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    pid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return False
        return False

    def classify(path: str, writing: bool) -> str | None:
        parts = path.split(os.sep)
        if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and not descends(int(parts[2])):
            return f"{PROCESS} (/proc/{parts[2]})"
        for part in parts:
            if part in names:
                return names[part]
        for folder, what in [*paths.items(), *(write_paths.items() if writing else ())]:
            if path == folder or path.startswith(folder + os.sep):
                return what
        return None

    def writable(path: str) -> bool:
        probe = path
        while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        return os.access(probe, os.W_OK)

    def note(what: str, op: str, path: str, outcome: str) -> None:
        key = (what, op, path, outcome)
        with lock:
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1 or len(seen) > MAX_ATTEMPTS:
                return
        line = json.dumps({ATTEMPT: {"what": what, "op": op, "path": path, "outcome": outcome}})
        os.write(fd, (line + "\n").encode())

    def seen_path(path, op: str, writing: bool, frame, outcome: str | None = None) -> None:
        if getattr(state, "busy", False) or isinstance(path, int) or path is None:
            return
        state.busy = True
        try:
            path = os.path.abspath(os.fsdecode(path))
            what = classify(path, writing)
            if what is None and not writing:
                return
            if what is None:  # a write anywhere is the learner's business while the sandbox allows it
                if writable(path) or not learners(frame, stdlib):
                    return
                note(UNWRITABLE, op, path, REFUSED)
                return
            if not learners(frame, library):
                return
            if outcome is None:
                outcome = (
                    (ALLOWED if writable(path) else REFUSED)
                    if writing
                    else (FOUND if os.path.lexists(path) else NOT_FOUND)
                )
            if (
                sandboxed
                and outcome in (FOUND, ALLOWED)
                and (what.startswith(PROCESS) or (path + os.sep).startswith(private))
            ):
                outcome = SANDBOX_ONLY
            note(what, op, path, outcome)
        except Exception:  # noqa: BLE001 - the watch must never break the learner's code
            pass
        finally:
            state.busy = False

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writing = (isinstance(flags, int) and bool(flags & write_flags)) or (
                isinstance(mode, str) and any(c in mode for c in "wax+")
            )
            seen_path(path, WROTE if writing else OPENED, writing, sys._getframe(1))
        elif event in ("os.listdir", "os.scandir") and args:
            seen_path(args[0] if args[0] is not None else ".", LISTED, False, sys._getframe(1))
        elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.utime", "os.truncate") and args:
            seen_path(args[0], WROTE, True, sys._getframe(1))
        elif event in ("os.rename", "os.link", "os.symlink") and len(args) > 1:
            seen_path(args[1], WROTE, True, sys._getframe(1))
            if event == "os.rename":
                seen_path(args[0], WROTE, True, sys._getframe(1))

    def looking(real):
        def stat(path, *, dir_fd=None, follow_symlinks=True):
            try:
                found = (
                    real(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
                    if real is real_stat
                    else real(path, dir_fd=dir_fd)
                )
            except OSError:
                if dir_fd is None:
                    seen_path(path, LOOKED, False, sys._getframe(1), NOT_FOUND)
                raise
            if dir_fd is None:
                seen_path(path, LOOKED, False, sys._getframe(1), FOUND)
            return found

        stat.__name__, stat.__qualname__, stat.__doc__ = real.__name__, real.__name__, real.__doc__
        return stat

    sys.addaudithook(hook)
    os.stat, os.lstat = looking(real_stat), looking(real_lstat)
    return True


def read_attempts(lines: list[str]) -> list[dict[str, str]]:
    """The attempts among a record file's lines (malformed ones skipped), each once, in order."""
    found: dict[tuple, dict[str, str]] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        attempt = row.get(ATTEMPT) if isinstance(row, dict) else None
        if not isinstance(attempt, dict):
            continue
        clean = {key: str(attempt.get(key, ""))[:300] for key in ("what", "op", "path", "outcome")}
        if clean["outcome"] in (NOT_FOUND, FOUND, REFUSED, ALLOWED, SANDBOX_ONLY) and clean["what"]:
            found.setdefault(tuple(clean.values()), clean)
    return list(found.values())[:MAX_ATTEMPTS]
