"""The block pool: fixed-size KV blocks handed out by reference count (PagedAttention's allocator).

The KV store is cut into ``num_blocks`` blocks of ``block_size`` token slots. The pool only
keeps the books, never touches tensors:

* every block ``0 .. num_blocks - 1`` has a reference count (how many sequences' block tables
  hold it); a block is **free** exactly when its count is 0;
* free blocks wait in one **free queue**, in eviction order. It starts as ``0, 1, 2, ...``;
  ``allocate`` takes from the front, and a block whose count drops to 0 joins the back, so the
  block freed longest ago is reused first (LRU);
* ``fork`` shares blocks (counts + 1) and ``prepare_write`` is copy-on-write: a shared block is
  never written, the writer gets a private copy first;
* with a ``PrefixCache``, a free block keeps its contents and stays findable by the prefix it
  holds until ``allocate`` hands it out again (then the pool evicts it from the cache).

Every operation either succeeds completely or raises and changes nothing.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable, Protocol

from infra_lib.serving.errors import OutOfBlocks

if TYPE_CHECKING:
    from infra_lib.serving.prefix_cache import PrefixCache


class BlockAllocator(Protocol):
    """What a paged KV cache needs from a pool (``BlockPool``, or a lab's own pool)."""

    block_size: int
    num_blocks: int

    @property
    def num_free(self) -> int: ...
    def ref_count(self, block_id: int) -> int: ...
    def allocate(self, n: int) -> list[int]: ...
    def free(self, block_ids: Iterable[int]) -> None: ...
    def fork(self, block_ids: Iterable[int]) -> list[int]: ...
    def prepare_write(self, block_id: int) -> tuple[int, int | None]: ...


class BlockPool:
    """Reference-counted KV blocks with an LRU free queue, copy-on-write and optional prefix caching.

    Args:
        num_blocks: blocks in the pool, ids ``0 .. num_blocks - 1``.
        block_size: token slots per block.
        prefix_cache: where full blocks are registered by the tokens they hold (None: no reuse).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None = None):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if prefix_cache is not None and prefix_cache.block_size != block_size:
            raise ValueError(
                f"the prefix cache hashes blocks of {prefix_cache.block_size} tokens but the pool's "
                f"blocks hold {block_size}: build both with the same block_size"
            )
        self.num_blocks, self.block_size, self.prefix_cache = num_blocks, block_size, prefix_cache
        self._ref_counts = [0] * num_blocks
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = next out

    # --- what the pool holds ---------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with reference count 0 (cached-but-unreferenced blocks count as free)."""
        return len(self._free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return self.num_used / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[self._check_id(block_id)]

    def is_shared(self, block_id: int) -> bool:
        """More than one table holds the block: writing it needs a copy first."""
        return self.ref_count(block_id) > 1

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next to be allocated) first."""
        return list(self._free_queue)

    # --- allocate / free / fork / copy-on-write --------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        return self._check_count(n) <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue, each with reference count 1.

        ``allocate(0)`` returns ``[]``. A taken block that the prefix cache knows is evicted from it
        (its slots are about to be overwritten). Raises ``OutOfBlocks`` (changing nothing) when
        fewer than ``n`` are free, ``ValueError`` when ``n`` is not a non-negative integer.
        """
        if not self.can_allocate(n):
            raise OutOfBlocks(n, self.num_free, self.num_blocks)
        taken = []
        for _ in range(n):
            block_id, _ = self._free_queue.popitem(last=False)
            if self.prefix_cache is not None and self.prefix_cache.is_cached(block_id):
                self.prefix_cache.evict(block_id)
            self._ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in the given order; a block reaching 0 joins the back
        of the free queue (it stays in the prefix cache, if cached, until reused).

        Callers free a sequence's table **reversed** (last block first), so among one sequence's
        blocks the tail is reused first and the shared-prefix head survives longest.
        Raises ``ValueError`` (changing nothing) when a block would drop below 0 (a double free).
        """
        block_ids = self._check_ids(block_ids)
        drops: dict[int, int] = {}
        for b in block_ids:
            drops[b] = drops.get(b, 0) + 1
            if drops[b] > self._ref_counts[b]:
                raise ValueError(
                    f"block {b} has reference count {self._ref_counts[b]} and cannot be freed "
                    f"{drops[b]} time(s) (a double free): free each table's blocks once"
                )
        for b in block_ids:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free_queue[b] = None

    def fork(self, block_ids: Iterable[int]) -> list[int]:
        """Share blocks with a new table: each count + 1; returns the same ids as a new list.

        Raises ``ValueError`` (changing nothing) for a free block.
        """
        block_ids = self._check_ids(block_ids)
        for b in block_ids:
            if self._ref_counts[b] == 0:
                raise ValueError(f"block {b} is free; only blocks some table holds can be shared")
        for b in block_ids:
            self._ref_counts[b] += 1
        return list(block_ids)

    def prepare_write(self, block_id: int) -> tuple[int, int | None]:
        """Copy-on-write: the block a table must write into instead of ``block_id``.

        Returns ``(block_id, None)`` when the caller holds the only reference (write in place),
        else ``(new_id, block_id)``: ``new_id`` comes from the front of the free queue with count 1,
        ``block_id`` loses the caller's reference, and the caller copies the old block's slots into
        the new one before writing. Raises ``OutOfBlocks`` (changing nothing) when a copy is needed
        and no block is free, ``ValueError`` for a free block.
        """
        block_id = self._check_id(block_id)
        count = self._ref_counts[block_id]
        if count == 0:
            raise ValueError(f"block {block_id} is free; a table can only write blocks it holds")
        if count == 1:
            return block_id, None
        (new_id,) = self.allocate(1)
        self._ref_counts[block_id] -= 1  # stays >= 1: others still hold it
        return new_id, block_id

    # --- prefix caching ---------------------------------------------------------------------------

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of a prompt (see ``PrefixCache.match``)."""
        return self.prefix_cache.match(token_ids) if self.prefix_cache is not None else []

    def blocks_for_prompt(self, token_ids: list[int]) -> int:
        """Free blocks ``allocate_prompt`` would consume: new blocks plus cache hits now free."""
        hits = self.cached_prefix(token_ids)
        needed = -(-len(token_ids) // self.block_size)
        return needed - len(hits) + sum(1 for b in hits if self._ref_counts[b] == 0)

    def can_allocate_prompt(self, token_ids: list[int]) -> bool:
        return self.blocks_for_prompt(token_ids) <= self.num_free

    def allocate_prompt(self, token_ids: list[int]) -> tuple[list[int], int]:
        """Blocks for a whole prompt: the cached prefix's blocks, shared, then fresh ones.

        A hit on a free block takes it out of the free queue (count 0 -> 1); hits are taken before
        any fresh block, so the fresh ones never evict a block this prompt is about to reuse.
        Returns ``(block_ids, num_cached_tokens)``. All or nothing: ``OutOfBlocks`` changes nothing.
        """
        hits = self.cached_prefix(token_ids)
        needed = self.blocks_for_prompt(token_ids)
        if needed > self.num_free:
            raise OutOfBlocks(needed, self.num_free, self.num_blocks)
        for b in hits:
            if self._ref_counts[b] == 0:
                del self._free_queue[b]
            self._ref_counts[b] += 1
        total = -(-len(token_ids) // self.block_size)
        return hits + self.allocate(total - len(hits)), len(hits) * self.block_size

    def cache_blocks(self, token_ids: list[int], block_ids: list[int]) -> None:
        """Register a sequence's full blocks (their K/V now written) with the prefix cache."""
        if self.prefix_cache is None:
            return
        for b in self._check_ids(block_ids):
            if self._ref_counts[b] == 0:
                raise ValueError(f"block {b} is free; register blocks while a table still holds them")
        self.prefix_cache.insert(token_ids, block_ids)

    # --- checks -----------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Counts are never negative; a block is in the free queue iff its count is 0; the queue has
        no duplicates; free + used = total; the prefix cache is consistent and names real blocks."""
        if len(self._ref_counts) != self.num_blocks:
            raise AssertionError(f"{len(self._ref_counts)} reference counts for {self.num_blocks} blocks")
        negative = [b for b, c in enumerate(self._ref_counts) if c < 0]
        if negative:
            raise AssertionError(f"blocks {negative} have negative reference counts")
        queue = list(self._free_queue)
        if len(set(queue)) != len(queue):
            raise AssertionError(f"the free queue holds duplicates: {queue}")
        zero = {b for b, c in enumerate(self._ref_counts) if c == 0}
        if set(queue) != zero:
            raise AssertionError(f"free queue {sorted(queue)} differs from the blocks with count 0 {sorted(zero)}")
        if self.num_free + self.num_used != self.num_blocks:
            raise AssertionError(f"free {self.num_free} + used {self.num_used} != {self.num_blocks}")
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
            stray = [b for b in self.prefix_cache.cached_blocks() if not 0 <= b < self.num_blocks]
            if stray:
                raise AssertionError(f"the prefix cache names blocks {stray} outside 0..{self.num_blocks - 1}")

    def _check_id(self, block_id) -> int:
        try:
            index = operator.index(block_id) if not isinstance(block_id, bool) else None
        except TypeError:
            index = None
        if index is None or not 0 <= index < self.num_blocks:
            raise ValueError(f"block id {block_id!r} is not in 0..{self.num_blocks - 1}")
        return index

    def _check_ids(self, block_ids: Iterable[int]) -> list[int]:
        return [self._check_id(b) for b in block_ids]

    @staticmethod
    def _check_count(n) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"the number of blocks must be a non-negative integer, got {n!r}")
        return n

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, free={self.num_free}, "
            f"prefix_cache={type(self.prefix_cache).__name__ if self.prefix_cache else None})"
        )
