"""The paged KV cache on a tiny random model: paged attention equals contiguous attention, the
model runs unchanged on blocks, forks copy on write, prefix hits skip prefill work, running out
of blocks fails cleanly, and a pool with only the lab's interface plugs in (SmolLM2's greedy
tokens are in test_serving_paged_smollm2.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from infra_lib.model import DenseKVCache, Llama, LlamaConfig, greedy_decode
from infra_lib.model.attention import attention
from infra_lib.serving import (
    BlockPool,
    BlockTable,
    HashPrefixCache,
    OutOfBlocks,
    PagedKVCache,
    PagedKVStore,
    RadixPrefixCache,
    paged_attention,
    paged_cached_attention,
    paged_greedy_decode,
    wasted_slots,
)

TINY = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    max_position=128,
)


@pytest.fixture(scope="module")
def tiny() -> Llama:
    torch.manual_seed(0)
    return Llama(TINY).eval()


def paged(num_blocks: int, block_size: int, prefix_cache=None, config: LlamaConfig = TINY):
    pool = BlockPool(num_blocks, block_size, prefix_cache)
    return PagedKVStore.for_model(config, num_blocks, block_size), pool


def dense_logits(model: Llama, steps: list[list[int]]) -> list[torch.Tensor]:
    """Logits of each step of one sequence fed through a contiguous cache."""
    cache = DenseKVCache.for_model(model.config, capacity=sum(map(len, steps)))
    with torch.no_grad():
        return [model(torch.tensor([s]), cache) for s in steps]


@pytest.mark.parametrize("block_size", [1, 3, 8])
@pytest.mark.parametrize("t", [1, 5])
def test_paged_attention_equals_contiguous_attention(block_size, t):
    gen = torch.Generator().manual_seed(block_size * 10 + t)
    n_heads, n_kv_heads, head_dim, num_blocks = 6, 2, 16, 40
    lengths = [t, 7 + t, 23]  # ragged, the shortest all new tokens
    k_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # tables point anywhere, out of order
    tables, used = [], 0
    for s in lengths:
        n = -(-s // block_size)
        tables.append(order[used : used + n])
        used += n
    q = torch.randn(len(lengths), n_heads, t, head_dim, generator=gen)
    out = paged_attention(q, k_cache, v_cache, tables, lengths)
    padded = torch.zeros(len(tables), max(map(len, tables)) + 2, dtype=torch.int64)
    for b, table in enumerate(tables):
        padded[b, : len(table)] = torch.tensor(table)
    assert torch.equal(paged_attention(q, k_cache, v_cache, padded, torch.tensor(lengths)), out)
    for b, (table, s) in enumerate(zip(tables, lengths)):
        slots = [BlockTable(block_size, table).slot(p) for p in range(s)]
        k = k_cache.reshape(-1, n_kv_heads, head_dim)[slots].transpose(0, 1)[None]  # [1, kv, s, hd]
        v = v_cache.reshape(-1, n_kv_heads, head_dim)[slots].transpose(0, 1)[None]
        torch.testing.assert_close(out[b : b + 1], attention(q[b : b + 1], k, v), rtol=1e-5, atol=1e-5)


def test_block_table_slot_mapping_and_bad_inputs():
    table = BlockTable(4, [7, 2, 5])
    assert [table.slot(p) for p in (0, 3, 4, 9)] == [28, 31, 8, 21]
    assert table.slot_mapping(2, 6).tolist() == [30, 31, 8, 9] and table.capacity == 12
    assert list(table.block_indices(3, 9)) == [0, 1, 2] and list(table.block_indices(4, 4)) == []
    assert [wasted_slots(n, 4) for n in (0, 1, 4, 5, 11)] == [0, 3, 0, 3, 1]
    with pytest.raises(IndexError, match="outside the table's 12 slots"):
        table.slot(12)
    q = torch.zeros(1, 2, 1, 4)
    cache = torch.zeros(8, 4, 1, 4)
    with pytest.raises(ValueError, match="its table holds 1 blocks"):
        paged_attention(q, cache, cache, [[0]], [5])
    with pytest.raises(ValueError, match="each >= t=1"):
        paged_attention(q, cache, cache, [[0]], [0])


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kernel", ["append", "paged_attention"])
def test_the_model_on_a_paged_cache_equals_the_contiguous_cache(tiny, block_size, kernel):
    steps = [[5, 9, 11, 3, 7, 1, 2, 8, 60, 4, 4], [17], [33], [2, 6, 40], [9]]
    store, pool = paged(32, block_size)
    cache = PagedKVCache.for_prompt(store, pool, steps[0])
    outputs = []
    swap = tiny.using_attention(paged_cached_attention) if kernel == "paged_attention" else contextlib.nullcontext()
    with torch.no_grad(), swap:
        for i, step in enumerate(steps):
            if i:
                cache.reserve(step)
            outputs.append(tiny(torch.tensor([step]), cache))
            cache.check_invariants()
            pool.check_invariants()
    store.check_invariants()
    for got, want in zip(outputs, dense_logits(tiny, steps)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cache.seq_len == 17 and cache.computed_tokens == 17 and len(cache.table) == -(-17 // block_size)
    cache.release()
    assert pool.num_free == 32 and cache.released
    pool.check_invariants()


def test_a_fork_shares_blocks_and_copies_the_partial_block_on_write(tiny):
    prompt = [3, 1, 4, 1, 5, 9, 2]  # 7 tokens: blocks of 4 -> one full, one part-full
    store, pool = paged(8, 4)
    parent = PagedKVCache.for_prompt(store, pool, prompt)
    with torch.no_grad():
        tiny(torch.tensor([prompt]), parent)
        child = parent.fork()
        assert child.table.blocks == parent.table.blocks == [0, 1] and pool.ref_count(1) == 2
        assert parent.blocks_to_reserve(1) == 1  # the shared part-full block must be copied
        parent.reserve([6])
        assert parent.table.blocks == [0, 2] and pool.ref_count(1) == 1 and pool.ref_count(0) == 2
        parent_out = tiny(torch.tensor([[6]]), parent)
        child.reserve([50, 51])
        assert child.table.blocks == [0, 1, 3]  # the child now holds block 1 alone: written in place
        child_out = tiny(torch.tensor([[50, 51]]), child)
    for cache in (parent, child):
        cache.check_invariants()
    pool.check_invariants()
    torch.testing.assert_close(parent_out, dense_logits(tiny, [prompt, [6]])[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(child_out, dense_logits(tiny, [prompt, [50, 51]])[1], rtol=1e-5, atol=1e-5)
    child.release()
    parent.release()
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 1, 2, 0]  # each table freed tail first


@pytest.mark.parametrize("backend", [HashPrefixCache, RadixPrefixCache])
def test_a_prefix_hit_computes_only_the_suffix_and_gives_the_same_logits(tiny, backend):
    system = [1, 10, 11, 12, 13, 14, 15, 16, 17, 2]
    first, second = system + [20, 21, 22], system + [30, 31]
    store, pool = paged(16, 4, backend(4))
    a = PagedKVCache.for_prompt(store, pool, first)
    with torch.no_grad():
        tiny(torch.tensor([a.pending_token_ids]), a)
        b = PagedKVCache.for_prompt(store, pool, second)
        assert (b.num_cached_tokens, b.seq_len, b.pending_token_ids) == (8, 8, [17, 2, 30, 31])
        assert b.table.blocks[:2] == a.table.blocks[:2] and pool.ref_count(a.table.blocks[0]) == 2
        out = tiny(torch.tensor([b.pending_token_ids]), b)
    assert b.computed_tokens == 4
    torch.testing.assert_close(out[:, -1], dense_logits(tiny, [second])[0][:, -1], rtol=1e-5, atol=1e-5)
    for cache in (a, b):
        cache.check_invariants()
    pool.check_invariants()


def test_running_out_of_blocks_mid_sequence_changes_nothing_and_can_resume(tiny):
    store, pool = paged(3, 2)
    other = PagedKVCache.for_prompt(store, pool, [1, 2])  # holds block 0
    seq = PagedKVCache.for_prompt(store, pool, [5, 6, 7])  # blocks 1, 2
    with torch.no_grad():
        tiny(torch.tensor([[5, 6, 7]]), seq)
        seq.reserve([8])  # fills block 2: no new block needed
        tiny(torch.tensor([[8]]), seq)
        assert not seq.can_reserve(1) and seq.blocks_to_reserve(1) == 1
        before = (
            seq.table.blocks[:],
            seq.seq_len,
            seq.reserved,
            pool.free_block_ids(),
            [pool.ref_count(b) for b in range(3)],
        )
        with pytest.raises(OutOfBlocks, match="need 1 free KV block"):
            seq.reserve([9])
        with pytest.raises(OutOfBlocks):
            tiny(torch.tensor([[9]]), seq)  # an unreserved forward reserves by itself, and fails first
        assert (
            seq.table.blocks,
            seq.seq_len,
            seq.reserved,
            pool.free_block_ids(),
            [pool.ref_count(b) for b in range(3)],
        ) == before
        seq.check_invariants()
        pool.check_invariants()
        other.release()  # preempt the other sequence; this one carries on
        seq.reserve([9])
        out = tiny(torch.tensor([[9]]), seq)
    torch.testing.assert_close(out, dense_logits(tiny, [[5, 6, 7], [8], [9]])[2], rtol=1e-5, atol=1e-5)
    assert pool.num_free == 0 and not PagedKVCache.can_admit(pool, [1])
    seq.release()
    assert PagedKVCache.can_admit(pool, [1] * 6) and not PagedKVCache.can_admit(pool, [1] * 7)
    with pytest.raises(OutOfBlocks):
        PagedKVCache.for_prompt(store, pool, [1] * 7)
    pool.check_invariants()


def test_a_forward_without_reserve_works_but_stops_registering_prefixes(tiny):
    store, pool = paged(8, 2, HashPrefixCache(2))
    cache = PagedKVCache.for_prompt(store, pool, [1, 2, 3])
    with torch.no_grad():
        tiny(torch.tensor([[1, 2, 3]]), cache)
        assert pool.prefix_cache.cached_blocks() == {0}
        tiny(torch.tensor([[4]]), cache)  # the cache sees keys and values, not the token's id
    assert cache.token_ids is None and pool.prefix_cache.cached_blocks() == {0}
    cache.check_invariants()


class ProtocolOnlyPool:
    """A pool with only what lab 07's learner writes (no prefix cache): the paged cache must
    need nothing more."""

    def __init__(self, num_blocks, block_size):
        self._pool = BlockPool(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size

    num_free = property(lambda self: self._pool.num_free)

    def __getattr__(self, name):
        if name not in ("ref_count", "allocate", "free", "fork", "prepare_write"):
            raise AttributeError(name)
        return getattr(self._pool, name)


def test_a_pool_with_only_the_lab_interface_plugs_into_the_paged_cache(tiny):
    pool = ProtocolOnlyPool(6, 2)
    store = PagedKVStore.for_model(TINY, 6, 2)
    out = paged_greedy_decode(tiny, store, pool, [3, 4, 5], 4)
    assert out.token_ids == greedy_decode(tiny, [3, 4, 5], 4) and pool.num_free == 6
    pool._pool.check_invariants()


def test_misuse_gets_clear_errors(tiny):
    store, pool = paged(4, 2)
    with pytest.raises(ValueError, match="same numbers"):
        PagedKVCache(PagedKVStore.for_model(TINY, 5, 2), pool)
    cache = PagedKVCache.for_prompt(store, pool, [1, 2, 3])
    with pytest.raises(RuntimeError, match="between steps"):
        cache.fork()
    with torch.no_grad(), pytest.raises(ValueError, match="but 3 were reserved"):
        tiny(torch.tensor([[1, 2, 3, 4]]), cache)
    cache.release()
    with pytest.raises(RuntimeError, match="released"):
        cache.reserve([1])
    with pytest.raises(ValueError, match="at least one token"):
        paged_greedy_decode(tiny, store, pool, [], 2)
