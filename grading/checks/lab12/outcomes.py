"""What lab 12's checks share: the tasks as the stubs name them, the package of the references, and the
comparison of outcomes recorded as ``["value", result]``, ``["raised", "Type: message"]`` or
``["malformed", description]``."""

from __future__ import annotations

from grading.checks.common import unwrap
from grading.registry import Mismatch

RAG = "infra_lib.apps.rag"  # the package of the reference functions

# task number -> the task as the stubs name it
TASKS = {
    1: "lab12 task 1: chunk_text",
    2: "lab12 task 2: top_k_cosine",
    3: "lab12 task 3: recall_at_k",
    4: "lab12 task 4: your retriever in the pipeline",
}


def kind_mismatch(what: str, where: str, got, expected) -> Mismatch | None:
    """An exception where a value was due, or the reverse; None when both are values."""
    (got_kind, got_value), (want_kind, want) = unwrap(got), unwrap(expected)
    if got_kind == "malformed":
        return Mismatch(f"{what} returned something the check could not read", f"on {where}: {got_value!r:.120}")
    if want_kind == "raised" and got_kind != "raised":
        return Mismatch(f"{what} should raise {want.split(':')[0]} here", f"on {where}: the reference raised {want}")
    if got_kind == "raised" and want_kind != "raised":
        return Mismatch(f"{what} raised where a result was expected", f"on {where}: {got_value}")
    if got_kind == "raised" and got_value.split(":")[0] != want.split(":")[0]:
        return Mismatch(
            f"{what} raised the wrong kind of exception", f"on {where}: expected {want.split(':')[0]}, got {got_value}"
        )
    return None


def cases_mismatch(name: str, got, expected, cases, describe, value_problem) -> Mismatch | None:
    """The first case whose outcome differs: its kind first, then ``value_problem`` on two values."""
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from {name}, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        where = describe(case)
        problem = kind_mismatch(name, where, g, e)
        if problem is None and unwrap(g)[0] == "value":
            problem = value_problem(unwrap(g)[1], unwrap(e)[1], case, where)
        if problem is not None:
            return problem
    return None


def plain_number(got: list) -> list:
    """A recorded outcome whose value is a plain float (a 0-d tensor or numpy scalar is unwrapped)."""
    if got[0] != "value":
        return got
    value = got[1]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if type(value) is float:
        return ["value", value]
    return ["malformed", f"{value!r:.60} is a {type(value).__name__}: recall_at_k must return a float"]
