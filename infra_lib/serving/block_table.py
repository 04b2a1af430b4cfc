"""A sequence's block table: which physical block holds each run of ``block_size`` positions.

Position ``p`` of a sequence lives in block ``blocks[p // block_size]`` at offset
``p % block_size``, in the KV store's **slot**

    slot = block_id * block_size + offset

so the store, flattened to ``[num_blocks * block_size, ...]``, is addressed by slot alone.
Consecutive positions are contiguous only inside a block; the table is the indirection that
lets a sequence grow one block at a time, anywhere in memory.
"""

from __future__ import annotations

import torch


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that ``num_tokens`` positions occupy (the last one possibly part-full)."""
    return -(-num_tokens // block_size)


def wasted_slots(num_tokens: int, block_size: int) -> int:
    """Slots a sequence of ``num_tokens`` holds but does not fill: the empty tail of its last block
    (internal fragmentation, always below ``block_size``)."""
    return blocks_needed(num_tokens, block_size) * block_size - num_tokens


class BlockTable:
    """An ordered list of block ids and the slot mapping through it."""

    def __init__(self, block_size: int, blocks: list[int] | None = None):
        self.block_size = block_size
        self.blocks: list[int] = list(blocks or [])

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def capacity(self) -> int:
        """Positions the table's blocks can hold."""
        return len(self.blocks) * self.block_size

    def slot(self, position: int) -> int:
        if not 0 <= position < self.capacity:
            raise IndexError(f"position {position} lies outside the table's {self.capacity} slots")
        return self.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, start: int, end: int, device=None) -> torch.Tensor:
        """Slots of positions ``start .. end - 1``, ``[end - start]`` int64."""
        if not 0 <= start <= end <= self.capacity:
            raise IndexError(f"positions {start}..{end - 1} lie outside the table's {self.capacity} slots")
        positions = torch.arange(start, end, device=device)
        table = torch.tensor(self.blocks, dtype=torch.int64, device=device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def block_indices(self, start: int, end: int) -> range:
        """Indices into ``blocks`` of the blocks that positions ``start .. end - 1`` touch."""
        return range(start // self.block_size, blocks_needed(end, self.block_size)) if end > start else range(0)

    def check_invariants(self) -> None:
        """No block appears twice (one sequence never holds the same block at two places)."""
        if len(set(self.blocks)) != len(self.blocks):
            raise AssertionError(f"block table {self.blocks} holds a block twice")

    def __repr__(self) -> str:
        return f"BlockTable(block_size={self.block_size}, blocks={self.blocks})"
