"""Lab 01's stated rules that a check must hold: for each, the wrong code that breaks only that rule
fails the check with a message naming the rule, and the instructor's answer passes."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

from conftest import REPO, check_fails, solution_namespace

from grading import check
from grading.checks.lab01 import _EXACT_COUNT_HINT

SOLUTION = REPO / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb"


def test_the_instructor_answers_pass_the_checks_that_hold_these_rules():
    answers = solution_namespace(SOLUTION, statistics=statistics, time=time)
    for check_id, name in (
        ("lab01.gemm_flops", "gemm_flops"),
        ("lab01.gemm_flops_shapes", "gemm_flops"),
        ("lab01.time_op_sync", "time_op"),
    ):
        check(check_id, answers[name])


def test_a_float_count_fails_the_rule_that_the_count_is_an_exact_int():
    message = check_fails("lab01.gemm_flops_shapes", lambda m, n, k: 2.0 * m * n * k)
    assert "gemm_flops must return the count as an int" in message and "of type float" in message, message
    assert f"hint: {_EXACT_COUNT_HINT}" in message


def test_one_middle_call_of_an_even_number_fails_the_median_rule():
    # The instructor's timer with a median that takes the upper of the two middle calls, not their mean.
    upper_middle = solution_namespace(
        SOLUTION, time=time, statistics=SimpleNamespace(median=lambda durations: sorted(durations)[len(durations) // 2])
    )["time_op"]
    message = check_fails("lab01.time_op_sync", upper_middle)
    assert "not the median of an even number of timed calls" in message, message
    assert "the median is the mean of the two middle durations" in message
    check("lab01.time_op_warmup", upper_middle)  # with an odd number of calls the rule cannot show
