"""Lab 08 part 5: the step's records, its index and the prefix-cache hit of every admission."""

from __future__ import annotations

import random

from grading.checks.lab08.forced_steps import simulated_run
from grading.checks.lab08.judging import forced_parts
from grading.checks.lab08.part2_admission import CHUNKING_SECTION
from grading.registry import Check, register

# part 5: the step's records (prefix caching on, so that admissions take hits of several sizes, and 0)


def _records_runs(rng: random.Random) -> list[dict]:
    return [
        simulated_run(
            {"max_num_seqs": 6, "max_num_batched_tokens": 32, "block_size": 4, "enable_prefix_caching": True},
            10,
            rng.randrange(10**6),
            200.0,
            (10, 30),
            (2, 8),
            shared=12,
        ),
        simulated_run(
            {"max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4},
            6,
            rng.randrange(10**6),
            None,
            (4, 20),
            (2, 6),
        ),
    ]


def _records_random(rng: random.Random) -> list[dict]:
    return [
        simulated_run(
            {
                "max_num_seqs": rng.randint(2, 8),
                "max_num_batched_tokens": rng.choice([8, 16, 64]),
                "block_size": rng.choice([2, 4]),
                "enable_prefix_caching": True,
            },
            rng.randint(8, 14),
            rng.randrange(10**6),
            rng.choice([None, 300.0]),
            (8, 30),
            (1, 8),
            shared=rng.choice([6, 10]),
        )
        for _ in range(3)
    ]


register(
    Check(
        check_id="lab08.records",
        **forced_parts(5, _records_runs),
        hint="the plan is also a record of the step: it carries the index of the step it plans (one per call), and "
        "num_cached_tokens holds one entry for every admission, the prefix-cache hit found before admitting it, "
        f"0 included ({CHUNKING_SECTION}).",
    )
)

register(
    Check(
        check_id="lab08.records_random",
        **forced_parts(5, _records_random),
        hint="if the fixed workloads pass, look at readmissions and long runs: every "
        "admission is recorded, a readmitted victim's too." + " Random budgets with prefix caching.",
    )
)
