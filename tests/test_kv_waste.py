"""The KV-waste benchmark (chapter 07): its JSON, the relations its numbers must satisfy by
construction, and the replay's bookkeeping checked after every step."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO, run_benchmark

sys.path.append(str(REPO / "benchmarks"))
import kv_waste  # noqa: E402  (a script in benchmarks/, importable once that folder is on the path)

NAMES = [
    "contiguous, max context",
    "contiguous, exact length",
    "paged, block size 1",
    "paged, block size 16",
    "paged, block size 256",
]


def test_kv_waste_benchmark_writes_json(tmp_path):
    result = run_benchmark("kv_waste", tmp_path / "kv_waste.json")
    flags, rows = result["flags"], {row["name"]: row for row in result["allocators"]}
    assert result["benchmark"] == "kv_waste" and list(rows) == NAMES
    assert flags["block_sizes"] == [1, 16, 256] and flags["kv_budget_tokens"] % flags["max_context"] == 0
    assert result["trace"]["final"]["max"] <= flags["max_context"]
    for row in rows.values():
        assert row["capacity_slots"] == flags["kv_budget_tokens"]
        for value in (row["token_fraction"], *row["held"].values(), *row["arena"].values()):
            assert 0.0 <= value <= 1.0
        assert sum(row["held"].values()) == pytest.approx(1.0)
        assert sum(row["arena"].values()) == pytest.approx(1.0)
        assert row["token_fraction"] == pytest.approx(row["held"]["tokens"]) == pytest.approx(1 - row["waste_fraction"])
        assert row["saturated_steps"] > 0 and 1 <= row["mean_running_saturated"] <= row["peak_running"]

    max_context, exact = rows["contiguous, max context"], rows["contiguous, exact length"]
    page1, page16, page256 = (rows[f"paged, block size {b}"] for b in (1, 16, 256))
    # Reserving the whole context for every sequence: exactly budget / context sequences fit, nothing strands.
    assert max_context["mean_running_saturated"] == max_context["peak_running"] == flags["kv_budget_tokens"] // 2048
    assert max_context["arena"]["external_fragmentation"] == 0.0
    assert exact["held"]["internal_fragmentation"] == 0.0 and exact["arena"]["external_fragmentation"] > 0
    # One-token blocks hold exactly the tokens written; no paged pool strands free memory in holes.
    assert page1["token_fraction"] == 1.0 and page1["held"]["reserved"] == page1["held"]["internal_fragmentation"] == 0
    for row in (page1, page16, page256):
        assert row["arena"]["external_fragmentation"] == 0.0
    fractions = [row["token_fraction"] for row in (max_context, exact, page256, page16)]
    assert fractions == sorted(fractions) and len(set(fractions)) == 4, fractions
    assert page16["waste_fraction"] < 0.04
    assert (
        max_context["mean_running_saturated"]
        < exact["mean_running_saturated"]
        < page256["mean_running_saturated"]
        < page16["mean_running_saturated"]
    )
    for row in (max_context, exact):
        assert row["preemptions"] == row["recomputed_tokens"] == 0


def test_the_trace_is_seeded_and_within_the_context():
    trace = kv_waste.make_trace(300)
    assert trace == kv_waste.make_trace(300) and trace != kv_waste.make_trace(300, seed=1)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.final_len <= kv_waste.MAX_CONTEXT for r in trace)


@pytest.mark.parametrize("index", range(5), ids=NAMES)
def test_replay_bookkeeping_holds_after_every_step(index):
    trace = kv_waste.make_trace(60, seed=3, max_context=512)
    allocator = kv_waste.make_allocators(2048, max_context=512)[index]
    seen = []

    def check(step, allocator, running, waiting):
        allocator.check_invariants()
        states = kv_waste.slot_states(allocator, running)
        assert states.count(kv_waste.TOKEN) == sum(s.tokens for s in running)
        assert len(states) - states.count(kv_waste.FREE) == sum(s.held for s in running)
        assert allocator.free_slots() == states.count(kv_waste.FREE)
        assert all(s.request.prompt_len <= s.tokens <= min(s.held, s.request.final_len) for s in running)
        seen.append(len(running))

    result = kv_waste.replay(trace, allocator, on_step=check)
    assert result["steps"] == len(seen) and max(seen) == result["peak_running"]
    assert allocator.free_slots() == allocator.capacity  # everything given back at the end


def test_first_fit_reuses_the_first_hole_that_fits():
    arena = kv_waste.ContiguousAllocator("first fit", 100, lambda request: request.final_len)
    seqs = [kv_waste.Sequence(i, kv_waste.Request(length - 1, 1)) for i, length in enumerate((30, 20, 30, 20))]
    for seq in seqs:
        arena.admit(seq, seq.request.prompt_len)
    arena.release(seqs[0])
    arena.release(seqs[2])
    assert arena.holes() == [(0, 30), (50, 30)]
    small, large = kv_waste.Sequence(9, kv_waste.Request(24, 1)), kv_waste.Sequence(10, kv_waste.Request(39, 1))
    assert arena.can_admit(small, 24) and not arena.can_admit(large, 39) and arena.fits_if_compacted(large)
    arena.admit(small, 24)
    assert small.start == 0 and arena.holes() == [(25, 5), (50, 30)]
    arena.check_invariants()
