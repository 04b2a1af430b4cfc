"""The lab's reference out of the graded kernel's reach, in bubblewrap.

While a lab is graded in the sandbox (:mod:`grading.run.bwrap`), each module that defines one of its
reference functions or classes (what ``register_shortcuts`` names) is shown to the kernel as a
copy in which those functions' bodies (every method, for a class) are one ``raise``; every other
line is unchanged, line numbers included. The module's cached bytecode (``__pycache__/*.pyc``)
is shown empty, so Python compiles the copy instead. Whatever route an answer takes (an import
under any name, re-running the module, reading its source, a subprocess), it finds the stub.
The grader's own process, outside the sandbox, computes the expected results with the real
reference.

Some reference pieces are the course's stack that a lab's checks run the learner's piece in;
``KEEP`` names them per lab, with the reason. Calling one from an answer is still caught by the
call monitor and the static scan.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

from grading.course import REPO_ROOT
from grading.registry import all_checks, lab_key, resolve_target, shortcut_targets

# lab -> reference names ("module:name") the kernel runs while that lab is graded, and why. (The
# checks' inputs are made by the grader, outside the sandbox, so none is needed for them.)
KEEP: dict[str, dict[str, str]] = {}

STUB_MESSAGE = "{name} is the reference for {lab}: it is not available while {lab} is graded"


def targets(lab: str) -> list[str]:
    """The lab's reference objects, "module:name" or "module:Class.method": what its checks compare with
    (a Triton kernel, a function, a class) and what its answers must not call (``register_shortcuts``),
    less ``KEEP``."""
    key = lab_key(lab)
    found = [
        getattr(check.reference, "target", None)
        for check_id, check in sorted(all_checks().items())
        if check_id.split(".")[0] == key
    ]
    found += list(shortcut_targets(key))
    kept = KEEP.get(key, {})
    return [t for t in dict.fromkeys(found) if t and t not in kept]


def _defining(lab: str) -> dict[Path, dict[str, set[str] | None]]:
    """Source file -> {top-level name in it: the methods to stub, or None for the object entirely}."""
    files: dict[Path, dict[str, set[str] | None]] = {}
    for target in targets(lab):
        obj = resolve_target(target)
        obj = getattr(obj, "fn", obj)  # a Triton kernel: the Python function it was made from
        obj = inspect.unwrap(obj) if callable(obj) and not isinstance(obj, type) else obj
        home = importlib.import_module(obj.__module__)
        path = Path(inspect.getsourcefile(home)).resolve()
        top, *member = obj.__qualname__.split(".")
        names = files.setdefault(path, {})
        if not member or (top in names and names[top] is None):
            names[top] = None
        else:  # one method of a class ("module:Class.method": lab 08 names the scheduler's planning)
            names.setdefault(top, set()).add(member[0])
    return files


def _functions(tree: ast.Module, names: dict[str, set[str] | None], module: str):
    """(function node, dotted name) for each named top-level function, and each named method (every
    method when the value is None) of a named class."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            yield node, f"{module}.{node.name}"
        elif isinstance(node, ast.ClassDef) and node.name in names:
            members = names[node.name]
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    members is None or item.name in members
                ):
                    yield item, f"{module}.{node.name}.{item.name}"


def stub_source(source: str, names: dict[str, set[str] | None], lab: str, module: str) -> str:
    """``source`` with the bodies of the named functions (and the methods of the named classes)
    replaced by a raise, each on the body's first line, blank lines after it (same line count)."""
    lines = source.splitlines(keepends=True)
    edits = []
    for node, dotted in _functions(ast.parse(source), names, module):
        body = (
            node.body[1:]
            if (
                isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
                and isinstance(node.body[0].value.value, str)
            )
            else node.body
        )
        if not body:
            continue
        start = min([body[0].lineno] + [d.lineno for d in getattr(body[0], "decorator_list", [])])
        end = node.end_lineno
        if start == node.lineno:
            raise ValueError(f"{dotted}: its body shares a line with its signature; the stub needs one of its own")
        message = STUB_MESSAGE.format(name=dotted, lab=lab)
        edits.append((start, end, " " * body[0].col_offset + f"raise RuntimeError({message!r})\n"))
    for start, end, line in sorted(edits, reverse=True):
        lines[start - 1 : end] = [line] + ["\n"] * (end - start)
    return "".join(lines)


def hidden_files(lab: str, folder: Path) -> dict[Path, Path]:
    """Write the lab's stub modules (and an empty file for cached bytecode) into ``folder``; returns
    real path -> file to show in its place, for :func:`grading.run.bwrap.kernel_prefix`'s ``hide``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    empty = folder / "empty.pyc"
    empty.write_bytes(b"")
    shown: dict[Path, Path] = {}
    for index, (path, names) in enumerate(sorted(_defining(lab).items())):
        stub = folder / f"{index}_{path.name}"
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        stub.write_text(stub_source(path.read_text(encoding="utf-8"), names, lab, module), encoding="utf-8")
        shown[path] = stub
        for cached in sorted((path.parent / "__pycache__").glob(f"{path.stem}.*.pyc")):
            shown[cached] = empty
    return shown
