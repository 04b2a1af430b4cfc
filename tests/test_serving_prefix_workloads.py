"""Prefix caching under engine-like workloads: a pool driven as an engine would (admit, decode,
fork, release, preemption right after a hit) remembers what each block holds, so a hit that
returns stale data fails; the hash and radix backends run in lockstep and must agree."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from infra_lib.serving import BlockPool, HashPrefixCache, OutOfBlocks, RadixPrefixCache, blocks_needed

BACKENDS = [HashPrefixCache, RadixPrefixCache]


class PrefixWorld:
    """A pool with a prefix cache, driven like an engine would, that remembers what each block
    holds (the full prefix its K/V were computed from) to prove a hit never returns stale data."""

    def __init__(self, backend, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks, block_size, backend(block_size))
        self.bs = block_size
        self.contents: dict[int, tuple] = {}
        self.seqs: list[dict] = []  # {"tokens": [...], "blocks": [...]}

    def admit(self, prompt: list[int], compute: bool = True):
        """Returns (blocks, num_cached) or None when the pool is too full."""
        if not self.pool.can_allocate_prompt(prompt):
            with pytest.raises(OutOfBlocks):
                self.pool.allocate_prompt(prompt)
            return None
        blocks, cached = self.pool.allocate_prompt(prompt)
        for i in range(cached // self.bs):
            assert self.contents[blocks[i]] == tuple(prompt[: (i + 1) * self.bs]), "a hit returned a stale block"
        seq = {"tokens": list(prompt), "blocks": blocks}
        if compute:
            self._compute(seq, cached)
        self.seqs.append(seq)
        return blocks, cached

    def _compute(self, seq, start):
        for i in range(start // self.bs, len(seq["blocks"])):
            self.contents[seq["blocks"][i]] = tuple(seq["tokens"][: (i + 1) * self.bs])
        self.pool.cache_blocks(seq["tokens"], seq["blocks"])

    def grow(self, index: int, new_tokens: list[int]) -> bool:
        """Decode ``new_tokens`` into sequence ``index``: copy-on-write, new blocks, register."""
        seq = self.seqs[index]
        old_len, end = len(seq["tokens"]), len(seq["tokens"]) + len(new_tokens)
        last = old_len // self.bs if old_len % self.bs else None
        copies = 1 if last is not None and self.pool.is_shared(seq["blocks"][last]) else 0
        extra = blocks_needed(end, self.bs) - len(seq["blocks"])
        if copies + extra > self.pool.num_free:
            return False
        if last is not None:
            new, old = self.pool.prepare_write(seq["blocks"][last])
            if old is not None:
                self.contents[new] = self.contents[old]
                seq["blocks"][last] = new
        seq["blocks"] += self.pool.allocate(extra)
        seq["tokens"] += new_tokens
        self._compute(seq, old_len - old_len % self.bs)
        return True

    def fork(self, index: int) -> None:
        seq = self.seqs[index]
        self.seqs.append({"tokens": list(seq["tokens"]), "blocks": self.pool.fork(seq["blocks"])})

    def release(self, index: int) -> None:
        self.pool.free(list(reversed(self.seqs.pop(index)["blocks"])))

    def state(self) -> tuple:
        pool = self.pool
        return (
            [pool.ref_count(b) for b in range(pool.num_blocks)],
            pool.free_block_ids(),
            sorted(pool.prefix_cache.cached_blocks()),
            [s["blocks"] for s in self.seqs],
        )

    def check(self) -> None:
        self.pool.check_invariants()
        holders = [sum(s["blocks"].count(b) for s in self.seqs) for b in range(self.pool.num_blocks)]
        assert [self.pool.ref_count(b) for b in range(self.pool.num_blocks)] == holders
        for b in self.pool.prefix_cache.cached_blocks():
            assert len(self.contents[b]) % self.bs == 0, f"block {b} is cached while part-full"


def random_prompt(rng: random.Random, history: list[list[int]]) -> list[int]:
    """A shared system prompt, or a branch off an earlier conversation, then new tokens."""
    systems = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [8] * 11]
    if history and rng.random() < 0.5:
        base = rng.choice(history)
        base = base[: rng.randint(1, len(base))]
    else:
        base = list(rng.choice(systems))
    return base + [rng.randrange(4) for _ in range(rng.randint(0, 6))] or [0]


@pytest.mark.parametrize("seed", range(6))
def test_hash_and_radix_backends_give_the_same_hits_on_seeded_workloads(seed):
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([6, 10, 16]), rng.choice([2, 3, 4])
    worlds = [PrefixWorld(backend, num_blocks, block_size) for backend in BACKENDS]
    history: list[list[int]] = []
    hit_tokens = 0
    for _ in range(150):
        action = rng.random()
        if action < 0.45 or not worlds[0].seqs:
            prompt = random_prompt(rng, history)
            results = [w.admit(prompt) for w in worlds]
            assert results[0] == results[1], f"the backends disagree on the prompt {prompt}"
            if results[0] is not None:
                hit_tokens += results[0][1]
                history.append(prompt)
        elif action < 0.65:
            index, tokens = rng.randrange(len(worlds[0].seqs)), [rng.randrange(4) for _ in range(rng.randint(1, 5))]
            assert len({w.grow(index, tokens) for w in worlds}) == 1
            history.append(list(worlds[0].seqs[index]["tokens"]))
        elif action < 0.72:
            index = rng.randrange(len(worlds[0].seqs))
            for w in worlds:
                w.fork(index)
        else:
            index = rng.randrange(len(worlds[0].seqs))
            for w in worlds:
                w.release(index)
        assert worlds[0].state() == worlds[1].state()
        for w in worlds:
            w.check()
    assert hit_tokens > 0  # the workload does reuse prefixes


@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_right_after_a_prefix_hit_leaves_counts_and_cache_consistent(backend):
    world = PrefixWorld(backend, num_blocks=8, block_size=2)
    system = [1, 2, 3, 4, 5, 6]
    world.admit(system + [7])
    world.release(0)
    blocks, cached = world.admit(system + [9, 9], compute=False)  # hit, then preempted before computing
    assert cached == 6
    world.release(0)
    world.check()
    again, cached = world.admit(system + [9, 9])  # re-admitted: the same hit
    assert again[:3] == blocks[:3] and cached == 6
    world.check()
    world.release(0)
    assert world.pool.num_free == 8 and world.pool.prefix_cache.cached_blocks() == set(again)


class PrefixPoolMachine(RuleBasedStateMachine):
    """Admit / grow / fork / release / preempt-after-hit on both backends in lockstep."""

    @initialize(num_blocks=st.integers(2, 10), block_size=st.integers(1, 3))
    def start(self, num_blocks, block_size):
        self.worlds = [PrefixWorld(b, num_blocks, block_size) for b in BACKENDS]

    @rule(
        system=st.sampled_from([[], [1, 2, 3], [1, 2, 3, 4, 5, 6]]),
        tail=st.lists(st.integers(0, 2), max_size=4),
        preempt=st.booleans(),
    )
    def admit(self, system, tail, preempt):
        prompt = system + tail or [0]
        results = [w.admit(prompt, compute=not preempt) for w in self.worlds]
        assert results[0] == results[1]
        if preempt and results[0] is not None:
            for w in self.worlds:
                w.release(len(w.seqs) - 1)

    @precondition(lambda self: self.worlds[0].seqs)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def grow(self, data, tokens):
        index = data.draw(st.integers(0, len(self.worlds[0].seqs) - 1))
        assert len({w.grow(index, tokens) for w in self.worlds}) == 1

    @precondition(lambda self: self.worlds[0].seqs)
    @rule(data=st.data())
    def fork(self, data):
        index = data.draw(st.integers(0, len(self.worlds[0].seqs) - 1))
        for w in self.worlds:
            w.fork(index)

    @precondition(lambda self: self.worlds[0].seqs)
    @rule(data=st.data())
    def release(self, data):
        index = data.draw(st.integers(0, len(self.worlds[0].seqs) - 1))
        for w in self.worlds:
            w.release(index)

    @invariant()
    def consistent(self):
        for w in self.worlds:
            w.check()
        assert self.worlds[0].state() == self.worlds[1].state()


PrefixPoolMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None, database=None, derandomize=True
)
test_prefix_pool_matches_across_backends = PrefixPoolMachine.TestCase
