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

from grading.checks.model_cases import TINY, tiny_model
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
    """``class LearnerScheduler(Scheduler): schedule = schedule``, checking what ``schedule`` returns
    (the capstone's engine builds its scheduler the same way)."""
    from infra_lib.serving.pieces import scheduler_class

    if not callable(schedule):
        raise TypeError(f"check(...) needs your schedule function, got a {type(schedule).__name__}")
    return scheduler_class(schedule)


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

def _simulate(run: dict, scheduler) -> None:
    """Serve the run's workload on the simulated runner with ``scheduler``."""
    from infra_lib.serving import LLMEngine, SimulatedRunner, StepCostModel, random_workload, replay

    w = run["workload"]
    requests = random_workload(w["n"], w["seed"], rate=w["rate"] if w["rate"] else float("inf"),
                               prompt_len=tuple(w["prompt_len"]), output_len=tuple(w["output_len"]),
                               shared_prefix_len=w.get("shared_prefix_len", 0))
    engine = LLMEngine(SimulatedRunner(StepCostModel(*_UNIT_COST)), scheduler.config, scheduler=scheduler)
    replay(engine, requests, max_steps=run["max_steps"])


def _reference_steps(run: dict) -> list[list[tuple[str, int, int]]]:
    """Each step of the reference scheduler's run of ``run``, as its actions in order: ``("preempt", seq
    id, 0)``, ``("reserve", seq id, tokens)`` for a running sequence, ``("admit", seq id, tokens)``."""
    from infra_lib.serving.scheduler import Scheduler

    steps: list[list[tuple[str, int, int]]] = []

    class Recorded(Scheduler):
        def schedule(self):
            steps.append([])
            return super().schedule()

        def preempt(self, seq):
            steps[-1].append(("preempt", seq.seq_id, 0))
            super().preempt(seq)

        def reserve(self, seq, num_tokens):
            steps[-1].append(("reserve", seq.seq_id, num_tokens))
            super().reserve(seq, num_tokens)

        def admit(self, seq, num_tokens):
            steps[-1].append(("admit", seq.seq_id, num_tokens))
            super().admit(seq, num_tokens)

    _simulate(run, Recorded(_config(run["config"])))
    return steps


def _with_reference_steps(make):
    """``make``'s runs, each with the reference's steps on it (``"reference_steps"``)."""

    def make_inputs(rng: random.Random) -> list[dict]:
        runs = make(rng)
        for run in runs:
            run["reference_steps"] = _reference_steps(run)
        return runs

    return make_inputs


def _carry_out(scheduler, actions: list) -> object:
    """One recorded step of the reference's, carried out on ``scheduler`` with its own actions; the plan."""
    from infra_lib.serving.scheduler_output import SchedulerOutput

    out = SchedulerOutput(scheduler.num_steps, scheduler.config.max_num_batched_tokens)
    for action, seq_id, num_tokens in actions:
        queue = scheduler.waiting if action == "admit" else scheduler.running
        seq = next((s for s in queue if s.seq_id == seq_id), None)
        if seq is None:
            raise RuntimeError(f"step {out.step} of the reference's run {action}s seq {seq_id}, which is not "
                               f"{'waiting' if action == 'admit' else 'running'}: the run left the reference's")
        if action == "preempt":
            scheduler.preempt(seq)
            out.preempted.append(seq_id)
            continue
        if action == "admit":
            out.num_cached_tokens[seq_id] = scheduler.cached_tokens(seq)
            scheduler.admit(seq, num_tokens)
            out.admitted.append(seq_id)
        else:
            scheduler.reserve(seq, num_tokens)
        out.add(seq, num_tokens)
    scheduler.num_steps += 1
    scheduler._scheduled = {s.seq_id: s.num_tokens for s in out.scheduled}
    out.num_running, out.num_waiting = len(scheduler.running), len(scheduler.waiting)
    out.num_free_blocks = scheduler.pool.num_free
    return out


def _plan_on_a_copy(schedule, scheduler) -> dict:
    """The learner's plan for the scheduler's next step, made on a copy of it, as plain data: the plan,
    the queues after it, the hit each admission took, the limits and books it broke (None: kept), and
    the state it started from."""
    import copy

    from grading.check import CheckTimeout
    from infra_lib.serving.scheduler_output import SchedulerOutput

    waiting = scheduler.waiting
    step = {"start": {"running": [[s.seq_id, s.num_uncomputed_tokens] for s in scheduler.running],
                      "head": [waiting[0].seq_id, waiting[0].num_tokens, scheduler.cached_tokens(waiting[0])]
                      if waiting else None},
            "error": None}
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


def _drive_forced(schedule, runs):
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
                return _carry_out(self, reference[self.num_steps])

        _simulate(run, Forced(_config(run["config"])))
        results.append({"steps": steps})
    return results


_HINT = {  # the idea a learner has most likely missed, by the kind of difference found
    "budget": "every planned sequence spends its tokens from one budget shared by the whole step, the running "
              "sequences and the admissions alike: what one takes, the next cannot, and the step's tokens never "
              "add up to more than max_num_batched_tokens.",
    "max_seqs": "admissions stop while max_num_seqs sequences are running: a step may plan at most that many "
                "sequences.",
    "running_order": "running sequences are planned oldest first (the order of the running queue), each before "
                     "any admission.",
    "running_missing": "every running sequence is planned while the budget lasts, the oldest first; only once the "
                       "budget is spent do the rest wait a step.",
    "running_tokens": "a running sequence computes what it has not computed yet, cut at the budget left: 1 token "
                      "for a decode, the rest of its prompt (or a chunk of it) for one still in prefill.",
    "reserve": "a sequence goes into the plan only with blocks for the positions it computes in this step.",
    "fcfs": "admission is first come, first served: only the head of the waiting queue is ever considered, and "
            "the first sequence that cannot come in ends the step's admissions, even when one behind it would fit.",
    "admit_tokens": "a new sequence computes its tokens past its prefix-cache hit, cut at the budget left when "
                    "chunked prefill is on.",
    "cut_first": "the blocks an admission asks for are those of the tokens it computes in this step: the prompt is "
                 "cut to the budget left first, and only that chunk needs blocks now (the rest gets its blocks in "
                 "later steps, as a running sequence).",
    "whole": "with chunked prefill off, a prompt is admitted whole or not at all: one larger than the budget left "
             "waits for a later step, and nobody behind it is admitted.",
    "held_back": {
        "budget exhausted": "once the budget is spent nobody more is admitted in this step.",
        "max_num_seqs": "admissions stop while max_num_seqs sequences are running.",
        "prefill of": "with chunked prefill off, a prompt larger than the budget left waits, whole.",
        "out of blocks": "a sequence whose blocks cannot be found waits, and so does everyone behind it.",
    },
    "victim": "when a running sequence cannot get its blocks, the victim is the newest running sequence (the most "
              "recently admitted), then the next newest, as many as needed, so that the oldest keep making "
              "progress.",
    "no_preemption": "preempt only when a running sequence cannot get the blocks for its next positions, and "
                     "only as many sequences as that takes.",
    "missed_preemption": "when a running sequence cannot get the blocks for its next positions, blocks are freed by "
                         "preempting running sequences, newest first; it is never skipped or planned without them.",
    "after_preemption": "a victim gets no tokens in this step, and once a sequence has preempted itself (it was the "
                        "newest) no later running sequence is planned: they were all preempted before it.",
    "no_admission": "a step that preempted admits nobody: blocks were short a moment ago, and a waiting sequence "
                    "never takes blocks from a running one.",
    "victim_front": "a victim goes back to the front of the waiting queue, ahead of everyone who never ran, so it "
                    "is the next to come back.",
    "step_index": "each call plans one step and counts it once: the plan carries the index of the step it plans, "
                  "and the scheduler's step count rises by one per call.",
    "cached_record": "every admission records its prefix-cache hit, the number found before admitting it, and 0 is "
                     "recorded too: the record holds one entry per admitted sequence, no more, no fewer.",
}


def _entries(step: dict, ids) -> list:
    return [entry for entry in step.get("scheduled", []) if entry[0] in ids]


def _running_at_start(step: dict) -> set:
    return {seq_id for seq_id, _ in step["start"]["running"]}


def _start_text(step: dict) -> str:
    running = ", ".join(f"seq {i} ({n} to compute)" for i, n in step["start"]["running"]) or "none"
    head = step["start"]["head"]
    first = f"seq {head[0]} ({head[1]} tokens, {head[2]} cached)" if head else "none"
    return f"running at its start: {running}; first waiting: {first}"


def _step_detail(where: str, k: int, g: dict, e: dict, what: str = "") -> str:
    yours = _plan_text(g) if "scheduled" in g else "(no plan)"
    extra = f"\n  {what}" if what else ""
    return (f"on {where}: at step {k} ({_start_text(e)})\n  expected: {_plan_text(e)}\n  yours:    {yours}{extra}\n"
            "  (each step is planned from the reference's state, so earlier steps do not carry your differences)")


def _limit(g: dict, *marks: str) -> str | None:
    for text in (g.get("limits"), g.get("books")):
        if text and any(mark in text for mark in marks):
            return text
    return None


def _part1(g: dict, e: dict) -> tuple[str, str, str] | None:
    """(what, extra detail, hint) for a difference part 1 owns at a step without preemption."""
    over = _limit(g, "tokens, budget")
    if over:
        return "the step plans more tokens than the budget", over, _HINT["budget"]
    crowd = _limit(g, "distinct sequences", "max_num_seqs is")
    if crowd:
        return "the step plans more sequences than max_num_seqs", crowd, _HINT["max_seqs"]
    running = _running_at_start(e)
    mine, want = _entries(g, running), _entries(e, running)
    if mine != want:
        if sorted(mine) == sorted(want):
            return "the running sequences are planned in another order", "", _HINT["running_order"]
        if [m[0] for m in mine] == [w[0] for w in want]:
            return "a running sequence computes another number of tokens", "", _HINT["running_tokens"]
        if len(mine) < len(want):
            return "a running sequence that should run this step waits", "", _HINT["running_missing"]
        return "the running sequences' entries differ from the reference's", "", _HINT["budget"]
    blocks = _limit(g, "holds", "blocks; its computed")
    if blocks:
        return "a planned sequence does not hold the blocks for the positions it computes", blocks, _HINT["reserve"]
    return None


def _part2(g: dict, e: dict) -> tuple[str, str, str] | None:
    """(what, extra detail, hint) for a difference part 2 owns at a step part 1 agrees on."""
    whole = _limit(g, "split a prefill although chunked prefill is off")
    if whole:
        return "a prompt was cut into chunks although chunked prefill is off", whole, _HINT["whole"]
    if g["admitted"] != e["admitted"]:
        head = e["start"]["head"]
        if len(g["admitted"]) > len(e["admitted"]) and g["admitted"][:len(e["admitted"])] == e["admitted"]:
            reason = next((r for r in e.get("reasons", []) if "waits" in r), "")
            first, held = g["admitted"][len(e["admitted"])], (e.get("waiting") or [None])[0]
            if held is not None and first != held:  # the head could not come in, and one behind it did
                return ("a sequence was admitted ahead of one that arrived before it and could not come in",
                        f"seq {first} was admitted ahead of seq {held}, which the reference holds back"
                        + (f" ({reason})" if reason else ""), _HINT["fcfs"])
            hint = next((h for mark, h in _HINT["held_back"].items() if reason.startswith(mark)), _HINT["fcfs"])
            return "a sequence was admitted that the reference holds back", reason, hint
        if g["admitted"] and (not e["admitted"] or g["admitted"][0] != e["admitted"][0]):
            return "a sequence was admitted out of arrival order", "", _HINT["fcfs"]
        missing = e["admitted"][len(g["admitted"])] if len(e["admitted"]) > len(g["admitted"]) else None
        chunk = _entries(e, {missing}) if missing is not None else []
        if not g["admitted"] and chunk and head and head[0] == missing and chunk[0][1] < head[1] - head[2]:
            return "a prompt whose chunk fits was not admitted", "", _HINT["cut_first"]
        return "admissions stopped earlier than the reference's", "", _HINT["fcfs"]
    admitted = set(e["admitted"])
    if _entries(g, admitted) != _entries(e, admitted):
        return "an admitted sequence computes another number of tokens", "", _HINT["admit_tokens"]
    if g["waiting"] != e["waiting"]:
        return "the waiting queue after the step differs", "", _HINT["fcfs"]
    return None


def _part3(g: dict, e: dict) -> tuple[str, str, str] | None:
    """(what, extra detail, hint) for a difference part 3 owns at a step where blocks ran out."""
    mine, want = g.get("preempted", []), e["preempted"]
    if mine != want:
        if not mine:
            return "no sequence was preempted although blocks ran out", "", _HINT["missed_preemption"]
        if not want:
            return "a sequence was preempted although its blocks could be found", "", _HINT["no_preemption"]
        return "other sequences were preempted than the reference's", "", _HINT["victim"]
    both = _limit(g, "and preempted it in the same step")
    if both:
        return "a preempted sequence is also planned in the same step", both, _HINT["after_preemption"]
    if g["admitted"]:
        return "a step that preempted also admitted a sequence", "", _HINT["no_admission"]
    if g["scheduled"] != e["scheduled"]:
        return "the plan after the preemption differs", "", _HINT["after_preemption"]
    if g["waiting"] != e["waiting"]:
        return "the waiting queue after the preemption differs", "", _HINT["victim_front"]
    return None


def _part5(g: dict, e: dict) -> tuple[str, str, str] | None:
    """(what, extra detail, hint) for a slip in the step's records."""
    if (g["step"], g["num_steps_after"]) != (e["step"], e["num_steps_after"]):
        return ("the step index is wrong", f"the plan says step {g['step']} and the scheduler counted "
                f"{g['num_steps_after']} steps after it; expected step {e['step']} and {e['num_steps_after']}",
                _HINT["step_index"])
    recorded = {seq_id: n for seq_id, n in g["num_cached_tokens"]}
    took = {seq_id: n for seq_id, n in g["hits"]}
    if recorded != took:
        missing = sorted(set(took) - set(recorded))
        if missing:
            return ("an admission's prefix-cache hit is not recorded",
                    f"num_cached_tokens has no entry for seq {missing[0]} (its admission took {took[missing[0]]} "
                    f"cached tokens); recorded {recorded}", _HINT["cached_record"])
        extra = sorted(set(recorded) - set(took))
        if extra:
            return ("num_cached_tokens records a sequence that was not admitted",
                    f"seq {extra[0]} is recorded but not admitted in this step", _HINT["cached_record"])
        wrong = next(i for i in took if recorded[i] != took[i])
        return ("an admission's recorded prefix-cache hit is wrong",
                f"seq {wrong}: recorded {recorded[wrong]}, its admission took {took[wrong]} cached tokens",
                _HINT["cached_record"])
    return None


_PARTS = {1: _part1, 2: _part2, 3: _part3, 5: _part5}


def _judged(part: int, g: dict, e: dict) -> bool:
    """Whether a step is part ``part``'s to judge (see the table above)."""
    preempting = bool(g.get("preempted")) or bool(e["preempted"])
    if part == 1:
        return not preempting
    if part == 2:
        return not preempting and _part1(g, e) is None
    if part == 3:
        return preempting and not _limit(g, "tokens, budget")
    return True


def _judge_for(part: int):
    """The comparison of one part: the first step it judges where the learner's plan differs."""

    def compare(got, expected, runs):
        if type(got) is not list or len(got) != len(expected):
            return Mismatch("the check recorded the wrong number of runs")
        seen = {"steps": 0, "hit": 0, "zero": 0}
        for run, g_run, e_run in zip(runs, got, expected):
            where = _workload_text(run)
            if len(g_run["steps"]) != len(e_run["steps"]):
                return Mismatch("the check recorded the wrong number of steps")
            for k, (g, e) in enumerate(zip(g_run["steps"], e_run["steps"])):
                if not _judged(part, g, e) and not g["error"]:
                    continue
                if g["error"]:
                    return Mismatch(f"your schedule raised {g['error'].split(':', 1)[0]} at step {k}",
                                    _step_detail(where, k, g, e, f"it raised {g['error']}"),
                                    hint="read the error: it names the line of your schedule that raised.")
                if (part == 2 and e["admitted"]) or (part == 3 and e["preempted"]):
                    seen["steps"] += 1
                if part == 5:
                    seen["hit"] += sum(1 for _, n in g["hits"] if n > 0)
                    seen["zero"] += sum(1 for _, n in g["hits"] if n == 0)
                problem = _PARTS[part](g, e)
                if problem:
                    what, extra, hint = problem
                    return Mismatch(what, _step_detail(where, k, g, e, extra), hint=hint)
        if part in (2, 3) and not seen["steps"]:
            return Mismatch(f"part {part} could not be judged: no step of its workloads left part 1's rules intact",
                            "every step that " + ("admits" if part == 2 else "preempts") + " in the reference's "
                            "run also breaks part 1's rules in yours", hint="fix part 1 first.")
        if part == 5 and not (seen["hit"] and seen["zero"]):
            return Mismatch("the records could not be judged: your scheduler admitted no sequence "
                            + ("with a prefix-cache hit" if seen["zero"] else "at all"),
                            "these workloads share prompt prefixes, so the reference admits sequences with hits and "
                            "without", hint="fix part 2 (admission) first.")
        return None

    return compare


# --- simulated workloads ----------------------------------------------------------------------------

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
        # a pool too small for every whole prompt at once: chunks that fit are admitted, whole prompts would wait
        _run({"max_num_seqs": 4, "max_num_batched_tokens": 10, "block_size": 4, "num_blocks": 14}, 5,
             rng.randrange(10**6), None, (20, 40), (2, 4)),
    ]


def _chunked_random(rng: random.Random) -> list[dict]:
    runs = []
    for _ in range(4):
        chunked = rng.random() < 0.6
        out_max = rng.randint(2, 10)
        budget = rng.randint(4, 40) if chunked else rng.randint(40, 80)
        prompt_max = rng.randint(10, 80) if chunked else budget - out_max + 1
        block_size = rng.choice([2, 4, 16])
        need = -(-(prompt_max + out_max) // block_size)
        blocks = rng.choice([512, need + rng.randint(1, need)])  # some pools too small for every prompt at once
        runs.append(_run({"max_num_seqs": rng.randint(2, 10), "max_num_batched_tokens": budget,
                          "block_size": block_size, "num_blocks": blocks, "enable_chunked_prefill": chunked},
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


# part 5: the step's records (prefix caching on, so that admissions take hits of several sizes, and 0)

def _records_runs(rng: random.Random) -> list[dict]:
    return [
        _run({"max_num_seqs": 6, "max_num_batched_tokens": 32, "block_size": 4, "enable_prefix_caching": True},
             10, rng.randrange(10**6), 200.0, (10, 30), (2, 8), shared=12),
        _run({"max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4}, 6, rng.randrange(10**6), None,
             (4, 20), (2, 6)),
    ]


def _records_random(rng: random.Random) -> list[dict]:
    return [_run({"max_num_seqs": rng.randint(2, 8), "max_num_batched_tokens": rng.choice([8, 16, 64]),
                  "block_size": rng.choice([2, 4]), "enable_prefix_caching": True}, rng.randint(8, 14), rng.randrange(10**6),
                 rng.choice([None, 300.0]), (8, 30), (1, 8), shared=rng.choice([6, 10]))
            for _ in range(3)]


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

_HINTS["lab08.records"] = (
    "the plan is also a record of the step: it carries the index of the step it plans (one per call), and "
    "num_cached_tokens holds one entry for every admission, the prefix-cache hit found before admitting it, "
    f"0 included ({_CHUNKING_SECTION}).")
_HINTS["lab08.records_random"] = ("if the fixed workloads pass, look at readmissions and long runs: every "
                                  "admission is recorded, a readmitted victim's too.")

for check_id, part, make, note in (
        ("lab08.decode_first", 1, _decode_first_runs, ""),
        ("lab08.decode_first_random", 1, _decode_first_random, " Random configurations and arrival rates."),
        ("lab08.chunked_prefill", 2, _chunked_runs, ""),
        ("lab08.chunked_prefill_random", 2, _chunked_random, " Random budgets and pools, with and without chunked "
                                                              "prefill."),
        ("lab08.preemption", 3, _preemption_runs, ""),
        ("lab08.preemption_random", 3, _preemption_random, " Random tight pools, some with prefix caching."),
        ("lab08.records", 5, _records_runs, ""),
        ("lab08.records_random", 5, _records_random, " Random budgets with prefix caching.")):
    register(Check(
        check_id=check_id,
        task=_TASKS[1],
        reference=_reference,
        make_inputs=_with_reference_steps(make),
        drive=_drive_forced,
        compare=_judge_for(part),
        hint=_HINTS[check_id] + note,
    ))


# --- task 4: the real engine on a small random model ------------------------------------------------

def _tiny_prompts(rng: random.Random, count: int, shared_len: int) -> list[list[int]]:
    vocab = TINY["vocab_size"]
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


def _engine_prefix_case(rng: random.Random) -> dict:
    return {"seed": rng.randrange(10**6), "new_tokens": 6, "runs": [
        # prefix caching on a pool large enough for everyone: cache hits at admission, chunks of 8
        {"config": {"max_num_seqs": 4, "max_num_batched_tokens": 8, "block_size": 2, "num_blocks": 64,
                    "enable_prefix_caching": True}, "prompts": _tiny_prompts(rng, 4, 6)},
        {"config": {"max_num_seqs": 3, "max_num_batched_tokens": 64, "block_size": 4, "num_blocks": 64,
                    "enable_chunked_prefill": False}, "prompts": _tiny_prompts(rng, 3, 4)},
    ]}


def _engine_preemption_case(rng: random.Random) -> dict:
    return {"seed": rng.randrange(10**6), "new_tokens": 10, "runs": [
        {"config": {"max_num_seqs": 6, "max_num_batched_tokens": 32, "block_size": 2, "num_blocks": 14},
         "prompts": _tiny_prompts(rng, 6, 6)},  # a pool this small forces preemptions
        # prefix caching on a pool that small: cache hits at admission, and preemptions
        {"config": {"max_num_seqs": 6, "max_num_batched_tokens": 8, "block_size": 2, "num_blocks": 14,
                    "enable_prefix_caching": True}, "prompts": _tiny_prompts(rng, 6, 6)},
    ]}


def _drive_engine(schedule, case):
    from infra_lib.model.generation import greedy_decode
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving import LLMEngine
    from infra_lib.serving.engine import PlanRefused

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
        planning = _PlanWatch(engine.scheduler)
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
        except PlanRefused as exc:
            _record_refused(engine, exc, steps)
            result["violation"] = _engine_stopped(exc, "not every request finished within 2000 steps")
        except Exception as exc:  # noqa: BLE001 - whose error it is decides how it is reported
            if planning.inside or planning.last is None:
                raise  # raised by your schedule: reported as your code's error
            # Raised by the course's engine while it ran the plan your schedule returned: the plan is
            # the cause, so it is recorded and compared like any other step.
            steps.append(_record(engine, planning.last))
            result["violation"] = (f"step {planning.last.step}: the engine could not run the plan your scheduler "
                                   f"returned ({type(exc).__name__} in the course's engine: {exc})")
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
        where = (f"the small random model, {_describe_config(config)}, {len(run['prompts'])} prompts of "
                 f"{[len(p) for p in run['prompts']]} tokens, {case['new_tokens']} new tokens each")
        if g["violation"]:
            return _violation(g, e, where)
        for i, (tokens, want) in enumerate(zip(g["tokens"], e["contiguous"])):
            if tokens != want:
                return Mismatch("the engine driven by your scheduler generates other tokens than greedy decoding",
                                f"on {where}: request {i}: expected {want}, got {tokens}")
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
    "lab08.engine_prefix_cache":
        "the real engine computes exactly the positions each plan schedules, so a plan that skips or repeats "
        "positions gives other tokens than greedy decoding: a sequence admitted with a prefix-cache hit computes "
        "only what follows the cached blocks. If the simulated checks fail as well, fix those first.",
    "lab08.engine_preemption":
        "on a pool this small the engine preempts: a victim gives back its blocks and gets no tokens in that step, "
        "and once readmitted it recomputes its prompt and every token it had generated, so its tokens still equal "
        "greedy decoding; every request must finish. If the simulated checks fail as well, fix those first.",
}

for check_id, make, note in (
        ("lab08.engine_tiny_model", _engine_case, ""),
        ("lab08.engine_prefix_cache", _engine_prefix_case, " Prefix caching, and whole prompts."),
        ("lab08.engine_preemption", _engine_preemption_case, " Tight pools that force preemptions.")):
    register(Check(
        check_id=check_id,
        task=_TASKS[1],
        reference=_reference,
        make_inputs=make,
        drive=_drive_engine,
        compare=_compare_engine,
        hint=_ENGINE_HINTS[check_id] + note,
    ))
