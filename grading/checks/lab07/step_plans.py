"""Lab 07 task 5's inputs: the plans of real engine steps, made by the course's ``Scheduler`` (in the
grader's process, where the course's pool runs) and kept as plain data, so that the learner's step and
the reference replay the same batches, in order, on stores of their own."""

from __future__ import annotations

import random

from grading.checks.model_cases import TINY, tiny_prompts

FEATURES = {  # what every drawn case's plans must contain, and how the check names it
    "several": "a step of two or more sequences",
    "continued": "a prefill chunk that continues an earlier chunk",
    "decode": "a decode",
    "not_sampling": "a sequence that does not sample (its prompt is not finished)",
    "scattered": "a sequence whose blocks are not contiguous",
}


def _plans(case: dict) -> list[list[dict]]:
    """Drive the course's scheduler over the case's requests; each step's batch as plain data. The
    tokens a step samples are drawn from the case's seed: what the step computes does not depend on them."""
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.scheduler import Scheduler
    from infra_lib.serving.scheduler_output import SchedulerConfig
    from infra_lib.serving.sequence import Sequence

    rng = random.Random(case["seed"])
    config = SchedulerConfig(
        max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["budget"],
        block_size=case["block_size"],
        num_blocks=case["num_blocks"],
        enable_prefix_caching=case["prefix_caching"],
    )
    scheduler = Scheduler(config)
    taken = scheduler.pool.allocate(config.num_blocks)
    rng.shuffle(taken)
    scheduler.pool.free(taken)  # every block free again, handed out in a shuffled order
    sequences = {}
    for i, (prompt, new) in enumerate(zip(case["prompts"], case["new_tokens"])):
        sequences[i] = Sequence(i, prompt, SamplingParams(max_new_tokens=new), config.block_size, arrival_index=i)
        scheduler.add(sequences[i])
    steps = []
    while scheduler.has_unfinished() and len(steps) < case["max_steps"]:
        out = scheduler.schedule()
        steps.append(
            [
                {
                    "seq_id": s.seq_id,
                    "prompt": sequences[s.seq_id].prompt_ids,
                    "output": list(sequences[s.seq_id].output_ids),
                    "blocks": list(sequences[s.seq_id].block_table.blocks),
                    "start": s.start,
                    "num_tokens": s.num_tokens,
                    "kind": s.kind,
                    "samples": s.samples,
                }
                for s in out.scheduled
            ]
        )
        scheduler.commit(out)
        for s in out.scheduled:
            seq = sequences[s.seq_id]
            if s.samples:
                seq.append_token(rng.randrange(TINY["vocab_size"]))
                if seq.num_tokens >= seq.max_tokens:
                    scheduler.finish(seq, "length")
    return steps


def features(steps: list[list[dict]]) -> set[str]:
    """Which of ``FEATURES`` the plans contain."""
    found = set()
    for step in steps:
        found |= {"several"} if len(step) > 1 else set()
        for part in step:
            found |= {"continued"} if part["kind"] == "prefill" and part["start"] > 0 else set()
            found |= {"decode"} if part["kind"] == "decode" else set()
            found |= {"not_sampling"} if not part["samples"] else set()
            blocks = part["blocks"]
            found |= {"scattered"} if any(b + 1 != c for b, c in zip(blocks, blocks[1:])) else set()
    return found


def step_case(rng: random.Random, block_sizes: list[int], prefix_caching: bool, tight: bool) -> dict:
    """A small random model, three or four requests and the scheduler's plans for them, drawn again until
    the plans hold every one of ``FEATURES``. With ``tight``, the pool is small enough that the scheduler
    may preempt (a preempted sequence is recomputed from position 0)."""
    for _ in range(100):
        block_size = rng.choice(block_sizes)
        lengths = [rng.randint(3, 20) for _ in range(rng.randint(3, 4))]
        prompts = tiny_prompts(rng, lengths)
        if prefix_caching:  # a later request shares the first one's opening blocks, so a prefix hit skips them
            shared = prompts[0][: 2 * block_size]
            prompts[-1] = shared + prompts[-1][len(shared) :] if len(prompts[-1]) > len(shared) else shared + [1]
        new_tokens = [rng.randint(2, 5) for _ in prompts]
        per_sequence = [-(-(len(p) + n) // block_size) for p, n in zip(prompts, new_tokens)]
        need = sum(per_sequence)
        case = {
            "model": "tiny",
            "model_seed": rng.randrange(10**6),
            "seed": rng.randrange(10**6),
            "block_size": block_size,
            "num_blocks": max(need // 2, max(per_sequence)) if tight else need + rng.randint(1, 4),
            "budget": rng.randint(6, 12),
            "max_num_seqs": rng.choice([3, 4]),
            "prefix_caching": prefix_caching,
            "prompts": prompts,
            "new_tokens": new_tokens,
            "max_steps": 12,
        }
        case["steps"] = _plans(case)
        if features(case["steps"]) == set(FEATURES):
            return case
    raise RuntimeError(f"no plan with every feature in 100 draws for block sizes {block_sizes}")


def token_slots(step: list[dict], block_size: int) -> list[tuple[int, int, int, int]]:
    """(part index, seq_id, position, slot) of every scheduled token, in batch order."""
    tokens = []
    for index, part in enumerate(step):
        for p in range(part["start"], part["start"] + part["num_tokens"]):
            tokens.append((index, part["seq_id"], p, part["blocks"][p // block_size] * block_size + p % block_size))
    return tokens
