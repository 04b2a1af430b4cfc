"""infra_lib.serving.BlockPool: the contract lab 07 re-implements (allocate, free, fork,
copy-on-write), its exact free-queue order, its errors, and a stateful property test against a
dictionary model of the same rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from infra_lib.serving import BlockPool, OutOfBlocks


def snapshot(pool: BlockPool) -> tuple:
    """Everything observable about a pool, as plain data."""
    return (
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        pool.free_block_ids(),
        pool.num_free,
        pool.num_used,
        pool.usage,
    )


def test_allocate_takes_the_front_of_the_free_queue_in_id_order():
    pool = BlockPool(6, 4)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4, 5] and pool.num_free == 6 and pool.usage == 0.0
    assert pool.allocate(2) == [0, 1] and pool.allocate(0) == [] and pool.allocate(3) == [2, 3, 4]
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert (pool.num_free, pool.num_used, pool.usage) == (1, 5, 5 / 6)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    pool.check_invariants()


def test_freed_blocks_join_the_back_in_the_given_order_lru():
    pool = BlockPool(6, 4)
    a, b = pool.allocate(3), pool.allocate(2)  # [0, 1, 2], [3, 4]; free queue [5]
    pool.free(list(reversed(a)))  # a sequence's table is freed tail first
    assert pool.free_block_ids() == [5, 2, 1, 0]
    pool.free(b)
    assert pool.free_block_ids() == [5, 2, 1, 0, 3, 4]
    assert pool.allocate(3) == [5, 2, 1]  # least recently freed first
    pool.check_invariants()


def test_fork_shares_and_a_shared_block_returns_only_when_every_holder_frees_it():
    pool = BlockPool(4, 2)
    parent = pool.allocate(2)
    child = pool.fork(parent)
    assert child == parent and child is not parent
    assert [pool.ref_count(b) for b in parent] == [2, 2] and pool.is_shared(0)
    pool.free(parent)
    assert pool.free_block_ids() == [2, 3] and pool.ref_count(0) == 1
    pool.free([1, 0])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    pool.check_invariants()


def test_copy_on_write_copies_only_shared_blocks():
    pool = BlockPool(4, 2)
    table = pool.allocate(2)  # [0, 1]
    assert pool.prepare_write(1) == (1, None)  # sole holder: write in place
    pool.fork(table)
    assert pool.prepare_write(1) == (2, 1)  # shared: a private copy from the front of the queue
    assert [pool.ref_count(b) for b in range(4)] == [2, 1, 1, 0] and pool.free_block_ids() == [3]
    assert pool.prepare_write(1) == (1, None)  # the other holder now holds it alone
    pool.check_invariants()


def test_out_of_blocks_is_clear_and_changes_nothing():
    pool = BlockPool(4, 2)
    table = pool.allocate(3)
    pool.fork(table)
    pool.allocate(1)
    before = snapshot(pool)
    with pytest.raises(OutOfBlocks, match=r"need 2 free KV block\(s\) but only 0 of 4") as caught:
        pool.allocate(2)
    assert isinstance(caught.value, RuntimeError) and (caught.value.requested, caught.value.free) == (2, 0)
    with pytest.raises(OutOfBlocks):
        pool.prepare_write(0)  # shared, and nothing free to copy into
    assert snapshot(pool) == before
    pool.check_invariants()


def test_double_free_and_bad_ids_raise_and_change_nothing():
    pool = BlockPool(4, 2)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.free([0, 1, 0])  # the second 0 would go below zero: neither 0 nor 1 is freed
    with pytest.raises(ValueError, match="double free"):
        pool.free([3])
    with pytest.raises(ValueError, match="not in 0..3"):
        pool.free([1, 4])
    with pytest.raises(ValueError, match="is free"):
        pool.fork([0, 2])
    with pytest.raises(ValueError, match="is free"):
        pool.prepare_write(3)
    for bad in (-1, 1.0, True, "0"):
        with pytest.raises(ValueError):
            pool.ref_count(bad)
    with pytest.raises(ValueError, match="non-negative"):
        pool.allocate(-1)
    assert snapshot(pool) == before
    pool.free(np.array([1, 0]))  # numpy and torch integers are block ids too
    assert pool.free_block_ids() == [2, 3, 1, 0]
    pool.check_invariants()


def test_bad_construction_is_refused():
    for args in ((0, 4), (4, 0), (2.5, 4)):
        with pytest.raises(ValueError, match="positive integer"):
            BlockPool(*args)


class PoolModel:
    """The pool's rules with a dict and a list: what lab 07's pool must reproduce."""

    def __init__(self, num_blocks: int):
        self.refs = {b: 0 for b in range(num_blocks)}
        self.queue = list(range(num_blocks))

    def allocate(self, n):
        if n > len(self.queue):
            return None
        taken, self.queue = self.queue[:n], self.queue[n:]
        for b in taken:
            self.refs[b] = 1
        return taken

    def free(self, ids):
        for b in ids:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.queue.append(b)

    def prepare_write(self, b):
        if self.refs[b] == 1:
            return b, None
        (new,) = self.allocate(1) or [None]
        if new is not None:
            self.refs[b] -= 1
        return new, b


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / fork / write / free sequences; every holder is a block table."""

    @initialize(num_blocks=st.integers(1, 8))
    def start(self, num_blocks):
        self.pool, self.model = BlockPool(num_blocks, 4), PoolModel(num_blocks)
        self.tables: list[list[int]] = []

    @rule(n=st.integers(0, 9))
    def allocate(self, n):
        expected = self.model.allocate(n)
        if expected is None:
            before = snapshot(self.pool)
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(n)
            assert snapshot(self.pool) == before
        else:
            assert self.pool.allocate(n) == expected
            self.tables.append(expected)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), reverse=st.booleans())
    def free(self, data, reverse):
        table = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        order = list(reversed(table)) if reverse else table
        self.pool.free(order)
        self.model.free(order)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        table = self.tables[data.draw(st.integers(0, len(self.tables) - 1))]
        self.tables.append(self.pool.fork(table))
        self.model.refs.update({b: self.model.refs[b] + 1 for b in table})
        assert self.tables[-1] == table

    @precondition(lambda self: any(self.tables))
    @rule(data=st.data())
    def write(self, data):
        table = data.draw(st.sampled_from([t for t in self.tables if t]))
        index = data.draw(st.integers(0, len(table) - 1))
        new, old = self.model.prepare_write(table[index])
        if new is None:
            before = snapshot(self.pool)
            with pytest.raises(OutOfBlocks):
                self.pool.prepare_write(table[index])
            assert snapshot(self.pool) == before
            return
        assert self.pool.prepare_write(table[index]) == (new, old)
        table[index] = new

    @rule(block=st.integers(0, 7))
    def double_free(self, block):
        if block >= self.pool.num_blocks:
            return
        before = snapshot(self.pool)
        with pytest.raises(ValueError):
            self.pool.free([block] * (self.model.refs[block] + 1))
        assert snapshot(self.pool) == before

    @invariant()
    def agrees_with_the_model(self):
        self.pool.check_invariants()
        refs = [self.model.refs[b] for b in range(self.pool.num_blocks)]
        assert snapshot(self.pool)[:2] == (refs, self.model.queue)
        holders = [sum(t.count(b) for t in self.tables) for b in range(self.pool.num_blocks)]
        assert refs == holders  # a block's count is the number of tables that hold it


BlockPoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, database=None, derandomize=True
)
test_block_pool_matches_its_model = BlockPoolMachine.TestCase
