"""Tiled matrix multiplication in Triton: C = A @ B, one program per BLOCK_M x BLOCK_N tile of C.

Each program walks the K dimension in steps of BLOCK_K, loading a BLOCK_M x BLOCK_K tile of A
and a BLOCK_K x BLOCK_N tile of B, and accumulates their product in float32. Strides are
passed explicitly, so a transposed (non-contiguous) input needs no copy; masks cover the
edge tiles when a dimension is not a multiple of its block.
"""

from __future__ import annotations

import torch

from infra_lib.kernels.triton_env import interpreter_active, load_triton, require_same_device, require_tensor

triton, tl = load_triton()

CPU_BLOCK = 32  # the default tile edge in the interpreter: small tiles keep NumPy calls cheap


@triton.jit
def matmul_kernel(
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
    """C[M, N] = A[M, K] @ B[K, N]; grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a_tile = tl.load(
            a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        b_tile = tl.load(
            b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=(k[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )  # (BLOCK_K, BLOCK_N)
        acc = tl.dot(a_tile, b_tile, acc)  # zeros in the masked lanes add nothing
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, c, mask=(rows[:, None] < M) & (cols[None, :] < N)
    )


def _gpu_configs():
    shapes = [(128, 128, 32, 4, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4), (32, 64, 32, 2, 5)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for m, n, k, warps, stages in shapes
    ]


# On a GPU, the tile shape that runs fastest depends on the chip and the problem size:
# the autotuner times each config once per (M, N, K) and keeps the best.
matmul_kernel_autotuned = (
    None if interpreter_active() else triton.autotune(configs=_gpu_configs(), key=["M", "N", "K"])(matmul_kernel)
)


def check_block(name: str, value) -> int:
    """``value`` as a ``tl.dot`` tile size: a power of two (16 or more on a GPU), else a ValueError naming ``name``."""
    if type(value) is not int or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two (16, 32, 64, ...), got {value!r}")
    if value < 16 and not interpreter_active():
        raise ValueError(f"{name}={value}: tl.dot on a GPU needs tiles of at least 16; use {name}=16 or more")
    return value


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A @ B with the tiled kernel.

    Args:
        a: [M, K] and b: [K, N], the same float dtype and device; any strides.
        block_m, block_n, block_k: the tile shape (powers of two). All None: autotuned on a
            GPU, 32 x 32 x 32 in the interpreter.
        out: optional [M, N] tensor of a's dtype to write into.

    Returns:
        [M, N] in a's dtype, accumulated in float32.
    """
    require_tensor("a", a, ndim=2)
    require_tensor("b", b, ndim=2)
    require_same_device(a=a, b=b)
    if a.dtype != b.dtype:
        raise TypeError(f"a is {a.dtype} but b is {b.dtype}; convert one, e.g. b.to(a.dtype)")
    (m, k), (k_b, n) = a.shape, b.shape
    if k != k_b:
        raise ValueError(
            f"a is {list(a.shape)} and b is {list(b.shape)}: a's columns ({k}) must equal b's rows "
            f"({k_b}); did you mean b.T?"
        )
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    else:
        require_tensor("out", out, ndim=2)
        require_same_device(a=a, out=out)
        if list(out.shape) != [m, n] or out.dtype != a.dtype:
            raise ValueError(f"out has shape {list(out.shape)} and dtype {out.dtype}; expected [{m}, {n}], {a.dtype}")
    strides = (*a.stride(), *b.stride(), *out.stride())
    tuned = block_m is None and block_n is None and block_k is None and matmul_kernel_autotuned is not None
    if tuned:

        def grid(meta):
            return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])

        matmul_kernel_autotuned[grid](a, b, out, m, n, k, *strides)
        return out
    bm, bn, bk = (
        check_block(name, CPU_BLOCK if value is None else value)
        for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k))
    )
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    matmul_kernel[grid](a, b, out, m, n, k, *strides, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return out


def tiled_matmul_bytes(m: int, n: int, k: int, block_m: int, block_n: int, element_size: int = 4) -> dict[str, int]:
    """The bytes the tiled kernel moves: {"loaded": ..., "stored": ...}.

    Every tile-row of C re-reads its rows of A once per tile-column, and every tile-column
    re-reads its columns of B once per tile-row; C is written once. Bigger tiles, fewer re-reads.
    """
    row_tiles, col_tiles = -(-m // block_m), -(-n // block_n)
    return {"loaded": (m * k * col_tiles + k * n * row_tiles) * element_size, "stored": m * n * element_size}
