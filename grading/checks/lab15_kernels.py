"""Lab 15's reference kernels that the library does not hold under the lab's signatures: task 1's
online softmax, and task 4's signature over the library's fused 4-bit kernel.

Imported only when a check needs a reference (``grading.checks.lab15`` names them lazily), so that
loading the check registry imports no Triton.
"""

from __future__ import annotations

from infra_lib.kernels.gemv_q4 import q4_kernel
from infra_lib.kernels.triton_env import load_triton

triton, tl = load_triton()


@triton.jit
def online_softmax_kernel(out_ptr, in_ptr, n_cols, in_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """out[row] = softmax(in[row]) in two walks over the row's column blocks; grid (n_rows,).

    The first walk keeps the running max and the running sum of exp(x - max), rescaled when the max
    grows; the second writes exp(x - max) / sum. Bytes: the row loaded twice, stored once.
    """
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        x = tl.load(in_ptr + row * in_row_stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # only -inf so far: nothing to shift
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        running_max = new_max
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        x = tl.load(in_ptr + row * in_row_stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + cols, tl.exp(x - running_max) / running_sum, mask=cols < n_cols)


@triton.jit
def q4_gemv_kernel(x_ptr, packed_ptr, scales_ptr, y_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_ym,
                   GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[M, N] = x[M, K] @ W.T read from ``QuantLinear(bits=4)`` storage, through ``q4_kernel``: groups
    of GROUP weights, nibbles stored as q + 8, no minimum, no bias, one group per step;
    grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    q4_kernel(x_ptr, packed_ptr, scales_ptr, scales_ptr, scales_ptr, y_ptr, M, N, K, stride_xm, 1, stride_pn,
              GROUP // 2, 1, stride_sn, 1, stride_sn, 1, stride_ym, 1, GROUP, 8, False, False, False, BLOCK_M,
              BLOCK_N, 1, GROUP // 2)
