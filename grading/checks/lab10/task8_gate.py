"""Lab 10 task 8: ``passes_gate``, the evaluation gate a candidate model version must pass."""

from __future__ import annotations

import math
import random

from grading.checks.common import outcome
from grading.checks.lab10.results import TASKS, compare_results
from grading.checks.lab10.timings import NAN
from grading.registry import Check, register

_SCORES = ("perplexity", "evidence_nll")


def reference_passes_gate(candidate, current, tolerance: float = 0.05) -> bool:
    """The reference's answer to task 8: whether ``gate`` lets the candidate serve."""
    from infra_lib.ops.llmops import gate

    return gate(candidate, current, perplexity_tolerance=tolerance, evidence_tolerance=tolerance).passed


def _card(name: str, scores: dict):
    from infra_lib.ops.llmops import VersionCard

    return VersionCard(
        name=name,
        weights="int8 g64" if name != "production" else "fp32",
        perplexity=scores["perplexity"],
        evidence_nll=scores["evidence_nll"],
        tokens_per_s=scores.get("tokens_per_s", 20.0),
        weight_mb=scores.get("weight_mb", 540.0),
    )


def _gate_case(label: str, current: tuple[float, float], candidate: tuple[float, float], tolerance: float) -> dict:
    return {
        "label": label,
        "current": dict(zip(_SCORES, current)),
        "candidate": dict(zip(_SCORES, candidate)),
        "tolerance": tolerance,
    }


def _gate_cases(rng: random.Random) -> list[dict]:
    """Cards like chapter 11's (perplexity near 16, evidence NLL near 2), each score placed relative to
    its limit. Binary-exact values (whole numbers of 1/64), so a score placed on its limit is on it."""

    def near(base: float) -> float:
        return base + rng.randint(-16, 16) / 64

    cases = []
    for tolerance in (0.0625, 0.125):
        ppl, nll = near(16.0), near(2.0)
        lim_p, lim_n = ppl * (1 + tolerance), nll * (1 + tolerance)
        cases += [
            _gate_case("a candidate better on both scores", (ppl, nll), (ppl - 1, nll - 0.25), tolerance),
            _gate_case(
                "a candidate a little worse on both, within the tolerance",
                (ppl, nll),
                (ppl + (lim_p - ppl) / 2, nll + (lim_n - nll) / 2),
                tolerance,
            ),
            _gate_case("a candidate past the limit on perplexity only", (ppl, nll), (lim_p + 0.25, nll), tolerance),
            _gate_case(
                "a candidate past the limit on the evidence score only", (ppl, nll), (ppl, lim_n + 0.125), tolerance
            ),
            _gate_case(
                "a broken candidate (rows shuffled: perplexity in the thousands)",
                (ppl, nll),
                (rng.randint(2000, 9000) + 0.5, nll * 3),
                tolerance,
            ),
        ]
    rng.shuffle(cases)
    return cases


def _divided(candidate: float, current: float, tolerance: float) -> bool:
    """The gate written as a relative difference, (candidate - current) / current <= tolerance: the same rule on
    paper, but its rounding differs from the product's, so it disagrees on some scores on the limit."""
    return (candidate - current) / current <= tolerance


def _on_the_limit(rng: random.Random, want_disagreement: int, past: bool = False) -> list[tuple[float, float, float]]:
    """(current, candidate, tolerance) with the candidate exactly on the limit current * (1 + tolerance), as
    floating point computes it (``past``: the next float above it), drawn until the division form gives the
    other verdict: on the limit it rejects what the rule passes; just past it, it passes what the rule rejects."""
    found = []
    while len(found) < want_disagreement:
        current = round(rng.uniform(1.5, 60.0), rng.choice([1, 2, 3]))
        tolerance = rng.choice([0.01, 0.02, 0.025, 0.03, 0.05, 0.1, 0.15, 0.2])
        limit = current * (1 + tolerance)
        candidate = math.nextafter(limit, math.inf) if past else limit
        if _divided(candidate, current, tolerance) == past:
            found.append((current, candidate, tolerance))
    return found


def _gate_edges(rng: random.Random) -> list[dict]:
    ppl, nll = 16.0 + rng.randint(-8, 8) / 8, 2.0 + rng.randint(-8, 8) / 32
    t = 0.0625
    cases = [
        _gate_case("a candidate exactly on both limits", (ppl, nll), (ppl * (1 + t), nll * (1 + t)), t),
        _gate_case(
            "a candidate exactly on the perplexity limit, better on evidence", (ppl, nll), (ppl * (1 + t), nll - 0.5), t
        ),
        _gate_case("a candidate whose perplexity is nan (its evaluation diverged)", (ppl, nll), (NAN, nll), t),
        _gate_case("a candidate whose evidence score is nan", (ppl, nll), (ppl, NAN), t),
        _gate_case("a candidate whose perplexity is infinite", (ppl, nll), (float("inf"), nll), t),
        _gate_case("a candidate whose evidence score is minus infinity", (ppl, nll), (ppl, float("-inf")), t),
        _gate_case("a tolerance of zero and an identical candidate", (ppl, nll), (ppl, nll), 0.0),
        _gate_case("a tolerance of zero and a candidate worse by 1/64", (ppl, nll), (ppl + 1 / 64, nll), 0.0),
        _gate_case("a large tolerance (1.0: twice as bad still passes)", (ppl, nll), (2 * ppl, 2 * nll - 0.25), 1.0),
        _gate_case(
            "a large tolerance and a candidate just past twice the perplexity", (ppl, nll), (2 * ppl + 0.25, nll), 1.0
        ),
        _gate_case(
            "an absolute gap of 0.5 that is within a relative tolerance of 0.0625 at perplexity 16",
            (16.0, 2.0),
            (16.5, 2.0),
            t,
        ),
        _gate_case(
            "a gap of 0.0625 in evidence NLL that is past a relative tolerance of 0.0625 at 0.5",
            (16.0, 0.5),
            (16.0, 0.5625),
            t,
        ),
        _gate_case(
            "the lab's own example on the limit: perplexity 16.8 against 16.0 at 5%", (16.0, nll), (16.8, nll), 0.05
        ),
        _gate_case("a current evidence score of 0 and a candidate at 0 too", (ppl, 0.0), (ppl, 0.0), t),
        _gate_case("a current evidence score of 0 and a candidate just above it", (ppl, 0.0), (ppl, 0.015625), t),
        _gate_case("a candidate evidence score of 0 (better than any positive one)", (ppl, nll), (ppl, 0.0), t),
        _gate_case("a negative tolerance", (ppl, nll), (ppl, nll), -0.05),
        _gate_case("a tolerance that is nan", (ppl, nll), (ppl, nll), NAN),
        _gate_case("a current perplexity that is nan (production's card is broken)", (NAN, nll), (ppl, nll), t),
        _gate_case("a current evidence score that is infinite", (ppl, float("inf")), (ppl, nll), t),
        _gate_case("a current perplexity that is negative", (-ppl, nll), (ppl, nll), t),
    ]
    for current, candidate, tolerance in _on_the_limit(rng, 3):
        cases.append(
            _gate_case(
                "a perplexity exactly on its limit (current times (1 + tolerance))",
                (current, nll),
                (candidate, nll),
                tolerance,
            )
        )
    for current, candidate, tolerance in _on_the_limit(rng, 1):
        cases.append(
            _gate_case(
                "an evidence score exactly on its limit (current times (1 + tolerance))",
                (ppl, current),
                (ppl, candidate),
                tolerance,
            )
        )
    for current, candidate, tolerance in _on_the_limit(rng, 1, past=True):
        cases.append(
            _gate_case(
                "a perplexity just past its limit (the next float above current times (1 + tolerance))",
                (current, nll),
                (candidate, nll),
                tolerance,
            )
        )
    rng.shuffle(cases)
    return cases


def _drive_gate(fn, cases: list[dict]) -> list:
    return [
        outcome(fn, _card("candidate", case["candidate"]), _card("production", case["current"]), case["tolerance"])
        for case in cases
    ]


def _describe_gate(case: dict) -> str:
    c, p = case["candidate"], case["current"]
    exact = repr  # every digit: a score on its limit must read as on it
    return (
        f"{case['label']}: candidate perplexity {exact(c['perplexity'])}, evidence_nll "
        f"{exact(c['evidence_nll'])}; current perplexity {exact(p['perplexity'])}, evidence_nll "
        f"{exact(p['evidence_nll'])}; tolerance {case['tolerance']!r}"
    )


def _variant_gate(
    case: dict, *, absolute=False, strict=False, nan_passes=False, only=None, higher=False, divided=False
) -> bool | None:
    """The gate with one common mistake, for the message (None where that mistake would raise)."""
    t = case["tolerance"]
    for key in _SCORES if only is None else (only,):
        ours, theirs = case["candidate"][key], case["current"][key]
        if higher:
            ok = ours >= theirs * (1 - t)
        elif divided:
            if theirs == 0:
                return None
            ok = _divided(ours, theirs, t)
        else:
            limit = theirs + t if absolute else theirs * (1 + t)
            ok = ours < limit if strict else ours <= limit
        if nan_passes:
            ok = ok or math.isnan(ours)
        if not ok:
            return False
    return True


def _gate_problem(case: dict, got, want):
    if type(got) is not bool:
        return "passes_gate must return a bool (True or False)", f"got {got!r:.60}"
    if got == want:
        return None
    mistakes = {
        "the tolerance is relative: a fraction of the current version's score, not an amount added to it": {
            "absolute": True
        },
        "a score exactly on its limit passes (<=, not <)": {"strict": True},
        "a score that is nan must fail: nan compares False with everything, so a test such as score > limit lets "
        "it through": {"nan_passes": True},
        "you judged perplexity only: the evidence score must be within the tolerance too": {"only": "perplexity"},
        "you judged the evidence score only: perplexity must be within the tolerance too": {"only": "evidence_nll"},
        "both scores are better when lower (a negative log-likelihood and its exponential)": {"higher": True},
        "the limit is the current score times (1 + tolerance), compared with <=: a relative difference, the gap "
        "divided by the current score, rounds differently in floating point and puts some scores that sit exactly "
        "on the limit past it (or some just past it within it)": {"divided": True},
    }
    fits = [why for why, flags in mistakes.items() if _variant_gate(case, **flags) == got]
    note = "; " + "; or ".join(fits) if fits else ""
    verdict = {True: "pass", False: "fail"}
    return (
        "passes_gate gave the wrong verdict",
        f"expected the candidate to {verdict[want]}, it would {verdict[got]}{note}",
    )


def _compare_gate(got, expected, cases):
    return compare_results("passes_gate", got, expected, cases, _describe_gate, _gate_problem)


_GATE_HINT = (
    "a candidate passes when each of its two scores, perplexity and evidence_nll (both lower is better), "
    "is a number no larger than the current version's times (1 + tolerance), that product as floating point "
    "gives it; a score on its limit passes, and a nan or infinite candidate score fails whatever the "
    "comparison says. A negative or nan tolerance, and a current score that is nan, infinite or negative, "
    "are invalid input (ValueError). "
    "chapter 11, section “7 · LLMOps: a registry, an evaluation gate, a canary, a rollback”."
)

register(
    Check(
        check_id="lab10.passes_gate",
        task=TASKS["passes_gate"],
        reference=lambda: reference_passes_gate,
        make_inputs=_gate_cases,
        drive=_drive_gate,
        compare=_compare_gate,
        hint=_GATE_HINT,
    )
)
register(
    Check(
        check_id="lab10.gate_edges",
        task=TASKS["passes_gate"],
        reference=lambda: reference_passes_gate,
        make_inputs=_gate_edges,
        drive=_drive_gate,
        compare=_compare_gate,
        hint=_GATE_HINT + " Scores exactly on their limits (the product, not a relative difference, decides), "
        "nan and infinite scores, scores of 0, tolerances of 0 and 1, and invalid tolerances "
        "and current scores.",
    )
)
