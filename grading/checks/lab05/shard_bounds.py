"""Lab 05 task 6: shard_bounds, the part of a tensor each rank owns, with the usual splitting rules named."""

from __future__ import annotations

import random

from grading.checks.common import outcome, reference, unwrap
from grading.registry import Check, Mismatch, register

_ZERO = "infra_lib.training.zero"
TASK = "lab05 task 6: shard_bounds"


def _shard_cases(rng: random.Random) -> list[list[int]]:
    return [
        [10, 4],
        [12, 4],
        [3, 5],
        [7, 3],
        [1, 1],
        [rng.randint(20, 200), rng.randint(2, 8)],
        [rng.randint(20, 200), rng.randint(2, 8)],
    ]


def _shard_edge_cases(rng: random.Random) -> list[list[int]]:
    return [
        [0, 4],
        [5, 5],
        [4, 5],
        [rng.randint(10, 99), 1],
        [10**9 + rng.randint(1, 63), 64],
        [rng.randint(1000, 9999), rng.randint(9, 17)],
        [rng.randint(2, 6), 8],
    ]


def _drive_shards(fn, cases: list[list[int]]) -> list:
    return [[outcome(fn, numel, world, rank) for rank in range(world)] for numel, world in cases]


def _shard_note(numel: int, world: int, got: list) -> str:
    """Name the splitting rule behind wrong bounds, when it is a recognisable one."""
    base, extra = divmod(numel, world)
    ceil = -(-numel // world)
    rules = {
        "ceil": [[min(r * ceil, numel), min((r + 1) * ceil, numel)] for r in range(world)],
        "last": [[r * base, numel if r == world - 1 else (r + 1) * base] for r in range(world)],
        "extra_last": [
            [r * base + max(0, r - (world - extra)), (r + 1) * base + max(0, r + 1 - (world - extra))]
            for r in range(world)
        ],
        "inclusive": [
            [r * base + min(r, extra), r * base + min(r, extra) + base + (r < extra) - 1] for r in range(world)
        ],
    }
    notes = {
        "ceil": (
            "; you gave every rank ceil(numel / world_size) elements and the last ones what was left (as "
            "torch.chunk does): split as evenly as possible, shards differ by at most one element"
        ),
        "last": "; the last rank took all the leftover elements: give one extra element to each of the first "
        "numel % world_size ranks",
        "extra_last": "; the extra elements go to the FIRST numel % world_size ranks (as torch.tensor_split does)",
        "inclusive": "; end is exclusive: the shard is [start, end), so end - start is its size",
    }
    for name, bounds in rules.items():
        if got == bounds:
            return notes[name]
    return ""


def _compare_shards(got, expected, cases: list[list[int]]) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected results for {len(expected)} splits, got {got!r:.80}")
    for (numel, world), ranks, want_ranks in zip(cases, got, expected):
        if type(ranks) is not list or len(ranks) != world:
            return Mismatch("the check recorded a malformed result", f"on numel={numel}, world_size={world}")
        values = []
        for rank, (g, _expected) in enumerate(zip(ranks, want_ranks)):
            where = f"shard_bounds(numel={numel}, world_size={world}, rank={rank})"
            kind, value = unwrap(g)
            if kind == "raised":
                return Mismatch("shard_bounds raised an exception", f"on {where}: your code raised {value}")
            if kind != "value" or type(value) is not list or len(value) != 2 or not all(type(x) is int for x in value):
                note = (
                    "; use integer arithmetic (divmod, //): a float cannot index a tensor"
                    if type(value) is list and any(type(x) is float for x in value)
                    else ""
                )
                return Mismatch(
                    "shard_bounds must return (start, end): two ints", f"on {where}: got {value!r:.80}{note}"
                )
            values.append(value)
        want = [e[1] for e in want_ranks]
        if values != want:
            rank = next(r for r, (v, w) in enumerate(zip(values, want)) if v != w)
            return Mismatch(
                "shard_bounds returned the wrong shard",
                f"on numel={numel}, world_size={world}: rank {rank} expected {tuple(want[rank])}, got "
                f"{tuple(values[rank])}; all ranks: expected {[tuple(w) for w in want]}, got "
                f"{[tuple(v) for v in values]}" + _shard_note(numel, world, values),
            )
    return None


_SHARD_HINT = (
    "split as evenly as possible: shard sizes differ by at most one element, and the larger shards go "
    "to the first ranks (torch.tensor_split's split, not torch.chunk's). Return (start, end), two ints: "
    "the half-open range [start, end); the shards are contiguous, in rank order, and cover [0, numel) "
    "exactly."
)

register(
    Check(
        check_id="lab05.shard_bounds",
        task=TASK,
        reference=reference(_ZERO, "shard_bounds"),
        make_inputs=_shard_cases,
        drive=_drive_shards,
        compare=_compare_shards,
        hint=_SHARD_HINT,
    )
)
register(
    Check(
        check_id="lab05.shard_bounds_more",
        task=TASK,
        reference=reference(_ZERO, "shard_bounds"),
        make_inputs=_shard_edge_cases,
        drive=_drive_shards,
        compare=_compare_shards,
        hint=_SHARD_HINT + " Empty tensors, fewer elements than ranks, one rank, a billion elements.",
    )
)
