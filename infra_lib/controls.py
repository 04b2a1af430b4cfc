"""Sliders that redraw text or a figure, without capturing output.

``ipywidgets.interactive`` and ``with output_widget:`` route what a cell prints into an Output
widget by capturing the kernel's messages; notebook runners (nbclient, papermill, the grader)
must then follow that capture, and they can stall on it. These helpers set an Output widget's
contents directly instead, so a notebook with controls runs headless exactly like any other.
"""

from __future__ import annotations

import contextlib
import io
import json

import ipywidgets as widgets


def printed(fn, *args, **kwargs) -> str:
    """What ``fn(*args, **kwargs)`` prints, as a string."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        fn(*args, **kwargs)
    return buffer.getvalue()


def show_in(output: widgets.Output, text: str | None = None, figure=None) -> None:
    """Replace what ``output`` shows with ``text`` and/or ``figure`` (anything IPython can display)."""
    output.outputs = ()
    if text is not None:
        output.append_stdout(text)
    if figure is not None and hasattr(figure, "to_json"):  # a plotly figure: its own mimetype, plain JSON
        bundle = {
            "application/vnd.plotly.v1+json": {**json.loads(figure.to_json()), "config": {}},
            "text/plain": f"<{type(figure).__name__}>",
        }
        output.outputs += ({"output_type": "display_data", "data": bundle, "metadata": {}},)
    elif figure is not None:
        output.append_display_data(figure)


def live(fn, **controls) -> widgets.VBox:
    """Controls above the text ``fn(**values)`` prints, redrawn whenever a control changes
    (``widgets.interactive`` for printing functions, without output capture)."""
    output = widgets.Output()

    def update(_=None) -> None:
        show_in(output, text=printed(fn, **{name: control.value for name, control in controls.items()}))

    for control in controls.values():
        control.observe(update, names="value")
    update()
    return widgets.VBox([*controls.values(), output])
