"""Lab 13 task 1: ``next_node(graph, current, state)``, the edge a finished node takes."""

from __future__ import annotations

import random

from grading.checks.common import reference, unwrap
from grading.checks.lab13.graphs import GRAPHS, LOOP, RUNNER, TASKS, build_graph, graph_spec, typed_outcome
from grading.registry import Check, Mismatch, register


def _next_cases(rng: random.Random) -> list[dict]:
    cases = []
    for _ in range(4):
        spec = graph_spec(rng, rng.randint(3, 7))
        for name in spec["nodes"]:
            cases.append({"spec": spec, "current": name, "x": rng.randint(0, 45)})
    return cases


def _next_edge_cases(rng: random.Random) -> list[dict]:
    """A router that returns a name that is not a node, an answer its mapping lacks, and a node with no outgoing
    edge. ``culprit``: the bad value the ValueError must name."""
    spec = graph_spec(rng, 4, loops=False, mapping=False)
    spec["branches"] = {"n1": {"limit": 10, "below": "n9", "above": "n2"}}  # n9 does not exist
    spec["edges"].pop("n1", None)
    cases = [{"spec": spec, "current": "n1", "x": 3, "culprit": "n9"}, {"spec": spec, "current": "n1", "x": 30}]
    dead = graph_spec(rng, 3, loops=False, mapping=False)
    dead["edges"] = {"n0": "n1", "n1": "n2"}
    dead["branches"] = {}
    cases.append({"spec": dead, "current": "n2", "x": 1, "culprit": "n2"})
    mapped = graph_spec(rng, 5)
    mapped["branches"]["n2"] = {"limit": 20, "below": "n0", "above": "END", "mapping": {"small": "n0", "big": "END"}}
    mapped["edges"].pop("n2", None)
    cases += [{"spec": mapped, "current": "n2", "x": 19}, {"spec": mapped, "current": "n2", "x": 20}]
    lacking = graph_spec(rng, 4, loops=False)
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
        got = typed_outcome(next_node, build_graph(case["spec"]), case["current"], {"x": case["x"], "log": []})
        if got[0] == "value":
            got = (
                ["value", "END" if got[1] == END else got[1]]
                if isinstance(got[1], str)
                else ["malformed", f"{got[1]!r:.60} is not a node name"]
            )
        named = case["culprit"] in got[2] if got[0] == "raised" and "culprit" in case else None
        results.append({"outcome": got[:2], "named": named})
    return results


def _describe_next(case: dict) -> str:
    spec, name = case["spec"], case["current"]
    if name in spec["branches"]:
        b = spec["branches"][name]
        how = f"a conditional edge: x < {b['limit']} -> {b['below']!r}, else {b['above']!r}" + (
            f", through the mapping {b['mapping']}" if "mapping" in b else ""
        )
    elif name in spec["edges"]:
        how = f"a plain edge to {spec['edges'][name]!r}"
    else:
        how = "no outgoing edge"
    return f"node {name!r} with {how}, state x={case['x']}"


NEXT_MISSED = {
    "form": "the answer is the name of the node that runs next (a string), or END: never the router, the edge or "
    "the mapping itself.",
    "mapping": "when a conditional edge has a mapping, the router does not name a node: it answers with one of the "
    f"mapping's keys, and the mapping turns that key into the node that runs next ({GRAPHS}).",
    "router": "a conditional edge is decided by its router, on the state it is given (the state after the node "
    f"ran); a plain edge always leads to the same node ({LOOP}).",
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
            return Mismatch(
                "next_node must return a node name or END", f"on {where}: got {gv}", hint=NEXT_MISSED["form"]
            )
        if ek == "raised" and gk != "raised":
            dead_end = branch is None and case["current"] not in case["spec"]["edges"]
            return Mismatch(
                f"next_node should raise {ev} here",
                f"on {where}: got {gv!r}",
                hint=NEXT_MISSED["dead end" if dead_end else "unknown"],
            )
        if gk == "raised" and ek != "raised":
            return Mismatch(
                "next_node raised where it should return the next node",
                f"on {where}: {gv}",
                hint=NEXT_MISSED["mapping"] if mapped else "",
            )
        if gk == "raised" and gv != ev:
            return Mismatch(
                "next_node raised the wrong kind of exception",
                f"on {where}: expected {ev}, got {gv}",
                hint=NEXT_MISSED["kind"],
            )
        if e_record["named"] and not g_record["named"]:
            return Mismatch(
                "next_node's ValueError does not name the bad value",
                f"on {where}: the message should contain {case['culprit']!r}",
                hint=NEXT_MISSED["name"],
            )
        if gk == "value" and gv != ev:
            unmapped = mapped and gv in branch["mapping"]  # the router's own answer, not the node it names
            return Mismatch(
                "next_node picked the wrong edge",
                f"on {where}: expected {ev!r}, got {gv!r}",
                hint=NEXT_MISSED["mapping" if unmapped else "router"],
            )
    return None


_NEXT_HINT = (
    "a node has exactly one outgoing edge: a conditional edge's router chooses from the state after the node "
    "ran, and when the edge has a mapping the router answers with one of its keys, which the mapping turns "
    "into the next node; a plain edge always leads to the same node (chapter 13, section “2 · The runner "
    "loop”). The result must be END or a node of the graph: a target that is neither, an answer the "
    "mapping lacks, and a node with no outgoing edge (a dead end) all raise ValueError naming the bad "
    "value."
)
register(
    Check(
        check_id="lab13.next_node",
        task=TASKS[1],
        reference=reference(RUNNER, "next_node"),
        make_inputs=_next_cases,
        drive=_drive_next,
        compare=_compare_next,
        hint=_NEXT_HINT,
    )
)
register(
    Check(
        check_id="lab13.next_node_errors",
        task=TASKS[1],
        reference=reference(RUNNER, "next_node"),
        make_inputs=_next_edge_cases,
        drive=_drive_next,
        compare=_compare_next,
        hint=_NEXT_HINT + " Hidden cases: a router's unknown target, a dead end, a mapping at its limit, an "
        "answer the mapping lacks.",
    )
)
