"""Notebook controls that redraw without output capture, and the rule that notebooks use them."""

from __future__ import annotations

import re

import ipywidgets as widgets
import plotly.graph_objects as go
from conftest import LABS, NOTEBOOKS, SOLUTIONS

from grading.notebook import read_notebook
from infra_lib.controls import live, printed, show_in


def test_live_redraws_what_the_function_prints():
    slider = widgets.IntSlider(value=3)
    box = live(lambda n: print("n squared is", n * n), n=slider)
    out = box.children[-1]
    assert out.outputs == ({"output_type": "stream", "name": "stdout", "text": "n squared is 9\n"},)
    slider.value = 4
    assert out.outputs[0]["text"] == "n squared is 16\n" and len(out.outputs) == 1
    assert printed(print, "a", 1) == "a 1\n"


def test_show_in_replaces_text_and_figures():
    out = widgets.Output()
    show_in(out, text="first\n")
    show_in(out, figure=go.Figure(go.Bar(y=[1, 2])))
    assert len(out.outputs) == 1 and "application/vnd.plotly.v1+json" in out.outputs[0]["data"]


def test_notebooks_never_capture_output_into_widgets():
    """``interactive``/``interact`` and ``with <Output>:`` capture kernel messages into a widget,
    which can stall headless runs (papermill, the grader): use infra_lib.controls instead."""
    capture = re.compile(r"widgets\.interactive\(|\binteract\(|^\s*with \w*(out|output|report|answer)\w*:", re.M)
    for path in NOTEBOOKS + SOLUTIONS + LABS:
        for cell in read_notebook(path).cells:
            if cell.cell_type == "code":
                assert not capture.search(cell.source), (
                    f"{path.name} captures output into a widget:\n{cell.source[:300]}"
                )
