"""Prefill/decode disaggregation: the KV handoff's contract (pack_kv / install_kv) on a pool whose blocks are
scattered, and two real worker processes (prefill, decode) that give the colocated engine's greedy tokens,
return every block to both pools and never outlive the run."""

from __future__ import annotations

import psutil
import pytest
import torch

from infra_lib.hardware.kv_cache import kv_bytes_per_token
from infra_lib.serving.block_pool import BlockPool, OutOfBlocks
from infra_lib.serving.disaggregated import KVMetadata, install_kv, pack_kv
from infra_lib.serving.disaggregated_workers import serve_colocated, serve_disaggregated
from infra_lib.serving.kv_store import PagedKVStore
from infra_lib.serving.scheduler_output import SchedulerConfig
from infra_lib.serving.workload import WorkloadRequest

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 3, 2, 8, 4
PROMPTS = ("What is Python?", "Name three planets.", "What is the capital of France?", "Explain what a KV cache is.")


def filled_store(num_blocks: int, seed: int) -> PagedKVStore:
    store = PagedKVStore(LAYERS, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    generator = torch.Generator().manual_seed(seed)
    for cache in store.k + store.v:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    return store


def scattered_table(pool: BlockPool) -> list[int]:
    """Three blocks of a pool whose free queue was shuffled by frees: ids neither contiguous nor ascending."""
    taken = pool.allocate(pool.num_blocks)
    pool.free([taken[6], taken[1], taken[4]])
    table = pool.allocate(3)
    assert table == [taken[6], taken[1], taken[4]]
    return table


def test_pack_then_install_gives_the_same_bytes_under_the_receivers_own_table():
    source, source_pool = filled_store(10, seed=0), BlockPool(10, BLOCK)
    table = scattered_table(source_pool)
    num_tokens = 2 * BLOCK + 1  # the last block part-full: it travels whole
    counts = [source_pool.ref_count(b) for b in range(10)]
    payload, metadata = pack_kv(source, table, num_tokens)

    assert payload.shape == (LAYERS, 2, 3, BLOCK, KV_HEADS, HEAD_DIM) == metadata.payload_shape
    assert payload.is_contiguous() and metadata.source_blocks == tuple(table)
    assert payload.nbytes == len(table) * BLOCK * kv_bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, 4)
    # packing neither frees nor allocates: the caller frees once sent
    assert [source_pool.ref_count(b) for b in range(10)] == counts

    receiver, receiver_pool = filled_store(12, seed=1), BlockPool(12, BLOCK)
    held = receiver_pool.allocate(5)  # the receiver's own sequences hold its first blocks
    untouched = {b: (receiver.k[0][b].clone(), receiver.v[2][b].clone()) for b in range(12)}
    new_table = install_kv(receiver, receiver_pool, payload, metadata)

    assert len(new_table) == 3 and not set(new_table) & set(held), f"{new_table} reuses blocks held: {held}"
    assert new_table != table, "the receiver's ids come from its own pool, not the sender's"
    assert all(receiver_pool.ref_count(b) == 1 for b in new_table)
    receiver_pool.check_invariants()
    for layer in range(LAYERS):
        for i, (src, dst) in enumerate(zip(table, new_table)):
            assert torch.equal(receiver.k[layer][dst], source.k[layer][src]), f"layer {layer} K of block {i}"
            assert torch.equal(receiver.v[layer][dst], source.v[layer][src]), f"layer {layer} V of block {i}"
        assert all(
            torch.equal(a, b)
            for a, b in zip(receiver.gather(layer, new_table, num_tokens), source.gather(layer, table, num_tokens))
        )
    for b in set(range(12)) - set(new_table):  # nothing else written
        assert torch.equal(receiver.k[0][b], untouched[b][0]) and torch.equal(receiver.v[2][b], untouched[b][1])


def test_install_refuses_a_foreign_layout_and_a_full_pool_without_changing_anything():
    source = filled_store(6, seed=2)
    payload, metadata = pack_kv(source, [4, 0], BLOCK + 2)
    other = PagedKVStore(LAYERS, 6, BLOCK, KV_HEADS, HEAD_DIM * 2)
    pool = BlockPool(6, BLOCK)
    with pytest.raises(ValueError, match="layout"):
        install_kv(other, pool, payload, metadata)
    with pytest.raises(ValueError, match="payload"):
        install_kv(source, pool, payload[:, :, :1], metadata)
    pool.allocate(5)
    with pytest.raises(OutOfBlocks):
        install_kv(source, pool, payload, metadata)
    assert pool.num_free == 1
    pool.check_invariants()


@pytest.mark.parametrize(
    ("table", "num_tokens", "match"),
    [
        ([1, 1], 2 * BLOCK, "twice"),
        ([1, 6], 2 * BLOCK, "outside"),
        ([1, 2], BLOCK, "table has 2"),
        ([1], 0, "positive"),
    ],
)
def test_pack_names_a_table_it_cannot_read(table, num_tokens, match):
    with pytest.raises(ValueError, match=match):
        pack_kv(filled_store(6, seed=3), table, num_tokens)


def test_metadata_layout_is_what_the_store_has():
    _, metadata = pack_kv(filled_store(4, seed=4), [3], 1)
    assert isinstance(metadata, KVMetadata) and metadata.num_blocks == 1
    assert metadata.layout() == (BLOCK, LAYERS, KV_HEADS, HEAD_DIM, torch.float32)


def no_worker_left(pids: list[int]) -> None:
    """The run's worker processes are gone, and no fork server of this process holds a child."""
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"worker {pid} lives"
    for child in psutil.Process().children():
        try:
            if "forkserver" in " ".join(child.cmdline()):
                assert not child.children(), f"the fork server still has workers: {child.children()}"
        except psutil.NoSuchProcess:
            pass


def test_disaggregated_workers_give_the_colocated_tokens_and_return_every_block(smollm2):
    tokenizer = smollm2.tokenizer
    lengths = (6, 1, 4, 5)  # one request whose first token, sampled by the prefill worker, is its last
    arrivals = (0.0, 0.0, 0.0, 0.3)
    workload = [
        WorkloadRequest(at, tuple(tokenizer.encode_chat([{"role": "user", "content": text}])), n)
        for text, n, at in zip(PROMPTS, lengths, arrivals)
    ]
    config = SchedulerConfig(num_blocks=32, block_size=16)
    colocated = serve_colocated(smollm2.model, workload, config)
    disaggregated = serve_disaggregated(workload, config, config, timeout_s=180)
    no_worker_left(disaggregated.worker_pids)

    for i, (a, b) in enumerate(zip(disaggregated.requests, colocated.requests)):
        assert a.token_ids == b.token_ids, (
            f"request {i} ({PROMPTS[i]!r}): disaggregated {a.token_ids}, colocated {b.token_ids}"
        )
        assert len(a.token_ids) == lengths[i] and len(a.token_times) == lengths[i]
    assert disaggregated.pools == {"prefill": (32, 32), "decode": (32, 32)}
    assert colocated.pools == {"colocated": (32, 32)}
    assert disaggregated.max_decode_batch >= 2, "the decode worker batches the requests it received"

    per_token = kv_bytes_per_token(30, 3, 64, 4)  # SmolLM2-135M in fp32, chapter 02's formula
    for request, transfer in zip(workload, disaggregated.transfers):
        assert transfer["tokens"] == request.prompt_len
        assert transfer["blocks"] == -(-request.prompt_len // 16) == len(transfer["decode_blocks"])
        assert transfer["payload_bytes"] == transfer["blocks"] * 16 * per_token


def test_disaggregation_benchmark_writes_every_variant(tmp_path):
    from conftest import run_benchmark

    result = run_benchmark("disaggregation", tmp_path / "disaggregation.json")
    assert result["same_tokens"] and result["all_blocks_returned"]
    assert set(result["results"]) == {"colocated", "disaggregated", "colocated_1_thread"}
    colocated, disaggregated = result["results"]["colocated"], result["results"]["disaggregated"]
    ratios = result["disaggregated_over"]["colocated"]
    assert ratios["all_p99_itl_ms"] == pytest.approx(
        disaggregated["all"]["p99_itl_ms"] / colocated["all"]["p99_itl_ms"]
    )
    transfer = result["transfer"]
    assert transfer["payload_bytes_per_slot"] == [transfer["formula_kv_bytes_per_token"]] == [46080]
    assert transfer["median_over_formula"] >= 1  # whole blocks travel: never fewer bytes than the tokens hold
