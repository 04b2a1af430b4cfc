"""Generating the learner notebooks in labs/ from the instructor notebooks in solutions/ with nbgrader,
and the learner edition: the course as a class receives it, without the answers."""

from __future__ import annotations

import ast
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from grading.course import DEFAULT_SOURCE, REPO_ROOT, lab_ids
from grading.notebook import grade_id, nbgrader_meta, read_notebook

CONFIG = REPO_ROOT / "course_tools" / "nbgrader_config.py"
# nbgrader's solution delimiters: a line that contains one opens or closes a region.
BEGIN_REGION = "BEGIN SOLUTION"
END_REGION = "END SOLUTION"
# Tracked folders the learner edition leaves out: the answer key (replaced by the labs' tests
# only), the course's own suite (it checks the course against the answer key) and the CI that runs it.
LEFT_OUT = ("solutions/", "tests/", ".ci/")
# Shipped folders whose code is not compared with the answers: the library, whose reference code the
# lessons and the labs' own stack need. An answer pasted from it is the similarity report's to find
# (grading.similarity compares every answer with the lab's reference functions).
LIBRARY = ("infra_lib/",)
# The share of an answer's structure (grading.similarity's found_in) at which a shipped function counts as holding
# it. Lower than the class report's grading.similarity.THRESHOLD (0.8), which must not flag two honest answers
# to one contract: course-side code is written knowing the answers, so the edition can be stricter. Measured on
# the edition built 2026-12-06, every shipped function outside the library against every answer cell: the
# course-side helpers that solved a task again scored 0.73 to 0.85 (lab 13's call_with_retry and its runner, lab
# 04's node histogram) and are gone; nothing else reaches 0.67, and the code that solves no task (the check
# modules' replays, drivers and comparisons, the lessons, the benchmarks) scores 0.57 or less. 0.7 sits between,
# so a near-answer at 0.75 no longer passes. Below it the measure cannot tell an answer from honest code: lab 15's
# reference kernels live in infra_lib.kernels, lab 06's decode checks replay the reference's recorded greedy path,
# and lab 10's canary messages ask the reference's judge; the highest course-side score left is the in-model
# greedy loop labs 06 and 15 share, greedy_through in grading/checks/model_cases.py (0.56 against lab 06 task 4),
# a fixed-length loop without the task's stop rule, then lab 05's RMSNorm comparison (0.53 against task 5).
EDITION_THRESHOLD = 0.7
TESTS_ONLY_NOTE = "TESTS_ONLY.md"  # in an edition's solutions/: its notebooks hold tests, not answers
EDITION_NOTE = "EDITION.md"
__all__ = ["CONFIG", "ReleaseError", "generate", "generate_all", "lab_ids", "learner_edition"]


class ReleaseError(RuntimeError):
    """A release that cannot be made as asked, said so that a person can act on it."""


def generate(lab_id: str, out_dir: Path, source_dir: Path = DEFAULT_SOURCE) -> Path:
    """Run ``nbgrader generate_assignment`` on one lab in a scratch course directory.

    Returns:
        The folder holding the generated lab (``out_dir/lab_id``), replaced if it existed.
    """
    return generate_all([lab_id], out_dir, source_dir)[0]


def generate_all(
    labs: list[str], out_dir: Path, source_dir: Path = DEFAULT_SOURCE, gradebook: Path | None = None
) -> list[Path]:
    """``generate`` for several labs in one nbgrader run (its start-up, seconds, is paid once).

    ``gradebook``: nbgrader's database (``gradebook.db`` at the course's root) to record each lab
    in, with its cells and points, as ``nbgrader generate_assignment`` does, so that ``nbgrader
    autograde LAB --create`` finds it; None records nothing.

    Returns:
        The folders holding the generated labs (``out_dir/<lab id>``), in the order given.

    Raises:
        ReleaseError: ``source_dir`` is a learner edition's tests-only source (its answer cells are
            stubs already; nbgrader would replace them whole).
    """
    labs = list(dict.fromkeys(labs))
    if not labs:
        return []
    if (Path(source_dir) / TESTS_ONLY_NOTE).is_file():
        raise ReleaseError(
            f"{source_dir} holds the learner edition's tests without answers; labs/ is released "
            f"from the instructor's solutions/"
        )
    for lab_id in labs:
        source = Path(source_dir) / lab_id
        if not (source / f"{lab_id}.ipynb").is_file():
            raise FileNotFoundError(f"no instructor notebook {source / (lab_id + '.ipynb')}")
    with tempfile.TemporaryDirectory(prefix="release-") as scratch:
        for lab_id in labs:
            shutil.copytree(
                Path(source_dir) / lab_id,
                Path(scratch) / "solutions" / lab_id,
                ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"),
            )
        (Path(scratch) / "nbgrader_config.py").write_text(f"load_subconfig({str(CONFIG)!r})\n")
        env = {**os.environ, "INFRA_COURSE_ROOT": scratch}
        # "*" is every assignment in the scratch course: exactly the labs copied above.
        database = ["--db", f"sqlite:///{Path(gradebook).resolve()}"] if gradebook else ["--no-db"]
        result = subprocess.run(
            [sys.executable, "-m", "nbgrader", "generate_assignment", "*", "--force", *database, "--log-level=WARN"],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"nbgrader generate_assignment {' '.join(labs)} failed:\n{result.stdout}\n{result.stderr}"
            )
        targets = []
        for lab_id in labs:
            produced = Path(scratch) / "labs" / lab_id
            if not produced.is_dir():
                raise RuntimeError(f"nbgrader generate_assignment did not produce {lab_id}:\n{result.stderr}")
            target = Path(out_dir) / lab_id
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(produced, target)
            targets.append(target)
    return targets


# --- the learner edition ------------------------------------------------------------------------------

_TESTS_ONLY_TEXT = """\
# Tests only

Each `<lab>/<lab>.ipynb` here is the lab's instructor notebook with every answer cell replaced by
its stub in `labs/`: no answers, only the tests (visible and hidden) that the grader runs on yours.
"""

_EDITION_TEXT = """\
# The learner edition

This is the course as a class receives it: the lessons (`notebooks/`), the labs (`labs/`), the
library (`infra_lib/`), the grader (`grading/`) and the benchmarks. It holds no answers:
`solutions/` keeps each lab's tests only (see `solutions/TESTS_ONLY.md`), and the course's own
test suite (`tests/`, run by `make test`) stays with the instructor.

## Grading your own work

Set up once with `make lab` (it opens JupyterLab), do a lab's tasks in `labs/<lab>/<lab>.ipynb`,
save it, then from this folder:

```bash
.venv/bin/infra-lab grade labs/lab01_gemm/lab01_gemm.ipynb   # one lab: points per task, feedback
.venv/bin/infra-lab progress                                 # every lab: a table and a chart
```

Feedback goes to `grades/<lab>/feedback.md`; the button in each lab's progress cell grades the
saved notebook the same way. Hidden checks run on inputs drawn at grade time: their feedback
names what failed, not the inputs or the expected values.
"""


def _is_answer(cell: dict) -> bool:
    """An nbgrader answer cell of any type, or any cell with a solution region in it."""
    return nbgrader_meta(cell).get("solution") is True or BEGIN_REGION in str(cell.get("source", ""))


def tests_only(instructor: NotebookNode, released: NotebookNode, lab_id: str) -> NotebookNode:
    """The instructor notebook with each answer cell's source replaced by its released stub.

    Everything else (test cells with their hidden tests, metadata, cell order) stays as it is,
    so the grader splices a learner's answers into it exactly as into the instructor notebook.

    Raises:
        ReleaseError: an answer cell has no released counterpart, or the released one still
            holds a solution region (``labs/`` is older than ``solutions/``).
    """
    stubs = {grade_id(cell): cell for cell in released.cells if grade_id(cell)}
    stripped = copy.deepcopy(instructor)
    for cell in stripped.cells:
        if not _is_answer(cell):
            continue
        stub = stubs.get(grade_id(cell))
        if stub is None or BEGIN_REGION in stub.source:
            raise ReleaseError(
                f"labs/{lab_id} has no released stub for answer cell {grade_id(cell)!r}; "
                f"run `infra-lab release {lab_id}` first"
            )
        cell.source = stub.source
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return stripped


def tracked_files(root: Path = REPO_ROOT) -> list[str]:
    """The course's files as git knows them (relative paths; those deleted from the working tree left out)."""
    try:
        listing = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ReleaseError(
            f"the learner edition is built from a git checkout of the course, and `git ls-files` "
            f"failed in {root}: {getattr(exc, 'stderr', '') or exc}".strip()
        ) from exc
    return [name for name in listing.stdout.split("\0") if name and (root / name).is_file()]


def solution_regions(source_dir: Path = DEFAULT_SOURCE, min_lines: int = 2) -> list[str]:
    """Each solution region of the instructor notebooks with ``min_lines`` or more non-blank lines,
    as its stripped non-blank lines joined by newlines (the form :func:`answer_leaks` searches for)."""
    regions = []
    for lab_id in lab_ids(source_dir):
        for cell in read_notebook(Path(source_dir) / lab_id / f"{lab_id}.ipynb").cells:
            region = None
            for line in cell.source.splitlines():
                if BEGIN_REGION in line:
                    region = []
                elif END_REGION in line and region is not None:
                    if len(region) >= min_lines:
                        regions.append("\n".join(region))
                    region = None
                elif region is not None and line.strip():
                    region.append(line.strip())
    return regions


def _strings(item) -> list[str]:
    if isinstance(item, dict):
        item = list(item.values())
    return [text for part in item for text in _strings(part)] if isinstance(item, list) else [str(item)]


def _text_lines(path: Path) -> str:
    """A file's text as stripped non-blank lines; a notebook's as the lines of every string in its JSON."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".ipynb":
        try:
            text = "\n".join(_strings(json.loads(text)))
        except json.JSONDecodeError:
            pass
    return "\n" + "\n".join(line.strip() for line in text.splitlines() if line.strip()) + "\n"


def answer_leaks(folder: Path, regions: list[str]) -> list[str]:
    """The files under ``folder`` (relative paths) that hold a solution marker line or one of ``regions``."""
    leaks = []
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        lines = _text_lines(path)
        if path.suffix == ".ipynb":
            marker = BEGIN_REGION in lines
        else:  # a line that opens a region; the grader's own constant and prose that names the marker are no answer
            marker = any(line.lstrip("#").strip().startswith(BEGIN_REGION) for line in lines.splitlines())
        if marker or any(f"\n{region}\n" in lines for region in regions):
            leaks.append(path.relative_to(folder).as_posix())
    return leaks


def solution_prints(source_dir: Path = DEFAULT_SOURCE) -> list[tuple[str, frozenset, dict]]:
    """("lab:grade_id", its stub's grams, the fingerprint of its entry functions) for each answer cell of
    the instructor notebooks (:mod:`grading.similarity`)."""
    from grading.notebook import clear_solutions, is_solution_cell
    from grading.similarity import fingerprint, grams

    found = []
    for lab_id in lab_ids(source_dir):
        for cell in read_notebook(Path(source_dir) / lab_id / f"{lab_id}.ipynb").cells:
            if is_solution_cell(cell):
                base = grams(clear_solutions(cell.source)) or frozenset()
                prints = fingerprint(cell.source, base, entries=True)
                if prints:
                    found.append((f"{lab_id}:{grade_id(cell)}", base, prints))
    return found


def _code(path: Path) -> list[str]:
    """A Python file's text; a notebook's code cells as one source (its magics and shell lines blanked),
    or cell by cell when that does not parse."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".py":
        return [text]
    try:
        cells = [cell for cell in json.loads(text).get("cells", []) if cell.get("cell_type") == "code"]
    except (json.JSONDecodeError, AttributeError):
        return []
    sources = [
        "\n".join(
            "" if line.lstrip().startswith(("%", "!")) else line
            for line in "".join(cell.get("source", "")).splitlines()
        )
        for cell in cells
    ]
    whole = "\n\n".join(sources)
    try:
        ast.parse(whole)
        return [whole]
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return sources


def equivalent_code(
    folder: Path, solutions: list[tuple[str, frozenset, dict]], threshold: float = EDITION_THRESHOLD
) -> list[tuple[str, str, str]]:
    """The functions of the files under ``folder`` (.py files and notebooks' code, :data:`LIBRARY` left out)
    that hold a solution cell's code: (file, "lab:grade_id", "unit ~ unit score") for each, where the
    share of the solution's grams (its stub's removed) found in the function reaches ``threshold``
    (:data:`EDITION_THRESHOLD`). Names, comments, constants, the order of functions and helpers split out
    or pasted in do not hide one."""
    from grading.similarity import best_pair, fingerprint, found_in

    found = []
    for path in sorted(p for p in Path(folder).rglob("*") if p.suffix in (".py", ".ipynb") and p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name.startswith(LIBRARY):
            continue
        for source in _code(path):
            prints = fingerprint(source)
            if not prints:
                continue
            for label, base, solution in solutions:
                best = best_pair(solution, prints, base, measure=found_in)
                if best is not None and best[0] >= threshold:
                    found.append((name, label, f"{best[2]} ~ {best[1]} {best[0]:.2f}"))
    return found


def _prepare(out_dir: Path, files: list[str], force: bool) -> None:
    """Make ``out_dir`` an empty folder, refusing to touch the course itself or, without ``force``, anything in it."""
    root = REPO_ROOT.resolve()
    if root.is_relative_to(out_dir) or any((root / name).is_relative_to(out_dir) for name in files):
        raise ReleaseError(f"{out_dir} holds the course's own files; write the edition into a folder of its own")
    if out_dir.exists() and not out_dir.is_dir():
        raise ReleaseError(f"{out_dir} is a file; name a folder for the edition")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise ReleaseError(f"{out_dir} is not empty; name a new folder, or pass --force to replace what is in it")
        for entry in out_dir.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def learner_edition(out_dir: Path, force: bool = False) -> Path:
    """Write the course as a class receives it into ``out_dir``: every tracked file but the answers.

    The tests-only notebooks keep the folder name ``solutions/``: every default that names the
    trusted source (``grading.course.DEFAULT_SOURCE``, ``infra-lab grade --source``, the progress
    cell, nbgrader's source directory, the sandbox that hides it from the kernel) then works in the
    edition unchanged, and ``solutions/TESTS_ONLY.md`` says what the folder holds. Besides each
    lab's tests-only notebook it keeps the lab's tracked ``*.json`` files (data the grader reads
    beside the notebook, such as release notes); other files there could hold answers.

    ``tests/`` and ``.ci/`` are left out whole (:data:`LEFT_OUT`): the suite grades the solutions,
    builds its adversarial corpus from them and compares the labs with what nbgrader generates from
    them, so it cannot run without the answers. Before returning, every file of the edition is
    scanned for an answer's lines (:func:`answer_leaks`), and every function of its Python files and
    notebooks for an answer's structure (:func:`equivalent_code`, the similarity report's measure at
    :data:`EDITION_THRESHOLD`): the grader's course-side code included, so that no check module ships a
    task solved again. The
    library (:data:`LIBRARY`) is not scanned: the lessons need its reference code, and the defence
    there is the similarity report, which compares every answer with the lab's reference functions.
    Untracked files (``.venv``, ``build/``, ``grades/``) never go in.

    Raises:
        ReleaseError: ``out_dir`` is not empty (and not ``force``) or holds the course itself, the
            course is not a git checkout, ``labs/`` lacks a stub, or a file of the edition holds an answer
            (its lines, or code equivalent to it outside :data:`LIBRARY`).
    """
    out_dir = Path(out_dir).resolve()
    files = tracked_files()
    _prepare(out_dir, files, force)
    for name in files:
        if name.startswith(tuple(LEFT_OUT)):
            continue
        (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, out_dir / name)
    source = out_dir / DEFAULT_SOURCE.relative_to(REPO_ROOT)
    for lab_id in lab_ids():
        released = read_notebook(REPO_ROOT / "labs" / lab_id / f"{lab_id}.ipynb")
        instructor = read_notebook(DEFAULT_SOURCE / lab_id / f"{lab_id}.ipynb")
        (source / lab_id).mkdir(parents=True, exist_ok=True)
        nbformat.write(tests_only(instructor, released, lab_id), source / lab_id / f"{lab_id}.ipynb")
        for data in (DEFAULT_SOURCE / lab_id).glob("*.json"):
            if data.relative_to(REPO_ROOT).as_posix() in files:
                shutil.copy2(data, source / lab_id / data.name)
    (source / TESTS_ONLY_NOTE).write_text(_TESTS_ONLY_TEXT, encoding="utf-8")
    (out_dir / EDITION_NOTE).write_text(_EDITION_TEXT, encoding="utf-8")
    leaks = answer_leaks(out_dir, solution_regions())
    if leaks:
        raise ReleaseError(
            f"the edition in {out_dir} holds solution code in {', '.join(leaks)}; leave them out "
            f"(course_tools.release.LEFT_OUT) and build it again"
        )
    equivalent = [
        f"{name}: {unit} is {label}'s answer" for name, label, unit in equivalent_code(out_dir, solution_prints())
    ]
    if equivalent:
        raise ReleaseError(
            f"the edition in {out_dir} holds code equivalent to an answer: {'; '.join(equivalent)}; "
            f"take it out of the course-side code (the checks can drive the library's reference) "
            f"and build it again"
        )
    return out_dir
