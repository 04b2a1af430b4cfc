"""infra_lib.serving.Scheduler: the decisions lab 08 re-implements (FCFS admission, the token
budget and chunked prefill, running first, preemption of the newest, prefix hits at admission),
its invariant checker, and random workloads on the simulated runner (no model) checked after
every step; the step-cost model and its calibration."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra_lib.model import SamplingParams
from infra_lib.serving import (
    LLMEngine,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    SimClock,
    SimulatedRunner,
    StepCostModel,
    WorkloadRequest,
    calibrate,
    fit_step_costs,
    random_workload,
    replay,
    summarize,
)

UNIT_COST = StepCostModel(1e-3, 1e-4, 1e-4, 1e-6)


def make(config: SchedulerConfig, *prompt_lens: int, max_new_tokens: int = 8) -> tuple[Scheduler, list[Sequence]]:
    scheduler = Scheduler(config)
    seqs = [
        Sequence(i, list(range(1, n + 1)), SamplingParams(max_new_tokens=max_new_tokens), config.block_size, i)
        for i, n in enumerate(prompt_lens)
    ]
    for seq in seqs:
        scheduler.add(seq)
    return scheduler, seqs


def finish_step(scheduler: Scheduler, out, token: int = 7) -> None:
    """What the engine does after the forward pass: commit, then give every sampling sequence a token."""
    scheduler.commit(out)
    for s in out.scheduled:
        if s.samples:
            next(q for q in scheduler.running if q.seq_id == s.seq_id).append_token(token)
    scheduler.check_invariants()


def plan(out) -> list[tuple[int, int, str]]:
    return [(s.seq_id, s.num_tokens, s.kind) for s in out.scheduled]


def test_task1_admission_is_fcfs_and_the_budget_cuts_the_last_prompt_into_a_chunk():
    scheduler, _ = make(SchedulerConfig(max_num_batched_tokens=10, block_size=4, num_blocks=32), 4, 4, 4, 4)
    out = scheduler.schedule()
    scheduler.check_output(out)
    scheduler.check_invariants()
    assert plan(out) == [(0, 4, "prefill"), (1, 4, "prefill"), (2, 2, "prefill")]
    assert out.admitted == [0, 1, 2] and out.preempted == [] and out.num_batched_tokens == 10
    assert [s.samples for s in out.scheduled] == [True, True, False]  # seq 2's prompt is not done
    assert any("budget exhausted" in r for r in out.reasons)
    assert [s.seq_id for s in scheduler.waiting] == [3] and out.num_running == 3
    finish_step(scheduler, out)
    out = scheduler.schedule()  # running first: two decodes, the rest of seq 2's prompt, then seq 3
    assert plan(out) == [(0, 1, "decode"), (1, 1, "decode"), (2, 2, "prefill"), (3, 4, "prefill")]
    assert out.admitted == [3]
    finish_step(scheduler, out)


def test_task1_without_chunked_prefill_a_prompt_that_does_not_fit_waits_whole():
    config = SchedulerConfig(max_num_batched_tokens=10, block_size=4, num_blocks=32, enable_chunked_prefill=False)
    scheduler, _ = make(config, 4, 4, 4)
    out = scheduler.schedule()
    scheduler.check_output(out)
    assert plan(out) == [(0, 4, "prefill"), (1, 4, "prefill")]
    assert any("prefill of 4 tokens > budget left 2" in r for r in out.reasons)


def test_task1_max_num_seqs_caps_the_running_set():
    scheduler, _ = make(SchedulerConfig(max_num_seqs=2, block_size=4, num_blocks=32), 3, 3, 3)
    out = scheduler.schedule()
    assert out.admitted == [0, 1] and any("max_num_seqs" in r for r in out.reasons)
    finish_step(scheduler, out)
    assert plan(scheduler.schedule()) == [(0, 1, "decode"), (1, 1, "decode")]


def test_task2_out_of_blocks_preempts_the_newest_which_returns_to_the_front():
    # 3 prompts of 4 tokens fill all 6 blocks of 2; each decode then needs a third block.
    scheduler, seqs = make(SchedulerConfig(block_size=2, num_blocks=6), 4, 4, 4)
    finish_step(scheduler, scheduler.schedule())
    scheduler.add(late := Sequence(3, [5, 6], SamplingParams(), 2, 3))
    out = scheduler.schedule()
    scheduler.check_invariants()
    assert out.preempted == [2] and plan(out) == [(0, 1, "decode"), (1, 1, "decode")]
    assert out.admitted == []  # a step that preempts admits nobody
    assert any("preempted seq 2" in r for r in out.reasons)
    victim = seqs[2]
    assert victim.status is SequenceStatus.PREEMPTED and victim.block_table.blocks == []
    assert victim.num_computed_tokens == 0 and victim.metrics.num_preemptions == 1
    assert list(scheduler.waiting) == [victim, late]  # ahead of a later arrival
    finish_step(scheduler, out)
    for seq in seqs[:2]:
        scheduler.finish(seq, "length")
    out = scheduler.schedule()  # recompute: the prompt and the token it had already produced
    assert out.admitted == [2, 3] and plan(out)[0] == (2, 5, "prefill") and out.scheduled[0].samples
    finish_step(scheduler, out)


def test_task2_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    scheduler, _ = make(SchedulerConfig(block_size=2, num_blocks=5), 4, 4)
    finish_step(scheduler, scheduler.schedule())  # 4 blocks used, 1 free; both need one more
    out = scheduler.schedule()
    assert plan(out) == [(0, 1, "decode")] and out.preempted == [1]
    assert [s.seq_id for s in scheduler.waiting] == [1]
    finish_step(scheduler, out)


def test_task3_prefix_hits_are_counted_at_admission_and_skipped():
    config = SchedulerConfig(block_size=4, num_blocks=16, enable_prefix_caching=True)
    scheduler = Scheduler(config)
    shared = [9, 8, 7, 6, 5, 4, 3, 2]
    first = Sequence(0, shared + [1, 1], SamplingParams(), 4, 0)
    scheduler.add(first)
    finish_step(scheduler, scheduler.schedule())
    second = Sequence(1, shared + [2, 2, 2], SamplingParams(), 4, 1)
    whole = Sequence(2, shared, SamplingParams(), 4, 2)  # all blocks cached: the last one is recomputed
    scheduler.add(second)
    scheduler.add(whole)
    out = scheduler.schedule()
    assert out.num_cached_tokens == {1: 8, 2: 4} and second.metrics.num_cached_tokens == 8
    assert plan(out) == [(0, 1, "decode"), (1, 3, "prefill"), (2, 4, "prefill")]
    assert out.scheduled[1].start == 8 and second.block_table.blocks[:2] == first.block_table.blocks[:2]
    finish_step(scheduler, out)


def test_check_invariants_catches_leaks_and_broken_plans():
    scheduler, seqs = make(SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=8), 4, 4)
    out = scheduler.schedule()
    scheduler.check_invariants()
    seqs[0].block_table.blocks.append(scheduler.pool.allocate(1)[0])  # a block the tables cannot explain
    with pytest.raises(AssertionError, match="holds 2 blocks"):
        scheduler.check_invariants()
    out.scheduled.append(out.scheduled[0])
    with pytest.raises(AssertionError, match="budget"):
        scheduler.check_output(out)


def test_config_and_pool_mismatches_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    from infra_lib.serving import BlockPool

    with pytest.raises(ValueError, match="4 blocks of 2"):
        Scheduler(SchedulerConfig(num_blocks=8, block_size=2), BlockPool(4, 2))


# --- random workloads on the simulated runner ---------------------------------------------------------


@st.composite
def workloads(draw):
    """A config and requests that often share a prefix, arrive close together and crowd the pool."""
    block_size = draw(st.integers(1, 8))
    prefix = draw(st.lists(st.integers(0, 5), max_size=16))
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        head = prefix[: draw(st.integers(0, len(prefix)))]
        tail = draw(st.lists(st.integers(0, 5), min_size=1, max_size=14))
        requests.append(WorkloadRequest(draw(st.floats(0, 0.02)), tuple(head + tail), draw(st.integers(1, 16))))
    biggest = max(r.prompt_len + r.output_len - 1 for r in requests)
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 48)) if chunked else draw(st.integers(biggest, biggest + 16))
    min_blocks = -(-biggest // block_size)
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=budget,
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, 2 * min_blocks)),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
    )
    return config, requests


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant_and_every_request_finishes(case):
    config, requests = case
    engine = LLMEngine(SimulatedRunner(UNIT_COST), config)
    running_after: list[list[int]] = [[]]

    def after_step(engine):
        engine.check_invariants()
        out = engine.steps[-1].output
        engine.scheduler.check_output(out)
        newest_first = list(reversed(running_after[-1]))  # victims: the newest running, in that order
        assert out.preempted == newest_first[: len(out.preempted)], (out.preempted, running_after[-1])
        running_after.append([s.seq_id for s in engine.scheduler.running])

    outputs = replay(engine, requests, on_step=after_step)
    assert [len(o.token_ids) for o in outputs] == [r.output_len for r in requests]
    assert all(o.finish_reason == "length" for o in outputs)
    first_admissions = list(dict.fromkeys(i for record in engine.steps for i in record.output.admitted))
    assert first_admissions == list(range(len(requests)))  # FCFS: request ids are given in arrival order
    for o in outputs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
        assert m.token_times == sorted(m.token_times) and len(m.token_times) == len(o.token_ids)
    assert engine.scheduler.pool.num_free == config.num_blocks


def test_preemptions_happen_and_are_counted_on_a_tight_pool():
    requests = random_workload(24, seed=3, prompt_len=(8, 24), output_len=(8, 24))
    engine = LLMEngine(SimulatedRunner(UNIT_COST), SchedulerConfig(max_num_seqs=8, block_size=4, num_blocks=16))
    outputs = replay(engine, requests, on_step=lambda e: e.check_invariants())
    preempted = sum(len(r.output.preempted) for r in engine.steps)
    assert preempted > 0 and summarize(outputs)["preemptions"] == preempted


def test_the_simulated_clock_advances_by_the_cost_model_and_replays_deterministically():
    requests = random_workload(16, seed=1, rate=50.0)
    traces = []
    for _ in range(2):
        engine = LLMEngine(SimulatedRunner(UNIT_COST), SchedulerConfig(max_num_batched_tokens=64))
        outputs = replay(engine, requests)
        for record in engine.steps:
            assert record.end - record.start == pytest.approx(UNIT_COST.step_cost(record.output.scheduled))
        traces.append(([r.output.as_dict() for r in engine.steps], [o.metrics.ttft for o in outputs]))
    assert traces[0] == traces[1]
    assert json.loads(json.dumps(traces[0][0])) == traces[0][0]  # plain data, as lab checks exchange it
    assert isinstance(engine.clock, SimClock) and engine.clock.now() == engine.steps[-1].end


def test_fit_step_costs_recovers_known_coefficients_and_stays_non_negative():
    truth = StepCostModel(0.04, 0.001, 0.002, 1e-5)
    rng = random.Random(0)
    shapes = [(rng.randint(0, 128), rng.randint(0, 8), rng.randint(1, 2048)) for _ in range(20)]
    fitted = fit_step_costs(shapes, [truth.cost(*s) for s in shapes])
    assert fitted == pytest.approx(list(truth.as_dict().values()), rel=1e-6)
    # a cost that falls with context would need a negative coefficient: it is dropped instead
    falling = fit_step_costs(shapes, [0.05 + 0.001 * p - 1e-6 * c + 0.01 for p, _, c in shapes])
    assert min(falling) >= 0 and falling[3] == 0.0


def test_calibrate_times_real_steps_and_returns_a_usable_cost_model():
    from grading.checks.lab06 import tiny_model

    model = calibrate(tiny_model(0), block_size=4, max_context=32, iters=1)
    assert len(model.measurements) == 11 and all(s > 0 for *_, s in model.measurements)
    assert all(value >= 0 for value in model.as_dict().values()) and model.fixed_s > 0
    with pytest.raises(ValueError, match="exceeds the model's context"):
        calibrate(tiny_model(0), max_context=128)
    with pytest.raises(ValueError, match=">= 0"):
        StepCostModel(-1.0, 0, 0, 0)


def test_lab08_worked_example_cuts_to_the_budget_before_asking_for_blocks():
    """Lab 08's text: on a pool of 3 blocks of 4, a 20-token prompt with a budget of 10 is admitted
    with a 10-token chunk (3 blocks); without chunked prefill it waits."""
    for chunked in (True, False):
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=4, max_num_batched_tokens=10, block_size=4, num_blocks=3, enable_chunked_prefill=chunked
            )
        )
        scheduler.add(Sequence(0, list(range(1, 21)), block_size=4, arrival_index=0))
        out = scheduler.schedule()
        if chunked:
            assert out.admitted == [0] and out.num_cached_tokens == {0: 0}
            assert [(s.seq_id, s.num_tokens) for s in out.scheduled] == [(0, 10)] and out.num_free_blocks == 0
        else:
            assert out.admitted == [] and out.scheduled == [] and out.num_free_blocks == 3


def _schedule_preempting_the_oldest(self):
    """A typical lab 08 mistake: room is made by preempting the *oldest* running sequence, which
    this step may already have scheduled."""

    def make_room(seq, num_tokens, out):
        while not self.can_reserve(seq, num_tokens):
            victim = self.running[0]
            self.preempt(victim)
            out.preempted.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    self.make_room = make_room
    return Scheduler.schedule(self)


def test_a_plan_that_schedules_a_preempted_sequence_is_refused_before_it_runs():
    from infra_lib.serving import LLMEngine, SimulatedRunner, StepCostModel, random_workload, replay

    class Oldest(Scheduler):
        schedule = _schedule_preempting_the_oldest

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_blocks=10)
    engine = LLMEngine(SimulatedRunner(StepCostModel(1e-3, 1e-4, 1e-4, 1e-6)), config, scheduler=Oldest(config))
    with pytest.raises(RuntimeError, match=r"scheduled seq \[\d+\] and preempted it in the same step"):
        replay(engine, random_workload(6, 0, rate=float("inf"), prompt_len=(6, 10), output_len=(10, 20)), max_steps=500)
    scheduler = Oldest(config)  # the scheduler's own check says the same of such a plan
    for i in range(6):
        scheduler.add(Sequence(i, list(range(1, 9)), block_size=4, arrival_index=i))
    with pytest.raises(AssertionError, match="and preempted it in the same step"):
        for _ in range(50):
            out = scheduler.schedule()
            scheduler.check_output(out)
            scheduler.commit(out)
            for s in out.scheduled:
                if s.samples:
                    scheduler._find(s.seq_id).append_token(1)


def test_lab08_shows_the_first_plan_difference_with_the_invariant_that_broke():
    """In the real engine (lab 08's own plans, run for real), a plan the engine refuses is shown with
    the first step that differs from the reference's, the refused step included."""
    import random

    from grading.registry import get_check

    check = get_check("lab08.engine_preemption")
    case = check.make_inputs(random.Random(0))
    got = check.drive(_schedule_preempting_the_oldest, case)
    expected = check.drive(Scheduler.schedule, case)
    assert any(r["violation"] and "preempted it in the same step" in r["violation"] for r in got), got
    mismatch = check.compare(got, expected, case)
    assert mismatch is not None and mismatch.what.startswith("which running sequences are preempted")
    assert "and then the run stopped" in mismatch.detail and "preempted it in the same step" in mismatch.detail
    assert "IndexError" not in mismatch.detail
