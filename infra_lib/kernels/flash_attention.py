"""FlashAttention forward in Triton, and the naive three-kernel attention it replaces.

Attention is softmax(scale * Q K^T) V. The naive way runs it as three kernels and writes
the ``t x s`` score matrix to memory in between (then reads it back twice). FlashAttention
gives each program one block of queries and walks the keys block by block, keeping a
running max ``m``, a running sum ``l`` and an output accumulator in registers (the online
softmax): the score matrix never leaves the chip.

Conventions (those of ``infra_lib.model.attention``): ``q`` is ``[batch, n_heads, t, head_dim]``,
``k`` and ``v`` are ``[batch, n_kv_heads, s, head_dim]`` with ``t <= s``; query ``i`` sits at
position ``s - t + i`` and, when causal, sees keys ``0 .. s - t + i``; query head ``h`` reads
key/value head ``h // (n_heads // n_kv_heads)`` (grouped-query attention).
"""

from __future__ import annotations

import math

import torch

from infra_lib.kernels.matmul import check_block
from infra_lib.kernels.softmax import MAX_BLOCK, softmax_kernel
from infra_lib.kernels.triton_env import load_triton, next_power_of_2, require_same_device, require_tensor

triton, tl = load_triton()

DEFAULT_BLOCK = 16  # query and key rows per tile: tl.dot's floor on a GPU, and cheap in the interpreter


@triton.jit
def flash_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    n_heads,
    group,
    t,
    s,
    head_dim,
    scale,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (query block, batch * head); grid (cdiv(t, BLOCK_M), batch * n_heads).

    lse is contiguous [batch, n_heads, t]; BLOCK_D >= head_dim, a power of two.
    """
    block, batch_head = tl.program_id(0), tl.program_id(1)
    batch, head = batch_head // n_heads, batch_head % n_heads
    kv_head = head // group
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query indices
    dims = tl.arange(0, BLOCK_D)
    row_in, dim_in = rows < t, dims < head_dim
    q_base = q_ptr + batch * stride_qb + head * stride_qh
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    q = tl.load(
        q_base + rows[:, None] * stride_qt + dims[None, :] * stride_qd,
        mask=row_in[:, None] & dim_in[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    m = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)  # running max of each row's scores
    denominator = tl.zeros((BLOCK_M,), dtype=tl.float32)  # l: running sum of exp(score - m)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)  # running sum of exp(score - m) * v
    if CAUSAL:  # keys past the block's last query position are masked for every row: never visit them
        end = s - t + tl.minimum((block + 1) * BLOCK_M, t)
    else:
        end = s
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key indices
        col_in = cols < end  # end <= s: lanes past s are off too
        k = tl.load(
            k_base + cols[None, :] * stride_ks + dims[:, None] * stride_kd,
            mask=dim_in[:, None] & col_in[None, :],
            other=0.0,
        )  # (BLOCK_D, BLOCK_N): K transposed
        scores = tl.dot(q, k) * scale  # (BLOCK_M, BLOCK_N), float32
        visible = col_in[None, :]
        if CAUSAL:  # only the blocks on the diagonal have keys hidden from some rows
            visible = visible & (cols[None, :] <= (s - t + rows)[:, None])
        scores = tl.where(visible, scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: every row sees key 0 in the first block
        rescale = tl.exp(m - m_new)  # shrinks what was summed under the old, smaller max
        p = tl.exp(scores - m_new[:, None])
        denominator = denominator * rescale + tl.sum(p, axis=1)
        v = tl.load(
            v_base + cols[:, None] * stride_vs + dims[None, :] * stride_vd,
            mask=col_in[:, None] & dim_in[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / denominator[:, None]
    out_base = out_ptr + batch * stride_ob + head * stride_oh
    tl.store(
        out_base + rows[:, None] * stride_ot + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_in[:, None] & dim_in[None, :],
    )
    tl.store(lse_ptr + batch_head * t + rows, m + tl.log(denominator), mask=row_in)


@triton.jit
def attention_scores_kernel(
    q_ptr,
    k_ptr,
    scores_ptr,
    n_heads,
    group,
    t,
    s,
    head_dim,
    scale,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Naive step 1: scores[bh, i, j] = scale * q_i . k_j (-inf where masked), float32 contiguous
    [batch * n_heads, t, s]; grid (cdiv(t, BLOCK_M), cdiv(s, BLOCK_N), batch * n_heads)."""
    batch_head = tl.program_id(2)
    batch, head = batch_head // n_heads, batch_head % n_heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    row_in, col_in, dim_in = rows < t, cols < s, dims < head_dim
    q = tl.load(
        q_ptr + batch * stride_qb + head * stride_qh + rows[:, None] * stride_qt + dims[None, :] * stride_qd,
        mask=row_in[:, None] & dim_in[None, :],
        other=0.0,
    )
    k = tl.load(
        k_ptr + batch * stride_kb + (head // group) * stride_kh + cols[None, :] * stride_ks + dims[:, None] * stride_kd,
        mask=dim_in[:, None] & col_in[None, :],
        other=0.0,
    )
    scores = tl.dot(q, k) * scale
    if CAUSAL:
        scores = tl.where(cols[None, :] <= (s - t + rows)[:, None], scores, -float("inf"))
    tl.store(
        scores_ptr + batch_head * t * s + rows[:, None] * s + cols[None, :],
        scores,
        mask=row_in[:, None] & col_in[None, :],
    )


@triton.jit
def attention_pv_kernel(
    p_ptr,
    v_ptr,
    out_ptr,
    n_heads,
    group,
    t,
    s,
    head_dim,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Naive step 3: out = P @ V, P float32 contiguous [batch * n_heads, t, s];
    grid (cdiv(t, BLOCK_M), batch * n_heads)."""
    batch_head = tl.program_id(1)
    batch, head = batch_head // n_heads, batch_head % n_heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_in, dim_in = rows < t, dims < head_dim
    v_base = v_ptr + batch * stride_vb + (head // group) * stride_vh
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(0, s, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_in = cols < s
        p = tl.load(
            p_ptr + batch_head * t * s + rows[:, None] * s + cols[None, :],
            mask=row_in[:, None] & col_in[None, :],
            other=0.0,
        )
        v = tl.load(
            v_base + cols[:, None] * stride_vs + dims[None, :] * stride_vd,
            mask=col_in[:, None] & dim_in[None, :],
            other=0.0,
        )
        acc = tl.dot(p, v.to(tl.float32), acc)
    tl.store(
        out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_ot + dims[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_in[:, None] & dim_in[None, :],
    )


def _launch(kernel, grid, *args, **meta) -> None:
    """Every launch of this module goes through here (tests run each one under ``check_bounds``)."""
    kernel[grid](*args, **meta)


def _attention_shapes(q, k, v) -> tuple[int, int, int, int, int, int]:
    """Check how q, k and v fit together; return (batch, n_heads, n_kv_heads, t, s, head_dim)."""
    (batch, n_heads, t, head_dim), (batch_k, n_kv_heads, s, head_dim_k) = q.shape, k.shape
    if k.shape != v.shape:
        raise ValueError(f"k has shape {list(k.shape)} but v has {list(v.shape)}; keys and values must match")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q is {q.dtype}, k is {k.dtype}, v is {v.dtype}; convert them to one dtype, e.g. k.to(q.dtype)"
        )
    if batch_k != batch or head_dim_k != head_dim:
        raise ValueError(f"q is {list(q.shape)} and k is {list(k.shape)}: batch and head_dim (dims 0 and 3) must match")
    if n_heads % n_kv_heads:
        raise ValueError(
            f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads}): each key/value "
            "head serves a whole group of query heads"
        )
    if s == 0:
        raise ValueError(f"k has no keys (shape {list(k.shape)}): attention needs at least one key per query")
    if t > s:
        raise ValueError(
            f"q has t = {t} queries but k only s = {s} keys; the queries are the last t of the "
            "s positions, so t <= s (append this step's keys before attending)"
        )
    return batch, n_heads, n_kv_heads, t, s, head_dim


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a positive number (default 1 / sqrt(head_dim)), got {scale!r}")
    return float(scale)


def _check_inputs(q, k, v, scale) -> tuple[tuple[int, ...], float]:
    """The checks both kernels' wrappers run: tensors, device, shapes, scale."""
    if isinstance(k, torch.Tensor) and k.dim() == 4 and k.shape[2] == 0:
        raise ValueError(f"k has no keys (shape {list(k.shape)}): attention needs at least one key per query")
    for name, x in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, x, ndim=4)
    require_same_device(q=q, k=k, v=v)
    shapes = _attention_shapes(q, k, v)
    return shapes, _check_scale(scale, shapes[-1])


def _block_d(head_dim: int) -> int:
    """The head dimension's tile: a power of two (lanes past head_dim masked), at least tl.dot's 16."""
    return max(16, next_power_of_2(head_dim))


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_m: int = DEFAULT_BLOCK,
    block_n: int = DEFAULT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with the FlashAttention kernel: the score matrix is never written to memory.

    With this module's convention every query sees at least key 0, so no row is fully masked.
    The bytes it moves are ``flash_attention_bytes``: Q, O and lse once, K and V once per
    query block (the blocks the causal mask hides entirely are skipped).

    Args:
        q: [batch, n_heads, t, head_dim]; k, v: [batch, n_kv_heads, s, head_dim] with t <= s,
            n_heads a multiple of n_kv_heads; one float dtype and device; any strides.
        causal: query i sees keys 0 .. s - t + i only (prefill t == s, decode t == 1).
        scale: multiplies q . k before the softmax; default 1 / sqrt(head_dim).
        block_m, block_n: queries and keys per tile (powers of two).

    Returns:
        (out, lse): out [batch, n_heads, t, head_dim] in q's dtype (accumulated in float32);
        lse [batch, n_heads, t] float32, the natural log of each row's softmax denominator,
        the sum of exp(scale * q . k_j) over the keys j the query sees.
    """
    (batch, n_heads, n_kv_heads, t, s, head_dim), scale = _check_inputs(q, k, v, scale)
    block_m, block_n = check_block("block_m", block_m), check_block("block_n", block_n)
    out = torch.empty(batch, n_heads, t, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, n_heads, t, dtype=torch.float32, device=q.device)
    _launch(
        flash_attention_kernel,
        (triton.cdiv(t, block_m), batch * n_heads),
        q,
        k,
        v,
        out,
        lse,
        n_heads,
        n_heads // n_kv_heads,
        t,
        s,
        head_dim,
        scale,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        CAUSAL=bool(causal),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_block_d(head_dim),
    )
    return out, lse


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """The same attention as three kernels through a float32 score matrix in memory: the baseline.

    Scores = scale * Q K^T (masked entries written as -inf), then the course's fused softmax
    in place, then P V; tiles of DEFAULT_BLOCK. Arguments as for ``flash_attention``.

    Returns:
        out [batch, n_heads, t, head_dim] in q's dtype.
    """
    (batch, n_heads, n_kv_heads, t, s, head_dim), scale = _check_inputs(q, k, v, scale)
    if next_power_of_2(s) > MAX_BLOCK:
        raise ValueError(
            f"s = {s} keys do not fit the softmax kernel's one-block rows (at most {MAX_BLOCK}); use flash_attention"
        )
    group, bd, blocks = n_heads // n_kv_heads, _block_d(head_dim), dict(BLOCK_M=DEFAULT_BLOCK, BLOCK_N=DEFAULT_BLOCK)
    scores = torch.empty(batch * n_heads, t, s, dtype=torch.float32, device=q.device)  # the t x s matrix
    _launch(
        attention_scores_kernel,
        (triton.cdiv(t, DEFAULT_BLOCK), triton.cdiv(s, DEFAULT_BLOCK), batch * n_heads),
        q,
        k,
        scores,
        n_heads,
        group,
        t,
        s,
        head_dim,
        scale,
        *q.stride(),
        *k.stride(),
        CAUSAL=bool(causal),
        BLOCK_D=bd,
        **blocks,
    )
    _launch(softmax_kernel, (batch * n_heads * t,), scores, scores, s, s, s, BLOCK=next_power_of_2(s))
    out = torch.empty(batch, n_heads, t, head_dim, dtype=q.dtype, device=q.device)
    _launch(
        attention_pv_kernel,
        (triton.cdiv(t, DEFAULT_BLOCK), batch * n_heads),
        scores,
        v,
        out,
        n_heads,
        group,
        t,
        s,
        head_dim,
        *v.stride(),
        *out.stride(),
        BLOCK_D=bd,
        **blocks,
    )
    return out


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (out, lse) in plain torch, float32 maths, GQA by repeating each key/value head."""
    (_, n_heads, n_kv_heads, t, s, head_dim) = _attention_shapes(q, k, v)
    scale = _check_scale(scale, head_dim)
    group = n_heads // n_kv_heads
    keys, values = (x.float().repeat_interleave(group, dim=1) for x in (k, v))  # [batch, n_heads, s, head_dim]
    scores = scale * q.float() @ keys.transpose(-1, -2)  # [batch, n_heads, t, s]
    if causal:
        visible = torch.arange(s, device=q.device) <= torch.arange(t, device=q.device)[:, None] + (s - t)
        scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ values).to(q.dtype), torch.logsumexp(scores, dim=-1)


def flash_cached_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache) -> torch.Tensor:
    """The model's cached attention step on the FlashAttention kernel (``model.using_attention(...)``).

    Appends this step's keys and values to ``cache`` (a ``LayerCache``), then attends causally
    over everything cached, as ``infra_lib.model.attention.cached_attention`` does.

    Returns:
        [batch, n_heads, t, head_dim].
    """
    keys, values = cache.append(k_new, v_new)
    return flash_attention(q, keys, values, causal=True)[0]


def flash_attention_bytes(
    batch: int,
    n_heads: int,
    t: int,
    s: int,
    head_dim: int,
    *,
    causal: bool = True,
    block_m: int = DEFAULT_BLOCK,
    element_size: int = 4,
) -> dict[str, int]:
    """The bytes ``flash_attention`` moves: {"loaded": ..., "stored": ...}.

    Per (batch, query head), with rows of head_dim * element_size bytes: Q is read once
    (t rows); query block b reads the keys it does not skip, end_b = s (not causal) or
    s - t + min((b + 1) * block_m, t) (causal), once from K and once from V:
    2 * sum_b end_b rows (a key/value head is read once per query head of its group). O is
    written once (t rows) and lse once (t float32).
    """
    row = head_dim * element_size
    ends = [s - t + min((b + 1) * block_m, t) if causal else s for b in range(-(-t // block_m))]
    heads = batch * n_heads
    return {"loaded": heads * (t + 2 * sum(ends)) * row, "stored": heads * t * (row + 4)}


def naive_attention_bytes(
    batch: int, n_heads: int, t: int, s: int, head_dim: int, element_size: int = 4
) -> dict[str, int]:
    """The bytes ``naive_attention`` moves: {"loaded": ..., "stored": ..., "scores": ...}.

    Per (batch, query head), with rows of head_dim * element_size bytes and float32 scores
    (t * s * 4 bytes), tiles of DEFAULT_BLOCK: the scores kernel reads Q once per key tile
    and K once per query tile and writes the scores; the softmax reads and rewrites them; the
    P V kernel reads them again, V once per query tile, and writes O. ``scores`` is the
    score matrix's size: it crosses memory four times. The same with or without the causal mask.
    """
    row, score_bytes = head_dim * element_size, t * s * 4
    query_tiles, key_tiles = -(-t // DEFAULT_BLOCK), -(-s // DEFAULT_BLOCK)
    heads = batch * n_heads
    loaded = (t * key_tiles + 2 * s * query_tiles) * row + 2 * score_bytes
    return {"loaded": heads * loaded, "stored": heads * (2 * score_bytes + t * row), "scores": heads * score_bytes}
