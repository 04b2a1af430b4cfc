"""Capstone tasks 1-4: one lab's piece at a time in the course's engine, so that a failure names the piece."""

from __future__ import annotations

from grading.checks.common import token_difference
from grading.checks.lab16.engine import (
    LAB_OF,
    QUESTIONS,
    TASK_OF,
    TASKS,
    compare_engine,
    course,
    engine_case,
    fixed_case,
    model,
    one_thread,
    pieces_of,
    prompts,
    served,
)
from grading.registry import Check, Mismatch, register

_PIECE_HINTS = {
    "Llama": "the engine loads SmolLM2's weights into your Llama and calls its modules by their names: its "
    "projections, norms, MLP and its rope(x, positions) at each token's own position (a continued chunk's "
    "positions do not start at 0) must compute what lab 06's checks compared (chapter 06).",
    "cached_attention": "the runner calls your cached_attention once per sequence with that sequence's queries (t = "
    "its chunk or 1) and a cache whose append hands back every key and value so far; the mask must place "
    "the t queries at the end of those s positions (chapter 06).",
    "BlockPool": "the engine allocates, frees and recomputes through your pool under preemption: a pool that "
    "passes lab 07's checks but fails here usually loses a block when one is freed in the middle of the "
    "free queue (chapter 07).",
    "forward_step": "every step of the engine runs through your forward_step: prefill chunks that continue an "
    "earlier chunk, decodes, and sequences whose blocks were recomputed after a preemption; each token's K/V "
    "goes to the slot its own block table gives (chapter 07).",
    "schedule": "the engine runs your plan as it is: each running sequence's blocks must cover exactly its "
    "computed plus scheduled tokens, and a preempted sequence must not be scheduled in the same step "
    "(chapter 08).",
    "engine_step": "your step runs every request to its end: each sampled token appended once, stops found "
    "on the text, and every finished or aborted request's blocks given back (chapter 08).",
}


def _drive_for(names):
    def drive(implementation, case):
        return served(implementation, pieces_of(implementation, names), case)

    return drive


def piece_parts(name: str) -> dict:
    """The fields of the checks of one piece in the course's engine (tasks 1-3)."""
    return dict(
        task=TASK_OF[LAB_OF[name]],
        reference=course,
        drive=_drive_for((name,)),
        compare=compare_engine,
        hint=_PIECE_HINTS[name],
    )


register(Check(check_id="lab16.model_in_engine", make_inputs=fixed_case(False), **piece_parts("Llama")))
register(
    Check(
        check_id="lab16.model_in_engine_random",
        make_inputs=lambda rng: engine_case(rng, n=3, tight=True),
        **piece_parts("Llama"),
    )
)
register(Check(check_id="lab16.attention_in_engine", make_inputs=fixed_case(False), **piece_parts("cached_attention")))
register(
    Check(
        check_id="lab16.attention_in_engine_random",
        make_inputs=lambda rng: engine_case(rng, n=3),
        **piece_parts("cached_attention"),
    )
)
register(Check(check_id="lab16.pool_in_engine", make_inputs=fixed_case(True), **piece_parts("BlockPool")))
register(
    Check(
        check_id="lab16.pool_aborts_random",
        make_inputs=lambda rng: engine_case(rng, n=3, tight=True, aborts=2),
        **piece_parts("BlockPool"),
    )
)
register(Check(check_id="lab16.step_in_engine", make_inputs=fixed_case(True), **piece_parts("forward_step")))
register(
    Check(
        check_id="lab16.step_in_engine_random",
        make_inputs=lambda rng: engine_case(rng, n=3, tight=True),
        **piece_parts("forward_step"),
    )
)
register(Check(check_id="lab16.scheduler_in_engine", make_inputs=fixed_case(True), **piece_parts("schedule")))
register(
    Check(
        check_id="lab16.scheduler_in_engine_random",
        make_inputs=lambda rng: engine_case(rng, n=3, tight=True),
        **piece_parts("schedule"),
    )
)
register(Check(check_id="lab16.loop_in_engine", make_inputs=fixed_case(True), **piece_parts("engine_step")))
register(
    Check(
        check_id="lab16.loop_aborts_random",
        make_inputs=lambda rng: engine_case(rng, n=3, tight=True, aborts=2),
        **piece_parts("engine_step"),
    )
)


# --- task 4: the acceptance rule in speculative decoding ---------------------------------------------


def _drive_speculative(implementation, case):
    import torch

    from infra_lib.serving.pieces import speculate

    rule = pieces_of(implementation, ("accept_or_resample",)).get("accept_or_resample")
    loaded = model()
    out = []
    with torch.inference_mode(), one_thread():
        for prompt in prompts(loaded.tokenizer, case["questions"]):
            result = speculate(loaded.model, prompt, case["new_tokens"], rule, gamma=case["gamma"])
            out.append({"tokens": result.token_ids, "accepted": result.accepted})
    return out


def _compare_speculative(got, expected, case):
    for i, (g, e) in enumerate(zip(got, expected)):
        where = f"SmolLM2, greedy, prompt lookup draft, gamma={case['gamma']}, {case['questions'][i]!r}"
        if g["tokens"] != e["tokens"]:
            return Mismatch(
                "speculative decoding with your acceptance rule answered with other tokens",
                f"on {where}: {token_difference(g['tokens'], e['tokens'])}",
            )
        if g["accepted"] != e["accepted"]:
            return Mismatch(
                "your rule accepted a different number of draft tokens than the course's",
                f"on {where}: {g['accepted']} accepted, expected {e['accepted']}",
            )
    return None


def speculative_parts() -> dict:
    return dict(
        task=TASKS[4],
        reference=course,
        drive=_drive_speculative,
        compare=_compare_speculative,
        hint="greedy drafts and targets are one-hot: a draft token is kept exactly when the target's "
        "probability of it is 1, and the first token not kept is replaced by the target's choice "
        "(chapter 09).",
    )


register(
    Check(
        check_id="lab16.speculative_answers",
        make_inputs=lambda rng: {"questions": [rng.choice(QUESTIONS)], "new_tokens": 12, "gamma": 4},
        **speculative_parts(),
    )
)
register(
    Check(
        check_id="lab16.speculative_answers_random",
        make_inputs=lambda rng: {
            "questions": rng.sample(QUESTIONS, 1),
            "new_tokens": rng.randint(8, 14),
            "gamma": rng.randint(2, 5),
        },
        **speculative_parts(),
    )
)
