"""SmolLM2 on the paged KV cache: greedy tokens identical to the contiguous cache, with and
without prefix caching, for a fully cached prompt of whole blocks, and after preemption right
after a prefix hit."""

from __future__ import annotations

from conftest import SMOLLM2

from infra_lib.model import greedy_decode
from infra_lib.serving import (
    BlockPool,
    HashPrefixCache,
    PagedKVCache,
    PagedKVStore,
    RadixPrefixCache,
    paged_cached_attention,
    paged_greedy_decode,
)


def paged(model, num_blocks: int, block_size: int, prefix_cache=None):
    pool = BlockPool(num_blocks, block_size, prefix_cache)
    return PagedKVStore.for_model(model.config, num_blocks, block_size), pool


def chat(smollm2, question: str) -> list[int]:
    return smollm2.tokenizer.encode_chat([{"role": "user", "content": question}])


@SMOLLM2
def test_smollm2_greedy_tokens_from_the_paged_cache_equal_the_dense_cache(smollm2):
    model, eos = smollm2.model, smollm2.tokenizer.eos_id
    prompt = chat(smollm2, "What is the capital of France?")
    dense = greedy_decode(model, prompt, 8, eos)
    store, pool = paged(model, 16, 16)
    assert paged_greedy_decode(model, store, pool, prompt, 8, eos).token_ids == dense
    with model.using_attention(paged_cached_attention):
        assert paged_greedy_decode(model, store, pool, prompt, 8, eos).token_ids == dense
    assert pool.num_free == 16
    pool.check_invariants()


@SMOLLM2
def test_smollm2_prefix_caching_reuses_the_system_prompt_with_identical_tokens(smollm2):
    model, eos = smollm2.model, smollm2.tokenizer.eos_id
    first, second = chat(smollm2, "What is the capital of France?"), chat(smollm2, "What is Python?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)  # the system prompt and more
    store, pool = paged(model, 32, 8, HashPrefixCache(8))
    a = paged_greedy_decode(model, store, pool, first, 6, eos)
    b = paged_greedy_decode(model, store, pool, second, 6, eos)
    assert a.token_ids == greedy_decode(model, first, 6, eos) and b.token_ids == greedy_decode(model, second, 6, eos)
    assert (a.num_cached_tokens, a.prefill_tokens) == (0, len(first))
    assert b.num_cached_tokens == shared // 8 * 8 > 0 and b.prefill_tokens == len(second) - b.num_cached_tokens
    pool.check_invariants()


@SMOLLM2
def test_smollm2_fully_cached_prompt_of_whole_blocks_still_computes_its_last_block(smollm2):
    model, eos = smollm2.model, smollm2.tokenizer.eos_id
    prompt = chat(smollm2, "What colour is the sky?")
    assert len(prompt) % 4 == 0  # every block full: the case with nothing left to compute
    dense = greedy_decode(model, prompt, 6, eos)
    store, pool = paged(model, 32, 4, RadixPrefixCache(4))
    assert paged_greedy_decode(model, store, pool, prompt, 6, eos).token_ids == dense
    again = paged_greedy_decode(model, store, pool, prompt, 6, eos)
    assert again.token_ids == dense
    assert (again.num_cached_tokens, again.prefill_tokens) == (len(prompt) - 4, 4)
    pool.check_invariants()


@SMOLLM2
def test_smollm2_preemption_right_after_a_prefix_hit_then_readmission(smollm2):
    model, eos = smollm2.model, smollm2.tokenizer.eos_id
    first, second = chat(smollm2, "Who wrote Hamlet?"), chat(smollm2, "Say hello.")
    store, pool = paged(model, 24, 8, HashPrefixCache(8))
    paged_greedy_decode(model, store, pool, first, 2, eos)
    cached_before = pool.prefix_cache.cached_blocks()
    victim = PagedKVCache.for_prompt(store, pool, second)  # a hit ...
    hit = victim.table.blocks[: victim.num_cached_tokens // 8]
    assert hit and all(pool.ref_count(b) == 1 for b in hit)
    victim.release()  # ... and preempted before its prefill ran
    pool.check_invariants()
    assert pool.num_free == 24 and pool.prefix_cache.cached_blocks() >= set(hit)
    assert cached_before >= set(hit)  # the hit blocks were cached by the first request
    result = paged_greedy_decode(model, store, pool, second, 6, eos)
    assert result.token_ids == greedy_decode(model, second, 6, eos)
    assert result.num_cached_tokens == len(hit) * 8
    pool.check_invariants()
