"""Lab 18 task 1's checks: the course's answer passes them; each usual mistake of ring attention (the course's
answer with one idea taken out, its source with one line replaced) fails the check that should catch it, with the
hint written for that mistake; a rank left waiting is stopped within seconds and named; an untouched answer fails
cleanly, pointing to the lesson.

The answer cells are read from the task's cell file until the lab notebook is assembled."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from conftest import REPO, answer_cells, check_fails

import grading.checks.lab18.task1_ring as ring
from grading import check
from grading.checks.lab18.tasks import TASKS

SOLUTION = REPO / "solutions" / "lab18_resilient_training" / "lab18_resilient_training.ipynb"


def _cells() -> dict[str, str]:
    return answer_cells(SOLUTION)


def variant(cell: str, *replacements: tuple[str, str]) -> dict:
    """The namespace of the course's answer ``cell`` with each (old, new) replacement made."""
    source = _cells()[cell]
    for old, new in replacements:
        assert source.count(old) == 1, f"the answer {cell} no longer holds {old!r}"
        source = source.replace(old, new)
    namespace = {"torch": torch, "math": math}
    exec(compile(source, f"<{cell}>", "exec"), namespace)  # noqa: S102 - the course's own answer, changed
    return namespace


FORWARD = "task1_ring_attention"
BACKWARD = "task1_bonus_ring_backward"


@pytest.mark.parametrize(
    "check_id, name",
    [
        ("lab18.ring_step", "ring_attention_step"),
        ("lab18.ring_step_edges", "ring_attention_step"),
        ("lab18.ring_forward", "ring_attention"),
        ("lab18.ring_forward_edges", "ring_attention"),
        ("lab18.ring_traffic", "ring_attention"),
    ],
)
def test_task1_the_course_answer_passes(check_id, name):
    check(check_id, variant(FORWARD)[name])


@pytest.mark.parametrize("check_id", ["lab18.ring_backward", "lab18.ring_backward_edges"])
def test_task1_bonus_the_course_answer_passes(check_id):
    namespace = variant(BACKWARD)
    check(check_id, namespace["ring_attention_backward"])


_SHRINK = "shrink = torch.exp(seen_max - top)"
_AHEAD = "rows.view(1, -1) > rows.view(-1, 1)"
STEP_MISTAKES = {
    "the running max not rescaled across steps": ((_SHRINK, "shrink = torch.ones_like(top)"), "no_rescale"),
    "the diagonal mask hides each query's own key": (
        (_AHEAD, "rows.view(1, -1) >= rows.view(-1, 1)"),
        "strict_diagonal",
    ),
    "the diagonal mask hides the past": ((_AHEAD, "rows.view(1, -1) < rows.view(-1, 1)"), "past_hidden"),
    "the diagonal block left unmasked": (('if causal_kind == "diagonal":', "if False:"), "diagonal_unmasked"),
    "scores not scaled": ((" / math.sqrt(q.shape[-1])  # [b, h, t, s]", "  # [b, h, t, s]"), "unscaled"),
}


@pytest.mark.parametrize("mistake", STEP_MISTAKES)
def test_task1_step_mistakes_are_named(mistake):
    replacement, hint = STEP_MISTAKES[mistake]
    message = check_fails("lab18.ring_step", variant(FORWARD, replacement)["ring_attention_step"])
    assert ring.HINTS[hint] in message, message


def test_task1_a_state_of_another_form_is_named():
    step = variant(FORWARD, ("    return top, new_sum, new_acc", "    return top, new_sum"))["ring_attention_step"]
    message = check_fails("lab18.ring_step", step)
    assert "must return (row_max, row_sum, acc)" in message and ring.STATE_HINT in message


def test_task1_a_step_that_accepts_any_causal_kind_fails_the_hidden_edges():
    lax = variant(FORWARD, ('    if causal_kind not in ("diagonal", "full"):', "    if False:"))["ring_attention_step"]
    check("lab18.ring_step", lax)
    message = check_fails("lab18.ring_step_edges", lax)
    assert "did not refuse a causal_kind" in message and "raised nothing" in message


def test_task1_a_row_max_that_is_not_the_max_is_named():
    """A state whose row_max is not the largest score met may give the right output on small scores, but it is not
    the contract's state, and on scores near 10^2 exp overflows float32."""
    unsafe = variant(
        FORWARD,
        ("top = torch.maximum(seen_max, logits.amax(dim=-1))", "top = torch.zeros_like(seen_max)"),
    )["ring_attention_step"]
    message = check_fails("lab18.ring_step", unsafe)
    assert "the state's row_max differs from the course's" in message and ring.STATE_HINT in message


_ROUTE = '''        if not causal or owner < me:
            kind = "full"'''
RING_MISTAKES = {
    "every block masked as diagonal": (
        "lab18.ring_forward",
        (
            _ROUTE,
            '        if not causal:\n            kind = "full"\n'
            '        elif owner < me:\n            kind = "diagonal"',
        ),
        "all_diagonal",
    ),
    "later ranks' blocks not skipped": ("lab18.ring_forward", ("kind = None  #", 'kind = "full"  #'), "no_skip"),
    "the final normalisation forgotten": (
        "lab18.ring_forward",
        ("return weighted / total.unsqueeze(-1)", "return weighted"),
        "unnormalised",
    ),
    "causal=False ignored": ("lab18.ring_forward", ("if not causal or owner < me:", "if owner < me:"), "masked"),
    "the running max not rescaled, seen in the ring": (
        "lab18.ring_forward",
        (_SHRINK, "shrink = torch.ones_like(top)"),
        "no_rescale",
    ),
    "a W-th exchange": ("lab18.ring_traffic", ("if hop < ranks - 1:", "if True:"), "traffic"),
}


@pytest.mark.parametrize("mistake", RING_MISTAKES)
def test_task1_ring_mistakes_are_named(mistake):
    check_id, replacement, hint = RING_MISTAKES[mistake]
    message = check_fails(check_id, variant(FORWARD, replacement)["ring_attention"])
    assert ring.HINTS[hint] in message, message


def test_task1_a_sent_block_straight_to_every_rank_is_excess_traffic():
    """An all-gather by hand: at hop j send the own block to rank + j (same bytes, but not the ring)."""
    gather = variant(
        FORWARD,
        (
            "comm.exchange(travelling, (me + 1) % ranks, arriving, (me - 1) % ranks)",
            "comm.exchange(torch.stack((k, v)), (me + hop + 1) % ranks, arriving, (me - hop - 1) % ranks)",
        ),
    )["ring_attention"]
    check("lab18.ring_forward", gather)  # the values are right
    message = check_fails("lab18.ring_traffic", gather)
    assert "(excess traffic)" in message and "other ranks than its ring neighbours" in message
    assert ring.HINTS["traffic"] in message


@pytest.mark.parametrize(
    "replacement, waiting",
    [
        # a rank that skips a later block's compute skips its exchange too: its neighbour waits
        (("if hop < ranks - 1:", "if hop < ranks - 1 and kind is not None:"), "rank 1 sent to 2 and waits for 0"),
        # receive from the rank it sends to: with 3 ranks nobody sends to anybody's source
        (("arriving, (me - 1) % ranks)", "arriving, (me + 1) % ranks)"), "rank 0 sent to 1 and waits for 1"),
    ],
    ids=["exchange skipped with the compute", "received from the right"],
)
def test_task1_a_deadlock_is_stopped_within_seconds_and_named(replacement, waiting):
    started = time.monotonic()
    message = check_fails("lab18.ring_forward", variant(FORWARD, replacement)["ring_attention"])
    assert time.monotonic() - started < 25
    assert "waited for a message that never came" in message and "deadlock: ranks" in message
    assert waiting in message and ring.HINTS["deadlock"] in message


def test_task1_a_rank_that_never_ends_is_stopped_and_named():
    def spin(q, k, v, comm, causal=True):
        while True:
            pass

    before, started = set(threading.enumerate()), time.monotonic()
    message = check_fails("lab18.ring_forward", spin)
    assert time.monotonic() - started < 25
    assert "still running your code" in message and "outside exchange" in message
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in set(threading.enumerate()) - before):
        assert time.monotonic() < deadline, "a rank thread kept running"
        time.sleep(0.05)


def test_task1_bonus_mistakes_are_named():
    no_home = variant(
        BACKWARD,
        (
            "    comm.exchange(carried[2:].contiguous(), (me + 1) % ranks, finished, (me - 1) % ranks)\n",
            "    finished = carried[2:]\n",
        ),
    )["ring_attention_backward"]
    message = check_fails("lab18.ring_backward", no_home)
    assert ring.HINTS["home"] in message, message
    no_delta = variant(BACKWARD, (" - row_dot)", ")"))["ring_attention_backward"]
    message = check_fails("lab18.ring_backward", no_delta)
    assert "differs from full attention's gradient" in message and ring.HINTS["backward"] in message


@pytest.mark.parametrize(
    "check_id",
    ["lab18.ring_step", "lab18.ring_forward", "lab18.ring_traffic", "lab18.ring_backward", "lab18.ring_forward_edges"],
)
def test_task1_an_untouched_answer_fails_cleanly(check_id):
    def stub(*args, **kwargs):
        raise NotImplementedError(TASKS[1])

    message = check_fails(check_id, stub)
    assert "lab18 task 1 is not started yet" in message and "5 · Context parallelism: ring attention" in message


def test_the_labs_last_cell_runs_the_ring_over_four_ranks_equal_to_full_attention(tmp_path, capsys):
    """The cell after the last test: the answer's ring over four thread ranks, its rows against full attention and
    each rank's bytes sent, three times its K/V block."""
    import re

    from conftest import run_cells_after_the_tests

    run_cells_after_the_tests(SOLUTION, tmp_path)
    out = capsys.readouterr().out
    error = float(re.search(r"max \|yours - full attention\| = ([0-9.e+-]+)", out).group(1))
    assert error < 1e-5, out
    assert len(re.findall(r"rank \d sent [\d,]+ bytes = 3 x its K/V block", out)) == 4, out
