"""Prefix caching: chained block hashes, the hit cap (a fully cached prompt still computes its
last token), hits on free blocks, eviction, and hits never evicted by their own allocation."""

from __future__ import annotations

import pytest

from infra_lib.serving import BlockPool, HashPrefixCache, OutOfBlocks, RadixPrefixCache, chained_block_hashes

BACKENDS = [HashPrefixCache, RadixPrefixCache]


def test_chained_hashes_identify_a_block_by_everything_before_it():
    a = chained_block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = chained_block_hashes([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3  # the trailing partial block has no hash
    assert a[1] != b[1]  # same tokens (3, 4), different history
    assert a == chained_block_hashes([1, 2, 3, 4, 5, 6, 8], 2)  # the partial block does not count
    assert chained_block_hashes([1, 2, 3, 4], 2, max_blocks=1) == a[:1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_match_leaves_at_least_the_last_prompt_token_to_compute(backend):
    cache = backend(4)
    cache.insert(list(range(12)), [7, 8, 9])
    assert cache.match(list(range(13))) == [7, 8, 9]  # the 13th token is computed
    assert cache.match(list(range(12))) == [7, 8]  # fully cached, a multiple of 4: the last block is recomputed
    assert cache.match(list(range(11))) == [7, 8]
    assert cache.match([0, 1, 2]) == [] and cache.match([]) == []
    assert cache.match([0, 1, 2, 3, 99, 5, 6, 7, 8]) == [7]
    cache.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_insert_keeps_the_first_block_and_refuses_a_block_with_other_contents(backend):
    cache = backend(2)
    cache.insert([1, 2, 3, 4], [0, 1])
    cache.insert([1, 2, 3, 4, 5, 6], [5, 6, 2])  # the same prefix computed twice: 0 and 1 stay
    assert cache.match([1, 2, 3, 4, 5, 6, 0]) == [0, 1, 2] and not cache.is_cached(5)
    with pytest.raises(ValueError, match="block 1 already caches another prefix"):
        cache.insert([7, 7, 8, 8], [3, 1])
    assert cache.cached_blocks() == {0, 1, 2} and not cache.is_cached(3)
    cache.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_evicted_block_cuts_the_chain_until_it_is_cached_again(backend):
    cache = backend(2)
    cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    assert cache.evict(0) and not cache.evict(0)
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == [] and cache.cached_blocks() == {1, 2}
    cache.insert([1, 2], [4])
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == [4, 1, 2]
    for b in (4, 1, 2):
        cache.evict(b)
    assert len(cache) == 0
    if backend is RadixPrefixCache:
        assert cache.num_nodes() == 0  # placeholders without blocks below them are pruned
    cache.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hit_on_a_free_block_takes_it_out_of_the_free_queue(backend):
    pool = BlockPool(6, 2, backend(2))
    prompt = [1, 2, 3, 4, 5]
    blocks, cached = pool.allocate_prompt(prompt)
    assert (blocks, cached) == ([0, 1, 2], 0)
    pool.cache_blocks(prompt, blocks)
    pool.free(list(reversed(blocks)))
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0] and pool.prefix_cache.cached_blocks() == {0, 1}
    blocks, cached = pool.allocate_prompt([1, 2, 3, 4, 9, 9])
    assert (blocks, cached) == ([0, 1, 3], 4)  # hits 0, 1 (count 0 -> 1), then a fresh block
    assert pool.free_block_ids() == [4, 5, 2] and [pool.ref_count(b) for b in blocks] == [1, 1, 1]
    other, cached = pool.allocate_prompt([1, 2, 7])  # a hit on a block in use shares it
    assert (other, cached) == ([0, 4], 2) and pool.ref_count(0) == 2
    pool.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_reusing_a_cached_free_block_evicts_it(backend):
    pool = BlockPool(2, 2, backend(2))
    blocks, _ = pool.allocate_prompt([1, 2, 3, 4])
    pool.cache_blocks([1, 2, 3, 4], blocks)
    pool.free(blocks)  # in order: block 0 is reused first
    assert pool.allocate(1) == [0] and pool.prefix_cache.cached_blocks() == {1}
    assert pool.cached_prefix([1, 2, 3, 4, 5]) == []  # block 1 stays cached but out of reach
    pool.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_hits_are_taken_before_fresh_blocks_so_they_are_not_evicted_by_their_own_prompt(backend):
    pool = BlockPool(3, 2, backend(2))
    blocks, _ = pool.allocate_prompt([1, 2, 3, 4])
    pool.cache_blocks([1, 2, 3, 4], blocks)
    pool.free(blocks)  # free queue [2, 0, 1]: take 2 first
    pool.allocate(1)
    pool.free([2])  # free queue [0, 1, 2]: the hits are at the front
    blocks, cached = pool.allocate_prompt([1, 2, 3, 4, 5])
    assert (blocks, cached) == ([0, 1, 2], 4) and pool.prefix_cache.cached_blocks() == {0, 1}
    pool.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_blocks_counts_free_hits_and_changes_nothing(backend):
    pool = BlockPool(3, 2, backend(2))
    blocks, _ = pool.allocate_prompt([1, 2, 3, 4])
    pool.cache_blocks([1, 2, 3, 4], blocks)
    pool.free(list(reversed(blocks)))
    pool.allocate(1)  # two free blocks left, both cached hits for the next prompt
    prompt = [1, 2, 3, 4, 5]  # two hits + one fresh: three free blocks, not one
    assert pool.blocks_for_prompt(prompt) == 3 and not pool.can_allocate_prompt(prompt)
    before = ([pool.ref_count(b) for b in range(3)], pool.free_block_ids(), pool.prefix_cache.cached_blocks())
    with pytest.raises(OutOfBlocks, match="need 3 free KV block"):
        pool.allocate_prompt(prompt)
    assert ([pool.ref_count(b) for b in range(3)], pool.free_block_ids(), pool.prefix_cache.cached_blocks()) == before
    pool.check_invariants()
