"""Lab 08 part 3: preemption on pools too small for the load."""

from __future__ import annotations

import random

from grading.checks.lab08.forced_steps import simulated_run
from grading.checks.lab08.judging import forced_parts
from grading.registry import Check, register

_PREEMPTION_SECTION = "chapter 08, section “4 · Preemption: a pool too small for the load”"

# part 3: preemption on tight pools (the newest running sequence goes, back to the front of the queue)


def _preemption_runs(rng: random.Random) -> list[dict]:
    return [
        simulated_run(
            {"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 4, "num_blocks": 16},
            12,
            rng.randrange(10**6),
            None,
            (8, 24),
            (8, 24),
        ),
        simulated_run(
            {"max_num_seqs": 6, "max_num_batched_tokens": 16, "block_size": 2, "num_blocks": 26},
            10,
            rng.randrange(10**6),
            None,
            (6, 16),
            (6, 16),
        ),
    ]


def _preemption_random(rng: random.Random) -> list[dict]:
    runs = []
    for _ in range(4):
        block_size = rng.choice([1, 2, 4])
        prompt_max, out_max = rng.randint(8, 24), rng.randint(6, 24)
        need = -(-(prompt_max + out_max - 1) // block_size)
        chunked = rng.random() < 0.7
        prefix = rng.random() < 0.5
        runs.append(
            simulated_run(
                {
                    "max_num_seqs": rng.randint(3, 10),
                    "max_num_batched_tokens": (rng.randint(8, 64) if chunked else prompt_max + out_max + 8),
                    "block_size": block_size,
                    "num_blocks": need + rng.randint(0, need),
                    "enable_chunked_prefill": chunked,
                    "enable_prefix_caching": prefix,
                },
                rng.randint(10, 20),
                rng.randrange(10**6),
                rng.choice([None, None, 300.0]),
                (1, prompt_max),
                (1, out_max),
                shared=rng.choice([0, 6]) if prefix else 0,
            )
        )
    return runs


register(
    Check(
        check_id="lab08.preemption",
        **forced_parts(3, _preemption_runs),
        hint="when a running sequence cannot get the blocks for its next positions, blocks are freed by preempting the "
        "newest running sequence (the most recently admitted), then the next newest, as many as needed, so that the "
        "oldest keep making progress; a sequence that is itself the newest preempts itself, and no later running "
        "sequence is planned. A victim goes back to the front of the waiting queue, is recorded in the order it was "
        "preempted and gets no tokens in this step; a step that preempted admits nobody, and a waiting sequence "
        f"never takes blocks from a running one ({_PREEMPTION_SECTION}).",
    )
)

register(
    Check(
        check_id="lab08.preemption_random",
        **forced_parts(3, _preemption_random),
        hint="on tight pools an admission can also fail for lack of blocks, which ends the step's admissions like any "
        "other reason. A readmitted victim computes all its tokens so far, prompt and generated, less what the "
        "prefix cache still holds, and its admission records that hit; every request must finish, and preempting "
        "anything but the newest can starve one." + " Random tight pools, some with prefix caching.",
    )
)
