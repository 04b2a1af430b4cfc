"""Lab 02's stated rules that a check must hold: the wrong code that breaks only that rule fails the
check with a message naming the rule, and the instructor's answer passes."""

from __future__ import annotations

from conftest import REPO, check_fails, solution_namespace

from grading import check

SOLUTION = REPO / "solutions" / "lab02_roofline" / "lab02_roofline.ipynb"


def test_a_float_number_of_sequences_fails_the_rule_that_the_answer_is_an_int():
    max_concurrency = solution_namespace(SOLUTION)["max_concurrency"]
    check("lab02.max_concurrency", max_concurrency)
    check("lab02.max_concurrency_tight", max_concurrency)

    def floor_of_floats(memory_bytes, weight_bytes, kv_bytes_per_token, context_len, reserve_bytes=0):
        free = memory_bytes - weight_bytes - reserve_bytes
        return max(0, free // kv_bytes_per_token // context_len)  # a float whenever the sizes are floats

    for check_id in ("lab02.max_concurrency", "lab02.max_concurrency_tight"):
        message = check_fails(check_id, floor_of_floats)
        assert "max_concurrency must return the number of sequences as an int" in message, message
        assert "of type float" in message and "a number of sequences is a count, an int" in message
