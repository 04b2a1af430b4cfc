"""Greedy decoding from the paged KV cache: ``greedy_decode`` with blocks instead of one buffer.

With a prefix cache in the pool, the prompt's cached blocks are reused and only the rest of the
prompt is computed; the result says how many tokens each part took.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infra_lib.model.model import Llama
from infra_lib.serving.block_pool import BlockAllocator
from infra_lib.serving.kv_store import PagedKVStore
from infra_lib.serving.paged_kv import PagedKVCache


@dataclass(frozen=True)
class PagedDecode:
    """What one paged request produced and what its prefill cost.

    Attributes:
        token_ids: the generated ids, ending with ``stop_id`` if it was produced.
        num_cached_tokens: prompt tokens whose K/V came from the prefix cache.
        prefill_tokens: prompt tokens the model computed (``len(prompt) - num_cached_tokens``).
        computed_tokens: every position this request computed, prefill and decode.
        blocks_used: blocks the sequence held at its end (before releasing them).
    """

    token_ids: list[int]
    num_cached_tokens: int
    prefill_tokens: int
    computed_tokens: int
    blocks_used: int


@torch.inference_mode()
def paged_greedy_decode(
    model: Llama,
    store: PagedKVStore,
    pool: BlockAllocator,
    prompt: list[int],
    max_new_tokens: int,
    stop_id: int | None = None,
    release: bool = True,
) -> PagedDecode:
    """Prefill the uncached part of ``prompt``, then feed back one greedy token per step.

    Every step reserves its slots before the forward pass, so the sequence's full blocks are
    registered with the pool's prefix cache as they fill. ``release`` gives the blocks back at
    the end (they stay in the prefix cache until reused).
    """
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    cache = PagedKVCache.for_prompt(store, pool, prompt)
    try:
        logits = model(torch.tensor([cache.pending_token_ids]), cache, last_only=True)  # [1, 1, vocab]
        prefill_tokens = cache.computed_tokens
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token == stop_id or len(out) == max_new_tokens:
                break
            cache.reserve([token])
            logits = model(torch.tensor([[token]]), cache, last_only=True)
        return PagedDecode(out, cache.num_cached_tokens, prefill_tokens, cache.computed_tokens, len(cache.table))
    finally:
        if release:
            cache.release()
