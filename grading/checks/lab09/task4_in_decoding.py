"""Lab 09 task 4 inside speculative decoding: greedy on a small random model, whose output must equal plain
greedy decoding."""

from __future__ import annotations

import random

from grading.checks.common import reference, token_difference
from grading.checks.lab09.task4_acceptance import using_acceptance_rule
from grading.checks.lab09.tasks import SPEC, TASKS
from grading.checks.model_cases import TINY, tiny_model
from grading.registry import Check, Mismatch, register

# the rule inside speculative_decode, greedy on a small random model


def _decoder_case(rng: random.Random) -> dict:
    vocab = TINY["vocab_size"]
    loop = [rng.randrange(vocab) for _ in range(rng.randint(3, 5))]
    return {
        "seed": rng.randrange(10**6),
        "runs": [
            {"draft": "layer_skip", "gamma": 3, "new_tokens": 16, "prompt": [rng.randrange(vocab) for _ in range(5)]},
            {"draft": "ngram", "gamma": 4, "new_tokens": 16, "prompt": loop * 3},
        ],
    }


def _decoder_more_case(rng: random.Random) -> dict:
    vocab = TINY["vocab_size"]
    return {
        "seed": rng.randrange(10**6),
        "runs": [
            {"draft": "layer_skip", "gamma": 1, "new_tokens": 12, "prompt": [rng.randrange(vocab)]},
            {"draft": "layer_skip", "gamma": 6, "new_tokens": 9, "prompt": [rng.randrange(vocab) for _ in range(7)]},
            {"draft": "ngram", "gamma": 8, "new_tokens": 20, "prompt": [rng.randrange(vocab) for _ in range(4)] * 4},
        ],
    }


def _drive_decoder(rule, case: dict) -> list[dict]:
    from infra_lib.model.generation import greedy_decode
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.speculative import (
        LayerSkipDraft,
        NgramDraft,
        speculative_decode,
    )

    if not callable(rule):
        raise TypeError(f"check(...) needs your accept_or_resample function, got a {type(rule).__name__}")
    model = tiny_model(case["seed"])
    results = []
    for run in case["runs"]:
        draft = LayerSkipDraft(model, 1) if run["draft"] == "layer_skip" else NgramDraft(model.config.vocab_size)
        with using_acceptance_rule(rule):
            out = speculative_decode(
                model, run["prompt"], draft, run["gamma"], SamplingParams(max_new_tokens=run["new_tokens"])
            )
        results.append(
            {
                "tokens": [int(t) for t in out.token_ids],
                "accepted": out.accepted,
                "proposed": out.proposed,
                "passes": out.target_passes,
                "greedy": greedy_decode(model, run["prompt"], run["new_tokens"]),
            }
        )
    return results


def _compare_decoder(got, expected, case):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} runs, got {got!r:.80}")
    for run, g, e in zip(case["runs"], got, expected):
        draft = "a draft of the model's first layer" if run["draft"] == "layer_skip" else "a prompt-lookup draft"
        where = (
            f"the small random model, {draft}, gamma={run['gamma']}, a prompt of {len(run['prompt'])} tokens, "
            f"{run['new_tokens']} new tokens"
        )
        if g["tokens"] != e["greedy"]:
            note = ""
            if g["accepted"] > e["accepted"]:
                note = (
                    "\n  your rule kept more draft tokens than greedy decoding allows: a draft token that is not "
                    "the target's argmax has p(x) = 0 and must be rejected"
                )
            return Mismatch(
                "greedy speculative decoding with your rule differs from plain greedy decoding",
                f"on {where}: {token_difference(g['tokens'], e['greedy'])}{note}",
            )
        if g["accepted"] != e["accepted"] or g["passes"] != e["passes"]:
            note = ""
            if g["accepted"] < e["accepted"]:
                note = (
                    "; a draft token equal to the target's greedy token has p(x) / q(x) = 1 and must be kept: "
                    "rejecting it costs a target pass per token"
                )
            return Mismatch(
                "your rule keeps a different number of draft tokens than greedy speculative decoding does",
                f"on {where}: the same tokens, but {g['accepted']} of {g['proposed']} draft tokens "
                f"accepted in {g['passes']} target passes, expected {e['accepted']} of {e['proposed']} in "
                f"{e['passes']}{note}",
            )
    return None


_DECODER_HINT = (
    "with temperature 0 the loop passes one-hot p and q, and speculative decoding must then reproduce "
    "plain greedy decoding token for token: a draft token is kept exactly when it is the target's argmax, "
    "and the step ends with the target's argmax where the agreement stops, or after the last draft token "
    "(chapter 09, section “2 · The acceptance rule”). The loop may call your rule with fewer draft tokens "
    "than gamma, even none."
)


register(
    Check(
        check_id="lab09.speculative_greedy",
        task=TASKS[4],
        reference=reference(SPEC, "accept_or_resample"),
        make_inputs=_decoder_case,
        drive=_drive_decoder,
        compare=_compare_decoder,
        hint=_DECODER_HINT,
    )
)


register(
    Check(
        check_id="lab09.speculative_greedy_more",
        task=TASKS[4],
        reference=reference(SPEC, "accept_or_resample"),
        make_inputs=_decoder_more_case,
        drive=_drive_decoder,
        compare=_compare_decoder,
        hint=_DECODER_HINT + " gamma from 1 to 8, a one-token prompt, and steps cut short by max_new_tokens.",
    )
)
