"""Lab 07 task 4, copy-on-write: prepare_write on blocks held alone and shared, and every operation mixed."""

from __future__ import annotations

import random

from grading.checks.lab07.pool_replay import SHARING_SECTION, random_scripts
from grading.checks.lab07.traces import replay_parts
from grading.registry import Check, register


def _cow_scripts(rng: random.Random) -> list[dict]:
    n = rng.randint(5, 8)
    return [
        {
            "num_blocks": n,
            "block_size": 4,
            "ops": [
                ["write_free", rng.randrange(n)],  # writing a block nobody holds
                ["write_unknown", True],
                ["write_unknown", False],  # writing an id outside the pool
                ["allocate", 2],  # table A
                ["write", 0, 1],  # A holds it alone: write in place
                ["fork", 0],  # table A' shares both blocks
                ["write_shared", 0],  # A's first block is shared: a private copy
                ["write", 0, 0],  # that copy is now private: in place
                ["write_shared", 0],  # the second block is still shared
                ["write", 1, 1],  # ... and A' now holds it alone
                ["fork", 1],
                ["allocate_free", 0],  # share again, then take every free block
                ["write_shared", 0],  # a copy is needed but nothing is free: OutOfBlocks, nothing changed
                ["free", 3, True],  # give the filler blocks back
                ["write_shared", 0],
                ["free", 0, True],
                ["free", 0, True],
                ["free", 0, True],
                ["allocate_free", 0],
            ],
        }
    ]


register(
    Check(
        check_id="lab07.copy_on_write",
        **replay_parts(4, _cow_scripts),
        hint="a block other tables also hold must never be written in place, or they would read the writer's tokens as "
        "their own: the writer gets a fresh block from the front of the free queue and gives up its own hold on "
        "the shared one, which the others keep, while a block the caller holds alone is written where it is. When "
        "a copy is needed and no block is free, OutOfBlocks is raised with nothing changed, and writing a free "
        f"block is a ValueError ({SHARING_SECTION}).",
    )
)

register(
    Check(
        check_id="lab07.random_ops",
        **replay_parts(4, random_scripts(4)),
        hint="with every operation mixed, all of them keep one set of books: a block's count is the number of tables "
        "holding it, a block is free exactly when that count is 0, and the free queue holds exactly the free "
        "blocks, handed out from the front and rejoined at the back. A copy moves one holder off the shared block, "
        "so once a single table holds it again, that table writes into it in place."
        + " Random sequences of every operation.",
    )
)
