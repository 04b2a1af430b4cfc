"""Lab 05 task 7: ring_all_reduce over point-to-point ``comm.exchange``, run on a ``ThreadGroup`` (every rank
a thread, exchanging tensors through queues): the sum in every rank's tensor, in place, and the bytes each
rank sent."""

from __future__ import annotations

import math
import random

from grading.checks.common import reference
from grading.checks.lab05.ring_diagnosis import describe_ring, plural, ring_results, values_problem
from grading.checks.lab05.ring_threads import drive_ring
from grading.registry import Check, Mismatch, register

TASK = "lab05 task 7: ring_all_reduce"


def _ring_case(
    rng: random.Random, world: int, shape: list[int], dtype: str = "float32", layout: str = "contiguous"
) -> dict:
    return {"world": world, "shape": shape, "dtype": dtype, "layout": layout, "seed": rng.randrange(10**6)}


def _divisible_shape(rng: random.Random, world: int, two_d: bool = False, large: bool = False) -> list[int]:
    if two_d:
        return [world * rng.randint(1, 4), rng.randint(2, 9)]
    return [world * rng.randint(200, 1200) if large else world * rng.randint(2, 40)]


def _ring_sum_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 2, _divisible_shape(rng, 2)),
        _ring_case(rng, 3, _divisible_shape(rng, 3)),
        _ring_case(rng, 4, _divisible_shape(rng, 4)),
        _ring_case(rng, 4, _divisible_shape(rng, 4, two_d=True)),
    ]


def _ring_sum_more_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 5, _divisible_shape(rng, 5)),
        _ring_case(rng, 6, _divisible_shape(rng, 6, large=True)),
        _ring_case(rng, 8, _divisible_shape(rng, 8)),
        _ring_case(rng, 3, _divisible_shape(rng, 3, two_d=True)),
        _ring_case(rng, 2, _divisible_shape(rng, 2, large=True)),
    ]


def _ring_traffic_cases(rng: random.Random) -> list[dict]:
    return [_ring_case(rng, w, [w * rng.randint(16, 64)]) for w in (2, 3, 4)]


def _ring_traffic_more_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 5, _divisible_shape(rng, 5, large=True)),
        _ring_case(rng, 8, _divisible_shape(rng, 8)),
        _ring_case(rng, 4, [4 * rng.randint(8, 32)], dtype="float64"),
        _ring_case(rng, 6, _divisible_shape(rng, 6, two_d=True)),
    ]


def _uneven(rng: random.Random, world: int) -> int:
    n = rng.randint(world + 1, 12 * world)
    return n + 1 if n % world == 0 else n


def _ring_any_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 3, [_uneven(rng, 3)]),  # not divisible: chunks differ by one element
        _ring_case(rng, 4, [_uneven(rng, 4)]),
        _ring_case(rng, 3, [2]),  # fewer elements than ranks: one chunk is empty
        _ring_case(rng, 4, [1]),
        _ring_case(rng, 4, [3, 5]),  # 2-D, 15 elements on 4 ranks
        _ring_case(rng, 3, [rng.randint(4, 7), rng.randint(2, 5)], layout="transposed"),  # non-contiguous
        _ring_case(rng, 2, [rng.randint(5, 30)], dtype="float64"),
        _ring_case(rng, 3, [_uneven(rng, 3)], dtype="float64"),
    ]


def _ring_edge_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 1, [rng.randint(3, 9)]),  # one rank: nothing to send
        _ring_case(rng, 5, [3]),
        _ring_case(rng, 5, [_uneven(rng, 5)]),
        _ring_case(rng, 3, [0]),  # empty
        _ring_case(rng, 3, [_uneven(rng, 3)], dtype="int64"),
        _ring_case(rng, 4, [3, rng.randint(3, 6)], layout="strided"),
        _ring_case(rng, 2, [2, 3, 4], layout="permuted"),
        _ring_case(rng, 5, [rng.randint(3, 6), 7], dtype="float64", layout="transposed"),
    ]


def _compare_ring_sum(got, expected, cases) -> Mismatch | None:
    rows = ring_results(got, expected, cases)
    if isinstance(rows, Mismatch):
        return rows
    for case, got_ranks, want_ranks in rows:
        problem = values_problem(case, got_ranks, want_ranks)
        if problem:
            return problem
    return None


def _compare_ring_traffic(got, expected, cases) -> Mismatch | None:
    rows = ring_results(got, expected, cases)
    if isinstance(rows, Mismatch):
        return rows
    for case, got_ranks, want_ranks in rows:
        problem = values_problem(case, got_ranks, want_ranks)
        if problem:
            return Mismatch("the traffic is measured on a correct all-reduce: " + problem.what, problem.detail)
        world, where = case["world"], describe_ring(case)
        itemsize = 8 if case["dtype"] in ("float64", "int64") else 4
        tensor_bytes = math.prod(case["shape"]) * itemsize
        for rank, (g, e) in enumerate(zip(got_ranks, want_ranks)):
            if g["bytes"] == e["bytes"]:
                continue
            sent, share = g["bytes"], 2 * (world - 1) / world
            chunk = tensor_bytes // world
            note = ""
            if sent == 0:
                note = (
                    "; you sent nothing: the ranks shared memory instead of messages, which only threads can do. "
                    "In a process group every rank is its own process (on its own GPU): only exchange moves data"
                )
            elif sent == (world - 1) * tensor_bytes:
                note = (
                    "; that is the whole tensor in each of W - 1 steps: send one chunk (1 / W of the tensor) per "
                    "step, in a reduce-scatter and then an all-gather"
                )
            elif sent % tensor_bytes == 0:
                note = "; you sent whole tensors: a ring sends one chunk (1 / W of the tensor) per message"
            elif sent == (world - 1) * chunk:
                note = "; that is only the reduce-scatter: the all-gather sends W - 1 chunks more"
            peers = g.get("peers") or []
            if any(pair != [(rank + 1) % world, (rank - 1) % world] for pair in peers):
                note += (
                    f"; rank {rank} exchanged with (to, from) {[tuple(p) for p in peers]}: in a ring it sends to "
                    f"{(rank + 1) % world} and receives from {(rank - 1) % world} only"
                )
            return Mismatch(
                "a rank sent a different number of bytes than a ring all-reduce does",
                f"on {where}: rank {rank} sent {sent} bytes in {plural(g['messages'], 'message')} "
                f"({sent / tensor_bytes:.3g} x the tensor's {tensor_bytes} bytes); a ring sends "
                f"2 (W - 1) / W = {share:.3g} x the tensor: {e['bytes']} bytes in 2 (W - 1) = "
                f"{2 * (world - 1)} messages of one {chunk}-byte chunk each{note}",
            )
    return None


_RING_HINT = (
    "a ring all-reduce is a reduce-scatter, in which each chunk travels the ring collecting one more "
    "rank's contribution per step (received partial sums are added to the rank's own copy), then an "
    "all-gather, in which the finished chunks travel the ring once more and replace the stale copies "
    "(nothing is added). The sum belongs in the tensor itself, in place, which is also what is returned; "
    "see chapter 05, section “4 · Collectives: all-reduce, reduce-scatter, all-gather”."
)


def ring_parts() -> dict:
    """The fields every ring check shares: the task, the reference ring and the driver."""
    return {
        "task": TASK,
        "reference": reference("infra_lib.training.collectives", "ring_all_reduce"),
        "drive": drive_ring,
    }


register(
    Check(
        check_id="lab05.ring_sum",
        make_inputs=_ring_sum_cases,
        compare=_compare_ring_sum,
        hint=_RING_HINT,
        **ring_parts(),
    )
)

register(
    Check(
        check_id="lab05.ring_sum_more",
        make_inputs=_ring_sum_more_cases,
        compare=_compare_ring_sum,
        hint=_RING_HINT + " Up to 8 ranks, tens of thousands of elements.",
        **ring_parts(),
    )
)

register(
    Check(
        check_id="lab05.ring_traffic",
        make_inputs=_ring_traffic_cases,
        compare=_compare_ring_traffic,
        hint="every message in a ring carries one chunk, 1 / W of the tensor, so each rank sends 2 (W - 1) / W of the "
        "tensor in all, whatever W is; ranks share nothing but what exchange carries. Passing the whole tensor around "
        "the ring also gives the sum, at W - 1 times the traffic (chapter 05, section “4 · Collectives: all-reduce, "
        "reduce-scatter, all-gather”).",
        **ring_parts(),
    )
)

register(
    Check(
        check_id="lab05.ring_traffic_more",
        make_inputs=_ring_traffic_more_cases,
        compare=_compare_ring_traffic,
        hint="every message carries one chunk (1 / W of the tensor), never the whole tensor, so each rank sends "
        "2 (W - 1) / W of the tensor's bytes whatever W is. Up to 8 ranks, float64 tensors.",
        **ring_parts(),
    )
)

register(
    Check(
        check_id="lab05.ring_any_tensor",
        make_inputs=_ring_any_cases,
        compare=_compare_ring_sum,
        hint=_RING_HINT + " Sizes W does not divide (chunks differ by one element), fewer elements than ranks (empty "
        "chunks, still exchanged: every rank makes 2 (W - 1) exchanges whatever the sizes), 2-D, non-contiguous "
        "(flattening one gives a copy, not a view: the sum must still reach the tensor) and float64 tensors (received "
        "data keeps the tensor's dtype).",
        **ring_parts(),
    )
)

register(
    Check(
        check_id="lab05.ring_edges",
        make_inputs=_ring_edge_cases,
        compare=_compare_ring_sum,
        hint=_RING_HINT + " One rank, empty tensors, fewer elements than ranks (an empty chunk is exchanged like any "
        "other: 2 (W - 1) exchanges per rank), int64, strided and permuted views, 5 ranks.",
        **ring_parts(),
    )
)
