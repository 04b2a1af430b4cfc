"""The house, read from the code's own imports: the course's three packages import in one direction
(course_tools -> grading -> infra_lib), infra_lib's layers never import upward, no import cycle
between the course's modules, and no module imports another module's private names.

Every import counts, the ones inside functions included: an import deferred to call time still
ties the two modules together.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

from grading.course import PACKAGES, REPO_ROOT

# Which package may import which: the tooling uses the grader and the library, the grader the
# library; nothing imports the tooling, and the library imports neither.
MAY_IMPORT = {
    "course_tools": {"course_tools", "grading", "infra_lib"},
    "grading": {"grading", "infra_lib"},
    "infra_lib": {"infra_lib"},
}
# infra_lib's layers, lowest first (COURSE.md): a layer imports its own and lower ones only. Modules at
# the package's top (device, timing, backends...) serve every layer and are not ranked.
LAYERS = {"hardware": 0, "kernels": 1, "training": 2, "model": 2, "serving": 3, "ops": 4, "apps": 5}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(the course module imported, the name taken from it or "", line) for every import in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:  # a submodule: ``from grading.run import warm``
                    found.append((f"{base}.{alias.name}", "", node.lineno))
                elif base in modules:
                    found.append((base, alias.name, node.lineno))
    return found


def _graph() -> tuple[dict[str, set[str]], list[str], list[str]]:
    """(module -> the course modules it imports, imports against the direction, private names taken)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    against, private = [], []
    for name, path in modules.items():
        where = path.relative_to(REPO_ROOT)
        for target, taken, line in _imports(name, path, modules):
            if target == name:
                continue
            graph[name].add(target)
            source_pkg, target_pkg = name.split(".")[0], target.split(".")[0]
            if target_pkg not in MAY_IMPORT[source_pkg]:
                against.append(f"{where}:{line}: {name} imports {target} ({source_pkg} never imports {target_pkg})")
            ours, theirs = name.split("."), target.split(".")
            if ours[0] == theirs[0] == "infra_lib" and len(ours) > 2 and len(theirs) > 1:
                low, high = LAYERS.get(ours[1]), LAYERS.get(theirs[1])
                if low is not None and high is not None and high > low:
                    against.append(f"{where}:{line}: {name} imports {target} (layer {ours[1]} below {theirs[1]})")
            if taken.startswith("_") and not taken.startswith("__"):
                private.append(f"{where}:{line}: {name} takes {target}.{taken}")
    return graph, against, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_imports_run_one_way_between_packages_and_down_infra_libs_layers():
    _, against, _ = _graph()
    assert not against, "imports against the house's direction:\n" + "\n".join(against)


def test_no_import_cycle_between_the_courses_modules():
    cycles = _cycles(_graph()[0])
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_private_names():
    _, _, private = _graph()
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_each_check_is_registered_by_one_module_level_statement():
    """Every check is registered by one statement at the top level of a module under grading/checks,
    ``register(Check(check_id="labNN.name", ...))`` with keyword arguments (shared fields may come as
    ``**parts``): no loop, wrapper or module ``__getattr__`` registers one, so its id finds its code."""
    from grading.registry import all_checks

    ids, stray = [], []
    for path in sorted((REPO_ROOT / "grading" / "checks").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(node.value) for node in tree.body if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register"):
                continue
            check = node.args[0] if len(node.args) == 1 else None
            named = [
                k.value.value
                for k in getattr(check, "keywords", [])
                if k.arg == "check_id" and isinstance(k.value, ast.Constant)
            ]
            if (
                id(node) not in top
                or not isinstance(check, ast.Call)
                or getattr(check.func, "id", None) != "Check"
                or check.args
                or len(named) != 1
            ):
                stray.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
            ids += named
        stray += [
            f"{path.relative_to(REPO_ROOT)}: __getattr__"
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
        ]
    assert not stray, f"register(...) other than one top-level register(Check(check_id=..., ...)): {stray}"
    assert sorted(ids) == sorted(all_checks())


def test_the_house_test_sees_a_planted_cycle_and_a_wrong_direction(tmp_path, monkeypatch):
    """The walk itself: a cycle, an upward import inside a function, and a private name are all found."""
    for package, files in {
        "infra_lib": {
            "__init__.py": "",
            "kernels/__init__.py": "",
            "serving/__init__.py": "",
            "kernels/k.py": "def f():\n    from infra_lib.serving import s\n",
            "serving/s.py": "from infra_lib.kernels.k import f\nfrom ..kernels.k import _hidden\n",
        },
        "grading": {"__init__.py": "", "a.py": "from grading import b\n", "b.py": "import grading.a\n"},
        "course_tools": {"__init__.py": "", "cli.py": "from grading import a\n"},
    }.items():
        for name, text in files.items():
            path = tmp_path / package / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    graph, against, private = _graph()
    assert _cycles(graph) == [["grading.a", "grading.b"], ["infra_lib.kernels.k", "infra_lib.serving.s"]]
    assert against == [
        "infra_lib/kernels/k.py:2: infra_lib.kernels.k imports infra_lib.serving.s (layer kernels below serving)"
    ]
    assert private == ["infra_lib/serving/s.py:2: infra_lib.serving.s takes infra_lib.kernels.k._hidden"]
    (tmp_path / "grading" / "c.py").write_text("def g():\n    from course_tools import cli\n")
    assert "grading/c.py:2: grading.c imports course_tools.cli (grading never imports course_tools)" in _graph()[1]
