"""Lab 07 task 2, giving blocks back: free, its refusals and the order of the free queue."""

from __future__ import annotations

import random

from grading.checks.lab07.pool_replay import POOL_SECTION, random_scripts
from grading.checks.lab07.traces import replay_parts
from grading.registry import Check, register


def _free_scripts(rng: random.Random) -> list[dict]:
    n = rng.randint(7, 10)
    return [
        {
            "num_blocks": n,
            "block_size": 4,
            "ops": [
                ["free_bad", rng.randrange(n)],  # a block nobody holds
                ["allocate", 2],
                ["allocate", 3],
                ["allocate", 1],  # tables A, B, C
                ["free_bad", 1],  # B's blocks plus a free block: raises before freeing any of B
                ["free", 1, False],  # B in the given order
                ["free", 0, True],  # A tail first
                ["allocate_free", 0],  # everything free, in free-queue order: the LRU order shows here
                ["free_twice", 0],
                ["free_unknown", 0, False],
                ["free_unknown", 0, True],
                ["free", 1, True],
                ["free", 0, False],
                ["free", 0, True],
                ["allocate", 3],
            ],
        }
    ]


register(
    Check(
        check_id="lab07.free_lru",
        **replay_parts(2, _free_scripts),
        hint="free is all or nothing: an id outside the pool (negative ones included) or a double free (a block "
        "released "
        "in one call more times than tables hold it) raises ValueError before any count changes, so a call that "
        "raises leaves the pool exactly as it was. Blocks whose count reaches 0 join the back of the free queue in the "
        "order the call releases them, so the block freed longest ago is reused first (LRU), never the one just "
        f"freed ({POOL_SECTION}).",
    )
)

register(
    Check(
        check_id="lab07.free_random",
        **replay_parts(2, random_scripts(2)),
        hint="over many calls the order of the free queue is what drifts first: blocks rejoin its back one at a "
        "time, in "
        "the order each call releases them, and a call that raises (an id outside the pool, or a block freed more "
        "times than it is held, even within one call) leaves every count and the queue's order untouched. num_free "
        "must always equal the number of blocks whose count is 0." + " Random sequences with double frees.",
    )
)
