"""Lab 03's stated rules that a check must hold: each kernel below breaks one rule of the lab's text and
nothing else; the check that holds the rule fails it with a message naming the rule, and the course's
kernel passes. Without a GPU the kernels run in Triton's interpreter, which also counts the bytes."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton", reason="Triton ships wheels for Linux only")

from conftest import REPO, check_fails  # noqa: E402

from grading import check  # noqa: E402
from grading.checks import lab03  # noqa: E402
from infra_lib.kernels.triton_env import interpreter_active, load_triton  # noqa: E402

triton, tl = load_triton()

from infra_lib.kernels.matmul import matmul_kernel  # noqa: E402
from infra_lib.kernels.softmax import softmax_kernel  # noqa: E402


@triton.jit
def softmax_with_a_floor(out_ptr, in_ptr, n_cols, in_row_stride, out_row_stride, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(in_ptr + tl.program_id(0) * in_row_stride + cols, mask=cols < n_cols, other=-float("inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    # a floor "to keep later logs finite": it gives every -inf logit a weight after all
    tl.store(
        out_ptr + tl.program_id(0) * out_row_stride + cols, tl.maximum(e / tl.sum(e, axis=0), 1e-12), mask=cols < n_cols
    )


@triton.jit
def matmul_storing_every_step(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside_c = (rows[:, None] < M) & (cols[None, :] < N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=(k[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )
        acc += tl.dot(a, b)
        # the partial tile goes to C after every step along K instead of once at the end
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc, mask=inside_c)


def test_the_course_kernels_pass_the_checks_that_hold_these_rules():
    check("lab03.softmax_extreme_values", softmax_kernel)
    check("lab03.matmul_traffic", matmul_kernel)


def test_a_probability_floor_fails_the_rule_that_a_minus_inf_logit_gives_exactly_zero():
    check("lab03.softmax_odd_shapes", softmax_with_a_floor)  # within the tolerance everywhere else
    message = check_fails("lab03.softmax_extreme_values", softmax_with_a_floor)
    assert "softmax_kernel gave a -inf logit a probability other than exactly 0" in message, message
    assert "many logits -inf" in message or "all but one logit per row -inf" in message
    assert "hint: a -inf logit is a key that must not be attended at all" in message


@pytest.mark.skipif(not interpreter_active(), reason="bytes are counted in Triton's interpreter")
def test_storing_c_at_every_step_fails_the_rule_that_each_tile_is_stored_once():
    for check_id in ("lab03.matmul_odd_shapes", "lab03.matmul_in_bounds"):
        check(check_id, matmul_storing_every_step)  # its final values are right, inside the bounds
    message = check_fails("lab03.matmul_traffic", matmul_storing_every_step)
    assert "matmul_kernel stores more bytes than it needs to `c_ptr` (its output is right)" in message, message
    assert "bytes to `c_ptr`, the reference stores" in message
    assert "hint: each program stores its tile of C once, after the last step along K" in message


def test_where_triton_compiles_the_reference_kernel_is_still_counted_in_the_interpreter(monkeypatch):
    """A sandboxed learner's kernel always runs interpreted, its bytes counted; a grader where Triton
    compiles must count the reference's too, or there is no budget to judge them by."""
    from grading.check import drive
    from grading.registry import get_check
    from infra_lib.kernels import triton_env

    registered = get_check("lab03.softmax_reads_once")
    inputs = registered.inputs(0)
    monkeypatch.setattr(triton_env, "interpreter_active", lambda: False)  # as on a GPU machine
    outcome = drive(registered, softmax_kernel, inputs)
    assert outcome.error is None, outcome.error
    for case, result in zip(inputs, outcome.data):
        assert result["interpreted"] is True
        assert result["bytes_loaded"] == result["bytes_stored"] == case["rows"] * case["cols"] * 4, (case, result)
        assert result["violations"] == []


def test_a_reference_record_without_byte_counts_is_named_as_the_graders_setup():
    """Counted bytes against a reference record that has none: a message about the grader's setup, not a
    KeyError reported as the learner's malformed result."""
    from grading.check import Outcome, drive, judge
    from grading.registry import get_check

    registered = get_check("lab03.softmax_reads_once")
    inputs = registered.inputs(0)
    counted = drive(registered, softmax_kernel, inputs).data
    uncounted = [{"interpreted": False, "violations": r["violations"], "out": r["out"]} for r in counted]
    verdict = judge(registered, Outcome(data=counted), Outcome(data=uncounted), inputs)
    assert not verdict.passed
    assert "the reference's were not" in verdict.what and "grade with TRITON_INTERPRET=1" in verdict.what, verdict
    assert "wrong form" not in verdict.what


_STATED = re.compile(
    r"\*\*atol = ([0-9.e-]+), rtol = ([0-9.e-]+)\*\*\s+in\s+Triton's\s+interpreter\s+and\s+"
    r"\*\*atol = ([0-9.e-]+), rtol = ([0-9.e-]+)\*\*\s+compiled\s+on\s+a\s+GPU"
)


def test_each_task_states_the_tolerances_its_value_checks_use():
    """Each task's text states, once and in the fixed form lab 15 uses, the atol and rtol of its kernel's
    value comparisons, interpreted and compiled: the numbers of the check module's table."""
    from grading.notebook import read_notebook

    texts = {
        cell.metadata["nbgrader"]["grade_id"]: cell.source
        for cell in read_notebook(REPO / "solutions" / "lab03_triton" / "lab03_triton.ipynb").cells
        if cell.cell_type == "markdown"
    }
    stated = {"task1_md": "softmax_kernel", "task2_md": "matmul_kernel", "task3_md": "rmsnorm_kernel"}
    assert set(stated.values()) == set(lab03.TOLERANCES)
    for grade_id, kernel in stated.items():
        found = _STATED.findall(texts[grade_id])
        assert len(found) == 1, f"{grade_id} should state its tolerances once, in the fixed form"
        tolerance = lab03.TOLERANCES[kernel]
        assert tuple(map(float, found[0])) == (
            tolerance.atol,
            tolerance.rtol,
            tolerance.gpu_atol,
            tolerance.gpu_rtol,
        ), (grade_id, found[0], tolerance)
        assert not re.search(r"within \d", texts[grade_id]), f"{grade_id} states a tolerance outside the fixed form"


def test_each_value_check_compares_with_its_kernels_tolerances_interpreted_and_compiled():
    """An output off by just over the stated atol + rtol × |reference| fails each value check, and one
    off by just under passes: interpreted when both sides were, compiled when either was not."""
    from grading.check import INTERACTIVE_SEED, Outcome, drive, judge
    from grading.registry import get_check
    from infra_lib.kernels.matmul import matmul_kernel as course_matmul
    from infra_lib.kernels.rmsnorm import rmsnorm_kernel

    for check_id, kernel, name in (
        ("lab03.softmax_odd_shapes", softmax_kernel, "softmax_kernel"),
        ("lab03.matmul_odd_shapes", course_matmul, "matmul_kernel"),
        ("lab03.rmsnorm_odd_shapes", rmsnorm_kernel, "rmsnorm_kernel"),
    ):
        registered = get_check(check_id)
        inputs = registered.inputs(INTERACTIVE_SEED)
        expected = drive(registered, kernel, inputs).data
        tolerance = lab03.TOLERANCES[name]
        for interpreted, atol, rtol in (
            (True, tolerance.atol, tolerance.rtol),
            (False, tolerance.gpu_atol, tolerance.gpu_rtol),
        ):
            reference = [{**r, "interpreted": interpreted} for r in expected]
            for factor, passes in ((0.9, True), (1.1, False)):
                shifted = [
                    {**r, "out": (_shift(r["out"], atol, rtol, factor) if i == len(reference) - 1 else r["out"])}
                    for i, r in enumerate(reference)
                ]
                verdict = judge(registered, Outcome(data=shifted), Outcome(data=reference), inputs)
                assert verdict.passed is passes, (check_id, interpreted, factor, verdict.what)


def _shift(values, atol: float, rtol: float, factor: float):
    """``values`` (nested lists) each moved up by ``factor`` × (atol + rtol × |value|)."""
    import numpy as np

    array = np.asarray(values, dtype=np.float64)
    return (array + factor * (atol + rtol * np.abs(array))).tolist()
