"""One sequence's view of the paged KV store, behind the model's ``KVCache`` interface.

* ``PagedKVStore`` (``kv_store.py``) holds the tensors, per layer ``[num_blocks, block_size,
  n_kv_heads, head_dim]``.
* ``PagedKVCache`` is one sequence (batch 1): its block table, its length, and the pool it
  takes blocks from. ``Llama.forward(tokens, paged_cache)`` works unchanged: each layer's
  ``append`` writes the new keys/values into their slots and returns the sequence's keys and
  values gathered through the table, ``[1, n_kv_heads, seq_len, head_dim]``.

A step's slots are **reserved** before the model runs (blocks allocated, a shared block
copied on write), so running out of blocks fails before any compute, with nothing changed:
``can_reserve(n)`` / ``reserve(token_ids)``. A forward without a reservation reserves by
itself, but the tokens' ids are then unknown and the sequence stops registering blocks with
the prefix cache. A prompt starts with ``PagedKVCache.for_prompt``: its cached prefix is
taken from the prefix cache (``seq_len`` starts at the hit) and the rest is reserved, so the
model runs only ``cache.pending_token_ids``.
"""

from __future__ import annotations

import torch

from infra_lib.model.cache import KVCache, LayerCache
from infra_lib.serving.block_pool import BlockAllocator, OutOfBlocks
from infra_lib.serving.block_table import BlockTable, blocks_needed
from infra_lib.serving.kv_store import PagedKVStore


class PagedLayerCache(LayerCache):
    """One decoder layer's view of a ``PagedKVCache``."""

    def __init__(self, sequence: "PagedKVCache", index: int):
        self.sequence, self.index, self._length = sequence, index, 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def k_cache(self) -> torch.Tensor:
        return self.sequence.store.k[self.index]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.sequence.store.v[self.index]

    @property
    def block_table(self) -> list[int]:
        return self.sequence.table.blocks

    def write(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store this step's ``[1, n_kv_heads, t, head_dim]`` keys/values in their slots."""
        if k_new.dim() != 4 or k_new.shape[0] != 1 or k_new.shape != v_new.shape:
            raise ValueError(
                f"a paged sequence takes k_new/v_new [1, n_kv_heads, t, head_dim] of one shape, "
                f"got {list(k_new.shape)} and {list(v_new.shape)}"
            )
        start = self._length
        end = self.sequence._start_layer_write(self.index, start, k_new.shape[2])
        slots = self.sequence.table.slot_mapping(start, end, device=self.k_cache.device)
        self.sequence.store.write(self.index, slots, k_new, v_new)
        self._length = end
        self.sequence._finish_layer_write()

    def append(self, k_new, v_new):
        self.write(k_new, v_new)
        return self.sequence.store.gather(self.index, self.block_table, self._length)


class PagedKVCache(KVCache):
    """One sequence in the paged store (batch 1), taking blocks from ``pool``."""

    def __init__(self, store: PagedKVStore, pool: BlockAllocator):
        if (store.num_blocks, store.block_size) != (pool.num_blocks, pool.block_size):
            raise ValueError(
                f"the store has {store.num_blocks} blocks of {store.block_size} slots but the pool "
                f"{pool.num_blocks} of {pool.block_size}: build both with the same numbers"
            )
        self.store, self.pool = store, pool
        self.table = BlockTable(pool.block_size)
        self.layers = [PagedLayerCache(self, i) for i in range(store.n_layers)]
        self._token_ids: list[int] | None = []  # ids of positions 0 .. reserved-1 (None: unknown)
        self._seq_len = self._reserved = 0
        self._step_end: int | None = None  # the length this step's layers write up to
        self._layers_written = 0
        self._blocks_registered = 0
        self.num_cached_tokens = 0  # positions taken from the prefix cache
        self.computed_tokens = 0  # positions whose K/V this sequence computed
        self.released = False

    @staticmethod
    def can_admit(pool: BlockAllocator, prompt_ids: list[int]) -> bool:
        """Whether ``for_prompt`` would find enough free blocks (cache hits on free blocks count)."""
        if getattr(pool, "prefix_cache", None) is not None:
            return pool.can_allocate_prompt(prompt_ids)
        return blocks_needed(len(prompt_ids), pool.block_size) <= pool.num_free

    @classmethod
    def for_prompt(cls, store: PagedKVStore, pool: BlockAllocator, prompt_ids: list[int]) -> "PagedKVCache":
        """Admit a prompt: blocks for all of it, the cached prefix shared (if the pool has a prefix
        cache). ``seq_len`` starts at the hit; the rest is reserved. ``OutOfBlocks`` changes nothing."""
        cache = cls(store, pool)
        prompt_ids = [int(t) for t in prompt_ids]
        if getattr(pool, "prefix_cache", None) is not None:
            blocks, cached = pool.allocate_prompt(prompt_ids)
        else:
            blocks, cached = pool.allocate(blocks_needed(len(prompt_ids), pool.block_size)), 0
        cache.table.blocks = blocks
        cache._token_ids, cache._reserved = prompt_ids, len(prompt_ids)
        cache._seq_len = cache.num_cached_tokens = cached
        cache._blocks_registered = cached // pool.block_size
        for layer in cache.layers:
            layer._length = cached
        return cache

    # --- the model's interface ---------------------------------------------------------------------

    def layer(self, index: int) -> PagedLayerCache:
        return self.layers[index]

    @property
    def seq_len(self) -> int:
        return self._seq_len

    # --- reserving, forking, releasing -------------------------------------------------------------

    @property
    def reserved(self) -> int:
        """Positions with slots ready: ``seq_len`` plus the tokens the next forward will write."""
        return self._reserved

    @property
    def pending_token_ids(self) -> list[int] | None:
        """The reserved tokens not yet computed (what the next forward runs); None if unknown."""
        return None if self._token_ids is None else self._token_ids[self._seq_len : self._reserved]

    @property
    def token_ids(self) -> list[int] | None:
        return None if self._token_ids is None else list(self._token_ids)

    def blocks_to_reserve(self, num_tokens: int) -> int:
        """Free blocks ``reserve`` would take: new blocks plus copies of shared blocks to be written."""
        end = self._reserved + num_tokens
        touched = [i for i in self.table.block_indices(self._reserved, end) if i < len(self.table)]
        copies = sum(1 for i in touched if self.pool.ref_count(self.table.blocks[i]) > 1)
        return max(0, blocks_needed(end, self.table.block_size) - len(self.table)) + copies

    def can_reserve(self, num_tokens: int) -> bool:
        return self.blocks_to_reserve(num_tokens) <= self.pool.num_free

    def reserve(self, token_ids: list[int]) -> None:
        """Make slots ready for ``token_ids``, the next forward's tokens. ``OutOfBlocks`` changes nothing."""
        self._reserve(len(token_ids), [int(t) for t in token_ids])

    def _reserve(self, num_tokens: int, token_ids: list[int] | None) -> None:
        self._check_usable()
        if self._step_end is not None:
            raise RuntimeError("cannot reserve while a forward pass is half way through the layers")
        need = self.blocks_to_reserve(num_tokens)
        if need > self.pool.num_free:
            raise OutOfBlocks(need, self.pool.num_free, self.pool.num_blocks)
        end = self._reserved + num_tokens
        for i in self.table.block_indices(self._reserved, end):
            if i < len(self.table):
                new, old = self.pool.prepare_write(self.table.blocks[i])
                if old is not None:
                    self.store.copy_block(old, new)
                    self.table.blocks[i] = new
        self.table.blocks += self.pool.allocate(max(0, blocks_needed(end, self.table.block_size) - len(self.table)))
        if self._token_ids is not None:
            self._token_ids = self._token_ids + token_ids if token_ids is not None else None
        self._reserved = end

    def fork(self) -> "PagedKVCache":
        """A child sequence sharing every block (parallel sampling, beam search); the first write
        into a shared block copies it."""
        self._check_usable()
        if self._reserved != self._seq_len or self._step_end is not None:
            raise RuntimeError("fork a sequence between steps, with no reserved tokens pending")
        child = PagedKVCache(self.store, self.pool)
        child.table.blocks = self.pool.fork(self.table.blocks)
        child._token_ids = self.token_ids
        child._seq_len = child._reserved = self._seq_len
        child._blocks_registered = self._blocks_registered
        for layer in child.layers:
            layer._length = self._seq_len
        return child

    def release(self) -> None:
        """Give every block back, tail first (see ``BlockPool.free``); the cache is then unusable."""
        self._check_usable()
        self.pool.free(list(reversed(self.table.blocks)))
        self.table.blocks = []
        self.released = True

    # --- the layers' bookkeeping ---------------------------------------------------------------------

    def _start_layer_write(self, index: int, start: int, num_tokens: int) -> int:
        self._check_usable()
        if start != self._seq_len:
            raise RuntimeError(f"layer {index} was written twice in one step")
        end = start + num_tokens
        if self._step_end is None:  # the first layer of this step
            if self._reserved == self._seq_len:
                self._reserve(num_tokens, None)
            elif end > self._reserved:
                raise ValueError(f"{num_tokens} tokens arrived but {self._reserved - self._seq_len} were reserved")
            self._step_end = end
        elif end != self._step_end:
            raise ValueError(f"layer {index} writes up to position {end}, another layer up to {self._step_end}")
        return end

    def _finish_layer_write(self) -> None:
        self._layers_written += 1
        if self._layers_written < len(self.layers):
            return
        self.computed_tokens += self._step_end - self._seq_len
        self._seq_len, self._step_end, self._layers_written = self._step_end, None, 0
        full = self._seq_len // self.table.block_size
        if self._token_ids is not None and full > self._blocks_registered and hasattr(self.pool, "cache_blocks"):
            bs = self.table.block_size
            self.pool.cache_blocks(self._token_ids[: full * bs], self.table.blocks[:full])
            self._blocks_registered = full

    def _check_usable(self) -> None:
        if self.released:
            raise RuntimeError("this sequence's blocks were released; admit it again to continue")

    def check_invariants(self) -> None:
        """seq_len <= reserved <= capacity, exactly the blocks reserved needs, each held, pending
        blocks private, known token ids for every reserved position, layers in step."""
        self.table.check_invariants()
        if self.released:
            if self.table.blocks:
                raise AssertionError("a released sequence still holds blocks")
            return
        if not 0 <= self._seq_len <= self._reserved <= self.table.capacity:
            raise AssertionError(f"seq_len {self._seq_len}, reserved {self._reserved}, capacity {self.table.capacity}")
        if len(self.table) != blocks_needed(self._reserved, self.table.block_size):
            raise AssertionError(f"{len(self.table)} blocks for {self._reserved} reserved positions")
        for b in self.table.blocks:
            if self.pool.ref_count(b) < 1:
                raise AssertionError(f"the table holds block {b}, which the pool counts as free")
        for i in self.table.block_indices(self._seq_len, self._reserved):
            if self.pool.ref_count(self.table.blocks[i]) != 1:
                raise AssertionError(f"block {self.table.blocks[i]} is reserved for writing but shared")
        if self._token_ids is not None and len(self._token_ids) != self._reserved:
            raise AssertionError(f"{len(self._token_ids)} token ids for {self._reserved} reserved positions")
        allowed = {self._seq_len} if self._step_end is None else {self._seq_len, self._step_end}
        if any(layer.length not in allowed for layer in self.layers):
            raise AssertionError(f"layer lengths {[layer.length for layer in self.layers]}, expected {allowed}")
