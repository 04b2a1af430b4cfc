"""Lab 08's checks score each part on its own: every simulated step is planned from the reference's
state, each part judges only what its behaviour decides, so a typical mistake loses exactly its own
part's checks, with the hint written for that mistake."""

from __future__ import annotations

import random
import re

import pytest
from conftest import REPO, answer_cells

from grading import check
from grading.checks.lab08.forced_steps import drive_forced, scheduler_config, simulate
from grading.checks.lab08.judging import HINT
from grading.registry import all_checks
from infra_lib.serving import Scheduler, SchedulerConfig, SchedulerOutput, SequenceStatus

SOLUTION = REPO / "solutions" / "lab08_scheduler" / "lab08_scheduler.ipynb"
PARTS = {
    1: ["lab08.decode_first", "lab08.decode_first_random"],
    2: ["lab08.chunked_prefill", "lab08.chunked_prefill_random"],
    3: ["lab08.preemption", "lab08.preemption_random", "lab08.engine_preemption"],
    4: ["lab08.engine_tiny_model", "lab08.engine_prefix_cache"],
    5: ["lab08.records", "lab08.records_random"],
}
SIMULATED = [c for part in (1, 2, 3, 5) for c in PARTS[part] if "engine" not in c]


def _answer(*edits: tuple[str, str]):
    """The instructor's schedule with lines of its source replaced (each edit must apply once)."""
    source = answer_cells(SOLUTION)["schedule"]
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {
        "Scheduler": Scheduler,
        "SchedulerConfig": SchedulerConfig,
        "SchedulerOutput": SchedulerOutput,
        "SequenceStatus": SequenceStatus,
    }
    exec(source, namespace)
    return namespace["schedule"]


def _failures(schedule, parts=(1, 2, 3, 4, 5)) -> dict[int, list[str]]:
    failed: dict[int, list[str]] = {}
    for part in parts:
        for check_id in PARTS[part]:
            try:
                check(check_id, schedule)
            except AssertionError as exc:
                failed.setdefault(part, []).append(str(exc))
    return failed


def _only_part_fails(schedule, part: int, hint: str, what: str, parts=(1, 2, 3, 4, 5)) -> None:
    failed = _failures(schedule, parts)
    assert set(failed) == {part}, {p: [m.splitlines()[:2] for m in ms] for p, ms in failed.items()}
    for message in failed[part]:
        if "engine" in message.split()[0]:
            continue  # the real engine's check names the run that stopped, with the scheduler's own words
        assert f"  {what}" in message and f"hint: {hint}" in message, message


def test_the_instructor_schedule_passes_every_part():
    assert _failures(_answer(), (1, 2, 3, 5)) == {}


def test_preempting_the_oldest_loses_part_3_only_with_the_newest_first_hint():
    oldest = _answer(("victim = self.running[-1]", "victim = self.running[0]"))
    _only_part_fails(oldest, 3, HINT["victim"], "other sequences were preempted than the reference's")


def test_a_budget_the_running_sequences_do_not_spend_loses_part_1_only():
    unspent = _answer(("        out.add(seq, n)\n        budget -= n\n    while", "        out.add(seq, n)\n    while"))
    _only_part_fails(unspent, 1, HINT["budget"], "the step plans more tokens than the budget")


def test_asking_for_the_whole_prompts_blocks_before_cutting_loses_part_2_only():
    check_then_cut = _answer(
        (
            "        n = min(n, budget)\n        if not self.can_admit(seq, n):",
            "        if not self.can_admit(seq, n):\n            break\n        n = min(n, budget)\n"
            "        if not self.can_admit(seq, n):",
        )
    )
    _only_part_fails(check_then_cut, 2, HINT["cut_first"], "a prompt whose chunk fits was not admitted")


def test_admitting_a_later_request_when_the_first_cannot_come_in_loses_part_2_only():
    """Rule 2's "never skip ahead": a step that sets aside a waiting head that cannot come in (a whole
    prompt past the budget left, or blocks not found), admits the ones behind it and puts the skipped
    ones back at the front in order loses part 2 only; each message shows a sequence admitted past the
    one the reference holds back, both named, with the first come, first served hint."""
    skip_ahead = _answer(
        (
            "    while self.waiting and not out.preempted:  # 2. admissions, FCFS\n",
            "    skipped = []\n    while self.waiting and not out.preempted:  # 2. admissions, FCFS\n",
        ),
        (
            "            break  # the whole prompt or nothing\n",
            "            skipped.append(self.waiting.popleft())  # try the one behind it\n            continue\n",
        ),
        (
            "        if not self.can_admit(seq, n):\n            break\n",
            "        if not self.can_admit(seq, n):\n            skipped.append(self.waiting.popleft())\n"
            "            continue\n",
        ),
        (
            "    return finish_plan(self, out)",
            "    self.waiting.extendleft(reversed(skipped))\n    return finish_plan(self, out)",
        ),
    )
    failed = _failures(skip_ahead)
    assert set(failed) == {2}, {p: [m.splitlines()[:2] for m in ms] for p, ms in failed.items()}
    for message in failed[2]:
        what = "  a sequence was admitted ahead of one that arrived before it and could not come in"
        assert what in message, message
        assert f"hint: {HINT['fcfs']}" in message, message
        named = re.search(
            r"seq (\d+) was admitted ahead of seq (\d+), which the reference holds back \(.*: "
            r"seq (\d+) waits\)",
            message,
        )
        assert named, message
        admitted, held, waits = map(int, named.groups())
        assert held == waits < admitted, message  # the one behind came in, the one that arrived first waits
        assert re.search(r"expected: .*waiting \[%d\b" % held, message), message  # the reference's waiting head
        assert re.search(r"yours: .*admitted \[[^\]]*\b%d\b" % admitted, message), message


def test_leaving_out_the_zero_hits_loses_the_records_part_only():
    no_zeros = _answer(
        (
            "        out.num_cached_tokens[seq.seq_id] = cached",
            "        if cached:\n            out.num_cached_tokens[seq.seq_id] = cached",
        )
    )
    _only_part_fails(no_zeros, 5, HINT["cached_record"], "an admission's prefix-cache hit is not recorded")


def test_a_schedule_that_admits_nothing_cannot_pass_the_records_part():
    nothing = _answer(("    while self.waiting and not out.preempted:", "    while False:"))
    message = str(pytest.raises(AssertionError, check, "lab08.records", nothing).value)
    assert "could not be judged" in message and "fix part 2 (admission) first" in message


def test_the_recorded_reference_steps_replay_the_reference_schedulers_own_run():
    """The simulated runs follow the reference's steps, recorded where the inputs are made and carried out
    in the kernel with the scheduler's own actions (the checks hold no planning of their own): a forced run
    must plan, step by step, exactly what the reference scheduler plans when it runs the workload alone."""
    for check_id in SIMULATED:
        registered = all_checks()[check_id]
        for seed in range(3):
            inputs = registered.inputs(seed)
            forced = drive_forced(Scheduler.schedule, inputs)
            for run, got in zip(inputs, forced):
                alone: list[dict] = []

                class Alone(Scheduler):
                    def schedule(self):
                        out = super().schedule()
                        alone.append(
                            {
                                **out.as_dict(),
                                "running": [s.seq_id for s in self.running],
                                "waiting": [s.seq_id for s in self.waiting],
                            }
                        )
                        return out

                simulate(run, Alone(scheduler_config(run["config"])))
                assert len(got["steps"]) == len(alone) == len(run["reference_steps"]), (check_id, seed)
                for k, (step, plain) in enumerate(zip(got["steps"], alone)):
                    assert {key: step[key] for key in plain} == plain, (check_id, seed, k)


def test_a_run_that_leaves_the_reference_steps_says_so():
    registered = all_checks()["lab08.decode_first"]
    inputs = registered.inputs(0)
    inputs[0]["reference_steps"] = inputs[0]["reference_steps"][:3]
    with pytest.raises(RuntimeError, match="past the reference's 3 steps"):
        drive_forced(Scheduler.schedule, inputs)


def test_each_part_judges_steps_it_owns_on_every_seed():
    """No part passes for want of steps to judge: each visible and hidden workload has admissions,
    preemptions (part 3) and hits of both kinds (part 5) in the reference's run."""
    for check_id in SIMULATED:
        registered = all_checks()[check_id]
        for seed in range(4):
            runs = drive_forced(Scheduler.schedule, registered.inputs(seed))
            steps = [s for run in runs for s in run["steps"]]
            assert any(s["admitted"] for s in steps), check_id
            if check_id.startswith("lab08.preemption"):
                assert any(s["preempted"] for s in steps), (check_id, seed)
            if check_id.startswith("lab08.records"):
                hits = [n for s in steps for _, n in s["hits"]]
                assert any(hits) and 0 in hits, (check_id, seed)


def test_a_step_that_raises_is_reported_at_that_step_and_the_run_goes_on():
    calls = {"n": 0}
    solution = _answer()

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyError("oops")
        return solution(self)

    message = str(pytest.raises(AssertionError, check, "lab08.decode_first", flaky).value)
    assert "your schedule raised KeyError at step 2" in message and "oops" in message
    calls["n"] = 0
    runs = drive_forced(flaky, all_checks()["lab08.decode_first"].make_inputs(random.Random(0)))
    assert len(runs[0]["steps"]) > 3 and runs[0]["steps"][2]["error"].startswith("KeyError")


def _engine_verdict(check_id: str, schedule, seed: int = 0):
    """The verdict on one of the real engine's checks, on the inputs the grader draws with ``seed``."""
    from grading.check import drive, judge
    from grading.registry import get_check

    registered = get_check(check_id)
    inputs = registered.inputs(seed)
    expected = drive(registered, registered.reference(), inputs)
    return judge(registered, drive(registered, schedule, inputs), expected, inputs)


def test_an_empty_plan_in_the_engine_still_shows_the_first_step_that_differed():
    """Preempting the oldest leaves the engine with an empty plan a step later: the verdict shows the
    step where the victim differed, then the stop, on the grader's own inputs."""
    oldest = _answer(("victim = self.running[-1]", "victim = self.running[0]"))
    verdict = _engine_verdict("lab08.engine_preemption", oldest)
    assert not verdict.passed and verdict.what.startswith("which running sequences are preempted"), verdict.what
    assert "preempted: expected [2], got [0]" in verdict.detail
    assert "and then the run stopped: step 3 scheduled nothing" in verdict.detail


def test_an_engine_error_on_a_plan_is_blamed_on_the_plan_not_on_the_learners_code():
    """Admitting a prompt without taking off its cached tokens plans positions the engine cannot
    compute: the engine's error is reported as the engine's, with the plan's first difference."""
    uncut = _answer(("        n = seq.num_tokens - cached\n", "        n = seq.num_tokens\n"))
    for check_id in ("lab08.engine_prefix_cache", "lab08.engine_preemption"):
        verdict = _engine_verdict(check_id, uncut)
        assert not verdict.passed and verdict.kind != "error", (check_id, verdict.kind, verdict.what)
        assert "your code raised" not in verdict.what + verdict.detail
        assert "scheduled: expected" in verdict.detail, verdict.detail
        assert (
            "the engine could not run the plan your scheduler returned (ValueError in the course's engine"
            in verdict.detail
        ), verdict.detail
