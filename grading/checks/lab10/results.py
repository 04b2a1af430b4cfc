"""Lab 10's checks compare results case by case: numbers equal up to float rounding (nan equal to nan),
an exception where one was due, and a message naming the case and the mistake."""

from __future__ import annotations

import math

from grading.checks.common import is_number, unwrap
from grading.registry import Mismatch

LATENCY = "infra_lib.ops.latency"  # the module of the reference metrics
# each learner function -> the task that names it, as the stubs do
TASKS = {
    "ttft": "lab10 task 1: ttft",
    "e2el": "lab10 task 1: e2el",
    "tpot": "lab10 task 2: tpot",
    "itl": "lab10 task 3: itl",
    "percentile": "lab10 task 4: percentile",
    "latency_percentiles": "lab10 task 5: latency_percentiles",
    "goodput": "lab10 task 6: goodput",
    "diagnose": "lab10 task 7: diagnose",
    "passes_gate": "lab10 task 8: passes_gate",
    "canary_verdict": "lab10 task 9: canary_verdict",
}


def same_number(got, expected: float, rel: float = 1e-9) -> bool:
    """Equal numbers (nan equals nan; a tolerance for the order of float operations)."""
    if not is_number(got):
        return False
    if math.isnan(expected) or math.isnan(got):
        return math.isnan(expected) and math.isnan(got)
    return math.isclose(got, expected, rel_tol=rel, abs_tol=1e-12)


def fmt(value) -> str:
    """A number as a message shows it (nan, or rounded to 6 places); anything else as its repr."""
    if is_number(value):
        return "nan" if math.isnan(value) else repr(round(value, 6))
    return repr(value)


def compare_results(name: str, got, expected, cases, describe, value_problem) -> Mismatch | None:
    """Case by case: an exception where a value was due (or the reverse), then ``value_problem``."""
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from {name}, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        (got_kind, got_value), (want_kind, want) = unwrap(g), unwrap(e)
        where = describe(case)
        if want_kind == "raised":
            error = str(want).split(":")[0]
            if got_kind == "raised" and str(got_value).split(":")[0] == error:
                continue
            got_text = f"it raised {got_value}" if got_kind == "raised" else f"it returned {fmt(got_value)}"
            return Mismatch(f"{name} should raise {error} on an invalid input", f"on {where}: {got_text}")
        if got_kind == "raised":
            return Mismatch(
                f"{name} raised an exception on a valid input",
                f"on {where}: expected {fmt(want)}, your code raised {got_value}",
            )
        if got_kind != "value":
            return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
        problem = value_problem(case, got_value, want)
        if problem is not None:
            what, detail = problem
            return Mismatch(what, f"on {where}: {detail}")
    return None


# the note on a wrong value of a task built on tasks 1 to 4, when no known mistake explains it
YOURS = "; this uses your functions from tasks 1 to 4: if one of their checks fails, fix that first"
