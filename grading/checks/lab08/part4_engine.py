"""Lab 08 part 4: the learner's scheduler in the real engine, serving a small random model whose tokens must
equal greedy decoding."""

from __future__ import annotations

import random

from grading.checks.common import one_thread
from grading.checks.lab08.engines import length_engine
from grading.checks.lab08.forced_steps import TASKS, schedule_reference, scheduler_config
from grading.checks.lab08.plans import describe_config, plan_text
from grading.checks.model_cases import TINY, tiny_model
from grading.registry import Check, Mismatch, register


class _Violation(Exception):
    """A broken scheduler invariant, found by the driver after a step."""


def _scheduler_class(schedule):
    """``class LearnerScheduler(Scheduler): schedule = schedule``, checking what ``schedule`` returns
    (the capstone's engine builds its scheduler the same way)."""
    from infra_lib.serving.pieces import scheduler_class

    if not callable(schedule):
        raise TypeError(f"check(...) needs your schedule function, got a {type(schedule).__name__}")
    return scheduler_class(schedule)


def _record(engine, output=None) -> dict:
    """One step as plain data: the plan (``SchedulerOutput.as_dict``; the last step's, or ``output``,
    a plan the engine refused) and the queues after the step."""
    step = (output if output is not None else engine.steps[-1].output).as_dict()
    step["running"] = [s.seq_id for s in engine.scheduler.running]
    step["waiting"] = [s.seq_id for s in engine.scheduler.waiting]
    return step


def _watch_steps(engine, steps: list):
    """After each step: record it, then the books the real engine needs (the plan's limits are the
    simulated parts' to judge)."""

    def after(engine):
        steps.append(_record(engine))
        try:
            engine.check_invariants()
        except AssertionError as exc:
            raise _Violation(f"after step {len(steps) - 1}: {exc}") from None

    return after


def _record_refused(engine, exc: RuntimeError, steps: list) -> None:
    """A plan the engine refused to run is still a step the scheduler planned: recorded, so that it is
    compared with the reference's like any other."""
    plan = getattr(exc, "output", None)
    if plan is not None:
        steps.append(_record(engine, plan))


def _engine_stopped(exc: RuntimeError, too_long: str) -> str:
    """The engine's own complaints about a plan, as a violation; anything else is re-raised."""
    text = str(exc)
    if "did not finish within" in text:
        return too_long
    if "the scheduler made no progress" in text:
        return f"{text.split(':', 1)[0]}: the plan is empty although sequences are unfinished"
    if "and preempted it in the same step" in text:
        return text.split(": the scheduler gave", 1)[0]  # the engine refused the plan before running it
    raise exc


# --- an engine's recorded steps, compared with the reference's -----------------------------------

_FIELDS = (  # (field, what it is): compared in this order
    ("preempted", "which running sequences are preempted, in what order"),
    ("scheduled", "the step's plan (which sequences run, with how many tokens, prefill or decode)"),
    ("admitted", "which waiting sequences are admitted"),
    ("num_cached_tokens", "the prefix-cache hits recorded at admission"),
    ("num_batched_tokens", "the number of tokens the step computes"),
    ("step", "the step index (schedule must count self.num_steps up once per call)"),
    ("running", "the running queue after the step"),
    ("waiting", "the waiting queue after the step"),
)


def _compare_steps(got: list, expected: list, where: str) -> Mismatch | None:
    for k, (g, e) in enumerate(zip(got, expected)):
        if g == e:
            continue
        for field, what in _FIELDS:
            if g.get(field) != e.get(field):
                before = (
                    f"the steps before agreed; after step {k - 1}: {plan_text(expected[k - 1])}"
                    if k
                    else "it was the first step"
                )
                return Mismatch(
                    f"{what}: yours differs from the reference scheduler's",
                    f"on {where}: at step {k}, {field}: expected {e.get(field)}, got {g.get(field)}\n"
                    f"  the reference's step {k}: {plan_text(e)}\n  {before}",
                )
        return Mismatch("a step differs from the reference scheduler's", f"on {where}: at step {k}")
    if len(got) != len(expected):
        return Mismatch(
            "your scheduler took a different number of steps than the reference",
            f"on {where}: {len(got)} steps instead of {len(expected)}; the first {min(len(got), len(expected))} agree",
        )
    return None


def _violation(g: dict, e: dict, where: str) -> Mismatch:
    """A run stopped by a broken invariant: the first step that differed from the reference's, if any
    (the step that broke it included), is shown with the invariant (the difference is usually the cause);
    otherwise the violation alone."""
    k = len(g["steps"])
    first = _compare_steps(g["steps"], e["steps"][:k], where) if k else None
    if first is not None and "different number of steps" not in first.what:
        return Mismatch(
            first.what,
            f"{first.detail}\n  and then the run stopped: {g['violation']}",
            hint=first.hint,
            reason=first.reason,
        )
    return Mismatch(
        "your scheduler broke an invariant of the scheduler (check_invariants / check_output, or an empty plan)",
        f"on {where}: {g['violation']}",
    )


# --- part 4: the real engine on a small random model ------------------------------------------------


def _tiny_prompts(rng: random.Random, count: int, shared_len: int) -> list[list[int]]:
    vocab = TINY["vocab_size"]
    shared = [rng.randrange(vocab) for _ in range(shared_len)]
    return [
        shared[: rng.randint(0, shared_len)] + [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        for _ in range(count)
    ]


def _engine_case(rng: random.Random) -> dict:
    return {
        "seed": rng.randrange(10**6),
        "new_tokens": 8,
        "runs": [
            {
                "config": {"max_num_seqs": 4, "max_num_batched_tokens": 512, "block_size": 4, "num_blocks": 64},
                "prompts": _tiny_prompts(rng, 6, 6),
            },
            {
                "config": {"max_num_seqs": 8, "max_num_batched_tokens": 3, "block_size": 4, "num_blocks": 64},
                "prompts": _tiny_prompts(rng, 4, 6),
            },
        ],
    }


def _engine_prefix_case(rng: random.Random) -> dict:
    return {
        "seed": rng.randrange(10**6),
        "new_tokens": 6,
        "runs": [
            # prefix caching on a pool large enough for everyone: cache hits at admission, chunks of 8
            {
                "config": {
                    "max_num_seqs": 4,
                    "max_num_batched_tokens": 8,
                    "block_size": 2,
                    "num_blocks": 64,
                    "enable_prefix_caching": True,
                },
                "prompts": _tiny_prompts(rng, 4, 6),
            },
            {
                "config": {
                    "max_num_seqs": 3,
                    "max_num_batched_tokens": 64,
                    "block_size": 4,
                    "num_blocks": 64,
                    "enable_chunked_prefill": False,
                },
                "prompts": _tiny_prompts(rng, 3, 4),
            },
        ],
    }


def _engine_preemption_case(rng: random.Random) -> dict:
    return {
        "seed": rng.randrange(10**6),
        "new_tokens": 10,
        "runs": [
            {
                "config": {"max_num_seqs": 6, "max_num_batched_tokens": 32, "block_size": 2, "num_blocks": 14},
                "prompts": _tiny_prompts(rng, 6, 6),
            },  # a pool this small forces preemptions
            # prefix caching on a pool that small: cache hits at admission, and preemptions
            {
                "config": {
                    "max_num_seqs": 6,
                    "max_num_batched_tokens": 8,
                    "block_size": 2,
                    "num_blocks": 14,
                    "enable_prefix_caching": True,
                },
                "prompts": _tiny_prompts(rng, 6, 6),
            },
        ],
    }


def _drive_engine(schedule, case):
    with one_thread():
        return _serve(schedule, case)


def _serve(schedule, case):
    from infra_lib.model.generation import greedy_decode
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.engine import PlanRefused

    cls = _scheduler_class(schedule)
    model = tiny_model(case["seed"])
    results = []
    for run in case["runs"]:
        config = scheduler_config({"enable_chunked_prefill": True, "enable_prefix_caching": False, **run["config"]})
        engine = length_engine().from_model(model, config=config, scheduler=cls(config))
        ids = [
            engine.add_request(p, SamplingParams(max_new_tokens=case["new_tokens"], stop_ids=()))
            for p in run["prompts"]
        ]
        steps: list[dict] = []
        after = _watch_steps(engine, steps)
        planning = _PlanWatch(engine.scheduler)
        result = {
            "steps": steps,
            "violation": None,
            "tokens": None,
            "num_free": None,
            "contiguous": [greedy_decode(model, p, case["new_tokens"]) for p in run["prompts"]],
        }
        try:
            for _ in range(2_000):
                if not engine.has_unfinished():
                    break
                engine.step()
                after(engine)
            else:
                raise _Violation("not every request finished within 2000 steps")
            result["tokens"] = [engine.output(i).token_ids for i in ids]
            result["num_free"] = engine.scheduler.pool.num_free
        except _Violation as exc:
            result["violation"] = str(exc)
        except PlanRefused as exc:
            _record_refused(engine, exc, steps)
            result["violation"] = _engine_stopped(exc, "not every request finished within 2000 steps")
        except Exception as exc:  # noqa: BLE001 - whose error it is decides how it is reported
            if planning.inside or planning.last is None:
                raise  # raised by your schedule: reported as your code's error
            # Raised by the course's engine while it ran the plan your schedule returned: the plan is
            # the cause, so it is recorded and compared like any other step.
            steps.append(_record(engine, planning.last))
            result["violation"] = (
                f"step {planning.last.step}: the engine could not run the plan your scheduler "
                f"returned ({type(exc).__name__} in the course's engine: {exc})"
            )
        results.append(result)
    return results


class _PlanWatch:
    """Wraps a scheduler's ``schedule`` to know whether an error arose inside it (the learner's code)
    or after it returned (the engine running its plan), and which plan it returned last."""

    def __init__(self, scheduler):
        self.inside, self.last = False, None
        own = scheduler.schedule

        def schedule():
            self.inside = True
            out = own()
            self.inside, self.last = False, out
            return out

        scheduler.schedule = schedule


def _compare_engine(got, expected, case):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch("the check recorded the wrong number of runs")
    for run, g, e in zip(case["runs"], got, expected):
        config = {"enable_chunked_prefill": True, "enable_prefix_caching": False, **run["config"]}
        where = (
            f"the small random model, {describe_config(config)}, {len(run['prompts'])} prompts of "
            f"{[len(p) for p in run['prompts']]} tokens, {case['new_tokens']} new tokens each"
        )
        if g["violation"]:
            return _violation(g, e, where)
        for i, (tokens, want) in enumerate(zip(g["tokens"], e["contiguous"])):
            if tokens != want:
                return Mismatch(
                    "the engine driven by your scheduler generates other tokens than greedy decoding",
                    f"on {where}: request {i}: expected {want}, got {tokens}",
                )
        if g["num_free"] != e["num_free"]:
            return Mismatch(
                "blocks are still held after every request finished",
                f"on {where}: {g['num_free']} blocks free, expected {e['num_free']}",
            )
    return None


def engine_parts(make) -> dict:
    """The fields of a check in the real engine whose cases ``make`` draws."""
    return dict(
        task=TASKS[1], reference=schedule_reference, make_inputs=make, drive=_drive_engine, compare=_compare_engine
    )


register(
    Check(
        check_id="lab08.engine_tiny_model",
        **engine_parts(_engine_case),
        hint="the real engine computes exactly the positions each plan schedules, so tokens that differ from greedy "
        "decoding mean a plan skipped or repeated positions: a prompt cut into chunks continues exactly where its "
        "previous chunk stopped, and no sequence is planned for more tokens than it has left to compute. If the "
        "simulated checks fail as well, fix those first: they name the first step that differs.",
    )
)

register(
    Check(
        check_id="lab08.engine_prefix_cache",
        **engine_parts(_engine_prefix_case),
        hint="the real engine computes exactly the positions each plan schedules, so a plan that skips or repeats "
        "positions gives other tokens than greedy decoding: a sequence admitted with a prefix-cache hit computes "
        "only what follows the cached blocks. If the simulated checks fail as well, fix those first."
        + " Prefix caching, and whole prompts.",
    )
)

register(
    Check(
        check_id="lab08.engine_preemption",
        **engine_parts(_engine_preemption_case),
        hint="on a pool this small the engine preempts: a victim gives back its blocks and gets no tokens in that "
        "step, "
        "and once readmitted it recomputes its prompt and every token it had generated, so its tokens still equal "
        "greedy decoding; every request must finish. If the simulated checks fail as well, fix those first."
        + " Tight pools that force preemptions.",
    )
)
