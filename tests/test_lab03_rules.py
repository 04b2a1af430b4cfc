"""Lab 03's stated rules that a check must hold: each kernel below breaks one rule of the lab's text and
nothing else; the check that holds the rule fails it with a message naming the rule, and the course's
kernel passes. Without a GPU the kernels run in Triton's interpreter, which also counts the bytes."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton ships wheels for Linux only")

from conftest import check_fails  # noqa: E402
from grading import check  # noqa: E402
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
    tl.store(out_ptr + tl.program_id(0) * out_row_stride + cols, tl.maximum(e / tl.sum(e, axis=0), 1e-12),
             mask=cols < n_cols)


@triton.jit
def matmul_storing_every_step(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                              stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside_c = (rows[:, None] < M) & (cols[None, :] < N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0)
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
