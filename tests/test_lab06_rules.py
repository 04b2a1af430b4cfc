"""Lab 06's stated rules that a check must hold: each answer below is the instructor's with one rule of
the lab's text broken; the check that holds the rule fails it with a message naming the rule, and the
instructor's answer passes."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import REPO, answer_cells, check_fails, solution_namespace
from grading import check
from grading.checks.lab06 import _NO_GRAD_HINT, _PREFILL_ONCE_HINT, _TIE_HINT

SOLUTION = REPO / "solutions" / "lab06_kv_cache" / "lab06_kv_cache.ipynb"


def _greedy_decode(*edits: tuple[str, str]):
    """The instructor's greedy_decode with lines of its source replaced (each edit must apply once)."""
    source = answer_cells(SOLUTION)["task4_greedy_decode"]
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"torch": torch, "math": math}
    exec(source, namespace)
    return namespace["greedy_decode"]


@pytest.fixture(scope="module")
def answers() -> dict:
    return solution_namespace(SOLUTION, torch=torch, math=math)


def test_the_instructor_answers_pass_the_checks_that_hold_these_rules(answers):
    check("lab06.repeat_kv", answers["repeat_kv"])
    check("lab06.greedy_decode", answers["greedy_decode"])
    check("lab06.greedy_decode_stop", answers["greedy_decode"])


def test_copies_made_in_the_default_dtype_fail_the_rule_that_repeat_kv_keeps_xs_dtype(answers):
    def float32_copies(x, group):
        out = torch.empty(x.shape[0], x.shape[1] * group, *x.shape[2:])  # torch's default dtype, not x's
        out.copy_(answers["repeat_kv"](x, group))
        return out

    message = check_fails("lab06.repeat_kv", float32_copies)
    assert "repeat_kv changed the dtype of the keys and values" in message, message
    assert "expected dtype bfloat16, got float32" in message and "and dtype bfloat16" in message


def test_a_prompt_fed_a_token_at_a_time_fails_the_rule_that_it_is_prefilled_once():
    token_by_token = _greedy_decode((
        "        logits = model(torch.tensor([prompt]), cache, last_only=True)\n",
        "        for token in prompt:\n            logits = model(torch.tensor([[token]]), cache, last_only=True)\n"))
    message = check_fails("lab06.greedy_decode", token_by_token)
    assert "greedy_decode called the model another number of times than a cached loop needs" in message, message
    assert f"hint: {_PREFILL_ONCE_HINT}" in message


def test_a_loop_that_records_gradients_fails_the_rule_to_run_under_inference_mode():
    with_grad = _greedy_decode(("    with torch.inference_mode():\n", "    if True:\n"))
    message = check_fails("lab06.greedy_decode", with_grad)
    assert "greedy_decode ran the model with gradient recording on" in message, message
    assert f"hint: {_NO_GRAD_HINT}" in message


def test_the_highest_id_on_a_tie_fails_the_rule_that_greedy_takes_the_lowest():
    highest_on_tie = _greedy_decode((
        "            token = int(logits[0, -1].argmax())\n",
        "            token = sorted(range(logits.shape[-1]), key=lambda i: float(logits[0, -1, i]))[-1]\n"))
    check("lab06.greedy_decode", highest_on_tie)  # without ties it is greedy decoding
    message = check_fails("lab06.greedy_decode_stop", highest_on_tie)
    assert "greedy_decode produced different tokens where two logits tie for the highest" in message, message
    assert f"hint: {_TIE_HINT}" in message
