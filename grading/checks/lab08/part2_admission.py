"""Lab 08 part 2: first-come-first-served admission and chunked prefill."""

from __future__ import annotations

import random

from grading.checks.lab08.forced_steps import simulated_run
from grading.checks.lab08.judging import forced_parts
from grading.registry import Check, register

CHUNKING_SECTION = "chapter 08, section “5 · Head-of-line blocking, and chunked prefill”"

# part 2: FCFS admission and chunked prefill (and whole prompts when it is off)


def _chunked_runs(rng: random.Random) -> list[dict]:
    return [
        simulated_run(
            {"max_num_seqs": 8, "max_num_batched_tokens": rng.randint(8, 14), "block_size": 4},
            6,
            rng.randrange(10**6),
            None,
            (20, 60),
            (2, 6),
        ),
        simulated_run(
            {"max_num_seqs": 8, "max_num_batched_tokens": 48, "block_size": 4, "enable_chunked_prefill": False},
            8,
            rng.randrange(10**6),
            None,
            (8, 40),
            (2, 8),
        ),
        # a pool too small for every whole prompt at once: chunks that fit are admitted, whole prompts would wait
        simulated_run(
            {"max_num_seqs": 4, "max_num_batched_tokens": 10, "block_size": 4, "num_blocks": 14},
            5,
            rng.randrange(10**6),
            None,
            (20, 40),
            (2, 4),
        ),
    ]


def _chunked_random(rng: random.Random) -> list[dict]:
    runs = []
    for _ in range(4):
        chunked = rng.random() < 0.6
        out_max = rng.randint(2, 10)
        budget = rng.randint(4, 40) if chunked else rng.randint(40, 80)
        prompt_max = rng.randint(10, 80) if chunked else budget - out_max + 1
        block_size = rng.choice([2, 4, 16])
        need = -(-(prompt_max + out_max) // block_size)
        blocks = rng.choice([512, need + rng.randint(1, need)])  # some pools too small for every prompt at once
        runs.append(
            simulated_run(
                {
                    "max_num_seqs": rng.randint(2, 10),
                    "max_num_batched_tokens": budget,
                    "block_size": block_size,
                    "num_blocks": blocks,
                    "enable_chunked_prefill": chunked,
                },
                rng.randint(6, 14),
                rng.randrange(10**6),
                rng.choice([None, 200.0]),
                (1, prompt_max),
                (1, out_max),
            )
        )
    return runs


register(
    Check(
        check_id="lab08.chunked_prefill",
        **forced_parts(2, _chunked_runs),
        hint="admission is first come, first served: only the head of the waiting queue is ever considered, and the "
        "first sequence that cannot come in ends the step's admissions, even when a shorter prompt behind it would "
        "fit. A new sequence computes its tokens beyond its prefix-cache hit, cut at what the budget leaves when "
        "chunked prefill is on (the rest follows in later steps, as a running sequence); with it off, a prompt "
        "larger than the budget left waits, whole, and is never admitted past the budget. Each admission is "
        "recorded with the prefix-cache hit found before admitting it, 0 included "
        f"({CHUNKING_SECTION}).",
    )
)

register(
    Check(
        check_id="lab08.chunked_prefill_random",
        **forced_parts(2, _chunked_random),
        hint="if the fixed workloads pass, look at the edges: a prompt exactly as large as the budget left fits, a "
        "budget the running sequences have spent admits nobody, and a sequence that cannot come in, for whatever "
        "reason, holds back everyone behind it in the waiting queue."
        + " Random budgets and pools, with and without chunked prefill.",
    )
)
