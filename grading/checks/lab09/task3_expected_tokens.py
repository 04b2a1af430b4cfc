"""Lab 09 task 3: expected_tokens_per_step."""

from __future__ import annotations

import math
import random

from grading.checks.common import is_number, outcome, reference, unwrap
from grading.checks.lab09.tasks import SPEC, TASKS, expect_raise
from grading.registry import Check, Mismatch, register

# --- task 3: expected_tokens_per_step --------------------------------------------------------------


def _expected_cases(rng: random.Random) -> list[list]:
    return [[round(rng.uniform(0.2, 0.95), 3), rng.randint(1, 8)] for _ in range(6)] + [[0.5, 2], [0.8, 4]]


def _expected_edge_cases(rng: random.Random) -> list[list]:
    return [
        [0.0, rng.randint(1, 8)],
        [0, rng.randint(1, 8)],
        [1.0, rng.randint(1, 8)],
        [1, 4],
        [round(rng.uniform(0.1, 0.9), 3), 0],
        [0.999999, rng.randint(2, 6)],
        [1.5, 3],
        [-0.1, 2],
        [round(rng.uniform(0.5, 0.99), 4), 16],
        [round(rng.uniform(0.1, 0.9), 3), -rng.randint(1, 3)],
        [1.0, -1],
    ]


def _drive_expected(fn, cases: list[list]) -> list:
    return [outcome(fn, a, gamma) for a, gamma in cases]


def _expected_note(a: float, gamma: int, got) -> str:
    def close(x):
        return math.isclose(got, x, rel_tol=1e-6)

    want = float(gamma + 1) if a == 1 else (1 - a ** (gamma + 1)) / (1 - a)
    if close(want - 1) and not close(want):
        return (
            "; that counts only the accepted draft tokens: every step also emits one token of the target's own "
            "(the replacement at the first rejection, or the bonus)"
        )
    if a < 1:
        if gamma > 0 and close((1 - a**gamma) / (1 - a)):
            return "; that sums gamma terms: with the bonus token there are gamma + 1, 1 + a + ... + a^gamma"
        if close(a ** (gamma + 1) / (1 - a)) or close((1 - a ** (gamma + 1)) * (1 - a)):
            return (
                "; that is not the closed form of 1 + a + ... + a^gamma: try yours where the answer is known, "
                "E = 1 at a = 0 and at gamma = 0"
            )
        if close(1 / (1 - a)):
            return "; that is the limit for an endless draft: gamma drafts give only gamma + 1 terms"
    if close(1 + a * gamma) or close(a * gamma):
        return (
            "; draft token i counts only when every token before it was accepted too (probability a^i), "
            "not with probability a on its own"
        )
    return ""


def _compare_expected(got, expected, cases):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for (a, gamma), g, e in zip(cases, got, expected):
        where = f"acceptance={a}, gamma={gamma}"
        (got_kind, value), (want_kind, want) = unwrap(g), unwrap(e)
        if want_kind == "raised":
            problem = expect_raise("expected_tokens_per_step", got_kind, value, str(want), where)
            if problem:
                return problem
            continue
        if got_kind == "raised":
            note = (
                "; at a = 1 the formula divides by zero: every draft token is accepted, E = gamma + 1" if a == 1 else ""
            )
            return Mismatch(
                f"expected_tokens_per_step raised {str(value).split(':')[0]} on a valid input",
                f"on {where}: expected {want!r}, your code raised {value}{note}",
            )
        if is_number(value) and type(value) is not float and math.isclose(value, want, rel_tol=1e-7):
            return Mismatch(
                "expected_tokens_per_step must return a float",
                f"on {where}: got the {type(value).__name__} {value!r}; the value is right",
            )
        if not is_number(value) or math.isnan(value) or not math.isclose(value, want, rel_tol=1e-7):
            note = _expected_note(a, gamma, value) if is_number(value) else ""
            return Mismatch(
                "expected_tokens_per_step returned the wrong number",
                f"on {where}: expected {want!r}, got {value!r}{note}",
            )
    return None


_EXPECTED_HINT = (
    "a step yields its accepted draft tokens plus one token of the target's own, and draft token i "
    "counts only when every draft token up to it was accepted, so the chances shrink geometrically and "
    "there is one more term than there are draft tokens (chapter 09, section “2 · The acceptance "
    "rule”). At acceptance 1 every draft token and the target's token come out, with no division by "
    "zero; the result is a float, and an acceptance outside [0, 1] or a negative gamma raises ValueError."
)


_EXPECTED_REFERENCE = reference(SPEC, "expected_tokens_per_step")


register(
    Check(
        check_id="lab09.expected_tokens",
        task=TASKS[3],
        reference=_EXPECTED_REFERENCE,
        make_inputs=_expected_cases,
        drive=_drive_expected,
        compare=_compare_expected,
        hint=_EXPECTED_HINT,
    )
)


register(
    Check(
        check_id="lab09.expected_tokens_edges",
        task=TASKS[3],
        reference=_EXPECTED_REFERENCE,
        make_inputs=_expected_edge_cases,
        drive=_drive_expected,
        compare=_compare_expected,
        hint=_EXPECTED_HINT + " a = 0, a = 1 (also the int 1), gamma = 0, a very close to 1, a outside [0, 1], "
        "a negative gamma.",
    )
)
