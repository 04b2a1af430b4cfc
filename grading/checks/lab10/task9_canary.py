"""Lab 10 task 9: ``canary_verdict``, the canary's verdict on a candidate against production,
case by case and over whole simulated rollouts."""

from __future__ import annotations

import math
import random

from grading.checks.common import outcome
from grading.checks.lab10.results import TASKS, compare_results, fmt
from grading.registry import Check, register


def reference_canary_verdict(candidate, production, policy) -> str:
    """The reference's answer to task 9: the verdict of ``RolloutPolicy.judge``."""
    from infra_lib.ops.llmops import RolloutPolicy

    return RolloutPolicy.judge(policy, candidate, production)[0]


_POLICY = {"window": 10, "max_error_rate": 0.1, "max_p99_ratio": 2.0, "max_p99_added_s": 1.0, "min_p99_s": 0.05}


def _served(version: str, requests: list[list]):
    from infra_lib.ops.llmops import Served

    return [Served(version, float(i), latency, ok, 0, 0.1) for i, (latency, ok) in enumerate(requests)]


def _policy(d: dict):
    from infra_lib.ops.llmops import RolloutPolicy

    return RolloutPolicy(shares=(0.1, 0.5, 1.0), baseline=50, **d)


def _lognormal(rng: random.Random, n: int, median: float, delay: float = 0.0, errors: int = 0) -> list[list]:
    """``n`` requests: latencies in whole milliseconds, ``errors`` of them failed (at random places)."""
    failed = set(rng.sample(range(n), errors))
    return [[round(median * math.exp(rng.gauss(0, 0.35)) + delay, 3), i not in failed] for i in range(n)]


def _canary_case(label: str, candidate: list[list], production: list[list], **policy) -> dict:
    return {"label": label, "candidate": candidate, "production": production, "policy": {**_POLICY, **policy}}


def _drawn(rng: random.Random, want: str, label: str, candidate, production: list[list], also=None, **policy) -> dict:
    """A case whose candidate requests are drawn by ``candidate(rng)`` until the rules give ``want`` (and
    ``also(case)`` holds), so that the label stays true for every seed."""
    while True:
        case = _canary_case(label, candidate(rng), production, **policy)
        if _judged(case) == want and (also is None or also(case)):
            return case


def _between(rng: random.Random, requests: list[list], low: float, high: float, shift: bool = False) -> list[list]:
    """``requests`` moved so that the P99 of their successful ones lands a random way between ``low`` and
    ``high`` (well clear of both): every latency shifted by the same amount, or scaled by the same factor."""
    target = low + (high - low) * rng.uniform(0.2, 0.8)
    now = _successful_p99(requests)
    return [[round(latency + target - now if shift else latency * target / now, 4), ok] for latency, ok in requests]


def _canary_cases(rng: random.Random) -> list[dict]:
    prod = _lognormal(rng, 50, 0.8)
    fast_prod = _lognormal(rng, 50, 0.12)
    cases = [
        _drawn(rng, "advance", "a healthy window", lambda r: _lognormal(r, 10, 0.8), prod),
        _drawn(rng, "advance", "a faster candidate", lambda r: _lognormal(r, 10, 0.55), prod),
        _drawn(
            rng, "rollback", "a window with 3 failed requests of 10", lambda r: _lognormal(r, 10, 0.8, errors=3), prod
        ),
        _canary_case(
            "a candidate behind a fixed delay (past the added limit, within the ratio one)",
            _between(rng, _lognormal(rng, 10, 0.8), _successful_p99(prod) + 1.0, 2 * _successful_p99(prod), shift=True),
            prod,
        ),
        _canary_case(
            "a candidate several times slower on a fast server (past the ratio limit, within the added one)",
            _between(rng, _lognormal(rng, 10, 0.12), 2 * _successful_p99(fast_prod), _successful_p99(fast_prod) + 1.0),
            fast_prod,
        ),
        _drawn(
            rng,
            "advance",
            "a window of 20 with 3 failed requests (15%), a policy allowing 15%",
            lambda r: _lognormal(r, 20, 0.8, errors=3),
            prod,
            window=20,
            max_error_rate=0.15,
        ),
        _drawn(
            rng,
            "advance",
            "a slow candidate under a lenient policy (ratio 4, 3 s added)",
            lambda r: _lognormal(r, 10, 0.8, delay=1.5),
            prod,
            max_p99_ratio=4.0,
            max_p99_added_s=3.0,
        ),
    ]
    rng.shuffle(cases)
    return cases


def _canary_edges(rng: random.Random) -> list[dict]:
    prod = _lognormal(rng, 50, 0.8)
    flat = [[0.5, True]] * 40
    cases = [
        _canary_case(
            "an error rate exactly at max_error_rate (1 of 10 at 10%)", _lognormal(rng, 10, 0.8, errors=1), prod
        ),
        _drawn(
            rng,
            "advance",
            "failed requests that timed out after 30 s (2 of 10, a policy allowing 25%)",
            lambda r: [[30.0, False]] * 2 + _lognormal(r, 8, 0.8),
            prod,
            max_error_rate=0.25,
        ),
        _canary_case(
            "a candidate P99 exactly twice production's (on the ratio limit)",
            [[1.0, True]] * 10,
            flat,
            max_p99_added_s=5.0,
        ),
        _canary_case(
            "a candidate P99 exactly 1 s above production's (on the added limit)",
            [[1.5, True]] * 10,
            flat,
            max_p99_ratio=10.0,
        ),
        _canary_case(
            "one slow request of 10: P99 interpolates, it is not the maximum",
            [[1.0, True]] * 9 + [[2.0625, True]],
            [[1.0, True]] * 40,
            max_p99_added_s=5.0,
        ),
        _canary_case("latencies under min_p99_s (fast, and 4x production's)", [[0.04, True]] * 10, [[0.01, True]] * 40),
        _canary_case("no production requests yet", _lognormal(rng, 10, 2.0), []),
        _canary_case("production's requests all failed", _lognormal(rng, 10, 2.0), [[0.5, False]] * 20),
        _canary_case("every candidate request failed", [[0.25, False]] * 10, prod),
        _canary_case(
            "a policy that allows no error, one failure", _lognormal(rng, 10, 0.8, errors=1), prod, max_error_rate=0.0
        ),
        _drawn(
            rng,
            "rollback",
            "a strict latency policy (ratio 1.25, 0.25 s added)",
            lambda r: _lognormal(r, 10, 1.3),
            prod,
            max_p99_ratio=1.25,
            max_p99_added_s=0.25,
        ),
    ]
    rng.shuffle(cases)
    return cases


def _drive_canary(fn, cases: list[dict]) -> list:
    return [
        outcome(
            fn,
            _served("candidate", case["candidate"]),
            _served("production", case["production"]),
            _policy(case["policy"]),
        )
        for case in cases
    ]


def _successful_p99(requests: list[list]) -> float:
    """The P99 latency of the successful requests, as the reference takes it (0 for none)."""
    from infra_lib.ops.llmops import p99

    return p99([latency for latency, ok in requests if ok])


def _describe_canary(case: dict) -> str:
    c, p, pol = case["candidate"], case["production"], case["policy"]
    failed = sum(not ok for _, ok in c)
    return (
        f"{case['label']}: {len(c)} candidate requests ({failed} failed, P99 of the successful ones "
        f"{fmt(_successful_p99(c))} s), {len(p)} production requests (P99 {fmt(_successful_p99(p))} s); "
        f"policy max_error_rate="
        f"{pol['max_error_rate']}, max_p99_ratio={pol['max_p99_ratio']}, max_p99_added_s={pol['max_p99_added_s']}, "
        f"min_p99_s={pol['min_p99_s']}"
    )


def _judged(
    case: dict, *, at_least=False, with_failed=False, no_floor=False, rule=None, nearest=False, maximum=False
) -> str:
    """The reference's verdict (``RolloutPolicy.judge``) on the case, or on the case as one common mistake reads
    it, for the message: a limit moved (``>=`` is ``>`` against the next float down, one rule alone is the other
    at infinity, no floor is a floor at minus infinity), or the latencies the P99s are taken over changed (the
    failed requests counted as well; a single request carrying the nearest-rank value or the maximum)."""
    policy = dict(case["policy"])
    if at_least:
        policy["max_error_rate"] = math.nextafter(policy["max_error_rate"], -math.inf)
    if no_floor:
        policy["min_p99_s"] = -math.inf
    if rule:
        policy["max_p99_added_s" if rule == "ratio" else "max_p99_ratio"] = math.inf
    candidate, production = case["candidate"], case["production"]
    if reference_canary_verdict(_served("candidate", candidate), [], _policy(policy)) == "rollback":
        return "rollback"  # the error rate alone: with no production latency, no latency rolls back

    def latencies(requests: list[list], top=None) -> list[list]:
        values = sorted(latency for latency, ok in requests if ok or with_failed)
        return [[top(values), True]] if top and values else [[value, True] for value in values]

    ranked = _nearest_rank if nearest else None
    return reference_canary_verdict(
        _served("candidate", latencies(candidate, max if maximum else ranked)),
        _served("production", latencies(production, ranked)),
        _policy(policy),
    )


def _nearest_rank(values: list[float]) -> float:
    """The 99th percentile as the nearest rank (a common mistake's P99)."""
    return values[max(0, math.ceil(0.99 * len(values)) - 1)]


def _canary_problem(case: dict, got, want):
    if got not in ("rollback", "advance"):
        return "canary_verdict must return 'rollback' or 'advance'", f"got {got!r:.60}"
    if got == want:
        return None
    mistakes = {
        "an error rate equal to max_error_rate is not above it (>, not >=)": {"at_least": True},
        "the P99s are over successful requests only: a failed request counts in the error rate, not in the latency": {
            "with_failed": True
        },
        "below min_p99_s a latency is never a reason to roll back, whatever the ratio": {"no_floor": True},
        "you applied the ratio rule only: the candidate also rolls back past production's P99 plus "
        "max_p99_added_s, whichever limit is lower": {"rule": "ratio"},
        "you applied the added-seconds rule only: the candidate also rolls back past max_p99_ratio times "
        "production's P99, whichever limit is lower": {"rule": "added"},
        "P99 is the 99th percentile with linear interpolation (your percentile from task 4), not the nearest rank": {
            "nearest": True
        },
        "P99 is the 99th percentile with linear interpolation (your percentile from task 4), not the maximum": {
            "maximum": True
        },
    }
    fits = [why for why, flags in mistakes.items() if _judged(case, **flags) == got]
    if not fits and not any(ok for _, ok in case["production"]):
        fits = [
            "with no successful production request there is nothing to compare a latency with: its P99 is 0, "
            "and only the error rate can roll the candidate back"
        ]
    note = "; " + "; or ".join(fits) if fits else ""
    return "canary_verdict gave the wrong verdict", f"expected {want!r}, got {got!r}{note}"


def _compare_canary(got, expected, cases):
    return compare_results("canary_verdict", got, expected, cases, _describe_canary, _canary_problem)


def _rollout_cases(rng: random.Random) -> list[dict]:
    from infra_lib.ops.llmops import BEHAVIOURS

    return [{"behaviour": b, "seed": rng.randrange(10_000)} for b in BEHAVIOURS for _ in range(2)]


def _drive_rollouts(fn, cases: list[dict]) -> list:
    from infra_lib.ops.llmops import RolloutPolicy, simulate_rollout

    def run(behaviour, seed):
        rollout = simulate_rollout(behaviour, RolloutPolicy(), judge=fn, seed=seed)
        return {
            "outcome": rollout.outcome,
            "served": len(rollout.served),
            "decisions": [[d["step"], d["verdict"]] for d in rollout.decisions],
        }

    return [outcome(run, case["behaviour"], case["seed"]) for case in cases]


def _describe_rollout(case: dict) -> str:
    return f"simulate_rollout({case['behaviour']!r}, RolloutPolicy(), judge=canary_verdict, seed={case['seed']})"


def _rollout_problem(case: dict, got, want):
    if got == want:
        return None
    if type(got) is not dict:
        return "the rollout returned something unexpected", f"got {got!r:.80}"
    return (
        "the rollout driven by your canary_verdict ended differently from the reference's",
        f"expected {want['outcome']} after {want['served']} requests (decisions {want['decisions']}), got "
        f"{got['outcome']} after {got['served']} (decisions {got['decisions']})",
    )


def _compare_rollouts(got, expected, cases):
    return compare_results("canary_verdict", got, expected, cases, _describe_rollout, _rollout_problem)


_CANARY_HINT = (
    "roll back when the candidate's error rate (failed over all its requests) is above max_error_rate; "
    "else when the P99 latency of its successful requests is above min_p99_s, production's P99 (of its "
    "successful requests) is above 0, and the candidate's is above the lower of max_p99_ratio times "
    "production's and production's plus max_p99_added_s; else advance. Every threshold comes from the "
    "policy; an empty list's P99 is 0. "
    "chapter 11, section “7 · LLMOps: a registry, an evaluation gate, a canary, a rollback”."
)
register(
    Check(
        check_id="lab10.canary_verdict",
        task=TASKS["canary_verdict"],
        reference=lambda: reference_canary_verdict,
        make_inputs=_canary_cases,
        drive=_drive_canary,
        compare=_compare_canary,
        hint=_CANARY_HINT,
    )
)
register(
    Check(
        check_id="lab10.canary_edges",
        task=TASKS["canary_verdict"],
        reference=lambda: reference_canary_verdict,
        make_inputs=_canary_edges,
        drive=_drive_canary,
        compare=_compare_canary,
        hint=_CANARY_HINT + " Values exactly on each limit, timed-out failures, a single outlier, no "
        "production requests, policies other than the default.",
    )
)
register(
    Check(
        check_id="lab10.canary_rollouts",
        task=TASKS["canary_verdict"],
        reference=lambda: reference_canary_verdict,
        make_inputs=_rollout_cases,
        drive=_drive_rollouts,
        compare=_compare_rollouts,
        hint=_CANARY_HINT + " Whole simulated rollouts of every behaviour, your verdict deciding each step.",
    )
)
