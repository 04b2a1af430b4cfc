"""Checks for lab 13 (the graph runner): the learner writes ``next_node(graph, current, state)``,
``call_with_retry(fn, state, policy, sleep)`` and ``run_graph(graph, state, *, checkpointer,
thread_id, max_steps, sleep)``: execute a node, merge its update, pick the next edge, checkpoint,
retry with exponential backoff, and resume from the last checkpoint.

Graphs are built from seeded plain-data specs with the course's ``StateGraph``: nodes that add to
or multiply a counter and append their name to a log (a reducer), plain edges, conditional edges
whose routers compare the counter with a limit (some through a mapping), and loops that end once
the counter passes a limit. Flaky functions fail a planned number of times with planned exception
types; ``sleep`` is replaced by a recorder, so the backoff sequence is compared exactly and no
check waits. A crash is a planned exception at step k of a run of the reference runner, recorded where the
inputs are made (in the grader's process when the kernel is sandboxed): its checkpoints, node calls
and waits are what a correct runner leaves. The learner's kernel only writes those checkpoints into
the thread, and the learner's run_graph then resumes it and must end in the same state as an
uninterrupted run, re-running only the node that crashed. So task 4 judges the resume alone, and a
checkpoint mistake costs task 3 only.

Each task is scored on its own: while a check of task 3 or 4 runs, the learner's notebook sees the
course's stand-ins for ``next_node`` and ``call_with_retry`` under those names, so a slip in task 1
or 2 costs only that task. The stand-ins answer from the check's own plain data, never by the
tasks' rules: the next node from the graph's spec, and a node's attempts and waits from the
reference's retries of that node, recorded with the inputs. A failure's hint is chosen by the
mistake the comparison found.
"""

from __future__ import annotations

import contextlib
import operator
import random
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, TypedDict

from grading.checks.common import first_difference, outcome, unwrap
from grading.registry import Check, Mismatch, register, register_shortcuts

_AGENTS = "infra_lib.apps.agents"

register_shortcuts("lab13", [f"{_AGENTS}.runner:next_node", f"{_AGENTS}.runner:run_graph",
                             f"{_AGENTS}.retry:call_with_retry", f"{_AGENTS}.retry:backoff_delays"])

_TASKS = {1: "lab13 task 1: next_node", 2: "lab13 task 2: call_with_retry", 3: "lab13 task 3: run_graph",
          4: "lab13 task 4: resume after a crash"}


class CounterState(TypedDict):
    x: int
    log: Annotated[list, operator.add]


class Crash(RuntimeError):
    """The planned failure of a crash case: never retried."""


class Flaky(ConnectionError):
    """A transient failure that retry policies retry."""


class Fatal(ValueError):
    """A failure no retry policy in these checks retries."""


_ERRORS = {"Flaky": Flaky, "Fatal": Fatal, "TimeoutError": TimeoutError}


def _outcome(fn, *args, **kwargs) -> list:
    """``["value", result]`` or ``["raised", "Type", "Type: message"]``: the type is what is compared."""
    got = outcome(fn, *args, **kwargs)
    return ["raised", got[1].split(":", 1)[0], got[1]] if got[0] == "raised" else got


# --- graphs from plain-data specs --------------------------------------------------------------------

def _graph_spec(rng: random.Random, n_nodes: int, loops: bool = True, mapping: bool = True) -> dict:
    """Nodes n0..n{k-1} in a chain; some nodes branch on the counter (forward, or back for a loop)."""
    names = [f"n{i}" for i in range(n_nodes)]
    nodes = {}
    for name in names:
        op = rng.choice(["add", "add", "mul"])
        nodes[name] = {"op": op, "arg": rng.randint(1, 4) if op == "add" else rng.randint(2, 3)}
    edges, branches = {}, {}
    for i, name in enumerate(names):
        forward = names[i + 1] if i + 1 < n_nodes else "END"
        if i >= 1 and rng.random() < 0.5:
            other = names[rng.randrange(0, i)] if loops and rng.random() < 0.6 else (
                names[rng.randrange(i + 1, n_nodes)] if i + 2 < n_nodes else "END")
            limit = rng.randint(8, 40)
            branch = {"limit": limit, "below": other, "above": forward}
            if mapping and rng.random() < 0.5:
                branch["mapping"] = {"small": other, "big": forward}
            branches[name] = branch
        else:
            edges[name] = forward
    return {"nodes": nodes, "edges": edges, "branches": branches, "entry": names[0]}


def _apply(spec: dict, x: int) -> int:
    """Every node but a meddler raises x, so every loop (which has no meddler) ends once x passes its limit."""
    if spec["op"] == "meddle":
        return x
    return x + spec["arg"] if spec["op"] == "add" else x * spec["arg"] + 1


MEDDLED = "meddled"  # what a meddling node appends, in place, to the log of the state it is handed


def build_graph(spec: dict, events: list | None = None, crash_at_call: int | None = None,
                flaky: dict | None = None):
    """The course's ``StateGraph`` for ``spec``.

    ``events`` collects every node call; the call numbered ``crash_at_call`` (0-based) raises
    ``Crash``; ``flaky[name]`` is a list of error names the node raises on its first calls.
    """
    from infra_lib.apps.agents import END, START, StateGraph

    calls = {"count": 0}
    flaky = {name: list(errors) for name, errors in (flaky or {}).items()}
    graph = StateGraph(CounterState)

    def make_node(name: str, node_spec: dict):
        def node(state: dict) -> dict:
            number = calls["count"]
            calls["count"] += 1
            if events is not None:
                events.append(name)
            if crash_at_call is not None and number == crash_at_call:
                raise Crash(f"planned crash in {name} (call {number})")
            if flaky.get(name):
                raise _ERRORS[flaky[name].pop(0)](f"{name} failed")
            if node_spec["op"] == "meddle":  # changes what it was handed, in place; returns only its log entry
                state["x"] += 1000
                state["log"].append(MEDDLED)
                return {"log": [name]}
            return {"x": _apply(node_spec, state["x"]), "log": [name]}

        # what the checks' stand-in for call_with_retry needs to find this node's recorded retries
        node.course_node, node.pending_failures = name, lambda: len(flaky.get(name) or ())
        return node

    for name, node_spec in spec["nodes"].items():
        node = make_node(name, node_spec)
        node.course_policy = _policy_object(node_spec.get("retry"))
        graph.add_node(name, node, retry=node.course_policy)
    graph.add_edge(START, spec["entry"])
    resolve = lambda target: END if target == "END" else target  # noqa: E731
    for name, target in spec["edges"].items():
        graph.add_edge(name, resolve(target))
    for name, branch in spec["branches"].items():
        def router(state: dict, branch=branch):
            below = state["x"] < branch["limit"]
            if "mapping" in branch:
                return "small" if below else "big"
            return resolve(branch["below"] if below else branch["above"])

        mapping = None if "mapping" not in branch else {k: resolve(v) for k, v in branch["mapping"].items()}
        graph.add_conditional_edges(name, router, mapping)
    return graph


def _plain_state(state) -> list:
    if not isinstance(state, dict):
        return ["malformed", f"a {type(state).__name__}, not a state dict"]
    return ["value", {"x": state.get("x"), "log": list(state.get("log", []))}]


# --- task 1: next_node ---------------------------------------------------------------------------------

def _next_cases(rng: random.Random) -> list[dict]:
    cases = []
    for _ in range(4):
        spec = _graph_spec(rng, rng.randint(3, 7))
        for name in spec["nodes"]:
            cases.append({"spec": spec, "current": name, "x": rng.randint(0, 45)})
    return cases


def _next_edge_cases(rng: random.Random) -> list[dict]:
    """A router that returns a name that is not a node, an answer its mapping lacks, and a node with no outgoing
    edge. ``culprit``: the bad value the ValueError must name."""
    spec = _graph_spec(rng, 4, loops=False, mapping=False)
    spec["branches"] = {"n1": {"limit": 10, "below": "n9", "above": "n2"}}  # n9 does not exist
    spec["edges"].pop("n1", None)
    cases = [{"spec": spec, "current": "n1", "x": 3, "culprit": "n9"},
             {"spec": spec, "current": "n1", "x": 30}]
    dead = _graph_spec(rng, 3, loops=False, mapping=False)
    dead["edges"] = {"n0": "n1", "n1": "n2"}
    dead["branches"] = {}
    cases.append({"spec": dead, "current": "n2", "x": 1, "culprit": "n2"})
    mapped = _graph_spec(rng, 5)
    mapped["branches"]["n2"] = {"limit": 20, "below": "n0", "above": "END", "mapping": {"small": "n0", "big": "END"}}
    mapped["edges"].pop("n2", None)
    cases += [{"spec": mapped, "current": "n2", "x": 19}, {"spec": mapped, "current": "n2", "x": 20}]
    lacking = _graph_spec(rng, 4, loops=False)
    lacking["branches"] = {"n1": {"limit": 15, "below": "n0", "above": "n2", "mapping": {"small": "n0"}}}  # no "big"
    lacking["edges"].pop("n1", None)
    cases += [{"spec": lacking, "current": "n1", "x": 4}, {"spec": lacking, "current": "n1", "x": 15, "culprit": "big"}]
    return cases


def _drive_next(next_node, cases: list[dict]) -> list:
    """Per case, the outcome (the error's type when it raised) and, for a case with a culprit, whether the
    error's message names it."""
    from infra_lib.apps.agents import END

    results = []
    for case in cases:
        got = _outcome(next_node, build_graph(case["spec"]), case["current"], {"x": case["x"], "log": []})
        if got[0] == "value":
            got = ["value", "END" if got[1] == END else got[1]] if isinstance(got[1], str) else \
                ["malformed", f"{got[1]!r:.60} is not a node name"]
        named = case["culprit"] in got[2] if got[0] == "raised" and "culprit" in case else None
        results.append({"outcome": got[:2], "named": named})
    return results


def _describe_next(case: dict) -> str:
    spec, name = case["spec"], case["current"]
    if name in spec["branches"]:
        b = spec["branches"][name]
        how = (f"a conditional edge: x < {b['limit']} -> {b['below']!r}, else {b['above']!r}"
               + (f", through the mapping {b['mapping']}" if "mapping" in b else ""))
    elif name in spec["edges"]:
        how = f"a plain edge to {spec['edges'][name]!r}"
    else:
        how = "no outgoing edge"
    return f"node {name!r} with {how}, state x={case['x']}"


_GRAPHS = "chapter 13, section “1 · A state graph: nodes, edges, reducers”"
_LOOP = "chapter 13, section “2 · The runner loop”"
_NEXT_MISSED = {
    "form": "the answer is the name of the node that runs next (a string), or END: never the router, the edge or "
            "the mapping itself.",
    "mapping": "when a conditional edge has a mapping, the router does not name a node: it answers with one of the "
               f"mapping's keys, and the mapping turns that key into the node that runs next ({_GRAPHS}).",
    "router": "a conditional edge is decided by its router, on the state it is given (the state after the node "
              f"ran); a plain edge always leads to the same node ({_LOOP}).",
    "unknown": "a router's answer is checked against the graph: one that is neither END nor a node (nor, with a "
               "mapping, one of its keys) must fail loudly with ValueError, not send the run to a node that does "
               "not exist.",
    "dead end": "a node with no outgoing edge is a dead end, a mistake in the graph, and raises ValueError: a run "
                "stops only where an edge leads to END.",
    "kind": "every malformed edge (an unknown target, an answer the mapping lacks, a dead end) raises ValueError, "
            "the one kind of error a caller catches for a broken graph.",
    "name": "an error about a broken graph names what is wrong in it: the target that is not a node, the answer "
            "the mapping lacks, the node that is a dead end, so that the person who reads it knows what to fix.",
}


def _compare_next(got, expected, cases) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from next_node, got {got!r:.80}")
    for case, g_record, e_record in zip(cases, got, expected):
        where = _describe_next(case)
        branch = case["spec"]["branches"].get(case["current"])
        mapped = branch is not None and "mapping" in branch
        g, e = g_record["outcome"], e_record["outcome"]
        (gk, gv), (ek, ev) = unwrap(g), unwrap(e)
        if gk == "malformed":
            return Mismatch("next_node must return a node name or END", f"on {where}: got {gv}",
                            hint=_NEXT_MISSED["form"])
        if ek == "raised" and gk != "raised":
            dead_end = branch is None and case["current"] not in case["spec"]["edges"]
            return Mismatch(f"next_node should raise {ev} here", f"on {where}: got {gv!r}",
                            hint=_NEXT_MISSED["dead end" if dead_end else "unknown"])
        if gk == "raised" and ek != "raised":
            return Mismatch("next_node raised where it should return the next node", f"on {where}: {gv}",
                            hint=_NEXT_MISSED["mapping"] if mapped else "")
        if gk == "raised" and gv != ev:
            return Mismatch("next_node raised the wrong kind of exception", f"on {where}: expected {ev}, got {gv}",
                            hint=_NEXT_MISSED["kind"])
        if e_record["named"] and not g_record["named"]:
            return Mismatch("next_node's ValueError does not name the bad value",
                            f"on {where}: the message should contain {case['culprit']!r}", hint=_NEXT_MISSED["name"])
        if gk == "value" and gv != ev:
            unmapped = mapped and gv in branch["mapping"]  # the router's own answer, not the node it names
            return Mismatch("next_node picked the wrong edge", f"on {where}: expected {ev!r}, got {gv!r}",
                            hint=_NEXT_MISSED["mapping" if unmapped else "router"])
    return None


_NEXT_HINT = ("a node has exactly one outgoing edge: a conditional edge's router chooses from the state after the node "
              "ran, and when the edge has a mapping the router answers with one of its keys, which the mapping turns "
              "into the next node; a plain edge always leads to the same node (chapter 13, section “2 · The runner "
              "loop”). The result must be END or a node of the graph: a target that is neither, an answer the "
              "mapping lacks, and a node with no outgoing edge (a dead end) all raise ValueError naming the bad "
              "value.")
register(Check(check_id="lab13.next_node", task=_TASKS[1], reference=lambda: _ref("runner", "next_node"),
               make_inputs=_next_cases, drive=_drive_next, compare=_compare_next, hint=_NEXT_HINT))
register(Check(check_id="lab13.next_node_errors", task=_TASKS[1], reference=lambda: _ref("runner", "next_node"),
               make_inputs=_next_edge_cases, drive=_drive_next, compare=_compare_next,
               hint=_NEXT_HINT + " Hidden cases: a router's unknown target, a dead end, a mapping at its limit, an "
                                 "answer the mapping lacks."))


def _ref(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(f"{_AGENTS}.{module}"), name)


# --- task 2: call_with_retry ---------------------------------------------------------------------------

PREDICATE = "every error but Fatal"  # a policy's retry_on given as a predicate on the error, not classes


def _policy(rng: random.Random, retry_on=("Flaky",)) -> dict:
    """``retry_on``: error names (a tuple of classes in the policy), or PREDICATE."""
    return {"max_attempts": rng.randint(2, 5), "initial_interval": rng.choice([0.1, 0.25, 0.5, 1.0]),
            "backoff_factor": rng.choice([1.0, 2.0, 3.0]), "max_interval": rng.choice([0.6, 2.0, 8.0]),
            "retry_on": retry_on if retry_on == PREDICATE else list(retry_on)}


def _retried(policy: dict, error: str) -> bool:
    """Whether the policy (as plain data) retries the error of that name."""
    return error != "Fatal" if policy["retry_on"] == PREDICATE else error in policy["retry_on"]


def _not_fatal(error: BaseException) -> bool:
    return not isinstance(error, Fatal)


def _retry_cases(rng: random.Random) -> list[dict]:
    cases = []
    policy = _policy(rng)
    cases.append({"policy": policy, "errors": []})  # succeeds at once
    cases.append({"policy": policy, "errors": ["Flaky"] * (policy["max_attempts"] - 1)})  # succeeds last
    cases.append({"policy": policy, "errors": ["Flaky"] * policy["max_attempts"]})  # exhausted
    cases.append({"policy": _policy(rng), "errors": ["Fatal"]})  # not retried
    cases.append({"policy": {**_policy(rng), "max_attempts": 6, "initial_interval": 0.5, "backoff_factor": 2.0,
                             "max_interval": 3.0}, "errors": ["Flaky"] * 5})  # the cap
    cases.append({"policy": None, "errors": ["Flaky"]})  # no policy: one attempt
    cases.append({"policy": {**_policy(rng, retry_on=PREDICATE), "max_attempts": 5},  # retry_on as a predicate
                  "errors": ["TimeoutError", "Flaky", "Fatal"]})
    return cases


def _retry_more_cases(rng: random.Random) -> list[dict]:
    policy = _policy(rng, retry_on=("Flaky", "TimeoutError"))
    return [{"policy": policy, "errors": ["TimeoutError", "Flaky"]},
            {"policy": policy, "errors": ["Flaky", "Fatal"]},  # a fatal error after a retry stops at once
            {"policy": {**policy, "max_attempts": 1}, "errors": ["Flaky"]},
            {"policy": None, "errors": []},
            {"policy": {**_policy(rng), "max_attempts": 8, "backoff_factor": 2.0, "max_interval": 1.0},
             "errors": ["Flaky"] * 7},
            {"policy": {**_policy(rng, retry_on=PREDICATE), "max_attempts": 3}, "errors": ["Flaky"] * 3}]


def _policy_object(policy: dict | None):
    if policy is None:
        return None
    from infra_lib.apps.agents import RetryPolicy

    retry_on = _not_fatal if policy["retry_on"] == PREDICATE else tuple(_ERRORS[e] for e in policy["retry_on"])
    return RetryPolicy(max_attempts=policy["max_attempts"], initial_interval=policy["initial_interval"],
                       backoff_factor=policy["backoff_factor"], max_interval=policy["max_interval"],
                       retry_on=retry_on)


def _drive_retry(call_with_retry, cases: list[dict]) -> list:
    results = []
    for case in cases:
        errors, calls, sleeps = list(case["errors"]), [], []

        def fn(state: dict) -> dict:
            calls.append(dict(state))
            if errors:
                raise _ERRORS[errors.pop(0)](f"attempt {len(calls)} failed")
            return {"x": state["x"] + 1}

        got = _outcome(call_with_retry, fn, {"x": 1, "log": []}, _policy_object(case["policy"]),
                       sleep=lambda seconds: sleeps.append(seconds))
        # an error is kept with its message ("Flaky: attempt 3 failed"): the last attempt's error must come back
        result = ["value", got[1] if isinstance(got[1], dict) else repr(got[1])] if got[0] == "value" else \
            ["raised", got[2]]
        results.append({"result": result, "attempts": len(calls), "sleeps": [round(float(s), 9) for s in sleeps]})
    return results


def _describe_retry(case: dict) -> str:
    policy = case["policy"]
    errors = ", ".join(case["errors"]) or "nothing"
    if policy is None:
        return f"policy=None, fn raising {errors} before it succeeds"
    retry_on = (f"<a predicate: {PREDICATE}>" if policy["retry_on"] == PREDICATE
                else f"({', '.join(policy['retry_on'])},)")
    return (f"RetryPolicy(max_attempts={policy['max_attempts']}, initial_interval={policy['initial_interval']}, "
            f"backoff_factor={policy['backoff_factor']}, max_interval={policy['max_interval']}, retry_on="
            f"{retry_on}), fn raising {errors} on its first calls (Flaky is a ConnectionError, Fatal a "
            "ValueError)")


_BACKOFF = "chapter 13, section “7 · Retries with exponential backoff, under a flaky tool”"
_RETRY_MISSED = {
    "count": "max_attempts counts every call of fn, the first one included: it is not the number of retries "
             f"({_BACKOFF}).",
    "retry_on": "only the errors the policy retries are passing failures worth another attempt (its retry_on "
                "names exception classes, or is a predicate on the error); any other error is a bug, and it goes "
                "to the caller at once, before any wait.",
    "no policy": "no policy means a single attempt: nothing is retried and nothing is waited for.",
    "cap": f"every wait is capped at the policy's max_interval, however many failures came before ({_BACKOFF}).",
    "between": "a wait comes only between two attempts: none before the first call, none after the last one.",
    "growth": "the waits grow geometrically: the first failure waits the initial interval, and each later wait is "
              f"backoff_factor times the one before, up to the cap ({_BACKOFF}).",
    "ending": "the first attempt that succeeds ends the call with fn's own result; when the attempts run out, the "
              "last error goes to the caller unchanged, never swallowed or replaced.",
}


def _attempts_hint(case: dict, got: int, expected: int) -> str:
    if case["policy"] is None:
        return _RETRY_MISSED["no policy"]
    stopped_by = case["errors"][expected - 1] if expected <= len(case["errors"]) else None
    if got > expected and stopped_by is not None and not _retried(case["policy"], stopped_by):
        return _RETRY_MISSED["retry_on"]
    if case["policy"]["retry_on"] == PREDICATE:  # the cases before it got the count right
        return _RETRY_MISSED["retry_on"]
    return _RETRY_MISSED["count"]


def _sleeps_hint(case: dict, got: list, expected: list) -> str:
    policy = case["policy"]
    if len(got) != len(expected):
        return _RETRY_MISSED["between"]
    uncapped = [round(policy["initial_interval"] * policy["backoff_factor"] ** i, 9) for i in range(len(got))]
    return _RETRY_MISSED["cap" if got == uncapped else "growth"]


def _compare_retry(got, expected, cases) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        where = _describe_retry(case)
        if g["attempts"] != e["attempts"]:
            return Mismatch("call_with_retry made the wrong number of attempts",
                            f"on {where}: expected {e['attempts']} calls of fn, got {g['attempts']}",
                            hint=_attempts_hint(case, g["attempts"], e["attempts"]))
        if g["sleeps"] != e["sleeps"]:
            return Mismatch("call_with_retry slept the wrong backoff",
                            f"on {where}: expected sleep() with {e['sleeps']}, got {g['sleeps']}",
                            hint=_sleeps_hint(case, g["sleeps"], e["sleeps"]))
        (gk, gv), (ek, ev) = g["result"][:2], e["result"][:2]
        if gk == ek == "raised" and gv.split(":")[0] == ev.split(":")[0] and gv != ev:
            return Mismatch("call_with_retry re-raised an earlier attempt's error",
                            f"on {where}: expected the last attempt's error, {ev}, got {gv}",
                            hint=_RETRY_MISSED["ending"])
        if gk != ek or gv != ev:
            said = {"value": "returned {}", "raised": "raised {}"}
            return Mismatch("call_with_retry ended the wrong way",
                            f"on {where}: expected it to {said[ek].format(ev)}, it {said.get(gk, '{}').format(gv)}",
                            hint=_RETRY_MISSED["ending"])
    return None


_RETRY_HINT = ("max_attempts counts every call of fn, the first included, and a wait comes only between two attempts; "
               "the waits grow geometrically from the first interval (exponential backoff), and each is capped at the "
               "policy's maximum (chapter 13, section “7 · Retries with exponential backoff, under a flaky tool”). "
               "Only the errors the policy retries are retried (retry_on: exception classes, or a predicate on the "
               "error): any other is re-raised at once, the last one is re-raised when the attempts run out, and no "
               "policy means a single attempt. Wait only through the "
               "sleep argument, never time.sleep: the checks pass a recorder and compare every delay exactly.")
register(Check(check_id="lab13.call_with_retry", task=_TASKS[2], reference=lambda: _ref("retry", "call_with_retry"),
               make_inputs=_retry_cases, drive=_drive_retry, compare=_compare_retry, hint=_RETRY_HINT))
register(Check(check_id="lab13.call_with_retry_more", task=_TASKS[2],
               reference=lambda: _ref("retry", "call_with_retry"), make_inputs=_retry_more_cases, drive=_drive_retry,
               compare=_compare_retry,
               hint=_RETRY_HINT + " Hidden cases: two retried error types, a fatal error after a retry, one attempt, "
                                  "a long run of failures against the cap, and a predicate that runs out of "
                                  "attempts."))


# --- task 3: run_graph ------------------------------------------------------------------------------------

def _run_cases(rng: random.Random) -> list[dict]:
    cases = [{"spec": _graph_spec(rng, rng.randint(2, 6)), "x": rng.randint(0, 5), "max_steps": 200}
             for _ in range(4)]
    retry = _graph_spec(rng, 4, loops=False)
    retry["nodes"]["n1"]["retry"] = _policy(rng)
    cases.append({"spec": retry, "x": 1, "max_steps": 200, "flaky": {"n1": ["Flaky"]}})
    meddling = _graph_spec(rng, 4, loops=False)
    meddling["nodes"]["n0"] = {"op": "meddle"}  # the entry node changes the state it is handed, in place
    cases.append({"spec": meddling, "x": 2, "max_steps": 200})
    return cases


def _resume_cases(rng: random.Random) -> list[dict]:
    spec = _graph_spec(rng, 5)
    steps = len(_reference_run(spec, 2, 200)["log"])
    cases = [{"spec": spec, "x": 2, "max_steps": 200, "crash_at": k} for k in range(0, steps, max(1, steps // 6))]
    cases.append({"spec": spec, "x": 2, "max_steps": 200, "crash_at": steps - 1})
    cases.append({"spec": spec, "x": 2, "max_steps": 200, "crash_at": None, "rerun_finished": True})
    # The steps before the crash count towards max_steps: a loop that would run for long stops max_steps steps after
    # its start, not max_steps steps after the resume (where exactly is task 3's check: see _resume_mismatch).
    max_steps = rng.randint(8, 12)
    cases.append({"spec": _counting_loop(600), "x": 0, "max_steps": max_steps, "crash_at": rng.randint(3, max_steps - 3)})
    return cases


def _sqlite_resume_cases(rng: random.Random) -> list[dict]:
    """A crash at every step of a graph with a flaky node, checkpoints in SQLite, resumed by a new checkpointer."""
    spec = _graph_spec(rng, 6)
    spec["nodes"]["n3"]["retry"] = _policy(rng)
    steps = len(_reference_run(spec, 1, 200)["log"])
    return [{"spec": spec, "x": 1, "max_steps": 200, "crash_at": k, "sqlite": True, "flaky": {"n3": ["Flaky"]}}
            for k in range(steps)]


def _counting_loop(limit: int) -> dict:
    """n0 -> n1, back to n0 while x < limit: each step adds 1, so the run takes ``limit`` steps from x = 0."""
    return {"nodes": {"n0": {"op": "add", "arg": 1}, "n1": {"op": "add", "arg": 1}},
            "edges": {"n0": "n1"}, "branches": {"n1": {"limit": limit, "below": "n0", "above": "END"}}, "entry": "n0"}


def _limit_cases(rng: random.Random) -> list[dict]:
    spec = _graph_spec(rng, 4)
    spec["nodes"]["n2"]["retry"] = _policy(rng)
    steps = 2 * rng.randint(2, 4)  # a run of exactly this many steps
    return [{"spec": _counting_loop(600), "x": 0, "max_steps": rng.randint(5, 12)},  # it would end, much later
            {"spec": _counting_loop(steps), "x": 0, "max_steps": steps},  # it needs exactly max_steps: it ends
            {"spec": _counting_loop(steps), "x": 0, "max_steps": steps - 1},  # one step short
            {"spec": spec, "x": 0, "max_steps": 200, "flaky": {"n2": ["Flaky"] * 10}},  # retries run out
            {"spec": spec, "x": 0, "max_steps": 200,
             "flaky": {"n2": ["Flaky"] * (spec["nodes"]["n2"]["retry"]["max_attempts"] - 1)}}]


def _reference_run(spec: dict, x: int, max_steps: int) -> dict:
    from infra_lib.apps.agents import MemoryCheckpointer
    from infra_lib.apps.agents.runner import run_graph

    return run_graph(build_graph(spec), {"x": x, "log": []}, checkpointer=MemoryCheckpointer(), thread_id="t",
                     max_steps=max_steps, sleep=lambda s: None)


def _history(checkpointer, thread_id: str) -> list:
    return [[cp.step, cp.node, "END" if cp.next_node == _end() else cp.next_node, _plain_state(cp.state)[1]]
            for cp in checkpointer.history(thread_id)]


def _end():
    from infra_lib.apps.agents import END

    return END


# --- tasks 3 and 4: run_graph on the course's stand-ins for next_node and call_with_retry ----------------
#
# run_graph calls next_node (task 1) and call_with_retry (task 2). While a check of task 3 or 4 runs, the
# learner's notebook sees the course's stand-ins under those two names, its helpers included, so a slip in
# task 1 or 2 costs only that task. The stand-ins solve neither task: the next node comes from the spec the
# check built the graph from, and a node's attempts and waits from the reference's own retries of that node,
# recorded where the inputs are made ("retry_plans"). A call they cannot answer that way (a graph or a node
# function the check did not make, a policy that is not the node's own) goes to the learner's own function,
# and so does a run_graph that reaches its own versions some other way (another name, a default argument):
# a failure then names them and their tasks.

_SIBLINGS = ("next_node", "call_with_retry")
_SIBLING_TASKS = {"next_node": _TASKS[1], "call_with_retry": _TASKS[2]}


def _retry_plans(case: dict) -> dict[str, list[list[float]]]:
    """For each flaky node of the case, the waits between the attempts of one call of it under its policy, by the
    number of planned failures left: the reference's call_with_retry on the node's planned errors. (The runner
    checks' policies retry named error classes, so an error nobody planned is never retried: it goes out of the
    stand-in at once, as out of the reference.)"""
    from infra_lib.apps.agents.retry import call_with_retry

    plans = {}
    for name, planned in (case.get("flaky") or {}).items():
        policy, plans[name] = _policy_object(case["spec"]["nodes"][name].get("retry")), []
        for left in range(len(planned) + 1):
            errors, waits = list(planned[len(planned) - left:]), []

            def attempt(state: dict, errors=errors) -> dict:
                if errors:
                    raise _ERRORS[errors.pop(0)]("planned")
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
    got = _outcome(run_graph, graph, given, checkpointer=checkpointer, thread_id="t", max_steps=case["max_steps"],
                   sleep=sleeps.append)
    return {"outcome": [got[0], _plain_state(got[1])[1]] if got[0] == "value" else got, "events": events,
            "sleeps": sleeps, "checkpoints": _history(checkpointer, "t")}


def _with_recorded_runs(make):
    """``make``'s cases, each with what the kernel replays instead of solving a task: the retries of its flaky
    nodes, and a resume case's first run."""

    def make_inputs(rng: random.Random) -> list[dict]:
        cases = make(rng)
        for case in cases:
            if _is_resume_case(case):
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
        checkpointer.put("t", Checkpoint(step=step, node=node, next_node=END if following == "END" else following,
                                         state={"x": state["x"], "log": list(state["log"])}))
    events.extend(run["events"])
    sleeps.extend(run["sleeps"])
    return list(run["outcome"])


class _StandIns:
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
            raise RuntimeError(f"the check cannot answer this {name} call for the course, and your notebook defines "
                               f"no {name} of its own ({_SIBLING_TASKS[name]})")
        return self.own[name](*args, **kwargs)

    def next_node(self, graph, current, state):
        from infra_lib.apps.agents import END

        spec = self.specs.get(id(graph), (None, None))[1]
        if spec is None or not isinstance(current, str) or current not in {**spec["edges"], **spec["branches"]}:
            return self._own("next_node", graph, current, state)
        branch = spec["branches"].get(current)
        target = spec["edges"][current] if branch is None else (
            branch["below"] if state["x"] < branch["limit"] else branch["above"])  # what the spec's router answers
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
def _course_siblings(run_graph) -> Iterator[tuple[set, _StandIns]]:
    """While the block runs, next_node and call_with_retry in the namespace ``run_graph`` was defined in are
    the course's stand-ins (the learner's come back after it). Yields a set that collects the names of the
    learner's own versions that ran all the same, and the stand-ins, to learn each case's graph."""
    ran: set[str] = set()
    namespace = run_graph.__globals__ if isinstance(run_graph, types.FunctionType) else None
    if namespace is None:
        yield ran, _StandIns({})
        return
    saved = {name: namespace[name] for name in _SIBLINGS if name in namespace}
    stand_ins = _StandIns(saved)
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


def _drive_run(run_graph, cases: list[dict]) -> list:
    learner = run_graph is not _ref("runner", "run_graph")  # the reference runs on its own next_node and retry
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


def _is_resume_case(case: dict) -> bool:
    """Task 4's cases: the reference's recorded run makes the thread's checkpoints, the runner under test resumes it."""
    return case.get("crash_at") is not None or bool(case.get("rerun_finished"))


def _run_case(run_graph, case: dict, database: Path, stand_ins: _StandIns | None = None) -> dict:
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
    resume = _is_resume_case(case)

    def run(graph, saver, given: dict) -> list:
        if stand_ins is not None:
            stand_ins.learn(graph, case)
        return _outcome(run_graph, graph, given, checkpointer=saver, thread_id="t", max_steps=case["max_steps"],
                        sleep=lambda s: sleeps.append(s))

    given = {"x": case["x"], "log": []}
    if resume:
        first = _replay_first_run(case, checkpointer, events, sleeps)
    else:
        first = run(build_graph(case["spec"], events, flaky=case.get("flaky")), checkpointer, given)
    record = {"first": _plain_state(first[1]) if first[0] == "value" else first[:2], "events": list(events),
              "input_after": _plain_state(given)[1]}
    if resume:
        record["history_first"] = _history(checkpointer, "t")
        events.clear()
        checkpointer = new_checkpointer() if new_checkpointer else checkpointer
        # A thread with a checkpoint ignores its input: this one would show if it were used.
        given = RESUME_INPUT if checkpointer.latest("t") is not None else {"x": case["x"], "log": []}
        given = {"x": given["x"], "log": list(given["log"])}
        second = run(build_graph(case["spec"], events), checkpointer, given)  # no crash: resume
        record["resumed"] = _plain_state(second[1]) if second[0] == "value" else second[:2]
        record["resumed_events"] = list(events)
        record["input_after"] = _plain_state(given)[1]
    record["history"] = _history(checkpointer, "t")
    record["sleeps"] = [round(float(s), 9) for s in sleeps]
    return record


RESUME_INPUT = {"x": 1000, "log": ["the input state of the second call"]}


def _describe_run(case: dict) -> str:
    spec = case["spec"]
    ops = {"add": "{name}: x + {arg}", "mul": "{name}: x * {arg} + 1",
           "meddle": "{name}: changes the state it is handed in place (x += 1000, log.append('meddled')) and returns "
                     "only its log entry"}
    parts = [ops[s["op"]].format(name=name, arg=s.get("arg")) for name, s in spec["nodes"].items()]
    edges = [f"{a} -> {b}" for a, b in spec["edges"].items()]
    edges += [f"{a} -> ({b['below']} if x < {b['limit']} else {b['above']})" for a, b in spec["branches"].items()]
    text = f"a graph with nodes [{'; '.join(parts)}] and edges [{', '.join(edges)}], start x={case['x']}"
    if case.get("crash_at") is not None:
        text += (f", a crash in node call {case['crash_at']} (in a run of the course's runner, which leaves the "
                 "checkpoints a correct run_graph leaves), then your run_graph with the same thread_id")
    elif case.get("rerun_finished"):
        text += (", a run of the course's runner to END, then your run_graph with the same thread_id")
    if case.get("flaky"):
        text += f", flaky nodes {case['flaky']}"
    return text + f", max_steps={case['max_steps']}"


_RESUME = "chapter 13, section “5 · Crash and resume from an SQLite checkpoint”"
_RESUME_HINT = ("a second call with the same checkpointer and thread_id takes everything from the thread's latest "
                "checkpoint, not from the input state: its state, its step count and the node it had chosen next, "
                "which is the node that crashed, so that node runs again and no finished node runs twice "
                f"({_RESUME}). A thread whose latest checkpoint leads to END has finished and returns its state "
                "without running anything.")
_RUN_MISSED = {
    "limit": "a run is bounded by max_steps, the steps taken before a resume included: once that many steps "
             "have run, a node still due ends the run with GraphRecursionError, so a loop whose exit never comes "
             f"cannot run forever, while a run that needs exactly max_steps steps finishes ({_LOOP}).",
    "gives up": "a node whose retries run out ends the whole run with its own error, unchanged; the checkpoints "
                "saved before it stay, ready for a resume.",
    "reducers": "a key with a reducer combines the old value with the node's update (the log grows step by step); "
                f"only the other keys are overwritten ({_GRAPHS}).",
    "order": "one node runs per step, exactly once (through its retry policy): the entry node first, then the node "
             f"that the finished node's edge picks from the state with its update merged ({_LOOP}).",
    "retry": "each node runs under its own retry policy (none: a single attempt), and every wait goes through the "
             "sleep argument the run was given.",
    "after merge": "a checkpoint is taken once its step is complete: it holds the state with that step's update "
                   "merged, so that a resume neither loses nor repeats what the step did "
                   f"({_LOOP}).",
    "steps": "a checkpoint's step is the number of steps completed so far, this one included, and the count "
             "goes on across a resume.",
    "next": "a checkpoint names the node chosen to run next (END after the last one): that is where a resume "
            f"starts ({_RESUME}).",
    "every step": "there is exactly one checkpoint per completed step, the last one included, so that a finished "
                  "thread is seen to be finished and a crash loses at most the step that was running.",
    "resume": _RESUME_HINT,
    "copy": "a node is handed a deep copy of the state, one that shares nothing with the run's own: a new dict "
            "alone still holds the same lists, so a node that appends to one in place changes the run's state; "
            f"whatever a node does to what it is handed, only the update it returns reaches the state ({_LOOP}).",
    "input": "the state dict the caller passes in is never changed, not even a list inside it: the run works on its "
             "own state, and every merge makes a new dict.",
}


def _own_siblings_hint(names: list[str]) -> str:
    own = " and ".join(f"{name} ({_SIBLING_TASKS[name]})" for name in names)
    return (f"this check runs the course's next_node and call_with_retry in place of yours, so that run_graph is "
            f"judged on its own, but your run_graph still reached your own {own} some other way than by that name "
            "(another name, a default argument), so a mistake there shows here too: get that task's checks to "
            "pass first; if they pass, the difference is in run_graph itself.")


def _state_hint(got, expected) -> str:
    same_x = isinstance(got, dict) and got.get("x") == expected["x"]
    return _RUN_MISSED["reducers"] if same_x and got.get("log") != expected["log"] else ""


def _checkpoints_hint(got: list, expected: list, first: int, start: dict) -> str:
    if first >= min(len(got), len(expected)):
        return _RUN_MISSED["every step"]
    g, e = got[first], expected[first]
    before_the_step = expected[first - 1][3] if first and len(e) > 3 else start
    if len(e) > 3 and g[3] != e[3] and g[3] == before_the_step:
        return _RUN_MISSED["after merge"]
    if g[0] != e[0]:
        return _RUN_MISSED["steps"]
    return _RUN_MISSED["next"] if g[2] != e[2] else ""


CHECKPOINT_FIELDS = ("step", "node", "next_node", "state")


def _checkpoints_mismatch(got: list, expected: list, where: str, start: dict, when: str,
                          fields: int = 4) -> Mismatch | None:
    """The first checkpoint that differs, and in which of its fields; ``fields=3`` leaves the states out."""
    got, expected = [c[:fields] for c in got], [c[:fields] for c in expected]
    if got == expected:
        return None
    first = first_difference(got, expected)
    names = ", ".join(CHECKPOINT_FIELDS[:fields])
    count = (f"{len(got)} checkpoints [{names}] as expected" if len(got) == len(expected) else
             f"{len(got)} checkpoints [{names}] where {len(expected)} were expected")
    if first < min(len(got), len(expected)):
        differs = " and ".join(name for name, g, e in zip(CHECKPOINT_FIELDS, got[first], expected[first]) if g != e)
        which = (f"checkpoint {first} is the first that differs, in its {differs}: expected {expected[first]}, "
                 f"got {got[first]}")
    elif len(got) < len(expected):
        which = f"the first {first} are right, then checkpoint {first} is missing: expected {expected[first]}"
    else:
        which = f"the first {first} are right, then comes one too many: {got[first]}"
    return Mismatch("run_graph saved the wrong checkpoints", f"on {where}: {when}, {count}; {which}",
                    hint=_checkpoints_hint(got, expected, first, start))


def _meddled(got, expected, where: str) -> Mismatch | None:
    """The node that changes its state in place reached the run's state: which copy was missing."""
    if not isinstance(got, dict) or got == expected:
        return None
    if isinstance(got.get("x"), int) and isinstance(expected.get("x"), int) and got["x"] >= expected["x"] + 1000:
        how = "its x += 1000 reached the run's state: the node was handed the run's own state dict"
    elif MEDDLED in (got.get("log") or []):
        how = ("its log.append('meddled') reached the run's state: the node was handed a new dict that still "
               "holds the run's lists")
    else:
        return None
    return Mismatch("a node's change to the state it was handed reached the run's state",
                    f"on {where}: {how}; expected the final state {expected!r:.160}, got {got!r:.160}",
                    hint=_RUN_MISSED["copy"])


def _limit_mismatch(g: dict, e: dict, case: dict, where: str) -> Mismatch | None:
    """Both runs stopped at max_steps, after different numbers of node calls."""
    if e["first"][:2] != ["raised", "GraphRecursionError"] or g["events"] == e["events"]:
        return None
    return Mismatch("run_graph stopped at a different step limit",
                    f"on {where}: with max_steps={case['max_steps']} the run should make {len(e['events'])} node "
                    f"calls ({e['events']}) and then raise GraphRecursionError; yours made {len(g['events'])} "
                    f"({g['events']})", hint=_RUN_MISSED["limit"])


def _input_mismatch(g: dict, e: dict, where: str, which: str) -> Mismatch | None:
    if g.get("input_after") == e["input_after"]:
        return None
    return Mismatch("run_graph changed the state dict it was given",
                    f"on {where}: the {which} was {e['input_after']!r:.120} before the call and "
                    f"{g.get('input_after')!r:.120} after it", hint=_RUN_MISSED["input"])


def _run_mismatch(g: dict, e: dict, case: dict) -> Mismatch | None:
    if _is_resume_case(case):
        return _resume_mismatch(g, e, case)
    where, start = _describe_run(case), {"x": case["x"], "log": []}
    (gk, gv), (ek, ev) = g["first"][:2], e["first"][:2]
    wrong = (_meddled(gv, ev, where) if gk == ek == "value" else None) or _input_mismatch(g, e, where, "input state")
    if wrong:
        return wrong
    if [gk, gv] != [ek, ev]:
        if ek == "raised":
            return Mismatch(f"run_graph should raise {ev} here", f"on {where}: got {gv!r:.200}",
                            hint=_RUN_MISSED["limit" if ev == "GraphRecursionError" else "gives up"])
        if gk == "raised" and gv == "GraphRecursionError":
            return Mismatch("run_graph stopped at max_steps where it should finish",
                            f"on {where}: the run needs {len(e['events'])} steps, within max_steps="
                            f"{case['max_steps']}, and should end in {ev!r:.200}; yours raised GraphRecursionError "
                            f"after {len(g['events'])} node calls", hint=_RUN_MISSED["limit"])
        if gk == "raised":
            return Mismatch("run_graph raised where it should finish", f"on {where}: expected {ev!r:.200}, got {gv}")
        if gk != "value":
            return Mismatch("run_graph must return the final state, a dict", f"on {where}: got {gv}")
        return Mismatch("run_graph ended in the wrong state", f"on {where}: expected {ev!r:.200}, got {gv!r:.200}",
                        hint=_state_hint(gv, ev))
    wrong = _limit_mismatch(g, e, case, where)
    if wrong:
        return wrong
    if g["events"] != e["events"]:
        return Mismatch("run_graph ran the nodes in the wrong order",
                        f"on {where}: expected the calls {e['events']}, got {g['events']}", hint=_RUN_MISSED["order"])
    if g["sleeps"] != e["sleeps"]:
        return Mismatch("run_graph did not retry as the node's policy says",
                        f"on {where}: expected sleep() with {e['sleeps']}, got {g['sleeps']}",
                        hint=_RUN_MISSED["retry"])
    return _checkpoints_mismatch(g["history"], e["history"], where, start, "after the run")


def _resume_mismatch(g: dict, e: dict, case: dict) -> Mismatch | None:
    """Task 4: the course's runner made the checkpoints, the runner under test resumed from them. What its
    resumed run saved is compared without the states: a checkpoint of the wrong state is task 3's."""
    where, start = _describe_run(case), {"x": case["x"], "log": []}
    wrong = _input_mismatch(g, e, where, "input state of the second call")
    if wrong:
        return wrong
    (gk, gv), (ek, ev) = g.get("resumed", [None, None])[:2], e["resumed"][:2]
    stopped = ek == gk == "raised" and ev == gv == "GraphRecursionError"
    if stopped and abs(len(g.get("resumed_events") or []) - len(e["resumed_events"])) <= 1:
        return None  # the steps before the crash were counted; the exact step limit is task 3's check
    made = len(g.get("resumed_events") or [])
    if [gk, gv] != [ek, ev] and ek == "raised" and ev == "GraphRecursionError":
        return Mismatch("the resumed run did not stop at max_steps",
                        f"on {where}: the {case['crash_at']} steps before the crash count, so the resumed run should "
                        f"stop after {len(e['resumed_events'])} more node calls with GraphRecursionError; yours made "
                        f"{made} and {'raised ' + str(gv) if gk == 'raised' else 'returned ' + repr(gv)[:120]}",
                        hint=_RUN_MISSED["limit"])
    if stopped:
        return Mismatch("the resumed run did not count the steps taken before the crash",
                        f"on {where}: with max_steps={case['max_steps']} and {case['crash_at']} steps done before the "
                        f"crash, the resumed run should make {len(e['resumed_events'])} node calls and then raise "
                        f"GraphRecursionError; yours made {made}", hint=_RUN_MISSED["limit"])
    if g.get("resumed_events") != e["resumed_events"]:
        return Mismatch("the resumed run did not start from the last checkpoint",
                        f"on {where}: expected it to call {e['resumed_events']}, it called {g.get('resumed_events')}",
                        hint=_RUN_MISSED["resume"])
    if [gk, gv] != [ek, ev]:
        return Mismatch("the resumed run ended in the wrong state",
                        f"on {where}: expected {ev!r:.200}, got {gv!r:.200}", hint=_RUN_MISSED["resume"])
    return _checkpoints_mismatch(g["history"], e["history"], where, start, "after the resumed run", fields=3)


def _compare_run(got, expected, cases) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        wrong = _run_mismatch(g, e, case)
        if wrong and g.get("own_siblings"):
            names = g["own_siblings"]
            return Mismatch(f"{wrong.what}; your run_graph ran your own {' and '.join(names)}, not the course's",
                            wrong.detail, hint=_own_siblings_hint(names))
        if wrong:
            return wrong
    return None


_RUN_HINT = ("one step runs one node on a deep copy of the state under that node's own retry policy (waiting through the "
             "sleep argument), merges its update through the graph's reducers, chooses the next node from the merged "
             "state, and only then checkpoints the step count, the node, the next node and the whole state (chapter "
             "13, section “2 · The runner loop”). A thread that already has a checkpoint continues from it rather "
             "than from the entry; at most max_steps steps run, and a node still due after that raises "
             "GraphRecursionError. A node whose retries run out ends the run with its exception; otherwise the final "
             "state is returned.")
register(Check(check_id="lab13.run_graph", task=_TASKS[3], reference=lambda: _ref("runner", "run_graph"),
               make_inputs=_with_recorded_runs(_run_cases), drive=_drive_run, compare=_compare_run, hint=_RUN_HINT))
register(Check(check_id="lab13.run_graph_resume", task=_TASKS[4], reference=lambda: _ref("runner", "run_graph"),
               make_inputs=_with_recorded_runs(_resume_cases), drive=_drive_run, compare=_compare_run, hint=_RESUME_HINT))
register(Check(check_id="lab13.run_graph_resume_sqlite", task=_TASKS[4], reference=lambda: _ref("runner", "run_graph"),
               make_inputs=_with_recorded_runs(_sqlite_resume_cases), drive=_drive_run, compare=_compare_run,
               hint=_RESUME_HINT + " Hidden cases: a crash at every step of a graph with a flaky node, checkpoints in "
                                   "SQLite, and the second run on a new SqliteCheckpointer over the same file."))
register(Check(check_id="lab13.run_graph_limits", task=_TASKS[3], reference=lambda: _ref("runner", "run_graph"),
               make_inputs=_with_recorded_runs(_limit_cases), drive=_drive_run, compare=_compare_run,
               hint=_RUN_HINT + " Hidden cases: a loop that never ends (max_steps), a run that needs exactly "
                                "max_steps steps and one that needs one more, a node whose retries run out."))
