"""Prefix caching: find blocks that already hold the K/V of a prompt's first tokens.

Two prompts that start with the same tokens (a chat template's system prompt, a shared few-shot
preamble, an earlier turn of the conversation) produce the same keys and values for those
tokens, so a block computed for one can serve the other. Only **full** blocks are shared: a
block is identified by *all* the tokens up to its end, through a chain of hashes

    hash(block 0) = H(None,            tokens of block 0)
    hash(block i) = H(hash(block i-1), tokens of block i)

so the same 16 tokens after different histories are different blocks (their K/V differ:
attention mixed in the history).

A ``PrefixCache`` maps such prefixes to block ids. Two interchangeable backends:
``HashPrefixCache`` (a dict from chained hash to block, as vLLM does) here, and
``RadixPrefixCache`` (a tree whose edges are blocks, as SGLang's radix tree does) in
``radix_cache.py``. They must give the same answers; a differential test checks it.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import Sequence


def block_hash(parent: bytes | None, block_tokens: Sequence[int]) -> bytes:
    """The chained hash of one full block: sha256 of the parent's hash and the block's token ids
    (stable across processes, so a notebook can print it)."""
    h = hashlib.sha256(parent or b"root")
    h.update(b",".join(str(int(t)).encode() for t in block_tokens))
    return h.digest()


def chained_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes, parent = [], None
    for i in range(count):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class PrefixCache(ABC):
    """Where full blocks are found by the tokens they hold.

    The cache never owns blocks: the ``BlockPool`` does. The pool calls ``insert`` once a
    sequence's full blocks are written, ``match`` when a prompt arrives, and ``evict`` when it
    hands a free, cached block out again (its contents are about to be overwritten).
    """

    def __init__(self, block_size: int):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest run of cached full blocks from the prompt's start.

        Capped so that at least the prompt's last token is computed (its logits give the first
        output token): a fully cached prompt whose length is a multiple of ``block_size`` drops its
        last block from the hit, and that block is recomputed.
        """
        max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        return self.longest_prefix(token_ids, max_blocks)

    @abstractmethod
    def longest_prefix(self, token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the first ``k <= max_blocks`` full blocks of ``token_ids``, all cached, ``k``
        as large as possible (stops at the first block not cached)."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """Register the full blocks of a sequence: ``block_ids[i]`` holds tokens
        ``i * block_size .. (i + 1) * block_size - 1``. A prefix already cached keeps its
        block (first come, first kept), and the duplicate block stays uncached. Raises
        ``ValueError`` when a block already caches a different prefix."""

    @abstractmethod
    def evict(self, block_id: int) -> bool:
        """Forget a block (its slots are about to be reused); False if it was not cached. Blocks
        after it in a chain stay cached but cannot be matched until it is cached again."""

    @abstractmethod
    def is_cached(self, block_id: int) -> bool: ...

    @abstractmethod
    def cached_blocks(self) -> set[int]: ...

    @abstractmethod
    def check_invariants(self) -> None: ...

    def __len__(self) -> int:
        return len(self.cached_blocks())

    def _full_blocks(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` are full blocks of ``token_ids``."""
        full = len(token_ids) // self.block_size
        if len(block_ids) < full:
            raise ValueError(
                f"{len(token_ids)} tokens fill {full} blocks of {self.block_size} but only "
                f"{len(block_ids)} block ids were given"
            )
        return full


class HashPrefixCache(PrefixCache):
    """A dict from chained block hash to block id, and its inverse."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    def longest_prefix(self, token_ids, max_blocks):
        hits = []
        for h in chained_block_hashes(token_ids, self.block_size, max_blocks):
            if h not in self._block_of:
                break
            hits.append(self._block_of[h])
        return hits

    def insert(self, token_ids, block_ids):
        hashes = chained_block_hashes(token_ids, self.block_size, self._full_blocks(token_ids, block_ids))
        for h, b in zip(hashes, block_ids):  # check first, so a refused insert changes nothing
            if self._hash_of.get(b, h) != h:
                raise ValueError(f"block {b} already caches another prefix; evict it before reusing it")
        for h, b in zip(hashes, block_ids):
            if h not in self._block_of:
                self._block_of[h], self._hash_of[b] = b, h

    def evict(self, block_id):
        h = self._hash_of.pop(block_id, None)
        if h is None:
            return False
        del self._block_of[h]
        return True

    def is_cached(self, block_id):
        return block_id in self._hash_of

    def cached_blocks(self):
        return set(self._hash_of)

    def check_invariants(self):
        if len(self._block_of) != len(self._hash_of):
            raise AssertionError(
                f"{len(self._block_of)} hashes map to blocks but {len(self._hash_of)} blocks map to hashes"
            )
        for h, b in self._block_of.items():
            if self._hash_of.get(b) != h:
                raise AssertionError(f"hash {h.hex()[:12]} names block {b}, which maps back to another hash")
