"""Lab 07 task 3, sharing blocks: fork, and frees of shared blocks."""

from __future__ import annotations

import random

from grading.checks.lab07.pool_replay import SHARING_SECTION, random_scripts
from grading.checks.lab07.traces import replay_parts
from grading.registry import Check, register


def _fork_scripts(rng: random.Random) -> list[dict]:
    n = rng.randint(6, 9)
    return [
        {
            "num_blocks": n,
            "block_size": 16,
            "ops": [
                ["fork_bad", rng.randrange(n)],  # sharing a block nobody holds
                ["allocate", 3],
                ["fork", 0],
                ["fork", 0],  # three tables hold the same 3 blocks
                ["fork_unknown", 0, True],
                ["fork_unknown", 0, False],  # an id outside the pool: nothing is shared
                ["fork_twice", rng.randrange(3)],
                ["free", 3, False],  # a block listed twice gains two holders, then loses them
                ["free", 0, True],  # one holder finishes: nothing is freed yet
                ["allocate", 1],
                ["fork_bad", 0],  # a held table plus a free block: nothing is shared
                ["fork", 2],
                ["free", 3, True],
                ["free_twice", 0],
                ["free", 0, True],
                ["free", 0, False],  # the last holders finish: the blocks join the free queue
                ["allocate_free", 0],
                ["free", 0, True],
                ["fork_bad", 0],
                ["free", 0, True],
                ["allocate_free", 0],
            ],
        }
    ]


register(
    Check(
        check_id="lab07.fork",
        **replay_parts(3, _fork_scripts),
        hint="fork shares blocks and copies nothing: each listed block gains one holder, and the caller gets a new "
        "list "
        "of the same ids, never the list it passed in, because the two tables change independently from then on. "
        "Sharing a free block is a ValueError raised before any count rises, and a shared block goes back to the "
        f"free queue only when its last holder frees it ({SHARING_SECTION}).",
    )
)

register(
    Check(
        check_id="lab07.fork_random",
        **replay_parts(3, random_scripts(3)),
        hint="once blocks are shared, a block's count is the number of tables holding it: an id listed twice in one "
        "fork "
        "gains two holders, and a free may release a block as often as it is held and no more, so a double free "
        "is judged against the count, not against 1. A refused fork or free changes nothing."
        + " Random sequences of allocate, free and fork.",
    )
)
