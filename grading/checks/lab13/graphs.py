"""Lab 13's graphs and retry policies, built from seeded plain-data specs with the course's ``StateGraph``:
nodes that add to or multiply a counter and append their name to a log, plain and conditional edges,
loops that end once the counter passes a limit, planned crashes and flaky nodes."""

from __future__ import annotations

import operator
import random
from typing import Annotated, TypedDict

from grading.checks.common import outcome

RUNNER, RETRY = "infra_lib.apps.agents.runner", "infra_lib.apps.agents.retry"  # the modules of the references
# task number -> the task as the stubs name it
TASKS = {
    1: "lab13 task 1: next_node",
    2: "lab13 task 2: call_with_retry",
    3: "lab13 task 3: run_graph",
    4: "lab13 task 4: resume after a crash",
}


class CounterState(TypedDict):
    x: int
    log: Annotated[list, operator.add]


class Crash(RuntimeError):
    """The planned failure of a crash case: never retried."""


class Flaky(ConnectionError):
    """A transient failure that retry policies retry."""


class Fatal(ValueError):
    """A failure no retry policy in these checks retries."""


ERRORS = {"Flaky": Flaky, "Fatal": Fatal, "TimeoutError": TimeoutError}


def typed_outcome(fn, *args, **kwargs) -> list:
    """``["value", result]`` or ``["raised", "Type", "Type: message"]``: the type is what is compared."""
    got = outcome(fn, *args, **kwargs)
    return ["raised", got[1].split(":", 1)[0], got[1]] if got[0] == "raised" else got


def graph_spec(rng: random.Random, n_nodes: int, loops: bool = True, mapping: bool = True) -> dict:
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
            other = (
                names[rng.randrange(0, i)]
                if loops and rng.random() < 0.6
                else (names[rng.randrange(i + 1, n_nodes)] if i + 2 < n_nodes else "END")
            )
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


def build_graph(spec: dict, events: list | None = None, crash_at_call: int | None = None, flaky: dict | None = None):
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
                raise ERRORS[flaky[name].pop(0)](f"{name} failed")
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
        node.course_policy = policy_object(node_spec.get("retry"))
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


def plain_state(state) -> list:
    """A state as plain data, ``["value", {"x": ..., "log": [...]}]``, or why it is not a state dict."""
    if not isinstance(state, dict):
        return ["malformed", f"a {type(state).__name__}, not a state dict"]
    return ["value", {"x": state.get("x"), "log": list(state.get("log", []))}]


# the lesson sections the hints point to
GRAPHS = "chapter 13, section “1 · A state graph: nodes, edges, reducers”"
LOOP = "chapter 13, section “2 · The runner loop”"
PREDICATE = "every error but Fatal"  # a policy's retry_on given as a predicate on the error, not classes


def random_policy(rng: random.Random, retry_on=("Flaky",)) -> dict:
    """``retry_on``: error names (a tuple of classes in the policy), or PREDICATE."""
    return {
        "max_attempts": rng.randint(2, 5),
        "initial_interval": rng.choice([0.1, 0.25, 0.5, 1.0]),
        "backoff_factor": rng.choice([1.0, 2.0, 3.0]),
        "max_interval": rng.choice([0.6, 2.0, 8.0]),
        "retry_on": retry_on if retry_on == PREDICATE else list(retry_on),
    }


def _not_fatal(error: BaseException) -> bool:
    return not isinstance(error, Fatal)


def policy_object(policy: dict | None):
    """The ``RetryPolicy`` a plain-data policy stands for (None: no policy)."""
    if policy is None:
        return None
    from infra_lib.apps.agents import RetryPolicy

    retry_on = _not_fatal if policy["retry_on"] == PREDICATE else tuple(ERRORS[e] for e in policy["retry_on"])
    return RetryPolicy(
        max_attempts=policy["max_attempts"],
        initial_interval=policy["initial_interval"],
        backoff_factor=policy["backoff_factor"],
        max_interval=policy["max_interval"],
        retry_on=retry_on,
    )


def counting_loop(limit: int) -> dict:
    """n0 -> n1, back to n0 while x < limit: each step adds 1, so the run takes ``limit`` steps from x = 0."""
    return {
        "nodes": {"n0": {"op": "add", "arg": 1}, "n1": {"op": "add", "arg": 1}},
        "edges": {"n0": "n1"},
        "branches": {"n1": {"limit": limit, "below": "n0", "above": "END"}},
        "entry": "n0",
    }
