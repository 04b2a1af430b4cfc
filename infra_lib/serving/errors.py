"""The serving layer's errors, in a module of their own so that code outside the library (a
lab's own block pool, a scheduler) can raise and catch them without importing the pool."""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """More free blocks were needed than the pool has; nothing was changed."""

    def __init__(self, requested: int, free: int, total: int):
        self.requested, self.free, self.total = requested, free, total
        super().__init__(
            f"need {requested} free KV block(s) but only {free} of {total} are free: finish or "
            "preempt a sequence to free its blocks, or give the pool more blocks"
        )
