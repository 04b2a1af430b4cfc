"""The progress cell at the top of each lab: the last grade recorded, and a button to grade now.

Running the cell only reads ``grades/<lab_id>/results.json`` (where ``infra-lab grade`` and
``infra-lab progress`` write): it never grades, so the grader and papermill run it headless
for free. The button grades the notebook *as saved on disk*, in a separate process
(``infra-lab progress``), so nothing in the learner's kernel can touch the verdicts.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from pathlib import Path

import ipywidgets as widgets

from grading.grading_times import estimate, machine_load
from grading.progress import RESULTS, LabProgress, read_recorded
from infra_lib.controls import show_in

BUTTON_LABEL = "Grade this lab now"
GRADE_TIMEOUT_S = 900


def grades_folder(lab_id: str, folder: str | Path) -> Path:
    """The grades folder that belongs to a lab notebook in ``folder``.

    ``infra-lab grade`` writes ``grades/<lab_id>/`` under the folder it runs in: the course
    folder (``labs/<lab_id>/`` is two levels down) or the notebook's own folder. The first
    of the notebook's folder, its parent and grandparent that holds a recorded grade wins;
    otherwise the course folder when the notebook sits in ``labs/``, else its own folder.
    """
    folder = Path(folder).resolve()
    candidates = [folder, *list(folder.parents)[:2]]
    for candidate in candidates:
        if (candidate / "grades" / lab_id / RESULTS).is_file():
            return candidate / "grades"
    if folder.parent.name == "labs":
        return folder.parent.parent / "grades"
    return folder / "grades"


def _how_to_grade(lab_id: str, notebook: Path) -> str:
    return (
        f'{lab_id} has no recorded grade yet. Save the notebook, then press "{BUTTON_LABEL}" below, '
        f"or grade it from a terminal in the course folder:\n"
        f"    infra-lab grade labs/{lab_id}/{lab_id}.ipynb\n"
        f"(the grader reads the saved file {notebook.name}, runs it in a fresh kernel and checks every task)\n"
    )


def lab_summary(lab_id: str, grades: str | Path, notebook: str | Path | None = None) -> str:
    """What the progress cell prints: the recorded score and the failing checks, or how to grade.

    Args:
        lab_id: e.g. "lab01_gemm".
        grades: the grades folder (holding ``<lab_id>/results.json`` once graded).
        notebook: the lab's notebook, named in the instructions (default ``<lab_id>.ipynb``).
    """
    notebook = Path(notebook or f"{lab_id}.ipynb")
    recorded = read_recorded(lab_id, grades)
    if recorded is None:
        return _how_to_grade(lab_id, notebook)
    results = Path(grades) / lab_id / RESULTS
    if not recorded.graded or (recorded.max_score == 0 and recorded.note):
        return f"{lab_id}: the last grading did not finish: {recorded.note}\n"
    when = datetime.fromtimestamp(results.stat().st_mtime).strftime("%Y-%m-%d %H:%M")
    lines = [
        f"{lab_id}: {recorded.score:g}/{recorded.max_score:g} points, "
        f"{recorded.tests_passed}/{recorded.tests} tests passed (graded {when}; {results})"
    ]
    if recorded.failing:
        lines.append("still failing:")
        lines += [f"  {check.line()}" for check in recorded.failing]
        lines.append(f"details and hints: {results.with_name('feedback.md')}")
    else:
        lines.append("every check passes")
    return "\n".join(lines) + "\n"


def lab_figure(progress: LabProgress):
    """Points earned of the maximum, per test cell; hover names the checks still failing."""
    import plotly.graph_objects as go

    names = [name for name, _, _ in progress.test_scores]
    hover = []
    for name, score, maximum in progress.test_scores:
        failing = [c.line(80) for c in progress.failing if c.test == name]
        hover.append("<br>".join([f"<b>{name}</b>: {score:g}/{maximum:g}", *failing]))
    fig = go.Figure(
        [
            go.Bar(
                x=names,
                y=[m for _, _, m in progress.test_scores],
                name="points",
                marker_color="#e0e0e0",
                hoverinfo="skip",
            ),
            go.Bar(
                x=names,
                y=[s for _, s, _ in progress.test_scores],
                name="earned",
                marker_color="#2e7d32",
                hovertext=hover,
                hoverinfo="text",
            ),
        ]
    )
    fig.update_layout(
        barmode="overlay",
        height=260,
        margin=dict(t=40, b=40, l=40, r=20),
        template="plotly_white",
        title=f"{progress.lab_id}: {progress.score:g}/{progress.max_score:g} points",
        yaxis_title="points",
        showlegend=False,
    )
    return fig


def show_progress(output: widgets.Output, lab_id: str, grades: Path, notebook: Path, prefix: str = "") -> None:
    """Draw the summary (and, once graded, the per-test chart) into ``output``."""
    recorded = read_recorded(lab_id, grades)
    figure = lab_figure(recorded) if recorded is not None and recorded.test_scores else None
    show_in(output, text=prefix + lab_summary(lab_id, grades, notebook), figure=figure)


def grade_saved_notebook(notebook: Path, grades: Path) -> subprocess.CompletedProcess:
    """Grade the saved notebook in a separate process (``infra-lab progress NOTEBOOK``)."""
    command = [sys.executable, "-m", "course_tools.cli", "progress", str(notebook), "--out", str(grades), "--no-chart"]
    return subprocess.run(command, cwd=notebook.parent, capture_output=True, text=True, timeout=GRADE_TIMEOUT_S)


def progress_panel(lab_id: str, notebook: str | Path | None = None) -> widgets.VBox:
    """The lab's progress cell: the recorded grade, and a button that grades the saved notebook.

    Args:
        lab_id: e.g. "lab01_gemm".
        notebook: the saved lab notebook (default: ``<lab_id>.ipynb`` in the working
            directory, where Jupyter starts a notebook's kernel).

    Returns:
        The widget to display (the cell's last expression).
    """
    notebook = Path(notebook) if notebook is not None else Path.cwd() / f"{lab_id}.ipynb"
    grades = grades_folder(lab_id, notebook.parent)
    output = widgets.Output()
    expected = estimate(lab_id, grades)  # a quiet machine's time: the load is measured when the button is pressed
    button = widgets.Button(
        description=BUTTON_LABEL,
        icon="check",
        button_style="primary",
        layout=widgets.Layout(width="auto"),
        tooltip=f"grade the saved notebook in a fresh kernel ({expected})",
    )

    def grade(_=None) -> None:
        if not notebook.is_file():
            show_in(
                output,
                text=f"cannot grade: no saved notebook at {notebook}; save it there, "
                f"or run infra-lab grade on the file from a terminal\n",
            )
            return
        button.disabled = True
        show_in(
            output,
            text=f"grading {notebook.name} as saved on disk (a fresh kernel runs the lab: "
            f"{estimate(lab_id, grades, load=machine_load())})...\n",
        )
        try:
            result = grade_saved_notebook(notebook, grades)
            problem = "" if result.returncode == 0 else f"grading failed:\n{result.stderr[-2000:]}\n\n"
        except subprocess.TimeoutExpired:
            problem = f"grading did not finish within {GRADE_TIMEOUT_S} s\n\n"
        finally:
            button.disabled = False
        show_progress(output, lab_id, grades, notebook, prefix=problem)

    button.on_click(grade)
    show_progress(output, lab_id, grades, notebook)
    return widgets.VBox([output, button])
