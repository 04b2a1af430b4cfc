"""Lab 13's runs of ``run_graph`` on the course's stand-ins for ``next_node`` and ``call_with_retry``.

run_graph calls next_node (task 1) and call_with_retry (task 2). While a check of task 3 or 4 runs, the
learner's notebook sees the course's stand-ins under those two names, its helpers included, so a slip in
task 1 or 2 costs only that task. The stand-ins solve neither task: the next node comes from the spec the
check built the graph from, and a node's attempts and waits from the reference's own retries of that node,
recorded where the inputs are made ("retry_plans"). A call they cannot answer that way (a graph or a node
function the check did not make, a policy that is not the node's own) goes to the learner's own function,
and so does a run_graph that reaches its own versions some other way (another name, a default argument):
a failure then names them and their tasks.
"""

from __future__ import annotations

import contextlib
import random
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path

from grading.checks.common import reference
from grading.checks.lab13.graphs import ERRORS, RUNNER, TASKS, build_graph, plain_state, policy_object, typed_outcome


def reference_run(spec: dict, x: int, max_steps: int) -> dict:
    """The final state of the reference runner on the spec's graph from x, with no crash and no waits."""
    from infra_lib.apps.agents import MemoryCheckpointer
    from infra_lib.apps.agents.runner import run_graph

    return run_graph(
        build_graph(spec),
        {"x": x, "log": []},
        checkpointer=MemoryCheckpointer(),
        thread_id="t",
        max_steps=max_steps,
        sleep=lambda s: None,
    )


def _history(checkpointer, thread_id: str) -> list:
    return [
        [cp.step, cp.node, "END" if cp.next_node == _end() else cp.next_node, plain_state(cp.state)[1]]
        for cp in checkpointer.history(thread_id)
    ]


def _end():
    from infra_lib.apps.agents import END

    return END


_SIBLINGS = ("next_node", "call_with_retry")
# the tasks of the two functions the stand-ins replace, named when the learner's own ran instead
SIBLING_TASKS = {"next_node": TASKS[1], "call_with_retry": TASKS[2]}


def _retry_plans(case: dict) -> dict[str, list[list[float]]]:
    """For each flaky node of the case, the waits between the attempts of one call of it under its policy, by the
    number of planned failures left: the reference's call_with_retry on the node's planned errors. (The runner
    checks' policies retry named error classes, so an error nobody planned is never retried: it goes out of the
    stand-in at once, as out of the reference.)"""
    from infra_lib.apps.agents.retry import call_with_retry

    plans = {}
    for name, planned in (case.get("flaky") or {}).items():
        policy, plans[name] = policy_object(case["spec"]["nodes"][name].get("retry")), []
        for left in range(len(planned) + 1):
            errors, waits = list(planned[len(planned) - left :]), []

            def attempt(state: dict, errors=errors) -> dict:
                if errors:
                    raise ERRORS[errors.pop(0)]("planned")
                return {}

            with contextlib.suppress(Exception):
                call_with_retry(attempt, {}, policy, sleep=waits.append)
            plans[name].append([round(float(w), 9) for w in waits])
    return plans


def _first_run(case: dict) -> dict:
    """The first run of a resume case, as the reference runner makes it (crashing as planned): its outcome,
    node calls, waits and checkpoints, for the kernel to write into the thread."""
    from infra_lib.apps.agents import MemoryCheckpointer
    from infra_lib.apps.agents.runner import run_graph

    events, sleeps, checkpointer, given = [], [], MemoryCheckpointer(), {"x": case["x"], "log": []}
    graph = build_graph(case["spec"], events, crash_at_call=case.get("crash_at"), flaky=case.get("flaky"))
    got = typed_outcome(
        run_graph,
        graph,
        given,
        checkpointer=checkpointer,
        thread_id="t",
        max_steps=case["max_steps"],
        sleep=sleeps.append,
    )
    return {
        "outcome": [got[0], plain_state(got[1])[1]] if got[0] == "value" else got,
        "events": events,
        "sleeps": sleeps,
        "checkpoints": _history(checkpointer, "t"),
    }


def with_recorded_runs(make):
    """``make``'s cases, each with what the kernel replays instead of solving a task: the retries of its flaky
    nodes, and a resume case's first run."""

    def make_inputs(rng: random.Random) -> list[dict]:
        cases = make(rng)
        for case in cases:
            if is_resume_case(case):
                case["first_run"] = _first_run(case)
            elif case.get("flaky"):
                case["retry_plans"] = _retry_plans(case)
        return cases

    return make_inputs


def _replay_first_run(case: dict, checkpointer, events: list, sleeps: list) -> list:
    """Write the recorded first run's checkpoints into the thread; its outcome, as ``_outcome`` gives one."""
    from infra_lib.apps.agents import END, Checkpoint

    run = case["first_run"]
    for step, node, following, state in run["checkpoints"]:
        checkpointer.put(
            "t",
            Checkpoint(
                step=step,
                node=node,
                next_node=END if following == "END" else following,
                state={"x": state["x"], "log": list(state["log"])},
            ),
        )
    events.extend(run["events"])
    sleeps.extend(run["sleeps"])
    return list(run["outcome"])


class StandIns:
    """next_node and call_with_retry for one drive of the learner's run_graph (see above)."""

    def __init__(self, own: dict):
        self.own = own  # the learner's own functions, by name
        self.specs: dict[int, tuple] = {}  # id(graph) -> (graph, the spec it was built from)
        self.plans: dict[str, list] = {}

    def learn(self, graph, case: dict) -> None:
        self.specs[id(graph)] = (graph, case["spec"])
        self.plans = case.get("retry_plans") or {}

    def _own(self, name: str, *args, **kwargs):
        if name not in self.own:
            raise RuntimeError(
                f"the check cannot answer this {name} call for the course, and your notebook defines "
                f"no {name} of its own ({SIBLING_TASKS[name]})"
            )
        return self.own[name](*args, **kwargs)

    def next_node(self, graph, current, state):
        from infra_lib.apps.agents import END

        spec = self.specs.get(id(graph), (None, None))[1]
        if spec is None or not isinstance(current, str) or current not in {**spec["edges"], **spec["branches"]}:
            return self._own("next_node", graph, current, state)
        branch = spec["branches"].get(current)
        target = (
            spec["edges"][current]
            if branch is None
            else (branch["below"] if state["x"] < branch["limit"] else branch["above"])
        )  # what the spec's router answers
        return END if target == "END" else target

    def call_with_retry(self, fn, state, policy, sleep=time.sleep):
        name = getattr(fn, "course_node", None)
        if name is None or policy not in (None, fn.course_policy):
            return self._own("call_with_retry", fn, state, policy, sleep)
        left = fn.pending_failures()
        recorded = self.plans.get(name, [[]])
        if left >= len(recorded):
            return self._own("call_with_retry", fn, state, policy, sleep)
        for wait in recorded[left] if policy is not None else ():
            with contextlib.suppress(Exception):  # a planned failure the reference waited after
                return fn(state)
            sleep(wait)
        return fn(state)


@contextlib.contextmanager
def _course_siblings(run_graph) -> Iterator[tuple[set, StandIns]]:
    """While the block runs, next_node and call_with_retry in the namespace ``run_graph`` was defined in are
    the course's stand-ins (the learner's come back after it). Yields a set that collects the names of the
    learner's own versions that ran all the same, and the stand-ins, to learn each case's graph."""
    ran: set[str] = set()
    namespace = run_graph.__globals__ if isinstance(run_graph, types.FunctionType) else None
    if namespace is None:
        yield ran, StandIns({})
        return
    saved = {name: namespace[name] for name in _SIBLINGS if name in namespace}
    stand_ins = StandIns(saved)
    previous = sys.gettrace()

    def watch(frame, event, arg):  # called for each new frame; passes it on to a tracer already there
        if frame.f_code.co_name in _SIBLINGS and frame.f_globals is namespace:
            ran.add(frame.f_code.co_name)
        return previous(frame, event, arg) if previous is not None else None

    namespace.update({name: getattr(stand_ins, name) for name in _SIBLINGS})
    sys.settrace(watch)
    try:
        yield ran, stand_ins
    finally:
        if sys.gettrace() is watch:
            sys.settrace(previous)
        for name in _SIBLINGS:
            namespace.pop(name, None)
        namespace.update(saved)


def drive_run(run_graph, cases: list[dict]) -> list:
    """Each case run by ``run_graph`` (on the stand-ins, when it is not the reference): its record."""
    learner = run_graph is not reference(RUNNER, "run_graph")()  # the reference runs on its own next_node and retry
    results = []
    with _course_siblings(run_graph) if learner else contextlib.nullcontext((set(), None)) as (ran, stand_ins):
        for case in cases:
            ran.clear()
            with tempfile.TemporaryDirectory() as folder:
                record = _run_case(run_graph, case, Path(folder) / "checkpoints.sqlite", stand_ins)
            if ran:
                record["own_siblings"] = sorted(ran)
            results.append(record)
    return results


def is_resume_case(case: dict) -> bool:
    """Task 4's cases: the reference's recorded run makes the thread's checkpoints, the runner under test resumes it."""
    return case.get("crash_at") is not None or bool(case.get("rerun_finished"))


def _run_case(run_graph, case: dict, database: Path, stand_ins: StandIns | None = None) -> dict:
    """Run the case's graph, or in a resume case write the reference's first run (crashed as planned) into the
    thread and run the graph again on it.

    In a resume case the first run is the reference's, recorded with the inputs (``_first_run``), so that the
    checkpoints ``run_graph`` resumes from are right whatever it would have saved itself: the resume alone is
    judged. The second run is given another input state, which a resume ignores.
    """
    from infra_lib.apps.agents import MemoryCheckpointer, SqliteCheckpointer

    events, sleeps = [], []
    # With SQLite the second run gets a new checkpointer on the same file, as a restarted process would.
    new_checkpointer = (lambda: SqliteCheckpointer(database)) if case.get("sqlite") else None
    checkpointer = new_checkpointer() if new_checkpointer else MemoryCheckpointer()
    resume = is_resume_case(case)

    def run(graph, saver, given: dict) -> list:
        if stand_ins is not None:
            stand_ins.learn(graph, case)
        return typed_outcome(
            run_graph,
            graph,
            given,
            checkpointer=saver,
            thread_id="t",
            max_steps=case["max_steps"],
            sleep=lambda s: sleeps.append(s),
        )

    given = {"x": case["x"], "log": []}
    if resume:
        first = _replay_first_run(case, checkpointer, events, sleeps)
    else:
        first = run(build_graph(case["spec"], events, flaky=case.get("flaky")), checkpointer, given)
    record = {
        "first": plain_state(first[1]) if first[0] == "value" else first[:2],
        "events": list(events),
        "input_after": plain_state(given)[1],
    }
    if resume:
        record["history_first"] = _history(checkpointer, "t")
        events.clear()
        checkpointer = new_checkpointer() if new_checkpointer else checkpointer
        # A thread with a checkpoint ignores its input: this one would show if it were used.
        given = RESUME_INPUT if checkpointer.latest("t") is not None else {"x": case["x"], "log": []}
        given = {"x": given["x"], "log": list(given["log"])}
        second = run(build_graph(case["spec"], events), checkpointer, given)  # no crash: resume
        record["resumed"] = plain_state(second[1]) if second[0] == "value" else second[:2]
        record["resumed_events"] = list(events)
        record["input_after"] = plain_state(given)[1]
    record["history"] = _history(checkpointer, "t")
    record["sleeps"] = [round(float(s), 9) for s in sleeps]
    return record


RESUME_INPUT = {"x": 1000, "log": ["the input state of the second call"]}


def describe_run(case: dict) -> str:
    """A case as a failure message names it: the graph, the start, the crash, the flaky nodes, max_steps."""
    spec = case["spec"]
    ops = {
        "add": "{name}: x + {arg}",
        "mul": "{name}: x * {arg} + 1",
        "meddle": "{name}: changes the state it is handed in place (x += 1000, log.append('meddled')) and returns "
        "only its log entry",
    }
    parts = [ops[s["op"]].format(name=name, arg=s.get("arg")) for name, s in spec["nodes"].items()]
    edges = [f"{a} -> {b}" for a, b in spec["edges"].items()]
    edges += [f"{a} -> ({b['below']} if x < {b['limit']} else {b['above']})" for a, b in spec["branches"].items()]
    text = f"a graph with nodes [{'; '.join(parts)}] and edges [{', '.join(edges)}], start x={case['x']}"
    if case.get("crash_at") is not None:
        text += (
            f", a crash in node call {case['crash_at']} (in a run of the course's runner, which leaves the "
            "checkpoints a correct run_graph leaves), then your run_graph with the same thread_id"
        )
    elif case.get("rerun_finished"):
        text += ", a run of the course's runner to END, then your run_graph with the same thread_id"
    if case.get("flaky"):
        text += f", flaky nodes {case['flaky']}"
    return text + f", max_steps={case['max_steps']}"
