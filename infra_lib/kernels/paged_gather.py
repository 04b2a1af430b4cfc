"""PagedAttention in plain torch: attention whose keys and values are scattered over KV blocks.

One layer's cache is a tensor ``[num_blocks, block_size, n_kv_heads, head_dim]`` (keys; values
alike). A sequence's keys are the rows its block table points at, in table order. A GPU kernel
(vLLM's PagedAttention, FlashInfer, ``paged_decode.py`` here) reads them block by block inside the
kernel; here the same indirection is one gather of whole blocks, then the ordinary causal
grouped-query attention, so the result equals attention over a contiguous cache (to float rounding).

It lives beside the kernels because the decode kernel's model step falls back to it for a prefill;
the serving layer builds its paged cache and batched step on it (``infra_lib.serving.paged_attention``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def block_table_tensor(block_tables, width: int, device) -> torch.Tensor:
    """Block tables as ``[batch, width]`` int64, ragged lists padded with block 0 (masked later)."""
    if isinstance(block_tables, torch.Tensor):
        if block_tables.dim() != 2 or block_tables.shape[1] < width:
            raise ValueError(
                f"block_tables must be [batch, >= {width}] to cover the longest sequence, "
                f"got {list(block_tables.shape)}"
            )
        return block_tables[:, :width].to(device=device, dtype=torch.int64)
    rows = []
    for table in block_tables:
        table = list(table)[:width]
        rows.append(table + [0] * (width - len(table)))
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(rows), width)


def _check_tables(block_tables, seq_lens: list[int], block_size: int) -> None:
    if not isinstance(block_tables, torch.Tensor):
        for i, (table, s) in enumerate(zip(block_tables, seq_lens)):
            if len(table) * block_size < s:
                raise ValueError(
                    f"sequence {i} has {s} tokens but its table holds {len(table)} blocks of {block_size} slots"
                )


def gather_blocks(cache: torch.Tensor, block_tables, seq_lens: Sequence[int]) -> torch.Tensor:
    """Each sequence's blocks, whole and in table order: ``[batch, width * block_size, n_kv_heads,
    head_dim]``, ``width`` the blocks of the longest sequence. Row ``p`` of sequence ``b`` is its
    position ``p``; rows at or past ``seq_lens[b]`` are filler (the rest of its last block, or block 0
    where its table is shorter) that attention must mask.

    One ``index_select`` of whole blocks (``block_size * n_kv_heads * head_dim`` contiguous floats
    each), not one of every token's row: the copy moves a few large rows instead of many small ones.
    """
    num_blocks, block_size, n_kv_heads, head_dim = cache.shape
    seq_lens = [int(s) for s in seq_lens]
    _check_tables(block_tables, seq_lens, block_size)
    width = -(-max(seq_lens, default=0) // block_size)  # the blocks the longest sequence fills
    tables = block_table_tensor(block_tables, width, cache.device)  # [batch, width]
    rows = cache.reshape(num_blocks, -1).index_select(0, tables.reshape(-1))
    return rows.view(tables.shape[0], width * block_size, n_kv_heads, head_dim)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables, seq_lens: Sequence[int]
) -> torch.Tensor:
    """Causal grouped-query attention of each sequence's newest ``t`` queries over its paged keys.

    Args:
        q: ``[batch, n_heads, t, head_dim]``; sequence ``b``'s query ``i`` sits at position
            ``seq_lens[b] - t + i`` (its keys are already written into the cache).
        k_cache, v_cache: one layer's ``[num_blocks, block_size, n_kv_heads, head_dim]``.
        block_tables: per sequence, its block ids in order (lists of any length, or a padded
            ``[batch, max_blocks]`` tensor).
        seq_lens: per sequence, its length including the ``t`` new tokens (ragged is fine).

    Returns:
        ``[batch, n_heads, t, head_dim]``.
    """
    batch, n_heads, t, head_dim = q.shape
    seq_lens = [int(s) for s in seq_lens]
    if len(seq_lens) != batch or any(s < t for s in seq_lens):
        raise ValueError(
            f"seq_lens must give {batch} lengths, each >= t={t} (the new tokens are in the cache), got {seq_lens}"
        )
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    # whole blocks, in the cache's own row layout: [batch, L, n_kv * hd], every K/V head side by side
    k = gather_blocks(k_cache, block_tables, seq_lens).flatten(2)
    v = gather_blocks(v_cache, block_tables, seq_lens).flatten(2)
    lengths = torch.tensor(seq_lens, device=q.device)
    query_positions = lengths[:, None] - t + torch.arange(t, device=q.device)  # [batch, t]
    key_positions = torch.arange(k.shape[1], device=q.device)
    hidden = (key_positions[None, None, :] > query_positions[:, :, None])[:, None]  # [batch, 1, t, L]
    # Grouped-query attention straight from that layout, without copying K and V into head-major
    # order or once per query head: query head j (of K/V head h = j // group, as repeat_kv pairs
    # them) is written into the h-th head_dim slice of a zero row n_kv * head_dim wide, so one
    # batched product against all of a sequence's key rows gives every head's scores (the other
    # slices add exact zeros). The values come back the same way, and each head keeps its own slice.
    # The product does n_kv times the multiply-adds, which are cheap; it reads K and V once each,
    # contiguous, which is what costs.
    rows = q.reshape(batch, n_kv, group * t, head_dim)  # (K/V head, then its query heads and queries)
    spread = q.new_zeros(batch, n_kv, group * t, n_kv, head_dim)
    for h in range(n_kv):
        spread[:, h, :, h] = rows[:, h]
    scores = torch.bmm(spread.view(batch, n_heads * t, n_kv * head_dim), k.transpose(1, 2)) / math.sqrt(head_dim)
    scores = scores.view(batch, n_heads, t, -1).masked_fill(hidden, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(batch, n_heads * t, -1)
    out = torch.bmm(weights, v).view(batch, n_kv, group * t, n_kv, head_dim)
    return torch.stack([out[:, h, :, h] for h in range(n_kv)], dim=1).view(batch, n_heads, t, head_dim)
