"""Lab 07 task 1, taking blocks: allocate, can_allocate, ref_count and num_free on fixed and random scripts."""

from __future__ import annotations

import random

from grading.checks.lab07.pool_replay import POOL_SECTION, random_scripts
from grading.checks.lab07.traces import replay_parts
from grading.registry import Check, register


def _allocate_scripts(rng: random.Random) -> list[dict]:
    n = rng.randint(6, 10)
    return [
        {
            "num_blocks": n,
            "block_size": rng.choice([4, 16]),
            "ops": [
                ["allocate", rng.randint(1, 3)],
                ["can_allocate_free", 0],
                ["can_allocate_free", 1],
                ["allocate", 0],
                ["allocate", 2],
                ["allocate_free", rng.randint(1, 3)],
                ["allocate", -1],
                ["allocate", 2.0],
                ["allocate", True],
                ["ref_count_unknown", True],
                ["ref_count_unknown", False],
                ["allocate_free", 0],
                ["can_allocate", 1],
                ["can_allocate", 0],
                ["allocate", 0],
                ["allocate", 1],
            ],
        },
        {"num_blocks": 1, "block_size": 8, "ops": [["allocate", 1], ["allocate", 1], ["can_allocate", 1]]},
    ]


register(
    Check(
        check_id="lab07.allocate",
        **replay_parts(1, _allocate_scripts),
        hint="allocate hands out blocks from the front of the free queue, each then held by one table, and serves a "
        "request in full or not at all: asking for more blocks than are free raises OutOfBlocks (the number "
        "requested, the number free, the pool's size) before any block is taken. A negative count is a ValueError "
        "and asking for no blocks is valid; can_allocate says, for a count of 0 or more, whether allocate would "
        f"succeed, and num_free is always the number of blocks nobody holds ({POOL_SECTION}).",
    )
)

register(
    Check(
        check_id="lab07.allocate_random",
        **replay_parts(1, random_scripts(1)),
        hint="if the fixed script passes, look at the edges: asking for exactly as many blocks as are free succeeds "
        "and "
        "empties the queue, asking for none succeeds even on an empty pool, and a pool of one block follows the "
        "same rules. A refused request changes nothing, neither a count nor the order of the free queue."
        + " Random sequences, pools of 1 to 14 blocks.",
    )
)
