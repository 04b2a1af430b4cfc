"""Context parallelism: ring attention (contiguous and zigzag) and Ulysses equal full causal attention in values and
gradients on ranks that are threads and on a gloo process group, and each sends the bytes its formula says."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from infra_lib.training import context_parallel as cp
from infra_lib.training.collectives import ThreadGroup
from infra_lib.training.launcher import run_workers


def _tensors(world, t, heads=4, kv_heads=None, batch=2, head_dim=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    full = (batch, heads, world * t, head_dim)
    kv = (batch, kv_heads or heads, world * t, head_dim)
    return [torch.randn(*shape, generator=gen, dtype=dtype) for shape in (full, kv, kv, full)]


def _run(attend, world, tensors, layout="contiguous", causal=True):
    """Every rank's output and gradients on a ThreadGroup, unsharded, with the bytes rank 0 sent forward and back;
    and full attention's on the whole sequence."""
    q, k, v, grad_out = tensors
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    expected.backward(grad_out)

    def on_rank(comm):
        mine = [cp.shard_sequence(x, world, comm.rank, layout).requires_grad_() for x in (q, k, v)]
        out = attend(*mine, comm, causal=causal, layout=layout)
        forward = comm.bytes_sent
        out.backward(cp.shard_sequence(grad_out, world, comm.rank, layout))
        return out.detach(), [x.grad for x in mine], forward, comm.bytes_sent - forward

    ranks = ThreadGroup(world).run(on_rank, timeout_s=30)
    got = [cp.unshard_sequence([r[0] for r in ranks], layout)]
    got += [cp.unshard_sequence([r[1][i] for r in ranks], layout) for i in range(3)]
    errors = [float((a - b).abs().max()) for a, b in zip(got, [expected.detach(), *(x.grad for x in full)])]
    return errors, [(r[2], r[3]) for r in ranks]


def _ring(q, k, v, comm, causal, layout):
    return cp.ring_attention(q, k, v, comm, causal=causal, layout=layout)


def _ulysses(q, k, v, comm, causal, layout):
    return cp.ulysses_attention(q, k, v, comm, causal=causal)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_attention_equals_full_attention_values_and_gradients(world, layout):
    t = 6 if layout == "zigzag" else 5
    errors, sent = _run(_ring, world, _tensors(world, t), layout)
    assert max(errors) < 1e-12, errors
    traffic = cp.ring_attention_traffic(2, world * t, 4, 8, world, element_size=8)
    assert all(s == (traffic["forward_per_rank"], traffic["backward_per_rank"]) for s in sent), (sent, traffic)


def test_ring_attention_without_the_causal_mask_and_with_grouped_query_heads():
    errors, _ = _run(_ring, 3, _tensors(3, 4), causal=False)
    assert max(errors) < 1e-12
    errors, sent = _run(_ring, 3, _tensors(3, 4, heads=6, kv_heads=2))
    assert max(errors) < 1e-12
    assert sent[0][0] == cp.ring_attention_traffic(2, 12, 6, 8, 3, n_kv_heads=2, element_size=8)["forward_per_rank"]


def test_ring_attention_in_float32_and_without_overlap_gives_the_same_output():
    q, k, v, _ = _tensors(3, 4, dtype=torch.float32)

    def on_rank(comm, overlap):
        mine = [cp.shard_sequence(x, 3, comm.rank) for x in (q, k, v)]
        return cp.ring_attention_forward(*mine, comm, overlap=overlap)[0]

    overlapped = ThreadGroup(3).run(on_rank, [(True,)] * 3)
    serial = ThreadGroup(3).run(on_rank, [(False,)] * 3)
    assert all(torch.equal(a, b) for a, b in zip(overlapped, serial))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert float((torch.cat(serial, dim=2) - expected).abs().max()) < 1e-5


def test_ring_attention_skips_the_blocks_in_the_queries_future(monkeypatch):
    """Rank r folds in r + 1 blocks (contiguous); every rank the same 2W + 1 chunk pairs (zigzag)."""
    import threading

    rank_of, calls = {}, {}
    step = cp.ring_attention_step

    def counting(q, k_block, v_block, state, causal_kind):
        rank = rank_of[threading.get_ident()]
        calls[rank] = calls.get(rank, 0) + 1
        return step(q, k_block, v_block, state, causal_kind)

    monkeypatch.setattr(cp, "ring_attention_step", counting)
    q, k, v, _ = _tensors(4, 4)
    for layout, expected in (("contiguous", [1, 2, 3, 4]), ("zigzag", [9, 9, 9, 9])):
        calls.clear()

        def on_rank(comm, layout=layout):
            rank_of[threading.get_ident()] = comm.rank
            mine = [cp.shard_sequence(x, 4, comm.rank, layout) for x in (q, k, v)]
            return cp.ring_attention_forward(*mine, comm, layout=layout, overlap=False)

        ThreadGroup(4).run(on_rank)
        assert [calls[r] for r in range(4)] == expected, (layout, calls)
    assert cp.causal_work(16, 4) == [16, 32, 48, 64]  # (r + 1) blocks of 4 x 4 scores
    assert cp.causal_work(16, 4, "zigzag") == [36] * 4  # 2W + 1 = 9 pairs of 2 x 2 chunks
    assert cp.causal_work(16, 4, causal=False) == [64] * 4


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ulysses_equals_full_attention_values_and_gradients(world):
    errors, sent = _run(_ulysses, world, _tensors(world, 3))
    assert max(errors) < 1e-12, errors
    traffic = cp.ulysses_traffic(2, world * 3, 4, 8, world, element_size=8)
    assert all(s == (traffic["forward_per_rank"], traffic["backward_per_rank"]) for s in sent), (sent, traffic)


def test_ulysses_with_grouped_query_heads_and_its_limit():
    errors, sent = _run(_ulysses, 2, _tensors(2, 3, heads=4, kv_heads=2))
    assert max(errors) < 1e-12
    assert sent[0][0] == cp.ulysses_traffic(2, 6, 4, 8, 2, n_kv_heads=2, element_size=8)["forward_per_rank"]
    q, k, v, _ = _tensors(4, 2, heads=4, kv_heads=2)

    def on_rank(comm):
        return cp.ulysses_attention(*(cp.shard_sequence(x, 4, comm.rank) for x in (q, k, v)), comm)

    with pytest.raises(RuntimeError, match="at most 2 ranks"):
        ThreadGroup(4).run(on_rank)


def test_traffic_per_rank_falls_with_the_world_for_ulysses_and_not_for_the_ring():
    ring = [cp.ring_attention_traffic(1, 4096, 32, 128, w)["forward_per_rank"] for w in (2, 4, 8, 16)]
    ulysses = [cp.ulysses_traffic(1, 4096, 32, 128, w)["forward_per_rank"] for w in (2, 4, 8, 16)]
    assert ring == [2 * (w - 1) * 4096 // w * 32 * 128 * 4 for w in (2, 4, 8, 16)]  # -> 2 S H d elements
    assert ulysses == [(w - 1) * 4 * 4096 * 32 * 128 // (w * w) * 4 for w in (2, 4, 8, 16)]
    assert ring[-1] > ring[0] and all(a > b for a, b in zip(ulysses, ulysses[1:]))


def test_the_ring_hides_its_traffic_from_the_slice_where_compute_equals_transfer():
    t = cp.ring_hidden_slice(32, 8, 989e12, 450e9)  # an H100's bf16 peak, NVLink's 900 GB/s over both directions
    assert round(t) == 549
    compute, transfer = 4 * t * t * 32 * 128 / 989e12, 2 * t * 8 * 128 * 2 / 450e9
    assert math.isclose(compute, transfer, rel_tol=1e-9)
    with pytest.raises(ValueError, match="positive"):
        cp.ring_hidden_slice(32, 0, 989e12, 450e9)


def test_the_step_and_the_sharding_refuse_bad_input():
    q = torch.randn(1, 2, 3, 4)
    state = cp.empty_state(q)
    with pytest.raises(ValueError, match="causal_kind"):
        cp.ring_attention_step(q, q, q, state, "skip")
    with pytest.raises(ValueError, match="own keys"):
        cp.ring_attention_step(q, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), state, "diagonal")
    with pytest.raises(ValueError, match="equal chunks"):
        cp.shard_sequence(torch.randn(1, 2, 7, 4), 2, 0)
    with pytest.raises(ValueError, match="layout"):
        cp.chunks_held(2, 0, "striped")
    x = torch.randn(1, 2, 12, 4)
    assert torch.equal(cp.unshard_sequence([cp.shard_sequence(x, 3, r, "zigzag") for r in range(3)], "zigzag"), x)


def test_ring_and_ulysses_on_a_gloo_process_group():
    """Two processes: ring (both layouts) and Ulysses equal full attention, send what the formulas say, and the
    course's all-to-all equals gloo's ``all_to_all_single``."""
    rows = run_workers(cp.context_parallel_worker, 2, args=(1, 8, 4, 8), timeout_s=120)
    ring = cp.ring_attention_traffic(1, 8, 4, 8, 2)
    ulysses = cp.ulysses_traffic(1, 8, 4, 8, 2)
    for row in rows:
        assert row["all_to_all_matches_gloo"]
        for name, formula in (("ring", ring), ("ring zigzag", ring), ("ulysses", ulysses)):
            assert row[name]["out_error"] < 1e-5 and row[name]["grad_error"] < 1e-5, (name, row[name])
            assert row[name]["forward_bytes"] == formula["forward_per_rank"], name
            assert row[name]["backward_bytes"] == formula["backward_per_rank"], name
