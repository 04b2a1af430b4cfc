"""Chapter 03's Triton kernels against torch, the out-of-bounds checker, and the traffic counter.

Without a GPU every kernel runs in Triton's interpreter, so the shapes are small; the same
tests compile the kernels on a GPU (the traffic counts need the interpreter: there they
are compared with a profiler instead, and those tests say so).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships wheels for Linux only")

from infra_lib.kernels.triton_env import (  # noqa: E402  (triton is imported through load_triton)
    interpreter_active,
    kernel_device,
    load_triton,
    next_power_of_2,
    require_same_device,
    require_tensor,
)

triton, tl = load_triton()

from infra_lib.kernels.matmul import matmul, matmul_kernel, tiled_matmul_bytes  # noqa: E402
from infra_lib.kernels.oob import BoundsReport, OutOfBoundsError, check_bounds  # noqa: E402
from infra_lib.kernels.rmsnorm import rmsnorm, rmsnorm_kernel  # noqa: E402
from infra_lib.kernels.softmax import softmax, softmax_bytes, softmax_kernel, softmax_three_pass  # noqa: E402
from infra_lib.kernels.traffic import Traffic, count_traffic, measure_traffic  # noqa: E402
from infra_lib.kernels.vector_add import add, add_kernel  # noqa: E402

DEVICE = kernel_device()
# tl.dot on a GPU rounds float32 inputs to tf32 by default; the interpreter computes in float32.
MATMUL_TOL = 1e-4 if interpreter_active() else 3e-2
needs_interpreter = pytest.mark.skipif(
    not interpreter_active(), reason="traffic is counted in the interpreter; on a GPU use Nsight Compute"
)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


# --- kernels deliberately written without masks, for the checker -----------------------------------


@triton.jit
def copy_no_masks(out_ptr, in_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(in_ptr + offsets))


@triton.jit
def copy_unmasked_store(out_ptr, in_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(in_ptr + offsets, mask=offsets < n, other=0.0))


@triton.jit
def shift_unmasked_load(out_ptr, in_ptr, n, BLOCK: tl.constexpr):
    """out[i] = in[i - 2] + in[i + 2]: reads two elements before and two after the input."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    left = tl.load(in_ptr + offsets - 2, mask=inside)
    right = tl.load(in_ptr + offsets + 2, mask=inside)
    tl.store(out_ptr + offsets, left + right, mask=inside)


@triton.jit
def softmax_no_load_mask(out_ptr, in_ptr, n_cols, in_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(in_ptr + row * in_row_stride + cols)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


# --- triton_env ------------------------------------------------------------------------------------


def test_load_triton_picks_the_interpreter_without_a_gpu():
    if not torch.cuda.is_available():
        assert interpreter_active() and os.environ["TRITON_INTERPRET"] == "1"
        assert DEVICE == torch.device("cpu")
    again = load_triton()
    assert again[0] is triton and again[1] is tl
    assert next_power_of_2(1) == 1 and next_power_of_2(211) == 256 and next_power_of_2(256) == 256


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only forced without a GPU")
def test_load_triton_recovers_when_torch_imported_triton_first():
    # importing torch._dynamo imports triton in compiled mode, before TRITON_INTERPRET is set
    script = (
        "import sys, torch, torch._dynamo; assert 'triton' in sys.modules\n"
        "from infra_lib.kernels.vector_add import add\n"
        "x = torch.arange(5.0); assert add(x, x).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@triton.jit
def scaled_index(out_ptr, scale, n, BLOCK: tl.constexpr):
    """out[i] = i * scale in int32 arithmetic (wraps around past 2**31 - 1)."""
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, offsets * scale + 7, mask=offsets < n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's options")
def test_skipping_the_interpreters_discarded_overflow_checks_changes_nothing():
    """load_triton turns off the overflow checks the interpreter computes and never asserts (its
    options never ask for debugging): an overflowing kernel gives the same wrapped result, and no
    error, with the checks on and off."""
    from dataclasses import replace

    from triton.runtime.interpreter import interpreter_builder

    options = interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow
    results = []
    try:
        for sanitize in (True, False):
            interpreter_builder.options = replace(options, sanitize_overflow=sanitize)
            out = torch.zeros(8, dtype=torch.int32)
            scaled_index[(1,)](out, 1_000_000_000, 8, BLOCK=8)
            results.append(out.tolist())
    finally:
        interpreter_builder.options = options
    wrapped = [((i * 1_000_000_000 + 7 + 2**31) % 2**32) - 2**31 for i in range(8)]
    assert results == [wrapped, wrapped]


@triton.jit
def _doubled_row_max(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    return 2 * tl.max(tl.load(x_ptr + offsets, mask=offsets < n, other=-float("inf")), axis=0)


@triton.jit
def helper_kernel(x_ptr, out_ptr, n, fail: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    best = _doubled_row_max(x_ptr + row * n, n, BLOCK)
    total = tl.sum(
        tl.where(
            tl.arange(0, BLOCK) < n,
            tl.load(x_ptr + row * n + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < n, other=0.0),
            0.0,
        ),
        axis=0,
    )
    if fail:
        tl.static_assert(BLOCK < 0, "a helper's error")
    tl.store(out_ptr + row, best + total)


def test_helpers_inside_a_launch_do_not_repatch_the_language_and_change_nothing(monkeypatch):
    """load_triton stops the interpreter swapping triton.language's builtins again at every call of
    a jitted helper inside a launch (tl.max and tl.sum are such helpers): a kernel with a helper of
    its own, flash attention and the fused softmax give bit-identical results, and the same error,
    with the interpreter's own helper calls; the language is swapped a few times per launch
    instead of at every call."""
    from triton.runtime import interpreter

    from infra_lib.kernels.flash_attention import flash_attention

    if not interpreter_active():
        pytest.skip("the interpreter is not in use (a GPU runs the kernels)")
    ours = interpreter.InterpretedFunction.__call__
    assert getattr(ours, "skips_repatching", False), "load_triton did not install the skip"
    swaps = []
    swap = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: swaps.append(fn) or swap(fn))
    torch.manual_seed(0)
    x = torch.randn(5, 37)
    q, k, v = torch.randn(1, 4, 24, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)

    def run() -> tuple[list, int, str]:
        swaps.clear()
        out = torch.empty(5)
        helper_kernel[(5,)](x, out, 37, fail=False, BLOCK=64)
        results = [out.clone(), *flash_attention(q, k, v, causal=True), softmax(x)]
        with pytest.raises(Exception) as failed:
            helper_kernel[(1,)](x, out, 37, fail=True, BLOCK=64)
        return results, len(swaps), str(failed.value)

    skipped, skipped_swaps, skipped_error = run()
    monkeypatch.setattr(interpreter.InterpretedFunction, "__call__", ours.interpreters_own)
    own, own_swaps, own_error = run()
    assert all(torch.equal(a, b) for a, b in zip(skipped, own))
    assert skipped_error == own_error and "a helper's error" in own_error
    assert skipped_swaps * 10 < own_swaps, (skipped_swaps, own_swaps)


def test_require_tensor_names_argument_value_and_fix():
    x = randn(3, 5)
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        require_tensor("x", [1.0])
    with pytest.raises(TypeError, match=r"x has dtype float64.*x.float\(\)"):
        require_tensor("x", x.double())
    with pytest.raises(ValueError, match=r"x must have 2 dimension\(s\), got shape \[15\]"):
        require_tensor("x", x.reshape(-1), ndim=2)
    with pytest.raises(ValueError, match=r"x is empty"):
        require_tensor("x", x[:0], ndim=2)
    with pytest.raises(ValueError, match=r"stride 5 along its last dimension.*x.contiguous\(\)"):
        require_tensor("x", x.t(), contiguous_last=True)
    with pytest.raises(ValueError, match=r"x is on meta, where Triton cannot run"):
        require_tensor("x", torch.empty(3, 5, device="meta"))
    with pytest.raises(ValueError, match=r"one device, got x on cpu, y on meta"):
        require_same_device(x=torch.empty(2), y=torch.empty(2, device="meta"))


# --- vector add -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 1000, 1025])
def test_add_matches_torch(n):
    x, y = randn(n, seed=1), randn(n, seed=2)
    assert torch.equal(add(x, y), x + y)


def test_add_errors():
    x = randn(4, 6)
    with pytest.raises(ValueError, match=r"x has shape \[4, 6\] but y has \[6\]"):
        add(x, randn(6))
    with pytest.raises(TypeError, match="x is torch.float32 but y is torch.float16"):
        add(x, x.half())
    with pytest.raises(ValueError, match=r"y is not contiguous"):
        add(x, randn(6, 4).t())
    with pytest.raises(ValueError, match="block must be a power of two, got 100"):
        add(x, x, block=100)


# --- softmax ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(37, 211), (1, 300), (64, 1), (1, 1), (5, 256)])
@pytest.mark.parametrize("version", [softmax, softmax_three_pass])
def test_softmax_matches_torch_on_odd_shapes(shape, version):
    x = randn(*shape, seed=3) * 3
    torch.testing.assert_close(version(x), torch.softmax(x, dim=1), atol=1e-6, rtol=1e-5)


def test_softmax_reads_rows_with_a_padded_stride_and_writes_into_out():
    wide = randn(37, 256, seed=4)
    x = wide[:, :211]  # row stride 256, 211 columns
    out = torch.full((37, 300), 7.0, device=DEVICE)[:, :211]
    assert softmax(x, out=out) is out
    torch.testing.assert_close(out, torch.softmax(x, dim=1), atol=1e-6, rtol=1e-5)


def test_softmax_extreme_logits_stay_finite():
    x = randn(6, 50, seed=5) * 1e4  # exp(1e4) overflows float32 without the max subtraction
    x[1, :] = 1e4  # every logit equal and huge
    x[2, 7:] = float("-inf")  # a row that is mostly -inf
    x[3, :] = float("-inf")
    x[3, 11] = -1e4  # one finite logit among -inf: probability 1 there
    for version in (softmax, softmax_three_pass):
        y = version(x)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, torch.softmax(x, dim=1), atol=1e-6, rtol=1e-5)
        assert y[3, 11] == 1.0 and y[2, 7:].eq(0).all()


def test_softmax_half_precision():
    x = randn(9, 77, seed=6, dtype=torch.float16)
    y = softmax(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), dim=1), atol=1e-3, rtol=1e-2)


def test_softmax_errors():
    with pytest.raises(ValueError, match=r"x must have 2 dimension\(s\), got shape \[2, 3, 4\]"):
        softmax(randn(2, 3, 4))
    with pytest.raises(TypeError, match="x has dtype int64"):
        softmax(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"stride 2 along its last dimension"):
        softmax(randn(3, 2).t())
    with pytest.raises(ValueError, match=r"out has shape \[3, 4\].*it must match x: \[3, 5\]"):
        softmax(randn(3, 5), out=randn(3, 4))


# --- matmul -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m, n, k, blocks",
    [(70, 50, 90, (32, 32, 32)), (1, 1, 1, (16, 16, 16)), (33, 17, 65, (16, 32, 16)), (64, 64, 64, (32, 32, 32))],
)
def test_matmul_matches_torch_on_odd_shapes(m, n, k, blocks):
    a, b = randn(m, k, seed=7), randn(k, n, seed=8)
    c = matmul(a, b, block_m=blocks[0], block_n=blocks[1], block_k=blocks[2])
    torch.testing.assert_close(c, a @ b, atol=MATMUL_TOL, rtol=MATMUL_TOL)


def test_matmul_transposed_inputs_through_strides():
    a_t, b_t = randn(90, 70, seed=9), randn(50, 90, seed=10)
    a, b = a_t.t(), b_t.t()  # non-contiguous: strides (1, 70) and (1, 90)
    out = torch.empty(50, 70, device=DEVICE).t()  # a transposed output too
    assert matmul(a, b, block_m=32, block_n=16, block_k=32, out=out) is out
    torch.testing.assert_close(out, a @ b, atol=MATMUL_TOL, rtol=MATMUL_TOL)


def test_matmul_default_blocks_and_half_precision():
    a, b = randn(40, 24, seed=11, dtype=torch.float16), randn(24, 33, seed=12, dtype=torch.float16)
    c = matmul(a, b)
    assert c.dtype == torch.float16
    torch.testing.assert_close(c.float(), a.float() @ b.float(), atol=1e-2, rtol=1e-2)


def test_matmul_errors():
    a = randn(4, 6)
    with pytest.raises(ValueError, match=r"a's columns \(6\) must equal b's rows \(5\)"):
        matmul(a, randn(5, 3))
    with pytest.raises(TypeError, match="a is torch.float32 but b is torch.float16"):
        matmul(a, randn(6, 3).half())
    with pytest.raises(ValueError, match=r"b must have 2 dimension\(s\)"):
        matmul(a, randn(6))
    with pytest.raises(ValueError, match="block_k must be a power of two .* got 24"):
        matmul(a, randn(6, 3), block_m=32, block_n=32, block_k=24)
    with pytest.raises(ValueError, match=r"out has shape \[4, 4\]"):
        matmul(a, randn(6, 3), out=randn(4, 4))


# --- rmsnorm ----------------------------------------------------------------------------------------


def rmsnorm_torch(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("shape, eps", [((37, 211), 1e-5), ((1, 1), 1e-6), ((8, 576), 1e-5), ((3, 64), 0.5)])
def test_rmsnorm_matches_torch(shape, eps):
    x, w = randn(*shape, seed=13), randn(shape[1], seed=14)
    torch.testing.assert_close(rmsnorm(x, w, eps), rmsnorm_torch(x, w, eps), atol=1e-5, rtol=1e-5)


def test_rmsnorm_errors():
    x = randn(3, 5)
    with pytest.raises(ValueError, match=r"weight has 4 elements but x has 5 columns"):
        rmsnorm(x, randn(4))
    with pytest.raises(TypeError, match="weight is torch.float16 but x is torch.float32"):
        rmsnorm(x, randn(5).half())
    with pytest.raises(ValueError, match="eps must be a positive number"):
        rmsnorm(x, randn(5), eps=0.0)
    with pytest.raises(ValueError, match=r"weight must have 1 dimension\(s\)"):
        rmsnorm(x, randn(1, 5))


# --- out-of-bounds checker --------------------------------------------------------------------------


def test_check_bounds_passes_masked_kernels_and_returns_their_results():
    x, y = randn(100, seed=15), randn(100, seed=16)
    out = torch.empty(100, device=DEVICE)
    report = check_bounds(add_kernel, (1,), x, y, out, 100, BLOCK=128)
    assert isinstance(report, BoundsReport) and report.clean and report.launches == 1
    assert torch.equal(out, x + y)  # the results land in the caller's tensor

    wide = randn(37, 256, seed=17)
    x2, out2 = wide[:, :211], torch.empty(37, 211, device=DEVICE)
    assert check_bounds(softmax_kernel, (37,), out2, x2, 211, 256, 211, BLOCK=256).clean
    torch.testing.assert_close(out2, torch.softmax(x2, dim=1), atol=1e-6, rtol=1e-5)

    w = randn(211, seed=18)
    assert check_bounds(rmsnorm_kernel, (37,), out2, x2, w, 211, 256, 211, 1e-5, BLOCK=256).clean

    a, b = randn(90, 70, seed=19).t(), randn(90, 50, seed=20)
    c = torch.empty(70, 50, device=DEVICE)
    assert check_bounds(
        matmul_kernel,
        (3, 2),
        a,
        b,
        c,
        70,
        50,
        90,
        *a.stride(),
        *b.stride(),
        *c.stride(),
        BLOCK_M=32,
        BLOCK_N=32,
        BLOCK_K=32,
    ).clean
    torch.testing.assert_close(c, a @ b, atol=MATMUL_TOL, rtol=MATMUL_TOL)


def test_check_bounds_catches_an_unmasked_store():
    x, out = randn(100, seed=21), torch.zeros(100, device=DEVICE)
    with pytest.raises(OutOfBoundsError) as caught:
        check_bounds(copy_unmasked_store, (1,), out, x, 100, BLOCK=128)
    (violation,) = caught.value.report.violations
    assert (violation.kind, violation.argument, violation.side, violation.elements) == ("store", "out_ptr", "after", 28)
    assert "28 element(s) written after the end of `out_ptr`" in str(caught.value)
    assert torch.equal(out, x)  # the in-range part still arrives


def test_check_bounds_catches_unmasked_loads_on_both_sides():
    x, out = randn(100, seed=22), torch.zeros(100, device=DEVICE)
    report = check_bounds(shift_unmasked_load, (1,), out, x, 100, BLOCK=128, raise_on_error=False)
    assert not report.clean
    found = {(v.kind, v.argument, v.side): (v.elements, v.poisoned) for v in report.violations}
    # out[0], out[1] read in[-2], in[-1]; out[98], out[99] read in[100], in[101]
    assert found == {("load", "in_ptr", "before"): (2, ("out_ptr",)), ("load", "in_ptr", "after"): (2, ("out_ptr",))}
    assert "the kernel read before the start of `in_ptr`" in str(report)


def test_check_bounds_catches_both_sides_of_a_kernel_without_masks():
    x, out = randn(100, seed=23), torch.zeros(100, device=DEVICE)
    report = check_bounds(copy_no_masks, (1,), out, x, 100, BLOCK=128, raise_on_error=False)
    kinds = {(v.kind, v.argument, v.side) for v in report.violations}
    assert ("store", "out_ptr", "after") in kinds
    # the 28 NaN loaded past in_ptr's end were stored past out_ptr's end, where they change its canary


def test_check_bounds_sees_reads_into_the_gaps_of_a_strided_tensor():
    wide = randn(5, 64, seed=24)
    x, out = wide[:, :37], torch.empty(5, 37, device=DEVICE)
    report = check_bounds(softmax_no_load_mask, (5,), out, x, 37, 64, 37, BLOCK=64, raise_on_error=False)
    sides = {(v.kind, v.argument, v.side) for v in report.violations}
    assert ("load", "in_ptr", "between") in sides and ("load", "in_ptr", "after") in sides
    assert all(v.poisoned == ("out_ptr",) for v in report.violations)


def test_check_bounds_refuses_overlapping_and_broadcast_tensors():
    base = randn(200, seed=25)
    with pytest.raises(ValueError, match="`out_ptr` and `in_ptr` overlap"):
        check_bounds(copy_unmasked_store, (1,), base[:100], base[50:150], 100, BLOCK=128)
    with pytest.raises(ValueError, match="`in_ptr` is broadcast"):
        check_bounds(copy_unmasked_store, (1,), base[:100], randn(1, seed=26).expand(100), 100, BLOCK=128)


# --- traffic ----------------------------------------------------------------------------------------


@needs_interpreter
def test_fused_softmax_reads_and_writes_the_matrix_once():
    x = randn(64, 300, seed=27)
    with count_traffic() as fused:
        softmax(x)
    assert (fused.bytes_loaded, fused.bytes_stored) == (76_800, 76_800)  # 64 * 300 * 4 bytes, each way
    assert (fused.loads, fused.stores, fused.flops) == (64, 64, 0)
    assert softmax_bytes(64, 300) == {"loaded": 76_800, "stored": 76_800}


@needs_interpreter
def test_three_pass_softmax_reads_the_matrix_three_times():
    x = randn(64, 300, seed=28)
    with count_traffic() as unfused:
        softmax_three_pass(x)
    # x three times (3 * 76_800), the row max twice and the row sum once (3 * 64 * 4)
    assert unfused.bytes_loaded == 231_168
    # the output (76_800), then the row max and the row sum (2 * 64 * 4)
    assert unfused.bytes_stored == 77_312
    assert softmax_bytes(64, 300, three_pass=True) == {"loaded": 231_168, "stored": 77_312}
    assert unfused.bytes_loaded / 76_800 == pytest.approx(3.01)


@needs_interpreter
def test_matmul_flops_and_bytes():
    a, b = randn(64, 64, seed=29), randn(64, 64, seed=30)
    c = torch.empty(64, 64, device=DEVICE)
    exact = measure_traffic(
        matmul_kernel, (2, 2), a, b, c, 64, 64, 64, 64, 1, 64, 1, 64, 1, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32
    )
    assert exact.flops == 2 * 64 * 64 * 64
    assert exact.bytes_loaded == tiled_matmul_bytes(64, 64, 64, 32, 32)["loaded"] == 2 * 64 * 64 * 4 * 2
    assert exact.intensity == pytest.approx(exact.flops / (exact.bytes_loaded + exact.bytes_stored))

    a, b = randn(70, 90, seed=31), randn(90, 50, seed=32)
    with count_traffic() as odd:
        matmul(a, b, block_m=32, block_n=32, block_k=32)
    # tl.dot computes whole tiles: M, N, K rounded up to 96, 64, 96; the masked loads move only real data
    assert odd.flops == 2 * 96 * 64 * 96
    assert odd.bytes_loaded == tiled_matmul_bytes(70, 50, 90, 32, 32)["loaded"] == (70 * 90 * 2 + 90 * 50 * 3) * 4
    assert odd.bytes_stored == 70 * 50 * 4


@needs_interpreter
def test_count_traffic_nests_and_restores_the_interpreter():
    from triton.runtime.interpreter import interpreter_builder

    x = randn(4, 10, seed=33)
    with count_traffic() as outer:
        softmax(x)
        with count_traffic() as inner:
            softmax(x)
    assert inner == Traffic(160, 160, 0, 4, 4, {"in_ptr": 160}, {"out_ptr": 160})
    assert outer == Traffic(320, 320, 0, 8, 8, {"in_ptr": 320}, {"out_ptr": 320})
    assert "create_masked_load" not in vars(interpreter_builder)
    from triton.runtime.interpreter import GridExecutor

    assert GridExecutor._init_args_hst.__name__ == "_init_args_hst"  # the launch hook is gone too
    with count_traffic() as after:
        pass
    assert after.intensity == 0.0


# --- lab 03's checks, on kernels a learner might write -----------------------------------------------


@triton.jit
def softmax_reading_three_times(out_ptr, in_ptr, n_cols, in_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    where = in_ptr + row * in_row_stride + cols
    row_max = tl.max(tl.load(where, mask=inside, other=-float("inf")), axis=0)
    total = tl.sum(tl.exp(tl.load(where, mask=inside, other=-float("inf")) - row_max), axis=0)
    y = tl.exp(tl.load(where, mask=inside, other=-float("inf")) - row_max) / total
    tl.store(out_ptr + row * out_row_stride + cols, y, mask=inside)


@triton.jit
def softmax_stub(out_ptr, in_ptr, n_cols, in_row_stride, out_row_stride, BLOCK: tl.constexpr):
    raise NotImplementedError("lab03 task 1: softmax_kernel")


def lab03_verdict(check_id: str, kernel):
    import grading.checks.lab03  # noqa: F401  (registers the checks)
    from grading.check import INTERACTIVE_SEED, drive, judge
    from grading.registry import get_check

    registered = get_check(check_id)
    inputs = registered.inputs(INTERACTIVE_SEED)
    return judge(
        registered, drive(registered, kernel, inputs), drive(registered, registered.reference(), inputs), inputs
    )


def test_lab03_reference_kernels_pass_their_checks():
    for check_id, kernel in (
        ("lab03.softmax_odd_shapes", softmax_kernel),
        ("lab03.matmul_strided", matmul_kernel),
        ("lab03.rmsnorm_in_bounds", rmsnorm_kernel),
    ):
        assert lab03_verdict(check_id, kernel).passed, check_id


def test_lab03_names_the_argument_and_side_a_missing_mask_overruns():
    verdict = lab03_verdict("lab03.softmax_in_bounds", softmax_no_load_mask)
    assert not verdict.passed
    assert verdict.what.startswith("softmax_kernel loaded past the end of `in_ptr`")  # shown even when hidden
    assert "in the gaps between the rows of `in_ptr`" in verdict.detail and "grid (" in verdict.detail


@needs_interpreter
def test_lab03_counts_the_bytes_an_unfused_softmax_reads():
    verdict = lab03_verdict("lab03.softmax_reads_once", softmax_reading_three_times)
    assert not verdict.passed
    assert verdict.what == "softmax_kernel loads more bytes than it needs from `in_ptr` (its output is right)"
    assert verdict.kind == "excess traffic"
    found = re.search(r"counted ([\d,]+) bytes, the budget is ([\d,]+)", verdict.detail)
    counted, budget = (int(n.replace(",", "")) for n in found.groups())
    assert counted == 3 * budget
    per_argument = re.search(r"([\d,]+) bytes from `in_ptr`, the reference loads ([\d,]+)", verdict.detail)
    assert [int(n.replace(",", "")) for n in per_argument.groups()] == [counted, budget]  # in_ptr is all it loads


@needs_interpreter
def test_count_traffic_splits_the_bytes_by_argument():
    x, w = randn(5, 100), randn(100, seed=1)
    out = torch.empty_like(x)
    with count_traffic() as traffic:
        rmsnorm_kernel[(5,)](out, x, w, 100, 100, 100, 1e-5, BLOCK=128)
    assert traffic.loaded_from == {"x_ptr": 5 * 100 * 4, "w_ptr": 5 * 100 * 4}
    assert traffic.stored_to == {"out_ptr": 5 * 100 * 4}


def test_lab03_stub_fails_with_its_task_name():
    verdict = lab03_verdict("lab03.softmax_odd_shapes", softmax_stub)
    assert verdict.kind == "error" and "NotImplementedError: lab03 task 1: softmax_kernel" in verdict.what


# --- typical mistakes in lab 03: each fails its own checks, with the hint written for it ------------


@triton.jit
def softmax_without_max(out_ptr, in_ptr, n_cols, in_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=inside, other=-float("inf"))
    e = tl.exp(x)  # no shift by the row's max: fine for small logits, inf for large ones
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=inside)


@triton.jit
def matmul_unmasked_store(
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
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
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
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc)  # the edge tiles overrun C


@triton.jit
def matmul_unmasked_last_k(
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
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks  # the last step along K hangs over A's rows and B's columns: no mask on k
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak, mask=rows[:, None] < M, other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn, mask=cols[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
        acc,
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


@triton.jit
def matmul_reading_rows_past_m(
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
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks  # A is masked along K only: rows past M are read, and only feed rows of C never stored
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak, mask=k[None, :] < K, other=0.0)
        b = tl.load(
            b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=(k[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, b, acc)
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
        acc,
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


@pytest.mark.filterwarnings("ignore:overflow encountered in exp", "ignore:invalid value encountered in divide")
def test_lab03_a_softmax_without_the_max_passes_plain_logits_and_fails_extreme_ones_with_the_overflow_hint():
    from grading.checks.lab03.task1_softmax import SOFTMAX_NAN_HINT

    assert lab03_verdict("lab03.softmax_odd_shapes", softmax_without_max).passed
    verdict = lab03_verdict("lab03.softmax_extreme_values", softmax_without_max)
    assert not verdict.passed and verdict.kind == "wrong result"
    assert "NaN or inf where the result is finite" in verdict.what and verdict.hint == SOFTMAX_NAN_HINT


def test_lab03_an_unmasked_store_is_named_with_the_store_hint_for_c():
    """Every matmul check it fails names the store past C and gives the store's hint, not the check's own
    (the strided check's "transposed views", the block-shapes check's grid axes)."""
    from grading.registry import get_check

    verdict = lab03_verdict("lab03.matmul_in_bounds", matmul_unmasked_store)
    assert not verdict.passed and verdict.what.startswith("matmul_kernel stored") and "`c_ptr`" in verdict.what
    assert verdict.hint.startswith("a store reached lanes outside `c_ptr`")
    failed = []
    for check_id in (
        "lab03.matmul_odd_shapes",
        "lab03.matmul_strided",
        "lab03.matmul_block_shapes",
        "lab03.matmul_traffic",
    ):
        verdict = lab03_verdict(check_id, matmul_unmasked_store)
        if verdict.passed:
            continue
        failed.append(check_id)
        assert "`c_ptr`" in verdict.what, check_id
        assert verdict.hint.startswith("a store reached lanes outside `c_ptr`"), check_id
        message = verdict.message(get_check(check_id), hidden=True)
        assert "transposed views" not in message and "grid axis" not in message, check_id
    assert {"lab03.matmul_odd_shapes", "lab03.matmul_strided", "lab03.matmul_block_shapes"} <= set(failed)


def test_lab03_an_unmasked_last_k_step_is_named_as_a_load_of_a_or_b():
    verdict = lab03_verdict("lab03.matmul_odd_shapes", matmul_unmasked_last_k)
    assert not verdict.passed and verdict.what.startswith("matmul_kernel loaded")
    argument = re.search(r"`(\w+)`", verdict.what).group(1)
    assert argument in ("a_ptr", "b_ptr") and verdict.hint.startswith(f"a load reached lanes outside `{argument}`")


@needs_interpreter
def test_lab03_reading_rows_of_a_past_m_is_excess_traffic_not_a_wrong_result():
    """Its output is right (the rows it reads past M only feed rows of C it never stores), so only
    the traffic check fails, labelled as traffic, with the check's own hint about masking A's rows."""
    from grading.registry import get_check

    for check_id in ("lab03.matmul_odd_shapes", "lab03.matmul_strided", "lab03.matmul_in_bounds"):
        assert lab03_verdict(check_id, matmul_reading_rows_past_m).passed, check_id
    verdict = lab03_verdict("lab03.matmul_traffic", matmul_reading_rows_past_m)
    assert not verdict.passed and verdict.kind == "excess traffic"
    assert verdict.what == "matmul_kernel loads more bytes than it needs from `a_ptr` (its output is right)"
    assert re.search(r"[\d,]+ bytes from `a_ptr`, the reference loads [\d,]+", verdict.detail)
    assert "`b_ptr`" not in verdict.detail  # B is masked along both of its axes
    message = verdict.message(get_check("lab03.matmul_traffic"), hidden=True)
    assert "(excess traffic)" in message and "rows past M" in message and "columns past N" not in message


@triton.jit
def rmsnorm_unmasked_weights(out_ptr, x_ptr, w_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0)
    w = tl.load(w_ptr + cols)  # no mask: the lanes past n_cols read past w, and only feed lanes never stored
    y = x / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps) * w
    tl.store(out_ptr + row * out_row_stride + cols, y, mask=inside)


@needs_interpreter
def test_lab03_an_unmasked_weight_load_is_excess_traffic_from_w():
    from grading.checks.lab03.task3_rmsnorm import RMSNORM_EXCESS_HINTS

    assert lab03_verdict("lab03.rmsnorm_odd_shapes", rmsnorm_unmasked_weights).passed
    verdict = lab03_verdict("lab03.rmsnorm_in_bounds", rmsnorm_unmasked_weights)
    assert not verdict.passed and verdict.kind == "excess traffic"
    assert verdict.what == "rmsnorm_kernel loads more bytes than it needs from `w_ptr` (its output is right)"
    assert "`x_ptr`" not in verdict.detail and verdict.hint == RMSNORM_EXCESS_HINTS["w_ptr"]


_MATMUL_ALL = {
    "lab03.matmul_odd_shapes",
    "lab03.matmul_strided",
    "lab03.matmul_block_shapes",
    "lab03.matmul_in_bounds",
    "lab03.matmul_traffic",
}


@pytest.mark.filterwarnings("ignore:overflow encountered in exp", "ignore:invalid value encountered in divide")
@pytest.mark.parametrize(
    "kernel, task, loses",
    [
        (softmax_without_max, 1, {"lab03.softmax_extreme_values"}),
        (matmul_unmasked_store, 2, _MATMUL_ALL),  # every launch stores past C
        (matmul_unmasked_last_k, 2, _MATMUL_ALL),
        pytest.param(matmul_reading_rows_past_m, 2, {"lab03.matmul_traffic"}, marks=needs_interpreter),
        pytest.param(rmsnorm_unmasked_weights, 3, {"lab03.rmsnorm_in_bounds"}, marks=needs_interpreter),
    ],
    ids=["no max shift", "unmasked store", "unmasked last K", "rows of A past M", "unmasked weights"],
)
def test_lab03_a_typical_mistake_loses_exactly_the_checks_that_see_it(kernel, task, loses):
    """Among its task's checks (each task is one kernel, so no other task's are touched), a mistake fails
    those that can see it and passes the rest: its output right where only the bytes or the extreme
    values show it."""
    from grading.registry import all_checks

    ids = {c for c, registered in all_checks().items() if registered.task.startswith(f"lab03 task {task}:")}
    assert loses <= ids
    assert {c for c in ids if not lab03_verdict(c, kernel).passed} == loses


def test_lab03_counts_a_compiled_kernels_bytes_in_a_child_interpreter_the_same_as_in_process():
    """Where Triton compiles, lab 03 counts the reference kernel's bytes in a child Python that sees no
    GPU: that child (its command line, the request naming the setup and the kernel as "module:name",
    the result file) must give what an in-process interpreted drive gives, case for case."""
    import random

    from grading.checks.lab03 import kernel_launch, task1_softmax

    cases = task1_softmax._softmax_traffic_cases(random.Random(3))
    in_process = kernel_launch.driver("softmax_kernel", task1_softmax.softmax_setup, count_traffic=True)(
        softmax_kernel, cases
    )
    assert all(result["interpreted"] and result["bytes_loaded"] > 0 for result in in_process)
    in_child = kernel_launch._drive_interpreted(
        "softmax_kernel", task1_softmax.softmax_setup, "infra_lib.kernels.softmax:softmax_kernel", cases
    )
    assert in_child == json.loads(json.dumps(in_process))  # the child's result comes back as JSON
