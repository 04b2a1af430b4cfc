"""Shared paths and helpers: building learner notebooks from the lab and the solution."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

# Headless plotting and quiet Jupyter for every test and every kernel they start.
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
SOLUTIONS = sorted(p for p in (REPO / "solutions").glob("*/*.ipynb") if p.stem == p.parent.name)
LABS = sorted(p for p in (REPO / "labs").glob("*/*.ipynb") if p.stem == p.parent.name)
LAB01 = REPO / "labs" / "lab01_gemm" / "lab01_gemm.ipynb"
SOLUTION01 = REPO / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb"


def answer_cells(path: Path) -> dict[str, str]:
    """grade_id -> source of each answer cell of a notebook."""
    from grading.notebook import grade_id, is_solution_cell, read_notebook

    return {grade_id(c): c.source for c in read_notebook(path).cells if is_solution_cell(c)}


def write_learner_notebook(path: Path, answers: dict[str, str], base: Path = LAB01) -> Path:
    """A copy of the released lab with some answer cells filled in (by grade_id)."""
    from grading.notebook import grade_id, read_notebook

    nb = read_notebook(base)
    for cell in nb.cells:
        if grade_id(cell) in answers:
            cell.source = answers[grade_id(cell)]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="session")
def solution_answers() -> dict[str, str]:
    return answer_cells(SOLUTION01)
