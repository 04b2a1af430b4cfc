"""What one lab's grade depends on, as a digest: the key of the grading caches.

A grade depends on the lab's instructor notebook (its code cells, test cells, points and
answer-cell ids, not its prose: :func:`graded_content`) and release notes, the lab's check
module, the course modules those checks run (the lab's reference included), the grader's own
modules, and the limits. The digest has two parts (:func:`lab_version_parts`), so that a
re-grade can say which changed: the lab's tests (the notebook's graded content and release
notes) and the course's code (the modules). Editing the serving engine must not re-grade lab 01,
so the modules are found by following imports from the grader and from the lab's check module,
not by hashing every file of ``grading/`` and ``infra_lib/``:

* every ``import``/``from ... import`` of a course module, at any depth of the code (an import
  inside a function counts), with the packages on the way (their ``__init__``);
* in the lab's check module only, string constants naming a course module (the checks import
  references lazily, ``"infra_lib.hardware.flops:gemm_flops"``);
* the imports of the instructor notebook's code cells, which run in the graded kernel.

Standard library only.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import re
from pathlib import Path

from grading.course import DEFAULT_SOURCE, GRADER_PACKAGES, REPO_ROOT

RELEASE_NOTES = "release_notes.json"
# The grader's own modules: whatever grading any lab runs through.
GRADER_ENTRY = ("grading.grader", "grading.report", "grading.batch", "grading.similarity")
_MODULE_NAME = re.compile(r"^((?:grading|infra_lib)(?:\.\w+)+)(?::[\w.]+)?$")


def _module_file(name: str, root: Path) -> Path | None:
    parts = name.split(".")
    if parts[0] not in GRADER_PACKAGES:
        return None
    for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts) / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path, strings: bool) -> set[str]:
    """Course modules that the file at ``path`` imports (and names in strings, if ``strings``)."""
    package = _module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    return _imported(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), package, strings)


def notebook_imports(path: Path) -> set[str]:
    """Course modules the code cells of a notebook import (lines of IPython magic skipped)."""
    found: set[str] = set()
    try:
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    except (OSError, ValueError, AttributeError):
        return found
    for cell in cells:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source)
        code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            found |= _imported(ast.parse(code), "", strings=False)
        except SyntaxError:
            continue
    return found


def _imported(tree: ast.AST, package: str, strings: bool) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule imported by name
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _MODULE_NAME.match(node.value)
            if match:
                found.add(match.group(1))
    expanded = set()
    for name in found:
        parts = name.split(".")
        expanded.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))  # with the packages above
    return {name for name in expanded if name.split(".")[0] in GRADER_PACKAGES}


def closure(modules: list[str], root: Path = REPO_ROOT, strings_in: set[str] = frozenset()) -> list[Path]:
    """The files of the course modules reachable by imports from ``modules``, sorted. In the modules of
    ``strings_in`` and every module under them (a lab's check package), a string that names a course
    module ("infra_lib.serving.scheduler:Scheduler.schedule") counts as an import too."""
    seen: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name, root)
        if path is None:
            continue
        seen[name] = path
        todo.extend(_imports(path, root, strings=any(name == s or name.startswith(f"{s}.") for s in strings_in)))
    return sorted(set(seen.values()))


def check_module(lab_id: str) -> str:
    return f"grading.checks.{lab_id.split('_')[0]}"


def lab_files(lab_id: str, source_dir: str | Path = DEFAULT_SOURCE, root: Path = REPO_ROOT) -> list[Path]:
    """Every file one lab's grade depends on (see the module's docstring)."""
    checks = check_module(lab_id)
    trusted = Path(source_dir) / lab_id / f"{lab_id}.ipynb"
    files = [trusted]
    notes = Path(source_dir) / lab_id / RELEASE_NOTES
    if notes.is_file():
        files.append(notes)
    # the lab's own cells run in the graded kernel: what they import counts too
    return files + closure([*GRADER_ENTRY, checks, *sorted(notebook_imports(trusted))], root, strings_in={checks})


# The parts of a lab's version, and what each covers in words (a re-grade's note names them).
TESTS, COURSE = "tests", "course"
PART_NAMES = {TESTS: "the lab's tests", COURSE: "the course's code"}


def graded_content(path: Path) -> bytes:
    """What grading reads of an instructor notebook: each code cell's source, tags and nbgrader
    metadata (answer-cell ids, test cells, points), and the nbgrader metadata of the other cells, in
    order; not the prose of markdown cells, outputs, cell ids or the notebook's metadata, so that
    editing a time estimate in the introduction changes nothing. The file's bytes when it is not a
    notebook."""
    raw = path.read_bytes()
    try:
        cells = json.loads(raw)["cells"]
        kept = []
        for cell in cells:
            meta = cell.get("metadata", {})
            entry = {"type": cell.get("cell_type"), "nbgrader": meta.get("nbgrader", {})}
            if cell.get("cell_type") == "code":
                source = cell.get("source", "")
                entry.update(source="".join(source) if isinstance(source, list) else source, tags=meta.get("tags", []))
            kept.append(entry)
    except (ValueError, KeyError, TypeError, AttributeError):
        return raw
    return json.dumps(kept, sort_keys=True).encode()


def lab_version_parts(lab_id: str, source_dir: str | Path = DEFAULT_SOURCE, root: Path = REPO_ROOT) -> dict[str, str]:
    """Digests of :func:`lab_files` in two parts: ``tests`` (the instructor notebook's
    :func:`graded_content` and the release notes) and ``course`` (the course modules)."""
    trusted = Path(source_dir) / lab_id / f"{lab_id}.ipynb"
    digests = {TESTS: hashlib.sha256(), COURSE: hashlib.sha256()}
    for path in _files_cached(lab_id, str(source_dir), str(root), _stamp_of(Path(root), Path(source_dir), lab_id)):
        label = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
        digest = digests[TESTS if path.parent == trusted.parent else COURSE]
        digest.update(label.encode() + b"\0")
        if not path.is_file():
            digest.update(b"(missing)")
        else:
            digest.update(graded_content(path) if path == trusted else path.read_bytes())
        digest.update(b"\0")
    return {part: digest.hexdigest() for part, digest in digests.items()}


def lab_version(lab_id: str, source_dir: str | Path = DEFAULT_SOURCE, root: Path = REPO_ROOT) -> str:
    """A digest of :func:`lab_version_parts`: equal while nothing this lab's grade depends on changed."""
    parts = lab_version_parts(lab_id, source_dir, root)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _stamp_of(root: Path, source_dir: Path, lab_id: str) -> tuple:
    """What the list of files could depend on, cheaply: every course module's, the lab notebook's
    and its release notes' modification time and size (a change lists the files again; the digest
    always reads their contents)."""
    found = []
    for package in GRADER_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            info = path.stat()
            found.append((str(path), info.st_mtime_ns, info.st_size))
    for path in (source_dir / lab_id / f"{lab_id}.ipynb", source_dir / lab_id / RELEASE_NOTES):
        if path.is_file():
            info = path.stat()
            found.append((str(path), info.st_mtime_ns, info.st_size))
    return tuple(found)


@functools.lru_cache(maxsize=64)
def _files_cached(lab_id: str, source_dir: str, root: str, stamp: tuple) -> tuple[Path, ...]:
    return tuple(lab_files(lab_id, source_dir, Path(root)))


def renamed_cells(lab_id: str, source_dir: str | Path = DEFAULT_SOURCE) -> dict[str, str]:
    """The lab's release notes' map of answer-cell ids: ``{old grade_id: current grade_id}``.

    ``solutions/<lab>/release_notes.json`` is written by the instructor when a re-release
    renames an answer cell: ``{"renamed": {"task1_flops": "task1_gemm_flops"}}``. A learner
    notebook made for the earlier release is then graded under the new id.

    Raises:
        ValueError: the file exists but is not such a map.
    """
    path = Path(source_dir) / lab_id / RELEASE_NOTES
    if not path.is_file():
        return {}
    try:
        renamed = json.loads(path.read_text(encoding="utf-8")).get("renamed", {})
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f'{path} is not a release-notes file ({{"renamed": {{old id: new id}}}}): {exc}') from exc
    if not isinstance(renamed, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in renamed.items()):
        raise ValueError(f'{path}: "renamed" must map old answer-cell ids to current ones (strings)')
    return renamed


@functools.lru_cache(maxsize=8)  # once per grading process, not two git calls per notebook
def course_version(root: Path = REPO_ROOT) -> str:
    """The installed course's version, with the commit it was graded at where git can say:
    ``0.1.0+g1a2b3c4`` (``.dirty`` when tracked files were changed)."""
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("infra-course")
    except PackageNotFoundError:
        found = "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", *GRADER_PACKAGES, "solutions"],
            cwd=root,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return found
    if commit.returncode != 0:
        return found
    return f"{found}+g{commit.stdout.strip()}" + (".dirty" if dirty.returncode == 1 else "")
