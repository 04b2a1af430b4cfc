"""Row-wise softmax in Triton: one fused kernel, the unfused three-pass version it replaces, and
an online version for rows longer than one block.

The fused kernel gives each row to one program: it loads the row once, keeps it in registers
while it finds the max, exponentiates and sums, and stores the result once. The three-pass
version is what running separate kernels costs: the row max, then the exp-sum, then the
normalisation, each reading the row again from memory. The online kernel (chapter 15) walks a
row block by block, keeping a running max and a running sum rescaled as the max grows, so a row
of any length is read twice and written once.
"""

from __future__ import annotations

import torch

from infra_lib.kernels.triton_env import load_triton, next_power_of_2, require_same_device, require_tensor

triton, tl = load_triton()

MAX_BLOCK = 1 << 16  # a whole row sits in one block: beyond this, registers spill on a GPU


@triton.jit
def softmax_kernel(out_ptr, in_ptr, n_cols, in_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """One program per row: out[row, :] = softmax(in[row, :]); BLOCK >= n_cols, a power of two."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    # Masked lanes read -inf: they never win the max and add exp(-inf) = 0 to the sum.
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=inside, other=-float("inf")).to(tl.float32)
    shifted = x - tl.max(x, axis=0)  # the largest logit becomes 0, so exp cannot overflow
    numerator = tl.exp(shifted)
    y = numerator / tl.sum(numerator, axis=0)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def row_max_kernel(max_ptr, in_ptr, n_cols, in_row_stride, BLOCK: tl.constexpr):
    """Pass 1 of 3: max_ptr[row] = max(in[row, :])."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
    tl.store(max_ptr + row, tl.max(x, axis=0))


@triton.jit
def exp_sum_kernel(sum_ptr, in_ptr, max_ptr, n_cols, in_row_stride, BLOCK: tl.constexpr):
    """Pass 2 of 3: sum_ptr[row] = sum(exp(in[row, :] - max[row]))."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
    row_max = tl.load(max_ptr + row)
    tl.store(sum_ptr + row, tl.sum(tl.exp(x - row_max), axis=0))


@triton.jit
def normalise_kernel(out_ptr, in_ptr, max_ptr, sum_ptr, n_cols, in_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Pass 3 of 3: out[row, :] = exp(in[row, :] - max[row]) / sum[row]."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=inside, other=-float("inf")).to(tl.float32)
    y = tl.exp(x - tl.load(max_ptr + row)) / tl.load(sum_ptr + row)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


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


def _check_rows(x: torch.Tensor, out: torch.Tensor | None, name: str = "x") -> tuple[torch.Tensor, int]:
    require_tensor(name, x, ndim=2, contiguous_last=True)
    if out is None:
        out = torch.empty_like(x)
    else:
        require_tensor("out", out, ndim=2, contiguous_last=True)
        require_same_device(**{name: x, "out": out})
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(
                f"out has shape {list(out.shape)} and dtype {out.dtype}; it must match {name}: "
                f"{list(x.shape)}, {x.dtype} (or pass out=None)"
            )
    block = next_power_of_2(x.shape[1])
    if block > MAX_BLOCK:
        raise ValueError(
            f"rows of {x.shape[1]} elements do not fit one block (at most {MAX_BLOCK}); "
            "split the row or use torch.softmax"
        )
    return out, block


def softmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dimension of a 2-D tensor, with the fused kernel.

    Args:
        x: [rows, cols] float32, float16 or bfloat16; stride 1 along the columns.
        out: optional [rows, cols] tensor of the same dtype to write into.

    Returns:
        [rows, cols], each row summing to 1 (computed in float32, stored in x's dtype).
    """
    out, block = _check_rows(x, out)
    softmax_kernel[(x.shape[0],)](out, x, x.shape[1], x.stride(0), out.stride(0), BLOCK=block)
    return out


def softmax_three_pass(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The same softmax as three kernels (row max, exp-sum, normalise): the unfused baseline.

    It reads x three times and writes two per-row float32 vectors in between, where the
    fused kernel reads x once.
    """
    out, block = _check_rows(x, out)
    rows, cols = x.shape
    row_max = torch.empty(rows, dtype=torch.float32, device=x.device)
    row_sum = torch.empty(rows, dtype=torch.float32, device=x.device)
    row_max_kernel[(rows,)](row_max, x, cols, x.stride(0), BLOCK=block)
    exp_sum_kernel[(rows,)](row_sum, x, row_max, cols, x.stride(0), BLOCK=block)
    normalise_kernel[(rows,)](out, x, row_max, row_sum, cols, x.stride(0), out.stride(0), BLOCK=block)
    return out


def softmax_bytes(rows: int, cols: int, element_size: int = 4, *, three_pass: bool = False) -> dict[str, int]:
    """The bytes each version must move: {"loaded": ..., "stored": ...}.

    Fused: the input once in, the output once out. Three-pass: the input three times, plus
    the per-row max (written once, read twice) and sum (written once, read once), in float32.
    """
    matrix = rows * cols * element_size
    if not three_pass:
        return {"loaded": matrix, "stored": matrix}
    return {"loaded": 3 * matrix + 3 * rows * 4, "stored": matrix + 2 * rows * 4}
