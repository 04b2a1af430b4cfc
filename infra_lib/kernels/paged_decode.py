"""Paged decode attention in Triton: one new query per sequence, keys and values read through the block table.

A decode step attends each sequence's one new query over its whole context. The context sits
in a paged cache ``[num_blocks, block_size, n_kv_heads, head_dim]``, scattered over the blocks
its block table lists. ``paged_attention`` in torch first gathers those rows into a contiguous
copy; this kernel reads them where they are: a program loads a block id from the table, then
that block's rows, and keeps an online softmax (running max, running sum, rescaled
accumulator, all float32) across blocks. Sequences of any length share one launch.

One program serves one (sequence, KV head) and all the query heads of its group (head ``h``
reads KV head ``h // group``): each K/V row is loaded once per KV head, where a program per
query head would load it ``group`` times. ``split_k`` cuts each context into that many slices
of blocks, one program each (more programs when the batch is small and contexts long); a
second kernel merges their partial (max, sum, accumulator).
"""

from __future__ import annotations

import math

import torch

from infra_lib.kernels.paged_gather import paged_attention
from infra_lib.kernels.triton_env import load_triton, next_power_of_2, require_same_device, require_tensor

triton, tl = load_triton()

INDEX_DTYPE = torch.int32  # block ids and lengths, as the kernels read them
INDEX_BYTES = 4


@triton.jit
def _attend_blocks(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    seq_len,
    kv_head,
    first_block,
    last_block,
    group,
    head_dim,
    scale,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Online softmax of one KV head's query group over blocks [first_block, last_block) of one
    sequence; returns the running max [G], sum [G] and unnormalised output [G, D], in float32."""
    heads, rows, dims = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_ROWS), tl.arange(0, BLOCK_D)
    in_group, in_dim = heads < group, dims < head_dim
    q = (
        tl.load(
            q_ptr + (kv_head * group + heads)[:, None] * stride_qh + dims[None, :],
            mask=in_group[:, None] & in_dim[None, :],
            other=0.0,
        ).to(tl.float32)
        * scale
    )  # (G, D)
    row_max = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for i in range(first_block, last_block):
        block = tl.load(table_ptr + i).to(tl.int64)  # the indirection: where position i * BLOCK_SIZE lives
        live = (rows < BLOCK_SIZE) & (i * BLOCK_SIZE + rows < seq_len)  # (R,): the last block may be partial
        tile = live[:, None] & in_dim[None, :]
        k = tl.load(
            k_cache_ptr + block * stride_kb + rows[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
            mask=tile,
            other=0.0,
        ).to(tl.float32)  # (R, D)
        v = tl.load(
            v_cache_ptr + block * stride_vb + rows[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
            mask=tile,
            other=0.0,
        ).to(tl.float32)
        scores = tl.where(live[None, :], tl.sum(q[:, None, :] * k[None, :, :], axis=2), float("-inf"))  # (G, R)
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))  # finite: every visited block has a live row
        rescale = tl.exp(row_max - new_max)  # what is already accumulated shrinks to the new max
        p = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        row_max = new_max
    return row_max, row_sum, acc


@triton.jit
def paged_decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    group,
    head_dim,
    scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_table,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[seq, group of kv_head] = attention over the whole context; grid (batch, n_kv_heads)."""
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    _, row_sum, acc = _attend_blocks(
        q_ptr + seq * stride_qb,
        k_cache_ptr,
        v_cache_ptr,
        tables_ptr + seq * stride_table,
        seq_len,
        kv_head,
        0,
        (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE,
        group,
        head_dim,
        scale,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        BLOCK_SIZE,
        BLOCK_ROWS,
        BLOCK_G,
        BLOCK_D,
    )
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # an empty context (seq_len 0) gives zeros
    heads, dims = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    tl.store(
        out_ptr + seq * stride_ob + (kv_head * group + heads)[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(heads < group)[:, None] & (dims < head_dim)[None, :],
    )


@triton.jit
def paged_decode_split_kernel(
    max_ptr,
    sum_ptr,
    acc_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    group,
    head_dim,
    scale,
    partitions,
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    stride_ab,
    stride_ah,
    stride_ap,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_table,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Partial (max, sum, acc) of one slice of a context; grid (batch, n_kv_heads, partitions)."""
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    per_part = (num_blocks + partitions - 1) // partitions
    first = tl.minimum(part * per_part, num_blocks)  # a slice past the end is empty: max -inf, sum 0
    row_max, row_sum, acc = _attend_blocks(
        q_ptr + seq * stride_qb,
        k_cache_ptr,
        v_cache_ptr,
        tables_ptr + seq * stride_table,
        seq_len,
        kv_head,
        first,
        tl.minimum(first + per_part, num_blocks),
        group,
        head_dim,
        scale,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        BLOCK_SIZE,
        BLOCK_ROWS,
        BLOCK_G,
        BLOCK_D,
    )
    lanes, dims = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads, in_group = kv_head * group + lanes, lanes < group
    where = seq * stride_pb + heads * stride_ph + part
    tl.store(max_ptr + where, row_max, mask=in_group)
    tl.store(sum_ptr + where, row_sum, mask=in_group)
    tl.store(
        acc_ptr + seq * stride_ab + heads[:, None] * stride_ah + part * stride_ap + dims[None, :],
        acc,
        mask=in_group[:, None] & (dims < head_dim)[None, :],
    )


@triton.jit
def merge_partitions_kernel(
    out_ptr,
    max_ptr,
    sum_ptr,
    acc_ptr,
    head_dim,
    partitions,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ab,
    stride_ah,
    stride_ap,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[seq, head] from its partitions' partials, each rescaled to the overall max; grid (batch, n_heads)."""
    seq, head = tl.program_id(0), tl.program_id(1)
    parts, dims = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)
    inside, in_dim = parts < partitions, dims < head_dim
    part_max = tl.load(max_ptr + seq * stride_pb + head * stride_ph + parts, mask=inside, other=float("-inf"))
    part_sum = tl.load(sum_ptr + seq * stride_pb + head * stride_ph + parts, mask=inside, other=0.0)
    part_acc = tl.load(
        acc_ptr + seq * stride_ab + head * stride_ah + parts[:, None] * stride_ap + dims[None, :],
        mask=inside[:, None] & in_dim[None, :],
        other=0.0,
    )  # (P, D)
    top = tl.max(part_max, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)  # an empty context leaves every partition at -inf
    weight = tl.exp(part_max - top)  # (P,): 0 for an empty slice
    total = tl.sum(part_sum * weight, axis=0)
    out = tl.sum(part_acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=in_dim)


# --- the wrapper and its checks ----------------------------------------------------------------------


def _lengths(seq_lens, batch: int) -> list[int]:
    values = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    if len(values) != batch:
        raise ValueError(f"seq_lens gives {len(values)} lengths for a batch of {batch} queries; give one per sequence")
    if any(int(s) != s or s < 0 for s in values):
        raise ValueError(
            f"seq_lens must be whole numbers >= 0 (0: an empty context, its output is zeros), got {values}"
        )
    return [int(s) for s in values]


def _table_tensor(block_tables, lengths: list[int], block_size: int, num_blocks: int, device) -> torch.Tensor:
    """The block tables as ``[batch, width]`` int32 on ``device``, ragged lists padded with 0 (never read)."""
    needed = [-(-s // block_size) for s in lengths]
    if isinstance(block_tables, torch.Tensor):
        if block_tables.dim() != 2 or block_tables.shape[0] != len(lengths):
            raise ValueError(f"block_tables must be [batch={len(lengths)}, max_blocks], got {list(block_tables.shape)}")
        if block_tables.is_floating_point() or block_tables.is_complex():
            raise TypeError(f"block_tables holds block ids, so an integer dtype; got {block_tables.dtype}")
        rows = block_tables.tolist()
    else:
        rows = [list(table) for table in block_tables]
        if len(rows) != len(lengths):
            raise ValueError(
                f"block_tables has {len(rows)} tables for a batch of {len(lengths)}; give one per sequence"
            )
    for i, (row, s, n) in enumerate(zip(rows, lengths, needed)):
        if len(row) < n:
            raise ValueError(
                f"sequence {i} has {s} tokens, {n} blocks of {block_size} slots, but its block table "
                f"holds {len(row)} block ids; allocate its blocks before attending"
            )
        bad = [b for b in row[:n] if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(
                f"sequence {i}'s block table names block {bad[0]}, outside the cache's "
                f"{num_blocks} blocks (0..{num_blocks - 1})"
            )
    width = max([1] + needed)
    padded = [row[:width] + [0] * (width - len(row[:width])) for row in rows]
    return torch.tensor(padded, dtype=INDEX_DTYPE, device=device)


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale, split_k):
    require_tensor("q", q, ndim=4, contiguous_last=True)
    require_tensor("k_cache", k_cache, ndim=4, contiguous_last=True)
    require_tensor("v_cache", v_cache, ndim=4, contiguous_last=True)
    device = require_same_device(q=q, k_cache=k_cache, v_cache=v_cache)
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError(
            f"q is {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}: use one dtype, e.g. q.to(k_cache.dtype)"
        )
    batch, n_heads, t, head_dim = q.shape
    if t != 1:
        raise ValueError(
            f"q holds t={t} queries per sequence; decode attention takes the one new token (t = 1): "
            "use paged_attention for a prefill"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache is {list(k_cache.shape)} but v_cache is {list(v_cache.shape)}; one layer's keys "
            "and values share the shape [num_blocks, block_size, n_kv_heads, head_dim]"
        )
    num_blocks, block_size, n_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the cache {cache_head_dim}")
    if n_heads % n_kv_heads:
        raise ValueError(
            f"{n_heads} query heads do not split into groups over {n_kv_heads} KV heads; n_heads must "
            "be a multiple of n_kv_heads (the cache's third dimension)"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive number (default 1 / sqrt(head_dim)), got {scale!r}")
    if split_k is not None and (type(split_k) is not int or split_k < 1):
        raise ValueError(f"split_k must be a whole number of partitions >= 1 (or None), got {split_k!r}")
    lengths = _lengths(seq_lens, batch)
    tables = _table_tensor(block_tables, lengths, block_size, num_blocks, device)
    return tables, torch.tensor(lengths, dtype=INDEX_DTYPE, device=device), float(scale)


def decode_launches(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables,
    seq_lens,
    *,
    scale: float | None = None,
    split_k: int | None = None,
):
    """Check the inputs; return ``(out, launches)``, each launch ``(kernel, grid, args, meta)`` to run in order.

    ``paged_decode_attention`` runs them; the bounds checker (``oob.check_bounds``) can run them instead.
    """
    tables, lengths, scale = _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale, split_k)
    batch, n_heads, _, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    meta = dict(
        BLOCK_SIZE=block_size,
        BLOCK_ROWS=next_power_of_2(block_size),
        BLOCK_G=next_power_of_2(group),
        BLOCK_D=next_power_of_2(head_dim),
    )
    caches = (*k_cache.stride()[:3], *v_cache.stride()[:3], tables.stride(0))
    inputs = (q, k_cache, v_cache, tables, lengths)
    if split_k is None or split_k == 1:
        args = (out, *inputs, group, head_dim, scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *caches)
        return out, [(paged_decode_kernel, (batch, n_kv_heads), args, meta)]
    part_max = torch.empty(batch, n_heads, split_k, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(batch, n_heads, split_k, head_dim, dtype=torch.float32, device=q.device)
    partials = (part_max.stride(0), part_max.stride(1), *part_acc.stride()[:3])
    split_args = (
        part_max,
        part_sum,
        part_acc,
        *inputs,
        group,
        head_dim,
        scale,
        split_k,
        q.stride(0),
        q.stride(1),
        *partials,
        *caches,
    )
    merge_args = (out, part_max, part_sum, part_acc, head_dim, split_k, out.stride(0), out.stride(1), *partials)
    return out, [
        (paged_decode_split_kernel, (batch, n_kv_heads, split_k), split_args, meta),
        (
            merge_partitions_kernel,
            (batch, n_heads),
            merge_args,
            dict(BLOCK_P=next_power_of_2(split_k), BLOCK_D=meta["BLOCK_D"]),
        ),
    ]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables,
    seq_lens,
    *,
    scale: float | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """Decode attention of each sequence's one new query over its paged keys and values.

    Equal to ``paged_attention`` (``paged_gather.py``) with t = 1, without the gather.

    Args:
        q: ``[batch, n_heads, 1, head_dim]`` float32/float16 (bfloat16 on a GPU); the new token's
            keys and values are already in the cache.
        k_cache, v_cache: one layer's ``[num_blocks, block_size, n_kv_heads, head_dim]``, q's dtype;
            n_heads a multiple of n_kv_heads (query head h reads KV head h // (n_heads // n_kv_heads)).
        block_tables: per sequence its block ids in order: lists of any length, or a ``[batch,
            max_blocks]`` integer tensor; entries past a sequence's length are never read.
        seq_lens: per sequence its length including the new token (ragged); 0 is allowed and gives
            a row of zeros (an empty context has nothing to attend to).
        scale: the score scale, default 1 / sqrt(head_dim).
        split_k: cut each context into this many slices of blocks, one program each, merged by a
            second kernel (None or 1: one program per sequence and KV head).

    Returns:
        ``[batch, n_heads, 1, head_dim]`` in q's dtype, accumulated in float32.
    """
    out, launches = decode_launches(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, split_k=split_k)
    for kernel, grid, args, meta in launches:
        kernel[grid](*args, **meta)
    return out


def paged_decode_cached_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache) -> torch.Tensor:
    """The model's attention step on a ``PagedLayerCache`` with the Triton decode kernel
    (``model.using_attention(paged_decode_cached_attention)``).

    Writes this step's K/V into their slots, then attends: a decode step (t = 1) runs
    ``paged_decode_attention``; a prefill (t > 1) falls back to the torch ``paged_attention``,
    since the kernel serves one query per sequence.
    """
    if not hasattr(cache, "write") or not hasattr(cache, "block_table"):
        raise TypeError(f"paged_decode_cached_attention needs a PagedLayerCache, got {type(cache).__name__}")
    cache.write(k_new, v_new)
    if q.shape[2] == 1:
        return paged_decode_attention(q, cache.k_cache, cache.v_cache, [cache.block_table], [cache.length])
    return paged_attention(q, cache.k_cache, cache.v_cache, [cache.block_table], [cache.length])


# --- the baseline, and what each path moves --------------------------------------------------------------


def gather_then_attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables, seq_lens, *, scale: float | None = None
) -> torch.Tensor:
    """The gathering baseline: copy each sequence's K/V rows into consecutive blocks of a new cache
    (torch indexing), then run the same decode kernel over the copy (its tables count 0, 1, 2, ...)."""
    tables, lengths, _ = _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale, None)
    block_size = k_cache.shape[1]
    needed = [-(-int(s) // block_size) for s in lengths.tolist()]
    starts = [sum(needed[:i]) for i in range(len(needed))]
    source, target = [], []
    for row, (s, start) in enumerate(zip(lengths.tolist(), starts)):
        positions = torch.arange(s, device=q.device)
        source.append(tables[row, positions // block_size].long() * block_size + positions % block_size)
        target.append(start * block_size + positions)
    source, target = torch.cat(source), torch.cat(target)
    copies = []
    for cache in (k_cache, v_cache):
        rows = cache.reshape(-1, *cache.shape[2:])  # [slots, n_kv_heads, head_dim]
        copy = torch.zeros(max(1, sum(needed)) * block_size, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
        copy[target] = rows[source]  # the gather: every row read, then written again
        copies.append(copy.view(-1, *cache.shape[1:]))
    consecutive = [list(range(start, start + n)) for start, n in zip(starts, needed)]
    return paged_decode_attention(q, *copies, consecutive, lengths, scale=scale)


def paged_decode_bytes(
    seq_lens,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    block_size: int,
    element_size: int = 4,
    *,
    split_k: int | None = None,
    gathered: bool = False,
) -> dict[str, int]:
    """The bytes the decode kernels move: {"loaded": ..., "stored": ...} (block ids and lengths int32).

    In place: every program (a sequence and KV head) loads its length, its group's queries, one
    block id per block and each of its K and V rows once, and stores its group's outputs: K/V
    bytes are sum(seq_len) * n_kv_heads * head_dim * 2 * element_size, a program per query head
    would load them n_heads / n_kv_heads times. ``split_k``: every slice loads the length and
    the queries again, and the partials (max, sum and head_dim accumulators, float32, per query
    head and slice) are stored once and loaded once by the merge. ``gathered``: the gather
    first loads each row and block id and stores the row into the copy, then the same kernel
    reads the copy (the rows a second time): K/V traffic three times the in-place kernel's.
    """
    lengths = [int(s) for s in seq_lens]
    batch, parts = len(lengths), split_k or 1
    kv_rows = sum(lengths) * n_kv_heads * head_dim * 2 * element_size
    block_ids = sum(-(-s // block_size) for s in lengths) * n_kv_heads * INDEX_BYTES
    queries = batch * n_heads * head_dim * element_size
    loaded = kv_rows + block_ids + parts * (queries + batch * n_kv_heads * INDEX_BYTES)
    stored = batch * n_heads * head_dim * element_size
    if parts > 1:
        partials = batch * n_heads * parts * (2 + head_dim) * 4
        loaded, stored = loaded + partials, stored + partials
    if gathered:
        loaded += kv_rows + block_ids // n_kv_heads
        stored += kv_rows
    return {"loaded": loaded, "stored": stored}
