"""Fused 4-bit GEMV / skinny GEMM in Triton: y = x @ W.T read straight from 4-bit storage.

Decoding one token multiplies a few rows of activations by every weight of the model once, so
its time is the time to read the weights. ``QuantLinear`` and ``Q4_1Linear`` store them in about
half a byte each, but their forward writes a float copy of the whole weight before the matmul
reads it again. These kernels read the packed bytes and scales as stored, turn the nibbles into
numbers in registers, and multiply: no dequantised weight ever reaches memory.

One kernel serves both formats (its constexpr flags pick the layout, so each format compiles to
its own kernel). Each program owns a BLOCK_M x BLOCK_N tile of y and walks k a few groups at a
time: it loads their bytes, splits every byte into its two nibbles, scales them (and adds the
Q4_1 minimum) in registers, and multiplies the two [k-step / 2, BLOCK_N] weight tiles by the x
columns they pair with, accumulating in float32. Masks cover the edge tiles of n and the last
k-step when the groups do not fill it; k itself must be a whole number of groups.

``q4_gemv_kernel`` is the same kernel under a narrower signature (``QuantLinear(bits=4)`` storage only,
one group per k-step): the one chapter 15's exercise asks for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from infra_lib.kernels.triton_env import (
    FLOAT_DTYPES,
    interpreter_active,
    load_triton,
    next_power_of_2,
    require_same_device,
    require_tensor,
)

triton, tl = load_triton()

Q4_1_BLOCK = 32  # weights per GGUF Q4_1 block
DECODE_ROWS = 16  # inputs with at most this many rows take the fused path in use_fused_q4
STEP_BYTES = 128  # packed bytes per weight row that one k-step reads (256 weights), by default


@triton.jit
def q4_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    min_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_qg,
    stride_qp,
    stride_sn,
    stride_sg,
    stride_mn,
    stride_mg,
    stride_ym,
    stride_yn,
    GROUP: tl.constexpr,
    ZERO: tl.constexpr,
    HALVES: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """y[M, N] = x[M, K] @ W.T, W read from 4-bit groups; grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).

    Weight k of a row, in group g = k // GROUP, is scale[g] * (nibble - ZERO), plus min[g] with
    HAS_MIN. Byte p of a group (at q + g * stride_qg + p * stride_qp) holds two weights: 2p in its
    low nibble and 2p + 1 in its high one, or with HALVES, p and p + GROUP / 2. A k-step covers
    GROUPS groups: BLOCK_HALF >= GROUP / 2 bytes of each, the lanes past GROUP / 2 masked.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output features
    lane = tl.arange(0, GROUPS * BLOCK_HALF)  # (R,) = (GROUPS * BLOCK_HALF,): the bytes of one k-step
    group, pair = lane // BLOCK_HALF, lane % BLOCK_HALF
    if HALVES:
        low_k, high_k = group * GROUP + pair, group * GROUP + pair + GROUP // 2
    else:
        low_k, high_k = group * GROUP + 2 * pair, group * GROUP + 2 * pair + 1
    step_groups = tl.arange(0, GROUPS)
    q_ptrs = q_ptr + group[:, None] * stride_qg + pair[:, None] * stride_qp + cols[None, :] * stride_qn  # (R, BLOCK_N)
    low_ptrs = x_ptr + rows[:, None] * stride_xm + low_k[None, :] * stride_xk  # (BLOCK_M, R)
    high_ptrs = x_ptr + rows[:, None] * stride_xm + high_k[None, :] * stride_xk
    scale_ptrs = scale_ptr + step_groups[:, None] * stride_sg + cols[None, :] * stride_sn  # (GROUPS, BLOCK_N)
    min_ptrs = min_ptr + step_groups[:, None] * stride_mg + cols[None, :] * stride_mn
    n_groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, n_groups, GROUPS):
        in_k = (g0 + group < n_groups) & (pair < GROUP // 2)  # (R,)
        byte = tl.load(q_ptrs, mask=in_k[:, None] & (cols[None, :] < N), other=0)  # (R, BLOCK_N) uint8
        x_low = tl.load(low_ptrs, mask=(rows[:, None] < M) & in_k[None, :], other=0.0)  # (BLOCK_M, R)
        x_high = tl.load(high_ptrs, mask=(rows[:, None] < M) & in_k[None, :], other=0.0)
        group_in = (g0 + step_groups[:, None] < n_groups) & (cols[None, :] < N)  # (GROUPS, BLOCK_N)
        scale = tl.load(scale_ptrs, mask=group_in, other=0.0).to(tl.float32)[:, None, :]  # (GROUPS, 1, BLOCK_N)
        # dequantise in registers: (GROUPS, BLOCK_HALF, BLOCK_N) tiles, one scale per group and column
        low = tl.reshape((byte & 0xF).to(tl.float32) - ZERO, (GROUPS, BLOCK_HALF, BLOCK_N)) * scale
        high = tl.reshape((byte >> 4).to(tl.float32) - ZERO, (GROUPS, BLOCK_HALF, BLOCK_N)) * scale
        if HAS_MIN:
            minimum = tl.load(min_ptrs, mask=group_in, other=0.0).to(tl.float32)[:, None, :]
            low, high = low + minimum, high + minimum
        w_low = tl.reshape(low, (GROUPS * BLOCK_HALF, BLOCK_N)).to(x_low.dtype)  # (R, BLOCK_N), as x @ W.T needs
        w_high = tl.reshape(high, (GROUPS * BLOCK_HALF, BLOCK_N)).to(x_low.dtype)
        acc = tl.dot(x_low, w_low, acc, input_precision="ieee")  # zeros in masked x lanes add nothing
        acc = tl.dot(x_high, w_high, acc, input_precision="ieee")
        q_ptrs += GROUPS * stride_qg
        low_ptrs += GROUPS * GROUP * stride_xk
        high_ptrs += GROUPS * GROUP * stride_xk
        scale_ptrs += GROUPS * stride_sg
        min_ptrs += GROUPS * stride_mg
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


@triton.jit
def q4_gemv_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[M, N] = x[M, K] @ W.T read from ``QuantLinear(bits=4)`` storage, through ``q4_kernel``: groups
    of GROUP weights, nibbles stored as q + 8, no minimum, no bias, one group per step;
    grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    q4_kernel(
        x_ptr,
        packed_ptr,
        scales_ptr,
        scales_ptr,
        scales_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        1,
        stride_pn,
        GROUP // 2,
        1,
        stride_sn,
        1,
        stride_sn,
        1,
        stride_ym,
        1,
        GROUP,
        8,
        False,
        False,
        False,
        BLOCK_M,
        BLOCK_N,
        1,
        GROUP // 2,
    )


def _power_of_two(name: str, value, floor: int) -> int:
    if type(value) is not int or value < floor or value & (value - 1):
        raise ValueError(f"{name} must be a power of two of at least {floor}, got {value!r}")
    return value


def tile_shape(m: int, block_n: int | None = None) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` for ``m`` rows: a GPU's tl.dot needs 16 or more, the interpreter fits m."""
    floor = 1 if interpreter_active() else 16
    block_n = _power_of_two("block_n", 64 if block_n is None else block_n, floor)
    return max(floor, min(16, next_power_of_2(m))), block_n


def _require_packed(name: str, value, ndim: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.dtype != torch.uint8:
        raise TypeError(
            f"{name} has dtype {str(value.dtype).replace('torch.', '')}; it must be uint8, two 4-bit "
            "weights per byte, as stored"
        )
    return require_tensor(name, value, ndim=ndim, dtypes=(torch.uint8,))


@dataclass
class Launch:
    """One kernel launch, checked and ready: ``launch()`` runs it and returns ``out``.

    Tests hand its parts to ``check_bounds(launch.kernel, launch.grid, *launch.args, **launch.meta)``.
    """

    kernel: object
    grid: tuple[int, int]
    args: tuple
    meta: dict = field(default_factory=dict)
    out: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        self.kernel[self.grid](*self.args, **self.meta)
        return self.out


def _launch(
    x, q, q_strides, scales, minimum, bias, *, group_size: int, zero: int, halves: bool, block_n, k_groups
) -> Launch:
    """The launch of ``q4_kernel`` for checked inputs; ``q_strides`` = (row, group, byte in group)."""
    (m, k), n = x.shape, q.shape[0]
    block_m, block_n = tile_shape(m, block_n)
    half = max(1 if interpreter_active() else 16, next_power_of_2(group_size // 2))
    if k_groups is None:
        k_groups = min(next_power_of_2(k // group_size), max(1, STEP_BYTES // half))
    _power_of_two("k_groups", k_groups, 1)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    meta = dict(
        GROUP=group_size,
        ZERO=zero,
        HALVES=halves,
        HAS_MIN=minimum is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        GROUPS=k_groups,
        BLOCK_HALF=half,
    )
    minimum = scales if minimum is None else minimum  # scales stand in for pointers the kernel never reads
    bias = scales if bias is None else bias
    args = (
        x,
        q,
        scales,
        minimum,
        bias,
        y,
        m,
        n,
        k,
        *x.stride(),
        *q_strides,
        *scales.stride(),
        *minimum.stride(),
        *y.stride(),
    )
    return Launch(q4_kernel, (triton.cdiv(m, block_m), triton.cdiv(n, block_n)), args, meta, y)


def q4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    k_groups: int | None = None,
) -> torch.Tensor:
    """x @ W.T for ``QuantLinear(bits=4)``'s storage, W dequantised in registers only.

    Args:
        x: [m, k] float activations (m small: 1 is a GEMV), any strides.
        packed: [n, k // 2] uint8, weight 2i in the low nibble of byte i, 2i + 1 in the high one,
            each stored as q + 8 (``pack_int4``).
        scales: [n, k // group_size] float, one per group of ``group_size`` consecutive weights:
            W[:, j] = (nibble - 8) * scale of j's group.
        group_size: weights per scale; even (no byte straddles two groups), and k a multiple of it.
        bias: optional [n] float, added to every row.
        block_n: output features per program (a power of two; default 64).
        k_groups: groups per step along k (a power of two; default: up to 256 weights' worth).

    Returns:
        y [m, n] in x's dtype, accumulated in float32.
    """
    return q4_matmul_launch(x, packed, scales, group_size, bias, block_n=block_n, k_groups=k_groups)()


def q4_matmul_launch(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    k_groups: int | None = None,
) -> Launch:
    """The checked launch behind ``q4_matmul`` (same arguments), not yet run."""
    require_tensor("x", x, ndim=2)
    _require_packed("packed", packed, 2)
    require_tensor("scales", scales, ndim=2)
    tensors = {"x": x, "packed": packed, "scales": scales}
    if bias is not None:
        tensors["bias"] = require_tensor("bias", bias, ndim=1)
    require_same_device(**tensors)
    if type(group_size) is not int or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be a positive even integer (two weights share a byte), got {group_size!r}")
    (_, k), n = x.shape, packed.shape[0]
    if k % group_size:
        raise ValueError(f"x has {k} columns, not a multiple of group_size {group_size}; the kernel reads whole groups")
    if packed.shape[1] * 2 != k:
        raise ValueError(
            f"packed {list(packed.shape)} holds {packed.shape[1] * 2} weights per row but x has {k} "
            f"columns; expected packed [n, {k // 2}]"
        )
    if list(scales.shape) != [n, k // group_size]:
        raise ValueError(
            f"scales has shape {list(scales.shape)}; expected [{n}, {k // group_size}] "
            f"(one per output row and group of {group_size})"
        )
    if bias is not None and bias.shape[0] != n:
        raise ValueError(f"bias has {bias.shape[0]} elements but the weight has {n} output rows")
    row, byte = packed.stride()
    return _launch(
        x,
        packed,
        (row, group_size // 2 * byte, byte),
        scales,
        None,
        bias,
        group_size=group_size,
        zero=8,
        halves=False,
        block_n=block_n,
        k_groups=k_groups,
    )


def q4_1_matmul(
    x: torch.Tensor,
    d: torch.Tensor,
    m_min: torch.Tensor,
    qs: torch.Tensor,
    *,
    block_n: int | None = None,
    k_groups: int | None = None,
) -> torch.Tensor:
    """x @ W.T for GGUF Q4_1 blocks as ``Q4_1Linear`` stores them, W dequantised in registers only.

    Args:
        x: [m, k] float activations, k a multiple of 32, any strides.
        d, m_min: [n, k // 32] float (fp16 as stored): each block's scale and minimum.
        qs: [n, k // 32, 16] uint8: byte j holds weight j of the block in its low nibble and
            weight 16 + j in its high one; weight = d * nibble + m_min.
        block_n: output features per program (a power of two; default 64).
        k_groups: blocks per step along k (a power of two; default: up to 8, 256 weights).

    Returns:
        y [m, n] in x's dtype, accumulated in float32.
    """
    return q4_1_matmul_launch(x, d, m_min, qs, block_n=block_n, k_groups=k_groups)()


def q4_1_matmul_launch(
    x: torch.Tensor,
    d: torch.Tensor,
    m_min: torch.Tensor,
    qs: torch.Tensor,
    *,
    block_n: int | None = None,
    k_groups: int | None = None,
) -> Launch:
    """The checked launch behind ``q4_1_matmul`` (same arguments), not yet run."""
    require_tensor("x", x, ndim=2)
    require_tensor("d", d, ndim=2)
    require_tensor("m_min", m_min, ndim=2)
    _require_packed("qs", qs, 3)
    require_same_device(x=x, d=d, m_min=m_min, qs=qs)
    (_, k), n = x.shape, qs.shape[0]
    if k % Q4_1_BLOCK:
        raise ValueError(f"x has {k} columns, not a multiple of the Q4_1 block ({Q4_1_BLOCK} weights)")
    if list(qs.shape) != [n, k // Q4_1_BLOCK, Q4_1_BLOCK // 2]:
        raise ValueError(
            f"qs has shape {list(qs.shape)}; for x with {k} columns expected [n, {k // Q4_1_BLOCK}, {Q4_1_BLOCK // 2}]"
        )
    for name, value in (("d", d), ("m_min", m_min)):
        if list(value.shape) != [n, k // Q4_1_BLOCK]:
            raise ValueError(
                f"{name} has shape {list(value.shape)}; expected [{n}, {k // Q4_1_BLOCK}] "
                "(one per output row and block)"
            )
    return _launch(
        x,
        qs,
        qs.stride(),
        d,
        m_min,
        None,
        group_size=Q4_1_BLOCK,
        zero=0,
        halves=True,
        block_n=block_n,
        k_groups=k_groups,
    )


def q4_matmul_bytes(
    m: int,
    n: int,
    k: int,
    group_size: int,
    *,
    block_m: int,
    block_n: int,
    x_bytes: int = 4,
    scale_bytes: int = 4,
    min_bytes: int = 0,
    bias_bytes: int = 0,
) -> dict[str, int]:
    """The bytes ``q4_matmul`` moves: {"loaded": ..., "stored": ...}.

    loaded = row_tiles * (n*k/2 + n*(k/group_size)*(scale_bytes + min_bytes) + n*bias_bytes)
             + col_tiles * m*k*x_bytes
    stored = m*n*x_bytes        (row_tiles = cdiv(m, block_m), col_tiles = cdiv(n, block_n))

    Half a byte per weight plus its share of a scale (and minimum), read once per tile-row of y:
    once for m <= 16. x is read again by every tile-column; y is written once, nothing else is.
    ``min_bytes`` and ``bias_bytes`` are 0 when there is no minimum or no bias.
    """
    row_tiles, col_tiles = -(-m // block_m), -(-n // block_n)
    weights = n * k // 2 + n * (k // group_size) * (scale_bytes + min_bytes) + n * bias_bytes
    return {"loaded": row_tiles * weights + col_tiles * m * k * x_bytes, "stored": m * n * x_bytes}


def q4_1_matmul_bytes(m: int, n: int, k: int, *, block_m: int, block_n: int, x_bytes: int = 4) -> dict[str, int]:
    """The bytes ``q4_1_matmul`` moves: ``q4_matmul_bytes`` with groups of 32 and an fp16 d and m each.

    A Q4_1 block is 20 bytes for 32 weights (16 of nibbles, 2 of d, 2 of m): 0.625 bytes a weight.
    """
    return q4_matmul_bytes(
        m, n, k, Q4_1_BLOCK, block_m=block_m, block_n=block_n, x_bytes=x_bytes, scale_bytes=2, min_bytes=2
    )


# --- the forward switch --------------------------------------------------------------------------


def stored_format(module: nn.Module) -> str | None:
    """The 4-bit format ``module`` stores: "int4" for ``QuantLinear(bits=4)``'s buffers (qweight and
    scales, in even groups), "q4_1" for ``Q4_1Linear``'s (d, m, qs), None for anything else.

    Layers are recognised by what they store, so the kernels import nothing from ``infra_lib.model``.
    """
    buffers = dict(module.named_buffers(recurse=False))
    if {"d", "m", "qs"} <= buffers.keys() and buffers["qs"].dtype == torch.uint8 and buffers["qs"].dim() == 3:
        return "q4_1"
    packed = buffers.get("qweight")
    if (
        getattr(module, "bits", None) == 4
        and "scales" in buffers
        and packed is not None
        and packed.dtype == torch.uint8
        and getattr(module, "group_size", 1) % 2 == 0
    ):
        return "int4"
    return None


def _kernel_takes(x: torch.Tensor) -> bool:
    on_device = x.device.type == "cuda" or (x.device.type == "cpu" and interpreter_active())
    dtype_ok = x.dtype in FLOAT_DTYPES and not (x.dtype == torch.bfloat16 and interpreter_active())
    return on_device and dtype_ok and x.numel() > 0 and not (torch.is_grad_enabled() and x.requires_grad)


def fused_forward(module: nn.Module, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` through the fused kernel when x has at most ``max_rows`` rows, else the stored path."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if not (0 < rows <= max_rows and _kernel_takes(x)):
        return type(module).forward(module, x)
    flat = x.reshape(rows, x.shape[-1])
    if stored_format(module) == "q4_1":
        y = q4_1_matmul(flat, module.d, module.m, module.qs)
    else:
        y = q4_matmul(flat, module.qweight, module.scales, module.group_size, module.bias)
    return y.reshape(*x.shape[:-1], module.out_features)


def use_fused_q4(model: nn.Module, enabled: bool = True, *, max_rows: int = DECODE_ROWS) -> list[str]:
    """Route every 4-bit linear of ``model`` through the fused kernels for small inputs, or back.

    With ``enabled``, each ``QuantLinear(bits=4)`` and ``Q4_1Linear`` computes inputs of at most
    ``max_rows`` rows (all dimensions but the last flattened: decode steps) with ``q4_matmul`` /
    ``q4_1_matmul``, and larger ones (prefill) with its own dequantise-then-matmul forward. The
    modules are changed in place; ``enabled=False`` restores their own forward.

    Returns:
        The names of the modules switched.
    """
    if type(max_rows) is not int or max_rows < 1:
        raise ValueError(f"max_rows must be a positive integer, got {max_rows!r}")
    switched = []
    for name, module in model.named_modules():
        if stored_format(module) is None:
            continue
        if enabled:
            module.forward = functools.partial(fused_forward, module, max_rows)
        else:
            module.__dict__.pop("forward", None)
        switched.append(name)
    return switched
