"""PagedAttention on the serving layer's paged caches.

The attention itself, a gather of each sequence's blocks then causal grouped-query attention, is
``infra_lib.kernels.paged_gather`` (beside the decode kernel that falls back to it); it is
imported here under the names the serving layer and the lessons use. This module adds what the
paged store and the model's attention step need on top: ``gather_kv`` (contiguous keys or
values per sequence) and ``paged_cached_attention`` (the model's step on a ``PagedLayerCache``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from infra_lib.kernels.paged_gather import gather_blocks, paged_attention


def gather_kv(cache: torch.Tensor, block_tables, seq_lens: Sequence[int]) -> torch.Tensor:
    """The keys (or values) of each sequence, contiguous: ``[batch, n_kv_heads, max_len, head_dim]``.

    Args:
        cache: one layer's ``[num_blocks, block_size, n_kv_heads, head_dim]``.
        block_tables: one list of block ids per sequence (or ``[batch, max_blocks]`` int tensor).
        seq_lens: tokens per sequence; positions past a sequence's length are filler.
    """
    max_len = max((int(s) for s in seq_lens), default=0)
    rows = gather_blocks(cache, block_tables, seq_lens)[:, :max_len]  # [batch, max_len, kv, hd]
    return rows.permute(0, 2, 1, 3).contiguous()


def paged_cached_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache) -> torch.Tensor:
    """The model's attention step on a ``PagedLayerCache``: write this step's K/V into their slots,
    then attend straight from the blocks (``model.using_attention(paged_cached_attention)``)."""
    if not hasattr(cache, "write") or not hasattr(cache, "block_table"):
        raise TypeError(f"paged_cached_attention needs a PagedLayerCache, got {type(cache).__name__}")
    cache.write(k_new, v_new)
    return paged_attention(q, cache.k_cache, cache.v_cache, [cache.block_table], [cache.length])
