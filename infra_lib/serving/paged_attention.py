"""PagedAttention in plain torch: attention whose keys and values are scattered over KV blocks.

One layer's cache is a tensor ``[num_blocks, block_size, n_kv_heads, head_dim]`` (keys; values
alike). A sequence's keys are the rows its block table points at, in table order. A GPU kernel
(vLLM's PagedAttention, FlashInfer) reads them block by block inside the kernel; here the same
indirection is one gather, then the ordinary causal grouped-query attention, so the result
equals attention over a contiguous cache exactly.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from infra_lib.serving.block_table import blocks_needed


def _table_tensor(block_tables, width: int, device) -> torch.Tensor:
    """Block tables as ``[batch, width]`` int64, ragged lists padded with block 0 (masked later)."""
    if isinstance(block_tables, torch.Tensor):
        if block_tables.dim() != 2 or block_tables.shape[1] < width:
            raise ValueError(f"block_tables must be [batch, >= {width}] to cover the longest sequence, "
                             f"got {list(block_tables.shape)}")
        return block_tables[:, :width].to(device=device, dtype=torch.int64)
    rows = []
    for table in block_tables:
        table = list(table)[:width]
        rows.append(table + [0] * (width - len(table)))
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(rows), width)


def gather_kv(cache: torch.Tensor, block_tables, seq_lens: Sequence[int]) -> torch.Tensor:
    """The keys (or values) of each sequence, contiguous: ``[batch, n_kv_heads, max_len, head_dim]``.

    Args:
        cache: one layer's ``[num_blocks, block_size, n_kv_heads, head_dim]``.
        block_tables: one list of block ids per sequence (or ``[batch, max_blocks]`` int tensor).
        seq_lens: tokens per sequence; positions past a sequence's length are filler.
    """
    num_blocks, block_size, n_kv_heads, head_dim = cache.shape
    seq_lens = [int(s) for s in seq_lens]
    if not isinstance(block_tables, torch.Tensor):
        for i, (table, s) in enumerate(zip(block_tables, seq_lens)):
            if len(table) * block_size < s:
                raise ValueError(f"sequence {i} has {s} tokens but its table holds {len(table)} blocks of "
                                 f"{block_size} slots")
    max_len = max(seq_lens, default=0)
    tables = _table_tensor(block_tables, blocks_needed(max_len, block_size), cache.device)
    positions = torch.arange(max_len, device=cache.device)
    slots = tables[:, positions // block_size] * block_size + positions % block_size  # [batch, max_len]
    rows = cache.reshape(num_blocks * block_size, n_kv_heads, head_dim)[slots]  # [batch, max_len, kv, hd]
    return rows.permute(0, 2, 1, 3).contiguous()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables,
                    seq_lens: Sequence[int]) -> torch.Tensor:
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
        raise ValueError(f"seq_lens must give {batch} lengths, each >= t={t} (the new tokens are "
                         f"in the cache), got {seq_lens}")
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    k = gather_kv(k_cache, block_tables, seq_lens)  # [batch, n_kv, max_len, hd]
    v = gather_kv(v_cache, block_tables, seq_lens)
    # Grouped-query attention without copying K and V once per query head: the `group` query heads
    # that share a K/V head (heads h*group .. h*group+group-1, as repeat_kv pairs them) are stacked
    # as extra query rows of that head, one product per K/V head.
    q_grouped = q.reshape(batch, n_kv, group * t, head_dim)  # rows: (head in group, query)
    scores = q_grouped @ k.transpose(-1, -2) / math.sqrt(head_dim)  # [batch, n_kv, group*t, max_len]
    lengths = torch.tensor(seq_lens, device=q.device)
    query_positions = lengths[:, None] - t + torch.arange(t, device=q.device)  # [batch, t]
    key_positions = torch.arange(k.shape[2], device=q.device)
    visible = key_positions[None, None, :] <= query_positions[:, :, None]  # [batch, t, max_len]
    scores = scores.view(batch, n_kv, group, t, -1).masked_fill(~visible[:, None, None], float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(batch, n_kv, group * t, -1)
    return (weights @ v).view(batch, n_heads, t, head_dim)


def paged_cached_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache) -> torch.Tensor:
    """The model's attention step on a ``PagedLayerCache``: write this step's K/V into their slots,
    then attend straight from the blocks (``model.using_attention(paged_cached_attention)``)."""
    if not hasattr(cache, "write") or not hasattr(cache, "block_table"):
        raise TypeError(f"paged_cached_attention needs a PagedLayerCache, got {type(cache).__name__}")
    cache.write(k_new, v_new)
    return paged_attention(q, cache.k_cache, cache.v_cache, [cache.block_table], [cache.length])
