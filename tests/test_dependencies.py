"""Every third-party package the course imports is declared in pyproject.toml and pinned in
constraints.txt, and nothing is declared that nothing uses."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib
from conftest import REPO

from grading.course import PACKAGES

# Imported by none of the course's files but needed all the same: each is a tool the course runs.
TOOLS = {
    "jupyterlab": "make lab",
    "ipykernel": "the notebooks' kernel",
    "nbgrader": "the instructor's grader",
    "faiss-cpu": "imported as faiss",
    "triton": "loaded through infra_lib.kernels.triton_env",
}


# Imported by a benchmark only, from the optional bench extra, and measured only where installed
# (benchmarks/decode.py says how to get it otherwise): module -> distribution.
BENCH = {"llama_cpp": "llama-cpp-python"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _imports(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _modules_used(folders: list[str]) -> set[str]:
    used = set()
    for folder in folders:
        for path in (REPO / folder).rglob("*.py"):
            used |= _imports(path.read_text(encoding="utf-8"))
        for path in (REPO / folder).rglob("*.ipynb"):
            if "adversarial" in path.parts:  # the hostile corpus: broken on purpose, and graded, not run
                continue
            for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
                if cell["cell_type"] == "code":
                    lines = "".join(cell["source"]).splitlines()
                    used |= _imports("\n".join(line for line in lines if not line.lstrip().startswith(("%", "!"))))
    local = {p.stem for p in (REPO / "benchmarks").glob("*.py")} | {p.stem for p in (REPO / "tests").glob("*.py")}
    local |= {p.parent.name for p in (REPO / "tests").glob("*/__init__.py")}  # the tests' own packages
    return {m for m in used if m not in sys.stdlib_module_names and m not in local | set(PACKAGES)}


def _distributions(modules: set[str], declared: set[str]) -> set[str]:
    """The distribution that provides each module: a declared one where several share a name
    (langgraph's namespace is spread over langgraph, langgraph-prebuilt, ...)."""
    owners = importlib.metadata.packages_distributions()
    missing = sorted(m for m in modules if m not in owners)
    assert not missing, f"imported but not installed: {missing}"
    found = set()
    for module in modules:
        names = [d.lower().replace("_", "-") for d in owners[module]]
        found.add(next((d for d in names if d in declared), names[0]))
    return found


def test_every_imported_package_is_declared_and_pinned():
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    test_extra = {_name(r) for r in project["optional-dependencies"]["test"]}
    pinned = {
        _name(line)
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    bench_extra = {_name(r) for r in project["optional-dependencies"]["bench"]}
    assert set(BENCH.values()) == bench_extra, f"the bench extra declares {sorted(bench_extra)}"
    used = _modules_used([*PACKAGES, "notebooks", "solutions", "benchmarks"])
    assert set(BENCH) & _modules_used([*PACKAGES, "notebooks", "solutions"]) == set(), "only benchmarks use the extra"
    course = _distributions(used - set(BENCH), runtime)
    assert course <= runtime, f"imported by the course but not in [project] dependencies: {sorted(course - runtime)}"
    tests = _distributions(_modules_used(["tests"]), runtime | test_extra)
    assert tests <= runtime | test_extra, f"imported by tests but not declared: {sorted(tests - runtime - test_extra)}"
    unused = runtime - course - set(TOOLS)
    assert not unused, f"declared but imported nowhere: {sorted(unused)} (drop them, or say in TOOLS why they stay)"
    declared = runtime | test_extra | bench_extra
    assert declared <= pinned, f"not pinned in constraints.txt: {sorted(declared - pinned)}"
    assert "accelerate" not in runtime, "accelerate is for one test (transformers reading GGUF): the test extra"


def test_makefile_installs_with_the_constraints_and_reinstalls_when_they_change():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    stamp_rule = re.search(r"^\$\(STAMP\):(.*)$", makefile, re.M).group(1).split()
    assert {"pyproject.toml", "$(CONSTRAINTS)", "Makefile"} <= set(stamp_rule)
    for name in ("PIP :=", "INSTALL ="):
        assert "--constraint $(CONSTRAINTS)" in re.search(rf"^{re.escape(name)}(.*)$", makefile, re.M).group(1)
    installs = [line for line in makefile.splitlines() if line.startswith(("\t$(PIP)", "\t$(INSTALL)"))]
    assert any('-e ".[test]"' in line for line in installs)


def test_make_hands_pips_find_links_to_uv_and_falls_back_to_pip(tmp_path):
    """uv does not read pip's configuration: the folder of local wheels that pip is pointed at
    (here PIP_FIND_LINKS) must reach uv's command line, or uv would fetch another torch build."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env = {**os.environ, "PIP_FIND_LINKS": str(wheels)}
    out = subprocess.run(
        ["make", "--dry-run", "--always-make", "--no-print-directory", ".venv"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    course = next(line for line in out.splitlines() if '-e ".[test]"' in line)
    uv_part, _, pip_part = course.partition("||")
    assert uv_part.lstrip().startswith(".venv/bin/uv pip install"), course
    assert f"--find-links {wheels}" in uv_part and "--constraint constraints.txt" in uv_part, course
    assert "-m pip install" in pip_part and "--constraint constraints.txt" in pip_part, course
    assert "uv==" in " ".join((REPO / "constraints.txt").read_text().split()), "uv is not pinned"


def test_the_environment_holds_bytecode_for_what_the_course_imports():
    """`make` installs with --no-compile and then runs course_tools.precompile: without its bytecode,
    torch alone would be compiled again by every process that imports it (seconds each)."""
    import importlib.util

    import papermill
    import torch

    from course_tools import precompile

    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert "-m course_tools.precompile" in makefile
    for module in (torch, torch.nn.functional, papermill):
        assert Path(importlib.util.cache_from_source(module.__file__)).is_file(), f"no bytecode for {module.__name__}"
    assert "torch" in precompile.TORCH_SIDE and "papermill" in precompile.TOOL_SIDE
