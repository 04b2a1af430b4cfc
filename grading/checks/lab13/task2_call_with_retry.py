"""Lab 13 task 2: ``call_with_retry(fn, state, policy, sleep)``, attempts and backoff waits."""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.lab13.graphs import ERRORS, PREDICATE, RETRY, TASKS, policy_object, random_policy, typed_outcome
from grading.registry import Check, Mismatch, register


def _retried(policy: dict, error: str) -> bool:
    """Whether the policy (as plain data) retries the error of that name."""
    return error != "Fatal" if policy["retry_on"] == PREDICATE else error in policy["retry_on"]


def _retry_cases(rng: random.Random) -> list[dict]:
    cases = []
    policy = random_policy(rng)
    cases.append({"policy": policy, "errors": []})  # succeeds at once
    cases.append({"policy": policy, "errors": ["Flaky"] * (policy["max_attempts"] - 1)})  # succeeds last
    cases.append({"policy": policy, "errors": ["Flaky"] * policy["max_attempts"]})  # exhausted
    cases.append({"policy": random_policy(rng), "errors": ["Fatal"]})  # not retried
    cases.append(
        {
            "policy": {
                **random_policy(rng),
                "max_attempts": 6,
                "initial_interval": 0.5,
                "backoff_factor": 2.0,
                "max_interval": 3.0,
            },
            "errors": ["Flaky"] * 5,
        }
    )  # the cap
    cases.append({"policy": None, "errors": ["Flaky"]})  # no policy: one attempt
    cases.append(
        {
            "policy": {**random_policy(rng, retry_on=PREDICATE), "max_attempts": 5},  # retry_on as a predicate
            "errors": ["TimeoutError", "Flaky", "Fatal"],
        }
    )
    return cases


def _retry_more_cases(rng: random.Random) -> list[dict]:
    policy = random_policy(rng, retry_on=("Flaky", "TimeoutError"))
    return [
        {"policy": policy, "errors": ["TimeoutError", "Flaky"]},
        {"policy": policy, "errors": ["Flaky", "Fatal"]},  # a fatal error after a retry stops at once
        {"policy": {**policy, "max_attempts": 1}, "errors": ["Flaky"]},
        {"policy": None, "errors": []},
        {
            "policy": {**random_policy(rng), "max_attempts": 8, "backoff_factor": 2.0, "max_interval": 1.0},
            "errors": ["Flaky"] * 7,
        },
        {"policy": {**random_policy(rng, retry_on=PREDICATE), "max_attempts": 3}, "errors": ["Flaky"] * 3},
    ]


def _drive_retry(call_with_retry, cases: list[dict]) -> list:
    results = []
    for case in cases:
        errors, calls, sleeps = list(case["errors"]), [], []

        def fn(state: dict) -> dict:
            calls.append(dict(state))
            if errors:
                raise ERRORS[errors.pop(0)](f"attempt {len(calls)} failed")
            return {"x": state["x"] + 1}

        got = typed_outcome(
            call_with_retry,
            fn,
            {"x": 1, "log": []},
            policy_object(case["policy"]),
            sleep=lambda seconds: sleeps.append(seconds),
        )
        # an error is kept with its message ("Flaky: attempt 3 failed"): the last attempt's error must come back
        result = (
            ["value", got[1] if isinstance(got[1], dict) else repr(got[1])] if got[0] == "value" else ["raised", got[2]]
        )
        results.append({"result": result, "attempts": len(calls), "sleeps": [round(float(s), 9) for s in sleeps]})
    return results


def _describe_retry(case: dict) -> str:
    policy = case["policy"]
    errors = ", ".join(case["errors"]) or "nothing"
    if policy is None:
        return f"policy=None, fn raising {errors} before it succeeds"
    retry_on = (
        f"<a predicate: {PREDICATE}>" if policy["retry_on"] == PREDICATE else f"({', '.join(policy['retry_on'])},)"
    )
    return (
        f"RetryPolicy(max_attempts={policy['max_attempts']}, initial_interval={policy['initial_interval']}, "
        f"backoff_factor={policy['backoff_factor']}, max_interval={policy['max_interval']}, retry_on="
        f"{retry_on}), fn raising {errors} on its first calls (Flaky is a ConnectionError, Fatal a "
        "ValueError)"
    )


_BACKOFF = "chapter 13, section “7 · Retries with exponential backoff, under a flaky tool”"
RETRY_MISSED = {
    "count": "max_attempts counts every call of fn, the first one included: it is not the number of retries "
    f"({_BACKOFF}).",
    "retry_on": "only the errors the policy retries are passing failures worth another attempt (its retry_on "
    "names exception classes, or is a predicate on the error); any other error is a bug, and it goes "
    "to the caller at once, before any wait.",
    "no policy": "no policy means a single attempt: nothing is retried and nothing is waited for.",
    "cap": f"every wait is capped at the policy's max_interval, however many failures came before ({_BACKOFF}).",
    "between": "a wait comes only between two attempts: none before the first call, none after the last one.",
    "growth": "the waits grow geometrically: the first failure waits the initial interval, and each later wait is "
    f"backoff_factor times the one before, up to the cap ({_BACKOFF}).",
    "ending": "the first attempt that succeeds ends the call with fn's own result; when the attempts run out, the "
    "last error goes to the caller unchanged, never swallowed or replaced.",
}


def _attempts_hint(case: dict, got: int, expected: int) -> str:
    if case["policy"] is None:
        return RETRY_MISSED["no policy"]
    stopped_by = case["errors"][expected - 1] if expected <= len(case["errors"]) else None
    if got > expected and stopped_by is not None and not _retried(case["policy"], stopped_by):
        return RETRY_MISSED["retry_on"]
    if case["policy"]["retry_on"] == PREDICATE:  # the cases before it got the count right
        return RETRY_MISSED["retry_on"]
    return RETRY_MISSED["count"]


def _sleeps_hint(case: dict, got: list, expected: list) -> str:
    policy = case["policy"]
    if len(got) != len(expected):
        return RETRY_MISSED["between"]
    uncapped = [round(policy["initial_interval"] * policy["backoff_factor"] ** i, 9) for i in range(len(got))]
    return RETRY_MISSED["cap" if got == uncapped else "growth"]


def _compare_retry(got, expected, cases) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        where = _describe_retry(case)
        if g["attempts"] != e["attempts"]:
            return Mismatch(
                "call_with_retry made the wrong number of attempts",
                f"on {where}: expected {e['attempts']} calls of fn, got {g['attempts']}",
                hint=_attempts_hint(case, g["attempts"], e["attempts"]),
            )
        if g["sleeps"] != e["sleeps"]:
            return Mismatch(
                "call_with_retry slept the wrong backoff",
                f"on {where}: expected sleep() with {e['sleeps']}, got {g['sleeps']}",
                hint=_sleeps_hint(case, g["sleeps"], e["sleeps"]),
            )
        (gk, gv), (ek, ev) = g["result"][:2], e["result"][:2]
        if gk == ek == "raised" and gv.split(":")[0] == ev.split(":")[0] and gv != ev:
            return Mismatch(
                "call_with_retry re-raised an earlier attempt's error",
                f"on {where}: expected the last attempt's error, {ev}, got {gv}",
                hint=RETRY_MISSED["ending"],
            )
        if gk != ek or gv != ev:
            said = {"value": "returned {}", "raised": "raised {}"}
            return Mismatch(
                "call_with_retry ended the wrong way",
                f"on {where}: expected it to {said[ek].format(ev)}, it {said.get(gk, '{}').format(gv)}",
                hint=RETRY_MISSED["ending"],
            )
    return None


_RETRY_HINT = (
    "max_attempts counts every call of fn, the first included, and a wait comes only between two attempts; "
    "the waits grow geometrically from the first interval (exponential backoff), and each is capped at the "
    "policy's maximum (chapter 13, section “7 · Retries with exponential backoff, under a flaky tool”). "
    "Only the errors the policy retries are retried (retry_on: exception classes, or a predicate on the "
    "error): any other is re-raised at once, the last one is re-raised when the attempts run out, and no "
    "policy means a single attempt. Wait only through the "
    "sleep argument, never time.sleep: the checks pass a recorder and compare every delay exactly."
)
register(
    Check(
        check_id="lab13.call_with_retry",
        task=TASKS[2],
        reference=reference(RETRY, "call_with_retry"),
        make_inputs=_retry_cases,
        drive=_drive_retry,
        compare=_compare_retry,
        hint=_RETRY_HINT,
    )
)
register(
    Check(
        check_id="lab13.call_with_retry_more",
        task=TASKS[2],
        reference=reference(RETRY, "call_with_retry"),
        make_inputs=_retry_more_cases,
        drive=_drive_retry,
        compare=_compare_retry,
        hint=_RETRY_HINT + " Hidden cases: two retried error types, a fatal error after a retry, one attempt, "
        "a long run of failures against the cap, and a predicate that runs out of "
        "attempts.",
    )
)
