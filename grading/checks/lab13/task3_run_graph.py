"""Lab 13 task 3: ``run_graph``, one node per step, reducers, checkpoints and the step limit."""

from __future__ import annotations

import random

from grading.checks.lab13.graphs import counting_loop, graph_spec, random_policy
from grading.checks.lab13.run_comparison import run_graph_parts
from grading.registry import Check, register


def _run_cases(rng: random.Random) -> list[dict]:
    cases = [{"spec": graph_spec(rng, rng.randint(2, 6)), "x": rng.randint(0, 5), "max_steps": 200} for _ in range(4)]
    retry = graph_spec(rng, 4, loops=False)
    retry["nodes"]["n1"]["retry"] = random_policy(rng)
    cases.append({"spec": retry, "x": 1, "max_steps": 200, "flaky": {"n1": ["Flaky"]}})
    meddling = graph_spec(rng, 4, loops=False)
    meddling["nodes"]["n0"] = {"op": "meddle"}  # the entry node changes the state it is handed, in place
    cases.append({"spec": meddling, "x": 2, "max_steps": 200})
    return cases


def _limit_cases(rng: random.Random) -> list[dict]:
    spec = graph_spec(rng, 4)
    spec["nodes"]["n2"]["retry"] = random_policy(rng)
    steps = 2 * rng.randint(2, 4)  # a run of exactly this many steps
    return [
        {"spec": counting_loop(600), "x": 0, "max_steps": rng.randint(5, 12)},  # it would end, much later
        {"spec": counting_loop(steps), "x": 0, "max_steps": steps},  # it needs exactly max_steps: it ends
        {"spec": counting_loop(steps), "x": 0, "max_steps": steps - 1},  # one step short
        {"spec": spec, "x": 0, "max_steps": 200, "flaky": {"n2": ["Flaky"] * 10}},  # retries run out
        {
            "spec": spec,
            "x": 0,
            "max_steps": 200,
            "flaky": {"n2": ["Flaky"] * (spec["nodes"]["n2"]["retry"]["max_attempts"] - 1)},
        },
    ]


_RUN_HINT = (
    "one step runs one node on a deep copy of the state under that node's own retry policy (waiting through "
    "the sleep argument), merges its update through the graph's reducers, chooses the next node from the "
    "merged state, and only then checkpoints the step count, the node, the next node and the whole state "
    "(chapter 13, section “2 · The runner loop”). A thread that already has a checkpoint continues from it "
    "rather than from the entry; at most max_steps steps run, and a node still due after that raises "
    "GraphRecursionError. A node whose retries run out ends the run with its exception; otherwise the final "
    "state is returned."
)

register(Check(check_id="lab13.run_graph", **run_graph_parts(3, _run_cases), hint=_RUN_HINT))
register(
    Check(
        check_id="lab13.run_graph_limits",
        **run_graph_parts(3, _limit_cases),
        hint=_RUN_HINT + " Hidden cases: a loop that never ends (max_steps), a run that needs exactly "
        "max_steps steps and one that needs one more, a node whose retries run out.",
    )
)
