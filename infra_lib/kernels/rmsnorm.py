"""Fused RMSNorm in Triton: y = x / sqrt(mean(x^2) + eps) * weight, one program per row.

In plain torch this is four kernels (square, mean, rsqrt-multiply, weight-multiply), each a
round trip through memory; fused, each row is read once and written once.
"""

from __future__ import annotations

import math

import torch

from infra_lib.kernels.triton_env import load_triton, next_power_of_2, require_same_device, require_tensor

triton, tl = load_triton()


@triton.jit
def rmsnorm_kernel(out_ptr, x_ptr, w_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    """One program per row: out[row, :] = x[row, :] / sqrt(mean(x[row, :]^2) + eps) * w."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols  # masked lanes are 0: they add nothing
    y = x * (1.0 / tl.sqrt(mean_square + eps)) * w
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dimension with the fused kernel (computed in float32).

    Args:
        x: [rows, cols] float tensor, stride 1 along the columns.
        weight: [cols], the same dtype and device.
        eps: added to the mean square before the square root, > 0.

    Returns:
        [rows, cols] in x's dtype.
    """
    require_tensor("x", x, ndim=2, contiguous_last=True)
    require_tensor("weight", weight, ndim=1, contiguous_last=True)
    require_same_device(x=x, weight=weight)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"weight has {weight.shape[0]} elements but x has {x.shape[1]} columns (shape "
            f"{list(x.shape)}); they must match"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"weight is {weight.dtype} but x is {x.dtype}; convert it with weight.to(x.dtype)")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0 or math.isinf(eps):
        raise ValueError(f"eps must be a positive number such as 1e-5, got {eps!r}")
    out = torch.empty_like(x)
    rows, cols = x.shape
    rmsnorm_kernel[(rows,)](out, x, weight, cols, x.stride(0), out.stride(0), float(eps), BLOCK=next_power_of_2(cols))
    return out
