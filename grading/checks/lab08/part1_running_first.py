"""Lab 08 part 1: the running sequences first, the token budget and max_num_seqs."""

from __future__ import annotations

import random

from grading.checks.lab08.forced_steps import simulated_run
from grading.checks.lab08.judging import forced_parts
from grading.registry import Check, register

_STEP_SECTION = "chapter 08, section “2 · One step's plan: iteration-level scheduling under a token budget”"

# part 1: decode first, the token budget, max_num_seqs (a pool large enough that nothing is preempted)


def decode_first_runs(rng: random.Random) -> list[dict]:
    return [
        simulated_run(
            {"max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4},
            8,
            rng.randrange(10**6),
            None,
            (2, 12),
            (3, 10),
        ),
        simulated_run(
            {"max_num_seqs": 3, "max_num_batched_tokens": 64, "block_size": 8},
            10,
            rng.randrange(10**6),
            None,
            (4, 20),
            (2, 12),
        ),
        simulated_run(
            {"max_num_seqs": 6, "max_num_batched_tokens": 4, "block_size": 4},
            8,
            rng.randrange(10**6),
            None,
            (1, 3),
            (4, 10),
        ),  # more running decodes than the budget: the oldest run, the rest wait
    ]


def _decode_first_random(rng: random.Random) -> list[dict]:
    return [
        simulated_run(
            {
                "max_num_seqs": rng.randint(1, 8),
                "max_num_batched_tokens": rng.choice([3, 8, 16, 32, 128]),
                "block_size": rng.choice([1, 2, 4, 16]),
            },
            rng.randint(8, 16),
            rng.randrange(10**6),
            rng.choice([None, 100.0, 400.0]),
            (1, rng.randint(2, 24)),
            (1, rng.randint(2, 20)),
        )
        for _ in range(4)
    ]


register(
    Check(
        check_id="lab08.decode_first",
        **forced_parts(1, decode_first_runs),
        hint="a step plans every running sequence before it admits anyone, oldest first, and each planned sequence "
        "spends its tokens from one budget shared by the whole step: a decode costs 1 token, a sequence still in "
        "its prompt takes as much of the rest as the budget leaves, and once the budget is spent everyone else, "
        "running or waiting, waits for the next step. Admissions also stop while max_num_seqs sequences are "
        "running, and a sequence goes into the plan only with the blocks for the positions it computes "
        f"({_STEP_SECTION}).",
    )
)

register(
    Check(
        check_id="lab08.decode_first_random",
        **forced_parts(1, _decode_first_random),
        hint="if the fixed workloads pass, look at the tight ends: a budget smaller than the number of decoding "
        "sequences (the oldest run, the newest wait), a max_num_seqs of 1, a prompt still being prefilled in "
        "chunks (a running sequence, served with the others before any admission), and steps in which one of the "
        "queues is empty." + " Random configurations and arrival rates.",
    )
)
