"""A disturbed measurement gets a note next to its table, and the lesson still runs to the end.

The disturbance is made on purpose, so the tests never depend on how busy the machine is: a fake
clock for the unit test, and for the notebooks a timer that inflates each call in proportion to
the size of its result. That is the shape of the real artefact, where threads waiting for cores
slow the larger, multithreaded operations most, and it turns every "bigger batch is cheaper per
token" and "the first call is slower than a warm one" upside down.
"""

from __future__ import annotations

import json

import nbformat
import pytest
from conftest import REPO

import infra_lib.timed_section as ts
import infra_lib.timing as timing
from grading.run.warm import run_lesson
from infra_lib.timed_section import MachineLoad, timed_section

NOTE = "⚠ Unexpected result"

DISTURB_TIMER = """
# Injected by tests/test_timing_notes.py: time_op reports each call as (real time) x (elements of its result).
# The real time is the least of three single calls: one call alone, preempted on a loaded machine or
# paying a first call's set-up, once came out 9 times its size's share and turned a comparison back.
import torch
import infra_lib.timing

_real_time_op = infra_lib.timing.time_op


def _disturbed_time_op(fn, *, warmup=3, iters=10, sync=None):
    seconds = min(_real_time_op(fn, warmup=0, iters=1, sync=sync) for _ in range(3))
    result = fn()
    return seconds * (result.numel() if isinstance(result, torch.Tensor) else 1)


infra_lib.timing.time_op = _disturbed_time_op
"""


class FakeClock:
    """A perf_counter that advances by the cost of the operation that just ran, and by nothing else."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def operation(self, seconds: float):
        def run() -> None:
            self.now += seconds

        return run


@pytest.mark.parametrize("batch_step_s, holds", [(0.002, True), (0.050, False)])
def test_fake_timer_flags_a_batch_slower_per_token_than_batch_1(monkeypatch, capsys, batch_step_s, holds):
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)  # time_op reads time.perf_counter
    monkeypatch.setattr(
        ts, "measure_load", lambda sample_s: MachineLoad(cores=2, others_busy_cores=1.8, load_average=3.2)
    )
    with timed_section() as section:
        one = timing.time_op(clock.operation(0.001), warmup=1, iters=5)
        eight = timing.time_op(clock.operation(batch_step_s), warmup=1, iters=5)
    gain = (8 / eight) / (1 / one)
    assert section.check(gain >= 2, "batch 8 at least twice batch 1's tokens/s", f"{gain:.2f}x") is holds
    out = capsys.readouterr().out
    assert out.startswith("timing with 1 torch thread"), "a busy two-core machine gets one thread"
    if holds:
        assert "✓ expected batch 8 at least twice batch 1's tokens/s, and this run measured 4.00x." in out
        assert NOTE not in out
    else:
        assert f"{NOTE}: expected batch 8 at least twice batch 1's tokens/s, but this run measured 0.16x." in out
        assert "1.8 of 2 cores" in out and "1 torch thread" in out and "rerun this cell" in out


def run_disturbed(name: str, tmp_path) -> list[dict]:
    """Run a lesson with QUICK=True and the disturbing timer injected before its code; return its cells."""
    nb = nbformat.read(REPO / "notebooks" / name, as_version=4)
    position = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])) + 1
    nb.cells.insert(position, nbformat.v4.new_code_cell(DISTURB_TIMER))
    source = tmp_path / f"disturbed_{name}"
    nbformat.write(nb, source)
    out = tmp_path / f"out_{name}"
    run_lesson(
        source,
        out,
        parameters={"QUICK": True},
        kernel_name="python3",
        cwd=str(tmp_path),
        progress_bar=False,
        execution_timeout=600,
    )
    cells = json.loads(out.read_text())["cells"]
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"a disturbed run must still run to the end: {errors[0]['ename']}: {errors[0]['evalue']}"
    return cells


def printed_by(cells: list[dict], code: str) -> str:
    """Everything printed by the one cell whose source contains ``code``."""
    matching = [c for c in cells if c["cell_type"] == "code" and code in "".join(c["source"])]
    assert len(matching) == 1, f"expected one cell containing {code!r}, found {len(matching)}"
    return "".join("".join(o.get("text", "")) for o in matching[0].get("outputs", []) if o["output_type"] == "stream")


@pytest.mark.notebook
def test_chapter01_notes_a_disturbed_shapes_table_and_first_call_table(tmp_path):
    cells = run_disturbed("01_gemm_profiling.ipynb", tmp_path)
    shapes = printed_by(cells, "shapes_section.check")
    assert f"{NOTE}: expected batch 32 at least twice the batch-1 GEMV's FLOP rate" in shapes, shapes
    assert "torch thread" in shapes and "rerun this cell" in shapes.lower()
    first_calls = printed_by(cells, "first_call_section.check")
    assert f"{NOTE}: expected no first call clearly faster than the warm calls after it" in first_calls, first_calls


@pytest.mark.notebook
def test_chapter06_notes_disturbed_batched_decoding(tmp_path):
    cells = run_disturbed("06_request_journey.ipynb", tmp_path)
    batched = printed_by(cells, "batch_section.check")
    assert f"{NOTE}: expected batch 8 to decode at least twice batch 1's tokens/s" in batched, batched
    assert "torch thread" in batched
