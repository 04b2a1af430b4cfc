"""``check(check_id, implementation)``: the single way lab tests are written.

Interactively (and under nbgrader) both the learner's implementation and the
``infra_lib`` reference are driven here, and a difference raises ``AssertionError`` with
what differed, on what input, and a hint. Under the course's grader (``INFRA_LAB_RECORD``
set), the learner's kernel only records what the learner's code produced, with a
grade-time seed; the comparison runs later in the grader's own process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from grading.registry import Check, Mismatch, get_check

RECORD_ENV = "INFRA_LAB_RECORD"
SEED_ENV = "INFRA_LAB_SEED"
INTERACTIVE_SEED = 0
_MAX_ERROR_CHARS = 400


@dataclass(frozen=True)
class Outcome:
    """What driving one implementation produced: plain data, or the error it raised."""

    data: Any = None
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    check_id: str
    passed: bool
    what: str = ""
    detail: str = ""

    def message(self, check: Check, *, hidden: bool) -> str:
        """The feedback text; for hidden checks, without inputs or expected values."""
        if self.passed:
            return f"{self.check_id} passed"
        lines = [f"{self.check_id} failed [{check.task}]", f"  {self.what}"]
        if self.detail and not hidden:
            lines.append(f"  {self.detail}")
        lines.append(f"  hint: {check.hint}")
        return "\n".join(lines)


_PLAIN_SCALARS = (bool, int, float, str, type(None))


def to_plain(value: Any, _depth: int = 0) -> Any:
    """Convert a driver's result to plain JSON-able data, refusing anything else.

    Only exact built-in types pass (a subclass of int could redefine ``==``); numpy and
    torch values are converted through ``tolist()``.
    """
    if _depth > 20:
        raise TypeError("result is nested too deeply")
    if type(value) in _PLAIN_SCALARS:
        return value
    if type(value) in (list, tuple):
        return [to_plain(v, _depth + 1) for v in value]
    if type(value) is dict:
        if not all(type(k) is str for k in value):
            raise TypeError("dict keys must be strings")
        return {k: to_plain(v, _depth + 1) for k, v in value.items()}
    module = type(value).__module__
    if module.startswith("numpy") or module.startswith("torch"):
        tolist = getattr(value, "tolist", None)
        if tolist is not None:
            return to_plain(tolist(), _depth + 1)
    raise TypeError(
        f"returned a {type(value).__module__}.{type(value).__qualname__}; "
        "return plain Python numbers, strings or lists"
    )


def drive(check: Check, implementation: Any, inputs: Any) -> Outcome:
    """Run the check's driver on an implementation; never raises for the implementation's errors."""
    try:
        return Outcome(data=to_plain(check.drive(implementation, inputs)))
    except Exception as exc:  # the learner's code may raise anything
        text = f"{type(exc).__name__}: {exc}"
        if len(text) > _MAX_ERROR_CHARS:
            text = text[:_MAX_ERROR_CHARS] + "..."
        return Outcome(error=text)


def judge(check: Check, learner: Outcome, expected: Outcome, inputs: Any) -> Verdict:
    """Compare the learner's outcome with the reference's, for one check."""
    if expected.error is not None:
        raise RuntimeError(f"the reference failed check {check.check_id}: {expected.error}")
    if learner.error is not None:
        return Verdict(check.check_id, False, f"your code raised {learner.error}")
    try:
        mismatch = check.compare(learner.data, expected.data, inputs)
    except Exception as exc:  # malformed learner data (wrong shapes, types)
        mismatch = Mismatch(f"your result has the wrong form ({type(exc).__name__}: {exc})")
    if mismatch is None:
        return Verdict(check.check_id, True)
    return Verdict(check.check_id, False, mismatch.what, mismatch.detail)


def check(check_id: str, implementation: Any) -> None:
    """Check a learner's implementation against the reference.

    Args:
        check_id: a registered check, e.g. "lab01.gemm_flops".
        implementation: the function or class the check exercises.

    Raises:
        AssertionError: interactively, when the implementation's results differ from the
            reference's (the message says what differed, on what input, and a hint).
    """
    registered = get_check(check_id)
    record_path = os.environ.get(RECORD_ENV)
    if record_path:
        seed = int(os.environ.get(SEED_ENV, "0"))
        outcome = drive(registered, implementation, registered.inputs(seed))
        line = json.dumps({"check_id": check_id, "data": outcome.data, "error": outcome.error})
        with open(record_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        print(f"{check_id}: answer recorded; the grader compares it with the reference")
        return
    inputs = registered.inputs(INTERACTIVE_SEED)
    learner = drive(registered, implementation, inputs)
    expected = drive(registered, registered.reference(), inputs)
    verdict = judge(registered, learner, expected, inputs)
    if not verdict.passed:
        raise AssertionError(verdict.message(registered, hidden=False))
    print(f"\N{CHECK MARK} {check_id} passed")
