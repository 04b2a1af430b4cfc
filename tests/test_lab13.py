"""Lab 13's checks: the instructor's runner passes every check, and the classic runner mistakes
fail with messages that name them (an unmapped router, an uncapped or miscounted backoff, a run
that never resumes, checkpoints of the wrong state, a loop without a step limit)."""

from __future__ import annotations

import operator
import time
from typing import Annotated, TypedDict

import pytest

from conftest import REPO, check_fails, solution_namespace
from grading import check

SOLUTION = REPO / "solutions" / "lab13_agents" / "lab13_agents.ipynb"
CHECKS = {"next_node": ["lab13.next_node", "lab13.next_node_errors"],
          "call_with_retry": ["lab13.call_with_retry", "lab13.call_with_retry_more"],
          "run_graph": ["lab13.run_graph", "lab13.run_graph_resume", "lab13.run_graph_resume_sqlite",
                        "lab13.run_graph_limits"]}


@pytest.fixture(scope="module")
def solution() -> dict:
    """The instructor's answers with the names the lab's setup cell imports."""
    import infra_lib.apps.agents as agents

    names = {name: getattr(agents, name) for name in ("END", "START", "Checkpoint", "GraphRecursionError",
                                                      "MemoryCheckpointer", "RetryPolicy", "StateGraph",
                                                      "merge_update")}
    return solution_namespace(SOLUTION, time=time, operator=operator, Annotated=Annotated, TypedDict=TypedDict,
                              **names)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_instructor_answers_pass_every_check(solution, name):
    for check_id in CHECKS[name]:
        check(check_id, solution[name])


def test_task1_a_router_without_its_mapping_is_caught(solution):
    def unmapped(graph, current, state):
        if current in graph.branches:
            return graph.branches[current][0](state)
        return graph.edges[current]

    assert "next_node picked the wrong edge" in check_fails("lab13.next_node", unmapped)


def test_task1_unknown_targets_and_dead_ends_must_raise(solution):
    def trusting(graph, current, state):
        if current in graph.branches:
            router, mapping = graph.branches[current]
            return mapping[router(state)] if mapping else router(state)
        return graph.edges.get(current, solution["END"])

    assert "next_node should raise ValueError here" in check_fails("lab13.next_node_errors", trusting)


def test_task2_an_uncapped_backoff_is_caught(solution):
    def uncapped(fn, state, policy, sleep=time.sleep):
        attempts = 1 if policy is None else policy.max_attempts
        for attempt in range(attempts):
            try:
                return fn(state)
            except Exception as error:
                if policy is None or not isinstance(error, policy.retry_on) or attempt == attempts - 1:
                    raise
                sleep(policy.initial_interval * policy.backoff_factor ** attempt)

    assert "call_with_retry slept the wrong backoff" in check_fails("lab13.call_with_retry", uncapped)


def test_task2_retrying_every_error_or_one_attempt_too_many_is_caught(solution):
    def retries_everything(fn, state, policy, sleep=time.sleep):
        attempts = 1 if policy is None else policy.max_attempts
        for attempt in range(attempts):
            try:
                return fn(state)
            except Exception:
                if attempt == attempts - 1:
                    raise
                sleep(min(policy.initial_interval * policy.backoff_factor ** attempt, policy.max_interval))

    def one_more(fn, state, policy, sleep=time.sleep):
        attempts = 1 if policy is None else policy.max_attempts + 1  # max_attempts retries after the first try
        for attempt in range(attempts):
            try:
                return fn(state)
            except Exception as error:
                if policy is None or not isinstance(error, policy.retry_on) or attempt == attempts - 1:
                    raise
                sleep(min(policy.initial_interval * policy.backoff_factor ** attempt, policy.max_interval))

    for wrong in (retries_everything, one_more):
        assert "call_with_retry made the wrong number of attempts" in check_fails("lab13.call_with_retry", wrong)


def _runner(solution, *, resume=True, checkpoint_before_merge=False, limit=True):
    """The instructor's runner with one mistake switched on."""
    END, Checkpoint = solution["END"], solution["Checkpoint"]

    def run_graph(graph, state, *, checkpointer, thread_id, max_steps=25, sleep=time.sleep):
        cp = checkpointer.latest(thread_id) if resume else None
        if cp is not None:
            state, node, step = cp.state, cp.next_node, cp.step
        else:
            state, node, step = dict(state), graph.entry, 0
        while node != END:
            if limit and step >= max_steps:
                raise solution["GraphRecursionError"](f"max_steps={max_steps}")
            spec = graph.nodes[node]
            update = solution["call_with_retry"](spec.fn, dict(state), spec.retry, sleep)
            before = state
            state = solution["merge_update"](state, update, graph.reducers)
            nxt = solution["next_node"](graph, node, state)
            step += 1
            saved = before if checkpoint_before_merge else state
            checkpointer.put(thread_id, Checkpoint(step=step, node=node, next_node=nxt, state=saved))
            node = nxt
        return state

    return run_graph


def test_task3_a_runner_that_never_resumes_is_caught(solution):
    text = check_fails("lab13.run_graph_resume", _runner(solution, resume=False))
    assert "the resumed run did not start from the last checkpoint" in text


def test_task3_checkpoints_of_the_old_state_are_caught(solution):
    text = check_fails("lab13.run_graph", _runner(solution, checkpoint_before_merge=True))
    assert "run_graph saved the wrong checkpoints" in text and "[step, node, next_node, state]" in text


def test_task3_a_loop_without_a_step_limit_is_caught(solution):
    text = check_fails("lab13.run_graph_limits", _runner(solution, limit=False))
    assert "run_graph should raise GraphRecursionError here" in text


def test_task3_the_reference_runner_agrees_with_the_compiled_graph(solution):
    """The checks' reference (run_graph) and the full runtime (CompiledGraph.invoke) end in the same state."""
    import random

    from grading.checks.lab13 import _graph_spec, build_graph
    from infra_lib.apps.agents import MemoryCheckpointer
    from infra_lib.apps.agents.runner import run_graph

    rng = random.Random(7)
    for _ in range(20):
        spec = _graph_spec(rng, rng.randint(2, 7))
        start = {"x": rng.randint(0, 5), "log": []}
        ours = run_graph(build_graph(spec), start, checkpointer=MemoryCheckpointer(), thread_id="t", max_steps=500)
        compiled = build_graph(spec).compile().invoke(start, max_steps=500)
        assert ours == compiled


def test_a_checkpoints_next_node_field_is_not_the_reference_function():
    from grading import tamper
    from grading.registry import shortcut_modules

    modules, names = shortcut_modules("lab13")
    field = "def run(checkpointer):\n    cp = checkpointer.latest('t')\n    return cp.next_node\n"
    assert tamper.scan(field, modules, names) == []
    module = "import infra_lib.apps.agents.runner as R\n\ndef next_node(g, c, s):\n    return R.next_node(g, c, s)\n"
    assert {f.kind for f in tamper.scan(module, modules, names)} == {tamper.SHORTCUT}
    shadowed = "import infra_lib.apps.agents.runner as R\n\ndef f(g):\n    R = R\n    return R.run_graph\n"
    assert {f.kind for f in tamper.scan(shadowed, modules, names)} == {tamper.SHORTCUT}
