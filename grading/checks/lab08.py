"""Checks for lab 08 (the scheduler): the learner writes ``schedule(self) -> SchedulerOutput``; the
checks plug it into a subclass of the course's ``Scheduler`` (which keeps the queues, the block pool
and the helpers) and drive whole engines with it: seeded workloads on the simulated runner, compared
with the reference scheduler step by step, with the scheduler's invariants checked after every step;
then a small random model served by the real engine, whose tokens must equal greedy decoding.

Shortcuts: ``Scheduler.schedule`` and ``Scheduler.make_room`` (the reference's planning and its
preemption loop) are registered through module-level aliases below, because a shortcut target names
a module attribute and a registered class would stand for every one of its methods, including the
helpers (``can_reserve``, ``reserve``, ``admit``, ``preempt``...) the learner is meant to call.
"""

from __future__ import annotations

import random

from grading.registry import Check, Mismatch, register, register_shortcuts

# The reference's planning and its preemption loop, as module attributes the shortcut registry can
# name (resolved lazily by ``__getattr__``, so that loading the registry imports no torch). An answer
# that calls either (``Scheduler.schedule``, ``super().schedule()``, ``self.make_room(...)``) is a
# shortcut, found statically and while the checks run.
_ALIASES = {"reference_schedule": "schedule", "reference_make_room": "make_room"}
register_shortcuts("lab08", [f"grading.checks.lab08:{alias}" for alias in _ALIASES])


def __getattr__(name: str):
    if name in _ALIASES:
        from infra_lib.serving.scheduler import Scheduler

        return getattr(Scheduler, _ALIASES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _reference():
    from infra_lib.serving.scheduler import Scheduler

    return Scheduler.schedule


_TASKS = {1: "lab08 task 1: schedule"}
_UNIT_COST = (1e-3, 1e-4, 1e-4, 1e-6)  # StepCostModel(fixed, per prefill token, per decode seq, per context token)


class _Violation(Exception):
    """A broken scheduler invariant, found by the driver after a step."""


def _scheduler_class(schedule):
    """``class LearnerScheduler(Scheduler): schedule = schedule``, checking what ``schedule`` returns."""
    from infra_lib.serving.scheduler import Scheduler
    from infra_lib.serving.scheduler_output import SchedulerOutput

    if not callable(schedule):
        raise TypeError(f"check(...) needs your schedule function, got a {type(schedule).__name__}")

    class LearnerScheduler(Scheduler):
        def schedule(self):
            out = schedule(self)
            if not isinstance(out, SchedulerOutput):
                raise TypeError(f"schedule must return a SchedulerOutput, got a {type(out).__name__}")
            return out

    return LearnerScheduler


def _config(c: dict):
    from infra_lib.serving.scheduler_output import SchedulerConfig

    return SchedulerConfig(**c)


def _describe_config(c: dict) -> str:
    flags = "".join([", enable_chunked_prefill=False" if not c.get("enable_chunked_prefill", True) else "",
                     ", enable_prefix_caching=True" if c.get("enable_prefix_caching") else ""])
    return (f"SchedulerConfig(max_num_seqs={c['max_num_seqs']}, max_num_batched_tokens={c['max_num_batched_tokens']}, "
            f"block_size={c['block_size']}, num_blocks={c['num_blocks']}{flags})")


def _record(engine, output=None) -> dict:
    """One step as plain data: the plan (``SchedulerOutput.as_dict``; the last step's, or ``output``,
    a plan the engine refused) and the queues after the step."""
    step = (output if output is not None else engine.steps[-1].output).as_dict()
    step["running"] = [s.seq_id for s in engine.scheduler.running]
    step["waiting"] = [s.seq_id for s in engine.scheduler.waiting]
    return step


def _watch_steps(engine, steps: list):
    """After each step: record it, then the scheduler's invariants and the plan's limits."""

    def after(engine):
        steps.append(_record(engine))
        try:
            engine.scheduler.check_output(engine.steps[-1].output)
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


# --- simulated workloads ----------------------------------------------------------------------------

def _drive_workloads(schedule, runs):
    from infra_lib.serving import (
        LLMEngine,
        SimulatedRunner,
        StepCostModel,
        random_workload,
        replay,
    )

    cls = _scheduler_class(schedule)
    results = []
    for run in runs:
        config = _config(run["config"])
        w = run["workload"]
        requests = random_workload(w["n"], w["seed"], rate=w["rate"] if w["rate"] else float("inf"),
                                   prompt_len=tuple(w["prompt_len"]), output_len=tuple(w["output_len"]),
                                   shared_prefix_len=w.get("shared_prefix_len", 0))
        engine = LLMEngine(SimulatedRunner(StepCostModel(*_UNIT_COST)), config, scheduler=cls(config))
        steps: list[dict] = []
        result = {"steps": steps, "violation": None, "output_lens": None}
        try:
            outputs = replay(engine, requests, on_step=_watch_steps(engine, steps), max_steps=run["max_steps"])
            result["output_lens"] = [len(o.token_ids) for o in outputs]
        except _Violation as exc:
            result["violation"] = str(exc)
        except RuntimeError as exc:
            _record_refused(engine, exc, steps)
            result["violation"] = _engine_stopped(exc, f"not every request finished within {run['max_steps']} steps "
                                                       "(starvation, or a scheduler that makes no progress)")
        results.append(result)
    return results


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


def _plan_text(step: dict) -> str:
    plan = ", ".join(f"seq {i}: {n} {kind}" for i, n, kind in step["scheduled"]) or "nothing"
    moved = "".join([f", admitted {step['admitted']}" if step["admitted"] else "",
                     f", preempted {step['preempted']}" if step["preempted"] else ""])
    return f"[{plan}]{moved}, running {step['running']}, waiting {step['waiting']}"


def _workload_text(run: dict) -> str:
    w = run["workload"]
    arrivals = "all at time 0" if not w["rate"] else f"arriving at {w['rate']:g} per second"
    prefix = f", a shared prefix of {w['shared_prefix_len']}" if w.get("shared_prefix_len") else ""
    return (f"{_describe_config(run['config'])}, {w['n']} requests {arrivals} (prompts of {w['prompt_len'][0]}-"
            f"{w['prompt_len'][1]} tokens{prefix}, outputs of {w['output_len'][0]}-{w['output_len'][1]})")


def _compare_steps(got: list, expected: list, where: str) -> Mismatch | None:
    for k, (g, e) in enumerate(zip(got, expected)):
        if g == e:
            continue
        for field, what in _FIELDS:
            if g.get(field) != e.get(field):
                before = (f"the steps before agreed; after step {k - 1}: {_plan_text(expected[k - 1])}" if k
                          else "it was the first step")
                return Mismatch(f"{what}: yours differs from the reference scheduler's",
                                f"on {where}: at step {k}, {field}: expected {e.get(field)}, got {g.get(field)}\n"
                                f"  the reference's step {k}: {_plan_text(e)}\n  {before}")
        return Mismatch("a step differs from the reference scheduler's", f"on {where}: at step {k}")
    if len(got) != len(expected):
        return Mismatch("your scheduler took a different number of steps than the reference",
                        f"on {where}: {len(got)} steps instead of {len(expected)}; the first {min(len(got), len(expected))} "
                        "agree")
    return None


def _violation(g: dict, e: dict, where: str) -> Mismatch:
    """A run stopped by a broken invariant: the first step that differed from the reference's, if any
    (the step that broke it included), is shown with the invariant (the difference is usually the cause);
    otherwise the violation alone."""
    k = len(g["steps"])
    first = _compare_steps(g["steps"], e["steps"][:k], where) if k else None
    if first is not None and "different number of steps" not in first.what:
        return Mismatch(first.what, f"{first.detail}\n  and then the run stopped: {g['violation']}",
                        hint=first.hint, reason=first.reason)
    return Mismatch("your scheduler broke an invariant of the scheduler (check_invariants / check_output, or an "
                    "empty plan)", f"on {where}: {g['violation']}")


def _compare_workloads(got, expected, runs):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch("the check recorded the wrong number of runs")
    for run, g, e in zip(runs, got, expected):
        where = _workload_text(run)
        if g["violation"]:
            return _violation(g, e, where)
        problem = _compare_steps(g["steps"], e["steps"], where)
        if problem:
            return problem
        if g["output_lens"] != e["output_lens"]:
            return Mismatch("not every request got all its tokens", f"on {where}: output lengths {g['output_lens']}, "
                                                                    f"expected {e['output_lens']}")
    return None


def _run(config: dict, n: int, seed: int, rate, prompt_len, output_len, shared: int = 0) -> dict:
    full = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "block_size": 16, "num_blocks": 512,
            "enable_chunked_prefill": True, "enable_prefix_caching": False, **config}
    return {"config": full, "max_steps": 20_000,
            "workload": {"n": n, "seed": seed, "rate": rate, "prompt_len": list(prompt_len),
                         "output_len": list(output_len), "shared_prefix_len": shared}}


# task 1: decode first, the token budget, max_num_seqs (a pool large enough that nothing is preempted)

def _decode_first_runs(rng: random.Random) -> list[dict]:
    return [
        _run({"max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4}, 8, rng.randrange(10**6), None,
             (2, 12), (3, 10)),
        _run({"max_num_seqs": 3, "max_num_batched_tokens": 64, "block_size": 8}, 10, rng.randrange(10**6), None,
             (4, 20), (2, 12)),
        _run({"max_num_seqs": 6, "max_num_batched_tokens": 4, "block_size": 4}, 8, rng.randrange(10**6), None,
             (1, 3), (4, 10)),  # more running decodes than the budget: the oldest run, the rest wait
    ]


def _decode_first_random(rng: random.Random) -> list[dict]:
    return [_run({"max_num_seqs": rng.randint(1, 8), "max_num_batched_tokens": rng.choice([3, 8, 16, 32, 128]),
                  "block_size": rng.choice([1, 2, 4, 16])}, rng.randint(8, 16), rng.randrange(10**6),
                 rng.choice([None, 100.0, 400.0]), (1, rng.randint(2, 24)), (1, rng.randint(2, 20)))
            for _ in range(4)]


# task 2: FCFS admission and chunked prefill (and whole prompts when it is off)

def _chunked_runs(rng: random.Random) -> list[dict]:
    return [
        _run({"max_num_seqs": 8, "max_num_batched_tokens": rng.randint(8, 14), "block_size": 4}, 6,
             rng.randrange(10**6), None, (20, 60), (2, 6)),
        _run({"max_num_seqs": 8, "max_num_batched_tokens": 48, "block_size": 4, "enable_chunked_prefill": False},
             8, rng.randrange(10**6), None, (8, 40), (2, 8)),
    ]


def _chunked_random(rng: random.Random) -> list[dict]:
    runs = []
    for _ in range(4):
        chunked = rng.random() < 0.6
        out_max = rng.randint(2, 10)
        budget = rng.randint(4, 40) if chunked else rng.randint(40, 80)
        prompt_max = rng.randint(10, 80) if chunked else budget - out_max + 1
        runs.append(_run({"max_num_seqs": rng.randint(2, 10), "max_num_batched_tokens": budget,
                          "block_size": rng.choice([2, 4, 16]), "enable_chunked_prefill": chunked},
                         rng.randint(6, 14), rng.randrange(10**6), rng.choice([None, 200.0]),
                         (1, prompt_max), (1, out_max)))
    return runs


# task 3: preemption on tight pools (the newest running sequence goes, back to the front of the queue)

def _preemption_runs(rng: random.Random) -> list[dict]:
    return [
        _run({"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 4, "num_blocks": 16}, 12,
             rng.randrange(10**6), None, (8, 24), (8, 24)),
        _run({"max_num_seqs": 6, "max_num_batched_tokens": 16, "block_size": 2, "num_blocks": 26}, 10,
             rng.randrange(10**6), None, (6, 16), (6, 16)),
    ]


def _preemption_random(rng: random.Random) -> list[dict]:
    runs = []
    for _ in range(4):
        block_size = rng.choice([1, 2, 4])
        prompt_max, out_max = rng.randint(8, 24), rng.randint(6, 24)
        need = -(-(prompt_max + out_max - 1) // block_size)
        chunked = rng.random() < 0.7
        prefix = rng.random() < 0.5
        runs.append(_run({"max_num_seqs": rng.randint(3, 10),
                          "max_num_batched_tokens": rng.randint(8, 64) if chunked else prompt_max + out_max + 8,
                          "block_size": block_size, "num_blocks": need + rng.randint(0, need),
                          "enable_chunked_prefill": chunked, "enable_prefix_caching": prefix},
                         rng.randint(10, 20), rng.randrange(10**6), rng.choice([None, None, 300.0]),
                         (1, prompt_max), (1, out_max), shared=rng.choice([0, 6]) if prefix else 0))
    return runs


_STEP_SECTION = "chapter 08, section “2 · One step's plan: iteration-level scheduling under a token budget”"
_PREEMPTION_SECTION = "chapter 08, section “4 · Preemption: a pool too small for the load”"
_CHUNKING_SECTION = "chapter 08, section “5 · Head-of-line blocking, and chunked prefill”"

_HINTS = {  # check id -> the idea a learner failing it has most likely missed
    "lab08.decode_first":
        "a step plans every running sequence before it admits anyone, oldest first, and each planned sequence "
        "spends its tokens from one budget shared by the whole step: a decode costs 1 token, a sequence still in "
        "its prompt takes as much of the rest as the budget leaves, and once the budget is spent everyone else, "
        "running or waiting, waits for the next step. Admissions also stop while max_num_seqs sequences are "
        "running, and a sequence goes into the plan only with the blocks for the positions it computes "
        f"({_STEP_SECTION}).",
    "lab08.decode_first_random":
        "if the fixed workloads pass, look at the tight ends: a budget smaller than the number of decoding "
        "sequences (the oldest run, the newest wait), a max_num_seqs of 1, a prompt still being prefilled in "
        "chunks (a running sequence, served with the others before any admission), and steps in which one of the "
        "queues is empty.",
    "lab08.chunked_prefill":
        "admission is first come, first served: only the head of the waiting queue is ever considered, and the "
        "first sequence that cannot come in ends the step's admissions, even when a shorter prompt behind it would "
        "fit. A new sequence computes its tokens beyond its prefix-cache hit, cut at what the budget leaves when "
        "chunked prefill is on (the rest follows in later steps, as a running sequence); with it off, a prompt "
        "larger than the budget left waits, whole, and is never admitted past the budget. Each admission is "
        "recorded with the prefix-cache hit found before admitting it, 0 included "
        f"({_CHUNKING_SECTION}).",
    "lab08.chunked_prefill_random":
        "if the fixed workloads pass, look at the edges: a prompt exactly as large as the budget left fits, a "
        "budget the running sequences have spent admits nobody, and a sequence that cannot come in, for whatever "
        "reason, holds back everyone behind it in the waiting queue.",
    "lab08.preemption":
        "when a running sequence cannot get the blocks for its next positions, blocks are freed by preempting the "
        "newest running sequence (the most recently admitted), then the next newest, as many as needed, so that the "
        "oldest keep making progress; a sequence that is itself the newest preempts itself, and no later running "
        "sequence is planned. A victim goes back to the front of the waiting queue, is recorded in the order it was "
        "preempted and gets no tokens in this step; a step that preempted admits nobody, and a waiting sequence "
        f"never takes blocks from a running one ({_PREEMPTION_SECTION}).",
    "lab08.preemption_random":
        "on tight pools an admission can also fail for lack of blocks, which ends the step's admissions like any "
        "other reason. A readmitted victim computes all its tokens so far, prompt and generated, less what the "
        "prefix cache still holds, and its admission records that hit; every request must finish, and preempting "
        "anything but the newest can starve one.",
}

for check_id, task, make, note in (
        ("lab08.decode_first", 1, _decode_first_runs, ""),
        ("lab08.decode_first_random", 1, _decode_first_random, " Random configurations and arrival rates."),
        ("lab08.chunked_prefill", 2, _chunked_runs, ""),
        ("lab08.chunked_prefill_random", 2, _chunked_random, " Random budgets, with and without chunked prefill."),
        ("lab08.preemption", 3, _preemption_runs, ""),
        ("lab08.preemption_random", 3, _preemption_random, " Random tight pools, some with prefix caching.")):
    register(Check(
        check_id=check_id,
        task=_TASKS[1],
        reference=_reference,
        make_inputs=make,
        drive=_drive_workloads,
        compare=_compare_workloads,
        hint=_HINTS[check_id] + note,
    ))


# --- task 4: the real engine on a small random model ------------------------------------------------

def _tiny_prompts(rng: random.Random, count: int, shared_len: int) -> list[list[int]]:
    from grading.checks.lab06 import _TINY

    vocab = _TINY["vocab_size"]
    shared = [rng.randrange(vocab) for _ in range(shared_len)]
    return [shared[:rng.randint(0, shared_len)] + [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
            for _ in range(count)]


def _engine_case(rng: random.Random) -> dict:
    return {"seed": rng.randrange(10**6), "new_tokens": 8, "runs": [
        {"config": {"max_num_seqs": 4, "max_num_batched_tokens": 512, "block_size": 4, "num_blocks": 64},
         "prompts": _tiny_prompts(rng, 6, 6)},
        {"config": {"max_num_seqs": 8, "max_num_batched_tokens": 3, "block_size": 4, "num_blocks": 64},
         "prompts": _tiny_prompts(rng, 4, 6)},
    ]}


def _engine_hidden_case(rng: random.Random) -> dict:
    return {"seed": rng.randrange(10**6), "new_tokens": 10, "runs": [
        {"config": {"max_num_seqs": 6, "max_num_batched_tokens": 32, "block_size": 2, "num_blocks": 14},
         "prompts": _tiny_prompts(rng, 6, 6)},  # a pool this small forces preemptions
        # prefix caching on a pool that small: cache hits at admission, and preemptions
        {"config": {"max_num_seqs": 6, "max_num_batched_tokens": 8, "block_size": 2, "num_blocks": 14,
                    "enable_prefix_caching": True}, "prompts": _tiny_prompts(rng, 6, 6)},
    ]}


def _drive_engine(schedule, case):
    from grading.checks.lab06 import tiny_model
    from infra_lib.model.generation import greedy_decode
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving import LLMEngine

    cls = _scheduler_class(schedule)
    model = tiny_model(case["seed"])
    results = []
    for run in case["runs"]:
        config = _config({"enable_chunked_prefill": True, "enable_prefix_caching": False, **run["config"]})
        engine = LLMEngine.from_model(model, config=config, scheduler=cls(config))
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=case["new_tokens"], stop_ids=()))
               for p in run["prompts"]]
        steps: list[dict] = []
        after = _watch_steps(engine, steps)
        result = {"steps": steps, "violation": None, "tokens": None, "num_free": None,
                  "contiguous": [greedy_decode(model, p, case["new_tokens"]) for p in run["prompts"]]}
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
        except RuntimeError as exc:
            _record_refused(engine, exc, steps)
            result["violation"] = _engine_stopped(exc, "not every request finished within 2000 steps")
        results.append(result)
    return results


def _compare_engine(got, expected, case):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch("the check recorded the wrong number of runs")
    for run, g, e in zip(case["runs"], got, expected):
        config = {"enable_chunked_prefill": True, "enable_prefix_caching": False, **run["config"]}
        where = (f"the small random model, {_describe_config(config)}, {len(run['prompts'])} prompts of "
                 f"{[len(p) for p in run['prompts']]} tokens, {case['new_tokens']} new tokens each")
        if g["violation"]:
            return _violation(g, e, where)
        for i, (tokens, want) in enumerate(zip(g["tokens"], e["contiguous"])):
            if tokens != want:
                return Mismatch("the engine driven by your scheduler generates other tokens than greedy decoding",
                                f"on {where}: request {i}: expected {want}, got {tokens}")
        problem = _compare_steps(g["steps"], e["steps"], where)
        if problem:
            return problem
        if g["num_free"] != e["num_free"]:
            return Mismatch("blocks are still held after every request finished",
                            f"on {where}: {g['num_free']} blocks free, expected {e['num_free']}")
    return None


_ENGINE_HINTS = {
    "lab08.engine_tiny_model":
        "the real engine computes exactly the positions each plan schedules, so tokens that differ from greedy "
        "decoding mean a plan skipped or repeated positions: a prompt cut into chunks continues exactly where its "
        "previous chunk stopped, and no sequence is planned for more tokens than it has left to compute. If the "
        "simulated checks fail as well, fix those first: they name the first step that differs.",
    "lab08.engine_preemption_prefix_cache":
        "the real engine computes exactly the positions each plan schedules, so a plan that skips or repeats "
        "positions gives other tokens than greedy decoding: a sequence admitted with a prefix-cache hit computes "
        "only what follows the cached blocks, and a preempted sequence, once readmitted, recomputes its prompt and "
        "every token it had generated. If the simulated checks fail as well, fix those first.",
}

for check_id, make, note in (
        ("lab08.engine_tiny_model", _engine_case, ""),
        ("lab08.engine_preemption_prefix_cache", _engine_hidden_case,
         " Tight pools that force preemptions, and prefix caching.")):
    register(Check(
        check_id=check_id,
        task=_TASKS[1],
        reference=_reference,
        make_inputs=make,
        drive=_drive_engine,
        compare=_compare_engine,
        hint=_ENGINE_HINTS[check_id] + note,
    ))
