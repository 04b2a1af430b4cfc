"""A static look at a learner's answer cells before they run: reaching into the grader,
the notebook machinery or the reference implementation.

An answer flagged here is not run at all (the grader substitutes the empty stub), so a
tampering answer cannot disturb the grading of the others; its own checks fail with the
reason found. The list is deliberately strict: a lab's answers never need any of it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

SHORTCUT = "reference shortcut"
TAMPERING = "tampering detected"

# Modules whose only use in an answer is to reach the notebook, the grader or the interpreter.
_FORBIDDEN_MODULES = {
    "grading", "IPython", "ipykernel", "jupyter_client", "nbclient", "nbformat", "papermill", "traitlets",
    "zmq", "importlib", "builtins", "gc", "inspect", "signal", "atexit", "sysconfig", "site",
}
_FORBIDDEN_CALLS = {"exec", "eval", "compile", "__import__", "get_ipython", "globals", "vars", "locals",
                    "exit", "quit", "breakpoint", "setattr", "delattr"}
_FORBIDDEN_SYS = {"modules", "excepthook", "displayhook", "settrace", "setprofile", "exit", "meta_path",
                  "path_hooks", "addaudithook", "breakpointhook", "unraisablehook", "_getframe"}
_FORBIDDEN_THREADING = {"settrace", "setprofile", "settrace_all_threads", "setprofile_all_threads", "excepthook"}
_ALLOWED_DUNDERS = {"__init__", "__name__", "__doc__", "__len__", "__iter__", "__next__", "__getitem__",
                    "__setitem__", "__contains__", "__repr__", "__str__", "__enter__", "__exit__", "__call__",
                    "__post_init__", "__slots__", "__future__", "__all__", "__hash__", "__lt__", "__le__",
                    "__gt__", "__ge__", "__add__", "__mul__", "__bool__"}
_COMMON_MODULES = {"torch", "np", "numpy", "math", "statistics", "time", "os", "sys", "json", "random",
                   "functools", "operator", "itertools", "collections", "threading", "typing", "re", "F", "nn"}


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


def scan(source: str, shortcut_modules: set[str], shortcut_names: set[str],
         module_names: set[str] = frozenset()) -> list[Finding]:
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
                        node.module.startswith("infra_lib") and alias.name in shortcut_names):
                    flag(SHORTCUT, f"imports {alias.name} from {node.module}", node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FORBIDDEN_CALLS:
            flag(TAMPERING, f"calls {node.func.id}()", node)
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted.startswith("sys.") and node.attr in _FORBIDDEN_SYS and dotted.count(".") == 1:
                flag(TAMPERING, f"uses {dotted}", node)
            elif dotted.startswith("threading.") and node.attr in _FORBIDDEN_THREADING:
                flag(TAMPERING, f"uses {dotted}", node)
            elif node.attr in shortcut_names and _root(node) not in outside and not (
                    _root(node) in values and _root(node) not in modules):
                flag(SHORTCUT, f"uses {dotted or '...'}.{node.attr}" if not dotted else f"uses {dotted}", node)
            elif node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in _ALLOWED_DUNDERS:
                flag(TAMPERING, f"reaches into {node.attr}", node)
        elif isinstance(node, ast.Name):
            if node.id in ("__builtins__", "SystemExit", "get_ipython", "__import__"):
                flag(TAMPERING, f"uses {node.id}", node)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and _root(part) in modules:
                        flag(TAMPERING, f"replaces {_dotted(part) or part.attr} (monkeypatching)", node)
                        break
    unique, seen = [], set()
    for finding in sorted(findings, key=lambda f: f.line):
        if (finding.kind, finding.detail) not in seen:
            seen.add((finding.kind, finding.detail))
            unique.append(finding)
    return unique


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
