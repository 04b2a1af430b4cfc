"""Lab 08's simulated runs, one step at a time from the reference's state: the workloads, the reference's
recorded steps, and the learner's plan for each step made on a copy of the scheduler."""

from __future__ import annotations

import random

from grading.checks.lab08.engines import carry_out, length_engine, recording


def schedule_reference():
    """The reference's step planning, imported when a check needs it."""
    from infra_lib.serving.scheduler import Scheduler

    return Scheduler.schedule


# the lab's task, as the checks name it
TASKS = {1: "lab08 task 1: schedule", 2: "lab08 task 2: engine_step"}


_UNIT_COST = (1e-3, 1e-4, 1e-4, 1e-6)  # StepCostModel(fixed, per prefill token, per decode seq, per context token)


def scheduler_config(c: dict):
    """A SchedulerConfig from a run's plain fields."""
    from infra_lib.serving.scheduler_output import SchedulerConfig

    return SchedulerConfig(**c)


# --- one step at a time, from the reference's state ---------------------------------------------------
#
# The simulated checks do not let the learner's plans steer the run. Before every step the scheduler is
# copied; the learner's schedule plans the step on the copy, and the original carries out the step the
# reference planned at that point of the same run, which the engine then runs. So every step of the
# learner's is judged from the state the reference would be in, one slip changes one step's plan and
# not every step after it, and each part judges only what its behaviour decides:
#
#   part 1  the running sequences' entries, the budget and max_num_seqs (steps without preemption);
#   part 2  who is admitted, with how many tokens, and the queues after (steps where part 1's entries
#           agree and the plan keeps the limits, without preemption);
#   part 3  the steps where blocks run out: who is preempted, in what order, and what else the step plans;
#   part 5  the step's records: the step index, and the prefix-cache hit of every admission, 0 included.
#
# The reference's steps are recorded where the inputs are made (in the grader's process when the kernel
# is sandboxed, where the reference is a stub), as the actions each step took in order: a preemption, a
# reservation for a running sequence, an admission. The learner's kernel only carries them out with the
# scheduler's own actions, so it needs no planning of the course's: nothing in it decides a step.


def simulate(run: dict, scheduler) -> None:
    """Serve the run's workload on the simulated runner with ``scheduler``."""
    from infra_lib.serving import SimulatedRunner, StepCostModel, random_workload, replay

    w = run["workload"]
    requests = random_workload(
        w["n"],
        w["seed"],
        rate=w["rate"] if w["rate"] else float("inf"),
        prompt_len=tuple(w["prompt_len"]),
        output_len=tuple(w["output_len"]),
        shared_prefix_len=w.get("shared_prefix_len", 0),
    )
    engine = length_engine()(SimulatedRunner(StepCostModel(*_UNIT_COST)), scheduler.config, scheduler=scheduler)
    replay(engine, requests, max_steps=run["max_steps"])


def _reference_steps(run: dict) -> list[list[tuple[str, int, int]]]:
    """Each step of the reference scheduler's run of ``run``, as its actions in order (``recording``)."""
    steps: list[list[tuple[str, int, int]]] = []
    simulate(run, recording(scheduler_config(run["config"]), steps))
    return steps


def with_reference_steps(make):
    """``make``'s runs, each with the reference's steps on it (``"reference_steps"``)."""

    def make_inputs(rng: random.Random) -> list[dict]:
        runs = make(rng)
        for run in runs:
            run["reference_steps"] = _reference_steps(run)
        return runs

    return make_inputs


def _plan_on_a_copy(schedule, scheduler) -> dict:
    """The learner's plan for the scheduler's next step, made on a copy of it, as plain data: the plan,
    the queues after it, the hit each admission took, the limits and books it broke (None: kept), and
    the state it started from."""
    import copy

    from grading.check import CheckTimeout
    from infra_lib.serving.scheduler_output import SchedulerOutput

    waiting = scheduler.waiting
    step = {
        "start": {
            "running": [[s.seq_id, s.num_uncomputed_tokens] for s in scheduler.running],
            "head": [waiting[0].seq_id, waiting[0].num_tokens, scheduler.cached_tokens(waiting[0])]
            if waiting
            else None,
        },
        "error": None,
    }
    shadow = copy.deepcopy(scheduler)
    try:
        out = schedule(shadow)
        if not isinstance(out, SchedulerOutput):
            raise TypeError(f"schedule must return a SchedulerOutput, got a {type(out).__name__}")
        step.update(out.as_dict())
    except (NotImplementedError, MemoryError, CheckTimeout):
        raise
    except Exception as exc:  # the learner's bug; the run goes on with the course's plan
        step["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return step
    step["reasons"] = [str(r) for r in out.reasons]
    step["running"] = [s.seq_id for s in shadow.running]
    step["waiting"] = [s.seq_id for s in shadow.waiting]
    step["num_steps_after"] = shadow.num_steps
    step["hits"] = [[s.seq_id, s.num_computed_tokens] for s in shadow.running if s.seq_id in out.admitted]
    for name, probe in (("limits", lambda: shadow.check_output(out)), ("books", shadow.check_invariants)):
        try:
            probe()
            step[name] = None
        except Exception as exc:
            step[name] = f"{type(exc).__name__}: {exc}"[:300] if not isinstance(exc, AssertionError) else str(exc)
    return step


def drive_forced(schedule, runs):
    from infra_lib.serving.scheduler import Scheduler

    if not callable(schedule):
        raise TypeError(f"check(...) needs your schedule function, got a {type(schedule).__name__}")
    results = []
    for run in runs:
        steps: list[dict] = []
        reference = run["reference_steps"]

        class Forced(Scheduler):
            def schedule(self):
                steps.append(_plan_on_a_copy(schedule, self))
                if self.num_steps >= len(reference):
                    raise RuntimeError(f"the run went on past the reference's {len(reference)} steps")
                return carry_out(self, reference[self.num_steps])

        simulate(run, Forced(scheduler_config(run["config"])))
        results.append({"steps": steps})
    return results


def simulated_run(config: dict, n: int, seed: int, rate, prompt_len, output_len, shared: int = 0) -> dict:
    full = {
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,
        "block_size": 16,
        "num_blocks": 512,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,
        **config,
    }
    return {
        "config": full,
        "max_steps": 20_000,
        "workload": {
            "n": n,
            "seed": seed,
            "rate": rate,
            "prompt_len": list(prompt_len),
            "output_len": list(output_len),
            "shared_prefix_len": shared,
        },
    }
