"""Tensor-parallel decode of SmolLM2 and a mixture-of-experts block with its experts across processes."""

from __future__ import annotations

import pytest
import torch
from conftest import SMOLLM2
from test_training import no_children_left

from infra_lib.hardware.specs import get_accelerator
from infra_lib.model.attention import cached_attention
from infra_lib.model.cache import DenseKVCache
from infra_lib.model.config import LlamaConfig
from infra_lib.model.generation import greedy_decode
from infra_lib.serving.moe import (
    MoEBlock,
    MoEConfig,
    expert_capacity,
    moe_forward,
    moe_worker,
    top_k_gating,
)
from infra_lib.serving.tensor_parallel_decode import (
    TensorParallelDecoder,
    kv_head_range,
    shard_attention,
    shard_mlp,
    tp_attention_forward,
    tp_decode_estimate,
    tp_decode_worker,
    tp_mlp_forward,
)
from infra_lib.training import run_workers


def unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# --- tensor-parallel decode --------------------------------------------------------------------


@SMOLLM2
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_tp_mlp_partials_sum_to_the_unsplit_mlp(smollm2, world_size):
    """Each rank's slice covers its own intermediate units (all of them once, over the ranks), the MLP function
    calls its all-reduce once with the rank's partial, and the partials sum to the unsplit SwiGLU output."""
    mlp = smollm2.model.layers[3].mlp
    x = torch.randn(2, 5, 576, generator=torch.Generator().manual_seed(0))
    shards = [shard_mlp(mlp, rank, world_size) for rank in range(world_size)]
    assert sum(s.gate.shape[0] for s in shards) == mlp.gate_proj.weight.shape[0]
    assert torch.equal(torch.cat([s.down for s in shards], dim=1), mlp.down_proj.weight)
    calls = []

    def record(tensor):
        calls.append(tensor.shape)
        return tensor

    with torch.no_grad():
        partials = [tp_mlp_forward(x, shard, record) for shard in shards]
        torch.testing.assert_close(sum(partials), mlp(x), atol=1e-4, rtol=1e-4)
    assert calls == [x.shape] * world_size


@SMOLLM2
def test_attention_split_by_kv_head_groups_sums_to_the_unsplit_attention(smollm2):
    """9 query heads over 3 KV heads split 6+3 (KV heads 2+1); each rank's cache holds its KV heads only, and
    the two partial outputs sum to the whole layer's attention over two steps (prefill and one decode)."""
    config, attn = smollm2.model.config, smollm2.model.layers[0].self_attn
    assert [kv_head_range(9, 3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    with pytest.raises(ValueError, match="KV heads"):
        kv_head_range(9, 3, 4, 0)
    shards = [shard_attention(attn, r, 2) for r in range(2)]
    assert [(s.n_heads, s.n_kv_heads, s.q.shape[0], s.o.shape[1]) for s in shards] == [
        (6, 2, 384, 384),
        (3, 1, 192, 192),
    ]
    x = torch.randn(1, 7, config.hidden_size, generator=torch.Generator().manual_seed(1))
    full_cache = DenseKVCache.for_model(config, capacity=8)
    caches = [DenseKVCache(config.n_layers, 1, s.n_kv_heads, 8, s.head_dim) for s in shards]
    cos, sin = smollm2.model.rope_cos, smollm2.model.rope_sin
    with torch.no_grad():
        for part in (slice(0, 6), slice(6, 7)):
            expected = attn(x[:, part], cos[part], sin[part], full_cache.layer(0), cached_attention)
            partials = [
                tp_attention_forward(x[:, part], s, cos[part], sin[part], c.layer(0), unchanged)
                for s, c in zip(shards, caches)
            ]
            torch.testing.assert_close(sum(partials), expected, atol=1e-5, rtol=1e-4)
    assert [c.layer(0).k.shape[1] for c in caches] == [2, 1]
    decoder = TensorParallelDecoder(smollm2.model, 0, 1, unchanged)
    with pytest.raises(ValueError, match="non-empty"):
        decoder.greedy([], 3)
    with pytest.raises(ValueError, match="context"):
        decoder.greedy([1] * config.max_position, 1)


@SMOLLM2
def test_tp2_greedy_decode_gives_the_single_process_tokens(smollm2):
    """SmolLM2 split over two gloo processes gives one process's greedy tokens on two prompts, on both ranks,
    with two all-reduces per layer; no worker outlives the call."""
    model, tokenizer = smollm2.model, smollm2.tokenizer
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": t}]) for t in ("What is Python?", "Name three planets.")
    ]
    expected = [greedy_decode(model, p, 6, tokenizer.eos_id) for p in prompts]
    ranks = run_workers(tp_decode_worker, 2, (prompts, 6, tokenizer.eos_id), timeout_s=120)
    assert [r["tokens"] for r in ranks] == [expected, expected]
    assert [r["all_reduces_per_step"] for r in ranks] == [2 * model.config.n_layers] * 2
    assert [(r["query_heads"], r["kv_heads"]) for r in ranks] == [(6, 2), (3, 1)]
    assert all(len(r["step_s"]) == len(r["all_reduce_s"]) == sum(len(t) - 1 for t in expected) for r in ranks)
    assert all(0 < a < s for r in ranks for a, s in zip(r["all_reduce_s"], r["step_s"]))
    # each rank holds less than the whole model; rank 0 (two KV-head groups) more than rank 1
    assert model.weight_bytes() > ranks[0]["weight_bytes"] > ranks[1]["weight_bytes"]
    no_children_left()


def test_tp_decode_estimate_says_tp_loses_on_smollm2_and_wins_on_large_layers():
    """On H100s with a 6 µs all-reduce: SmolLM2's 7 MB layers lose to 60 all-reduces; 70B-sized layers gain."""
    h100 = get_accelerator("H100 SXM")
    smol = LlamaConfig(49152, 576, 30, 9, 3, 64, 1536, 100000.0, 1e-5, 2048, tie_embeddings=True)
    small = tp_decode_estimate(smol, 2, h100.bandwidth_bytes_per_s, 6e-6)
    assert small["one_gpu_bytes"] == 2 * (30 * (576 * 64 * 24 + 3 * 576 * 1536) + 49152 * 576)
    assert small["rank_layer_share"] == pytest.approx(
        (576 * 64 * 16 + 3 * 576 * 768) / (576 * 64 * 24 + 3 * 576 * 1536)
    )
    assert small["tp_all_reduce_s"] == pytest.approx(60 * 6e-6)
    assert small["tp_speedup"] < 1 and small["layer_bytes"] < small["break_even_layer_bytes"]
    big = LlamaConfig(128256, 8192, 80, 64, 8, 128, 28672, 500000.0, 1e-5, 8192, tie_embeddings=False)
    large = tp_decode_estimate(big, 8, h100.bandwidth_bytes_per_s, 6e-6)
    assert large["tp_speedup"] > 4 and large["layer_bytes"] > large["break_even_layer_bytes"]


# --- experts across processes ------------------------------------------------------------------


def test_top_k_gating_picks_per_token_over_the_experts_axis():
    """Per row (token): the k largest logits, largest first, ties to the lower expert; softmax over those k only."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0, 0.5], [3.0, 1.0, 0.0, -2.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    experts, weights = top_k_gating(logits, 2)
    assert experts.tolist() == [[1, 3], [0, 1], [0, 1]]
    torch.testing.assert_close(weights[1], torch.softmax(torch.tensor([3.0, 1.0]), 0))
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))
    assert top_k_gating(logits, 1)[1].eq(1).all()
    with pytest.raises(ValueError, match="k must be"):
        top_k_gating(logits, 6)
    with pytest.raises(ValueError, match="tokens, n_experts"):
        top_k_gating(logits[0], 1)


def test_capacity_and_the_single_process_block_against_a_slot_by_slot_reference():
    """ceil(C * tokens * k / E) slots per expert; every first choice is seated before any second choice, token
    order within a choice; a dropped slot adds nothing and the kept weights are not renormalised."""
    assert [expert_capacity(10, 2, 4, c) for c in (0.5, 1.0, 1.25, 2.0)] == [3, 5, 7, 10]
    with pytest.raises(ValueError, match="capacity factor"):
        expert_capacity(10, 2, 4, 0)
    config = MoEConfig(hidden_size=16, intermediate_size=24, n_experts=4, top_k=2)
    block = MoEBlock(config, seed=3)
    x = torch.randn(23, 16, generator=torch.Generator().manual_seed(2))
    for factor in (0.5, 1.0):
        result = moe_forward(block, x, factor)
        experts, weights = top_k_gating(x @ block.router.T, 2)
        seats, kept = [0] * 4, torch.zeros(23, 2, dtype=torch.bool)
        for choice in range(2):
            for token in range(23):
                e = int(experts[token, choice])
                kept[token, choice] = seats[e] < result.capacity
                seats[e] += 1
        assert torch.equal(result.kept, kept)
        expected = torch.stack(
            [
                sum(weights[t, j] * block.expert(int(experts[t, j]), x[t : t + 1])[0] for j in range(2) if kept[t, j])
                if kept[t].any()
                else torch.zeros(16)
                for t in range(23)
            ]
        )
        torch.testing.assert_close(result.out, expected, atol=1e-5, rtol=1e-4)
        assert result.load.sum() == 46 and result.dropped_fraction() == pytest.approx(1 - kept.float().mean().item())
    assert moe_forward(block, x, 0.5).dropped_fraction() > 0
    with pytest.raises(ValueError, match="hidden=16"):
        moe_forward(block, torch.zeros(3, 5), 1.0)


def test_expert_parallel_block_equals_the_single_process_block_drops_included():
    """Four experts over two processes, 37 tokens split 19/18: the same outputs, kept slots, capacity and loads as
    one process, at a capacity factor that drops about half the slots and at 1.0; no worker outlives it."""
    config, seed, factors = MoEConfig(), 0, [0.5, 1.0]
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(1))
    ranks = run_workers(moe_worker, 2, (config, seed, x, factors), timeout_s=120)
    block = MoEBlock(config, seed)
    for factor in factors:
        reference = moe_forward(block, x, factor)
        parts = [r["results"][factor] for r in ranks]
        assert torch.equal(torch.cat([p["kept"] for p in parts]), reference.kept), f"capacity factor {factor}"
        torch.testing.assert_close(torch.cat([p["out"] for p in parts]), reference.out, atol=1e-5, rtol=1e-4)
        assert all(p["capacity"] == reference.capacity and torch.equal(p["load"], reference.load) for p in parts)
    assert moe_forward(block, x, 0.5).dropped_fraction() > 0.3
    no_children_left()
