"""Lab 08 task 2 (the engine step): the instructor's answer passes every check, and each typical mistake fails
the task's checks with the hint written for it (task 1's checks take the scheduler only, so no mistake in the
engine step reaches them). The workloads hold every way a request ends, and the checks' engine is the course's
own: the reference step run through ``engine_class`` answers exactly as ``LLMEngine`` does."""

from __future__ import annotations

import pytest
from conftest import REPO, answer_cells

from grading.check import drive, judge
from grading.checks.lab08.engines import LeftTheReference, replaying
from grading.checks.lab08.part6_engine_step import HINT, NEVER, stream_pieces, tokenizer
from grading.registry import get_check
from infra_lib.serving import RequestOutput, Scheduler, SchedulerConfig, SchedulerOutput, SequenceStatus

SOLUTION = REPO / "solutions" / "lab08_scheduler" / "lab08_scheduler.ipynb"
VISIBLE = ["lab08.engine_loop", "lab08.engine_loop_aborts"]
HIDDEN = ["lab08.engine_loop_preemption", "lab08.engine_loop_random"]


def _answer(*edits: tuple[str, str]):
    """The instructor's engine_step with lines of its source replaced (each edit must apply once)."""
    source = answer_cells(SOLUTION)["engine_step"]
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {
        "RequestOutput": RequestOutput,
        "Scheduler": Scheduler,
        "SchedulerConfig": SchedulerConfig,
        "SchedulerOutput": SchedulerOutput,
        "SequenceStatus": SequenceStatus,
    }
    exec(source, namespace)
    return namespace["engine_step"]


_INPUTS: dict = {}


def _verdict(check_id: str, step, seed: int = 0):
    registered = get_check(check_id)
    if (check_id, seed) not in _INPUTS:
        inputs = registered.inputs(seed)
        _INPUTS[check_id, seed] = (inputs, drive(registered, registered.reference(), inputs))
    inputs, expected = _INPUTS[check_id, seed]
    return judge(registered, drive(registered, step, inputs), expected, inputs)


@pytest.mark.parametrize("check_id", VISIBLE + HIDDEN)
def test_the_instructor_answer_passes_on_workloads_that_hold_every_ending(check_id):
    """On seeds 0-2 the instructor's engine_step passes, and each run ends requests on the end-of-turn token, on a
    stop string whose first occurrence begins in one token's text and ends in the next's, and at their length;
    the abort and random checks abort mid-stream, the preemption check preempts."""
    for seed in range(3):
        verdict = _verdict(check_id, _answer(), seed)
        assert verdict.passed, (seed, verdict.what, verdict.detail)
        inputs, expected = _INPUTS[check_id, seed]
        for run, got in zip(inputs["runs"], expected.data):
            finals = got["final"]
            assert any(f["reason"] == "stop" and f["tokens"][-1] == run["eos"] for f in finals), seed
            assert "length" in [f["reason"] for f in finals], seed
            straddled = [
                (f, r["stop"][1])
                for f, r in zip(finals, run["requests"])
                if len(r["stop"]) == 2 and f["reason"] == "stop" and f["tokens"][-1] != run["eos"]
            ]
            assert straddled, seed
            for final, stop in straddled:  # the stop string's two characters come from the last two pieces
                pieces = [p for p in stream_pieces(tokenizer(run["eos"]), final["tokens"]) if p]
                assert (pieces[-2][-1], pieces[-1][0]) == tuple(stop) and not any(stop in p for p in pieces)
                assert "".join(pieces).startswith(final["text"] + stop)
            assert all(NEVER not in f["text"] for f in finals)
        if check_id in ("lab08.engine_loop_aborts", "lab08.engine_loop_random"):
            assert all(run["aborts"] for run in inputs["runs"]), seed
        if check_id == "lab08.engine_loop_preemption":
            assert any(a[0] == "preempt" for run in inputs["runs"] for plan in run["plans"] for a in plan), seed
            assert any(run["aborts"] for run in inputs["runs"]), seed


@pytest.mark.parametrize("check_id", VISIBLE + HIDDEN)
def test_every_run_holds_two_endings_in_one_step(check_id):
    """On seeds 0-2, every run has a request whose own stop token is the last token it may hold, and one whose
    stop string ends in its last token: the reference finishes both with "stop" (the lab: "stop" wins)."""
    for seed in range(3):
        _verdict(check_id, _answer(), seed)
        inputs, expected = _INPUTS[check_id, seed]
        for run, got in zip(inputs["runs"], expected.data):
            at_length = [(r, f) for r, f in zip(run["requests"], got["final"]) if len(f["tokens"]) == r["new_tokens"]]
            assert any(
                r.get("stop_ids") is not None and f["tokens"][-1] in r["stop_ids"] and f["reason"] == "stop"
                for r, f in at_length
            ), (check_id, seed)
            assert any(
                r["stop"] and f["reason"] == "stop" and f["tokens"][-1] not in (r.get("stop_ids") or [run["eos"]])
                for r, f in at_length
            ), (check_id, seed)


def _fails_with(step, what: str, hint: str) -> None:
    for check_id in VISIBLE:
        verdict = _verdict(check_id, step)
        assert not verdict.passed, check_id
        assert verdict.kind != "error", (check_id, verdict.what, verdict.detail)
        assert what in verdict.what, (check_id, verdict.what, verdict.detail)
        assert verdict.hint == HINT[hint], (check_id, verdict.hint)


def test_a_stop_string_looked_for_in_one_tokens_text_fails_with_the_text_hint():
    in_piece = _answer(
        (
            "        found = [seq.text.find(stop, max(0, searched - len(stop) + 1)) for stop in seq.stop_strings]\n",
            "        found = [searched + piece.find(stop) for stop in seq.stop_strings if stop in piece]\n",
        )
    )
    _fails_with(in_piece, "did not stop on a stop string that its text contains", "stop_string")


def test_a_finish_by_hand_that_keeps_the_blocks_fails_with_the_blocks_hint():
    by_hand = _answer(
        (
            "            engine.finish(seq, reason)\n",
            "            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason\n"
            "            engine.scheduler.running.remove(seq)\n",
        )
    )
    _fails_with(by_hand, "blocks are still held after the step that finished a request", "blocks")


def test_a_text_that_keeps_the_stop_string_fails_with_the_cut_hint():
    uncut = _answer(
        ('            seq.text, reason = seq.text[: min(found)], "stop"\n', '            reason = "stop"\n')
    )
    _fails_with(uncut, "still holds the stop string", "cut")


def test_deltas_that_repeat_the_text_fail_with_the_delta_hint():
    whole = _answer(
        (
            "outputs.append(engine.output(seq_id, [token], now[len(shown) :]))",
            "outputs.append(engine.output(seq_id, [token], now))",
        )
    )
    _fails_with(whole, "repeats the text sent before it", "delta")


def test_deltas_that_do_not_hold_back_what_a_stop_string_may_take_fail_with_the_held_back_hint():
    eager = _answer(
        (
            "        shown = engine.output(seq_id).text  # what the client has seen so far\n",
            "        shown = seq.text\n",
        ),
        ("        now = engine.output(seq_id).text\n", "        now = seq.text\n"),
    )
    verdict = _verdict("lab08.engine_loop", eager)
    assert not verdict.passed and verdict.hint == HINT["held"], (verdict.what, verdict.hint)


def test_a_replayed_run_that_leaves_the_reference_says_so():
    registered = get_check("lab08.engine_loop")
    inputs = registered.inputs(0)
    run = inputs["runs"][0]
    config = SchedulerConfig(**run["config"])
    scheduler = replaying(config, run["plans"][:2])
    scheduler.num_steps = 2
    with pytest.raises(LeftTheReference, match="past the reference's 2 steps"):
        scheduler.schedule()


@pytest.mark.parametrize(
    "old, new",
    [
        pytest.param(
            '        if token in seq.stop_ids:\n            reason = "stop"\n'
            '        elif seq.num_tokens >= seq.max_tokens:\n            reason = "length"\n',
            '        if seq.num_tokens >= seq.max_tokens:\n            reason = "length"\n'
            '        elif token in seq.stop_ids:\n            reason = "stop"\n',
            id="the length looked at before the stop token",
        ),
        pytest.param(
            '            seq.text, reason = seq.text[: min(found)], "stop"\n',
            '            seq.text, reason = seq.text[: min(found)], reason or "stop"\n',
            id="the length kept when a stop string is found",
        ),
    ],
)
def test_a_length_that_wins_over_a_stop_in_the_same_step_fails_with_the_stop_wins_hint(old, new):
    _fails_with(_answer((old, new)), "finished at its length where a stop ends it in the same step", "stop_wins")


def test_outputs_out_of_batch_order_fail_with_the_order_hint():
    reversed_outputs = _answer(("    return outputs\n", "    return outputs[::-1]\n"))
    _fails_with(reversed_outputs, "the step's outputs are not in batch order", "order")
