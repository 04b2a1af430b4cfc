"""Lab 13's checks: the instructor's runner passes every check, and the classic runner mistakes
fail with messages and hints that name them (an unmapped router, an uncapped or miscounted backoff,
a run that never resumes, checkpoints of the wrong state, a loop without a step limit). Each task is
scored on its own: the checks of tasks 3 and 4 run the learner's run_graph on the course's next_node
and call_with_retry, so a slip in task 1 or 2 costs only that task, as whole gradings show."""

from __future__ import annotations

import copy
import operator
import time
from typing import Annotated, TypedDict

import pytest
from conftest import REPO, answer_cells, check_fails, solution_namespace, write_learner_notebook

from grading import check
from grading.checks.lab13.run_comparison import RUN_MISSED
from grading.checks.lab13.task1_next_node import NEXT_MISSED
from grading.checks.lab13.task2_call_with_retry import RETRY_MISSED

SOLUTION = REPO / "solutions" / "lab13_agents" / "lab13_agents.ipynb"
LAB = REPO / "labs" / "lab13_agents" / "lab13_agents.ipynb"
CHECKS = {
    "next_node": ["lab13.next_node", "lab13.next_node_errors"],
    "call_with_retry": ["lab13.call_with_retry", "lab13.call_with_retry_more"],
    "run_graph": [
        "lab13.run_graph",
        "lab13.run_graph_resume",
        "lab13.run_graph_resume_sqlite",
        "lab13.run_graph_limits",
    ],
}


# The points of each task's test cell.
POINTS = {1: 3.0, 2: 4.0, 3: 3.0, 4: 3.0}

# Typical mistakes, as edits (old text, new text) of the instructor's answer cells.
UNMAPPED = {
    "task1_next_node": [
        (
            """        if mapping is not None:
            if choice not in mapping:
                raise ValueError(f"the router of {current!r} returned {choice!r}, not a key of {sorted(mapping)}")
            choice = mapping[choice]
""",
            "",
        )
    ]
}  # the router's answer is taken for the node
UNCAPPED = {
    "task2_call_with_retry": [
        (
            "sleep(min(policy.initial_interval * policy.backoff_factor ** attempt, policy.max_interval))",
            "sleep(policy.initial_interval * policy.backoff_factor ** attempt)",
        )
    ]
}
RETRIES_EVERY_ERROR = {"task2_call_with_retry": [("not policy.should_retry(error) or ", "")]}
CLASSES_ONLY = {"task2_call_with_retry": [("not policy.should_retry(error)", "not isinstance(error, policy.retry_on)")]}
RERAISES_THE_FIRST = {
    "task2_call_with_retry": [
        (
            "            if policy is None or not policy.should_retry(error) or attempt == attempts - 1:\n          "
            "      raise\n",
            "            first = first if attempt else error\n"
            "            if policy is None or not policy.should_retry(error) or attempt == attempts - 1:\n"
            "                raise first\n",
        )
    ]
}
MAPPING_UNCHECKED = {
    "task1_next_node": [
        (
            """            if choice not in mapping:
                raise ValueError(f"the router of {current!r} returned {choice!r}, not a key of {sorted(mapping)}")
""",
            "",
        )
    ]
}  # the mapping's KeyError goes out as it is
DEAD_END_UNNAMED = {
    "task1_next_node": [
        (
            'raise ValueError(f"node {current!r} has no outgoing edge: a dead end")',
            'raise ValueError("a node has no outgoing edge")',
        )
    ]
}
CHECKPOINTS_BEFORE_MERGE = {
    "task3_run_graph": [
        ("        state = merge_update(", "        before, state = state, merge_update("),
        ("next_node=nxt, state=state)", "next_node=nxt, state=before)"),
    ]
}
NEVER_RESUMES = {"task3_run_graph": [("cp = checkpointer.latest(thread_id)", "cp = None")]}
SHALLOW_COPY = {"task3_run_graph": [("copy.deepcopy(state), spec.retry", "dict(state), spec.retry")]}
NO_COPY = {"task3_run_graph": [("copy.deepcopy(state), spec.retry", "state, spec.retry")]}
ONE_STEP_TOO_MANY = {"task3_run_graph": [("if step >= max_steps:", "if step > max_steps:")]}
ONE_STEP_TOO_FEW = {"task3_run_graph": [("if step >= max_steps:", "if step >= max_steps - 1:")]}
COUNTS_FROM_THE_RESUME = {
    "task3_run_graph": [  # max_steps counted from this call, not from the thread's start
        (
            "    while node != END:\n        if step >= max_steps:",
            "    taken = 0\n    while node != END:\n        if taken >= max_steps:",
        ),
        ("        step += 1\n", "        step += 1\n        taken += 1\n"),
    ]
}
INPUT_OVER_THE_CHECKPOINT = {
    "task3_run_graph": [
        (
            "state, node, step = cp.state, cp.next_node, cp.step",
            "state, node, step = {**cp.state, **state}, cp.next_node, cp.step",
        )
    ]
}


def _answers(*mistakes: dict) -> dict[str, str]:
    """The instructor's answer cells (by grade_id) with the mistakes' edits made."""
    answers = answer_cells(SOLUTION)
    for mistake in mistakes:
        for grade_id, edits in mistake.items():
            for old, new in edits:
                assert answers[grade_id].count(old) == 1, f"{grade_id} has no single {old!r}"
                answers[grade_id] = answers[grade_id].replace(old, new)
    return answers


def _setup_names() -> dict:
    """The names the lab's setup cell gives the answer cells."""
    import infra_lib.apps.agents as agents

    names = {
        name: getattr(agents, name)
        for name in (
            "END",
            "START",
            "Checkpoint",
            "GraphRecursionError",
            "MemoryCheckpointer",
            "RetryPolicy",
            "StateGraph",
            "merge_update",
        )
    }
    return {"time": time, "operator": operator, "Annotated": Annotated, "TypedDict": TypedDict, **names}


def _namespace(tmp_path, *mistakes: dict) -> dict:
    """The answer cells with these mistakes, run in one namespace as the notebook runs them."""
    notebook = write_learner_notebook(tmp_path / SOLUTION.name, _answers(*mistakes), base=SOLUTION)
    return solution_namespace(notebook, **_setup_names())


@pytest.fixture(scope="module")
def solution() -> dict:
    """The instructor's answers with the names the lab's setup cell imports."""
    return solution_namespace(SOLUTION, **_setup_names())


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_instructor_answers_pass_every_check(solution, name):
    for check_id in CHECKS[name]:
        check(check_id, solution[name])


def test_task1_a_router_without_its_mapping_is_caught(solution):
    def unmapped(graph, current, state):
        if current in graph.branches:
            return graph.branches[current][0](state)
        return graph.edges[current]

    text = check_fails("lab13.next_node", unmapped)
    assert "next_node picked the wrong edge" in text and f"hint: {NEXT_MISSED['mapping']}" in text


def test_task1_unknown_targets_and_dead_ends_must_raise(solution):
    def trusting(graph, current, state):
        if current in graph.branches:
            router, mapping = graph.branches[current]
            return mapping[router(state)] if mapping else router(state)
        return graph.edges.get(current, solution["END"])

    text = check_fails("lab13.next_node_errors", trusting)
    assert "next_node should raise ValueError here" in text and f"hint: {NEXT_MISSED['unknown']}" in text


def test_task2_an_uncapped_backoff_is_caught(solution):
    def uncapped(fn, state, policy, sleep=time.sleep):
        attempts = 1 if policy is None else policy.max_attempts
        for attempt in range(attempts):
            try:
                return fn(state)
            except Exception as error:
                if policy is None or not policy.should_retry(error) or attempt == attempts - 1:
                    raise
                sleep(policy.initial_interval * policy.backoff_factor**attempt)

    text = check_fails("lab13.call_with_retry", uncapped)
    assert "call_with_retry slept the wrong backoff" in text and f"hint: {RETRY_MISSED['cap']}" in text


def test_task2_retrying_every_error_or_one_attempt_too_many_is_caught(solution):
    def retries_everything(fn, state, policy, sleep=time.sleep):
        attempts = 1 if policy is None else policy.max_attempts
        for attempt in range(attempts):
            try:
                return fn(state)
            except Exception:
                if attempt == attempts - 1:
                    raise
                sleep(min(policy.initial_interval * policy.backoff_factor**attempt, policy.max_interval))

    def one_more(fn, state, policy, sleep=time.sleep):
        attempts = 1 if policy is None else policy.max_attempts + 1  # max_attempts retries after the first try
        for attempt in range(attempts):
            try:
                return fn(state)
            except Exception as error:
                if policy is None or not policy.should_retry(error) or attempt == attempts - 1:
                    raise
                sleep(min(policy.initial_interval * policy.backoff_factor**attempt, policy.max_interval))

    for wrong, missed in ((retries_everything, "retry_on"), (one_more, "count")):
        text = check_fails("lab13.call_with_retry", wrong)
        assert "call_with_retry made the wrong number of attempts" in text
        assert f"hint: {RETRY_MISSED[missed]}" in text, text


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
            update = solution["call_with_retry"](spec.fn, copy.deepcopy(state), spec.retry, sleep)
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
    assert f"hint: {RUN_MISSED['resume']}" in text


def test_task3_checkpoints_of_the_old_state_are_caught(solution):
    text = check_fails("lab13.run_graph", _runner(solution, checkpoint_before_merge=True))
    assert "run_graph saved the wrong checkpoints" in text and "[step, node, next_node, state]" in text
    assert f"hint: {RUN_MISSED['after merge']}" in text


def test_task3_a_loop_without_a_step_limit_is_caught(solution):
    text = check_fails("lab13.run_graph_limits", _runner(solution, limit=False))
    assert "run_graph should raise GraphRecursionError here" in text and f"hint: {RUN_MISSED['limit']}" in text


def test_task3_the_reference_runner_agrees_with_the_compiled_graph(solution):
    """The checks' reference (run_graph) and the full runtime (CompiledGraph.invoke) end in the same state."""
    import random

    from grading.checks.lab13.graphs import build_graph, graph_spec
    from infra_lib.apps.agents import MemoryCheckpointer
    from infra_lib.apps.agents.runner import run_graph

    rng = random.Random(7)
    for _ in range(20):
        spec = graph_spec(rng, rng.randint(2, 7))
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


# --- each task scored on its own ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_the_stand_ins_solve_neither_task_1_nor_task_2(seed):
    """The checks of tasks 3 and 4 run the learner's run_graph on the course's stand-ins for next_node and
    call_with_retry. They answer only from a run's spec and its recorded retries: on task 1's and task 2's own
    checks, with nothing of the learner's to fall back on, they answer nothing, so the kernel holds no answer."""
    from grading.check import drive
    from grading.checks.lab13.runs import StandIns
    from grading.registry import get_check

    stand_ins = StandIns({})
    for name in ("next_node", "call_with_retry"):
        for check_id in CHECKS[name]:
            registered = get_check(check_id)
            inputs = registered.inputs(seed)
            got = drive(registered, getattr(stand_ins, name), inputs)
            assert got != drive(registered, registered.reference(), inputs), check_id
            answered = [r for r in got.data if "value" in str(r.get("outcome", r.get("result")))]
            assert not answered and "RuntimeError" in str(got.data), (check_id, answered)


def test_the_stand_ins_equal_the_reference_on_every_call_the_runner_checks_make(solution, monkeypatch):
    """Every next_node call of the instructor's runner gets the reference's answer from the spec, every
    call_with_retry runs the node as the reference's retries did, and none needs the learner's own."""
    from grading.checks.lab13.graphs import typed_outcome
    from grading.checks.lab13.runs import StandIns
    from infra_lib.apps.agents.runner import next_node as reference

    calls, retried = [], []
    stand_in_next, stand_in_retry = StandIns.next_node, StandIns.call_with_retry

    def compared(self, graph, current, state):
        ours = typed_outcome(stand_in_next, self, graph, current, state)
        assert ours[:2] == typed_outcome(reference, graph, current, state)[:2], (current, state)
        calls.append(current)
        return stand_in_next(self, graph, current, state)

    def watched(self, fn, state, policy, sleep=time.sleep):
        waits = []
        try:
            return stand_in_retry(self, fn, state, policy, lambda s: (waits.append(s), sleep(s)))
        finally:
            retried.extend(waits)

    def never(self, name, *args, **kwargs):
        raise AssertionError(f"the stand-in for {name} could not answer a call of the instructor's runner")

    monkeypatch.setattr(StandIns, "next_node", compared)
    monkeypatch.setattr(StandIns, "call_with_retry", watched)
    monkeypatch.setattr(StandIns, "_own", never)
    for check_id in CHECKS["run_graph"]:
        check(check_id, solution["run_graph"])
    assert len(calls) > 100 and retried, (len(calls), retried)


def test_a_call_the_stand_ins_cannot_answer_goes_to_the_learners_own_and_is_named(tmp_path):
    """A runner that wraps each node in a function of its own hands call_with_retry a function the check did
    not make: the learner's own call_with_retry answers it, and a mistake there is named with its task."""
    wrapped = {
        "task3_run_graph": [
            ("update = call_with_retry(spec.fn,", "update = call_with_retry(lambda s, f=spec.fn: f(s),")
        ]
    }
    waits_twice = {"task2_call_with_retry": [("sleep(min(", "sleep(2 * min(")]}
    namespace = _namespace(tmp_path, waits_twice, wrapped)
    text = check_fails("lab13.run_graph", namespace["run_graph"])
    assert "your run_graph ran your own call_with_retry" in text and "(lab13 task 2: call_with_retry)" in text, text
    check("lab13.run_graph", _namespace(tmp_path, wrapped)["run_graph"])  # a right one passes


def test_the_runner_checks_give_the_course_versions_to_helpers_of_the_answer_cell_too(tmp_path):
    """A run_graph that calls next_node through a helper of its own cell still runs the course's."""
    helper = {
        "task3_run_graph": [
            (
                "def run_graph(",
                "def _advance(graph, node, state):\n    return next_node(graph, node, state)\n\n\ndef run_graph(",
            ),
            ("nxt = next_node(graph, node, state)", "nxt = _advance(graph, node, state)"),
        ]
    }
    namespace = _namespace(tmp_path, UNMAPPED, RETRIES_EVERY_ERROR, helper)
    own = {name: namespace[name] for name in ("next_node", "call_with_retry")}
    assert "next_node raised where it should return the next node" in check_fails("lab13.next_node", own["next_node"])
    for check_id in CHECKS["run_graph"]:
        check(check_id, namespace["run_graph"])
    assert all(namespace[name] is function for name, function in own.items())  # the learner's own, back again


def test_a_run_graph_that_keeps_its_own_next_node_is_told_which_task_failed(tmp_path):
    """A default argument holds the learner's next_node itself, which no check can replace: a failure it
    causes names that function and its task."""
    default = {
        "task3_run_graph": [
            ("sleep=time.sleep) -> dict:", "sleep=time.sleep, choose=next_node) -> dict:"),
            ("nxt = next_node(graph, node, state)", "nxt = choose(graph, node, state)"),
        ]
    }
    namespace = _namespace(tmp_path, UNMAPPED, default)
    text = check_fails("lab13.run_graph", namespace["run_graph"])
    assert "[lab13 task 3: run_graph]" in text and "your run_graph ran your own next_node" in text
    assert "(lab13 task 1: next_node)" in text.split("hint: ", 1)[1]
    check("lab13.run_graph", _namespace(tmp_path, default)["run_graph"])  # a right one passes, of course


def _graded_alone(tmp_path, mistake: dict) -> dict[int, tuple[float, list[str]]]:
    """Every check of the lab, visible and hidden, on the instructor's answers with one mistake: per
    task, the points its cell keeps (all of its checks must pass) and the messages of its failed checks."""
    from grading.registry import all_checks

    namespace = _namespace(tmp_path, mistake)
    failed: dict[int, list[str]] = {task: [] for task in POINTS}
    for name, check_ids in CHECKS.items():
        for check_id in check_ids:
            task = int(all_checks()[check_id].task.split(":")[0].rsplit(" ", 1)[1])
            try:
                check(check_id, namespace[name])
            except AssertionError as exc:
                failed[task].append(str(exc))
    return {task: (0.0 if failed[task] else points, failed[task]) for task, points in POINTS.items()}


@pytest.mark.parametrize(
    "mistake, losing, hint",
    [
        (UNMAPPED, {1}, NEXT_MISSED["mapping"]),
        (UNCAPPED, {2}, RETRY_MISSED["cap"]),
        (RETRIES_EVERY_ERROR, {2}, RETRY_MISSED["retry_on"]),
        (CLASSES_ONLY, {2}, RETRY_MISSED["retry_on"]),
        (RERAISES_THE_FIRST, {2}, RETRY_MISSED["ending"]),
        (MAPPING_UNCHECKED, {1}, NEXT_MISSED["kind"]),
        (DEAD_END_UNNAMED, {1}, NEXT_MISSED["name"]),
        (CHECKPOINTS_BEFORE_MERGE, {3}, RUN_MISSED["after merge"]),
        (SHALLOW_COPY, {3}, RUN_MISSED["copy"]),
        (NO_COPY, {3}, RUN_MISSED["copy"]),
        (ONE_STEP_TOO_MANY, {3}, RUN_MISSED["limit"]),
        (ONE_STEP_TOO_FEW, {3}, RUN_MISSED["limit"]),
        (NEVER_RESUMES, {4}, RUN_MISSED["resume"]),
        (COUNTS_FROM_THE_RESUME, {4}, RUN_MISSED["limit"]),
        (INPUT_OVER_THE_CHECKPOINT, {4}, RUN_MISSED["resume"]),
    ],
    ids=[
        "unmapped router",
        "uncapped backoff",
        "retries every error",
        "retry_on as classes only",
        "re-raises the first error",
        "mapping unchecked",
        "dead end unnamed",
        "checkpoints before the merge",
        "shallow copy for the node",
        "no copy for the node",
        "one step too many",
        "one step too few",
        "never resumes",
        "counts steps from the resume",
        "input over the checkpoint",
    ],
)
def test_a_mistake_costs_only_its_own_task_with_the_hint_for_it(tmp_path, mistake, losing, hint):
    graded = _graded_alone(tmp_path, mistake)
    assert {task: score for task, (score, _) in graded.items()} == {
        task: 0.0 if task in losing else points for task, points in POINTS.items()
    }
    for task in losing:
        messages = graded[task][1]
        assert messages and all(f"hint: {hint}" in message for message in messages), messages


def test_a_step_limit_off_by_one_is_named_as_such(tmp_path):
    late = check_fails("lab13.run_graph_limits", _namespace(tmp_path, ONE_STEP_TOO_MANY)["run_graph"])
    assert "run_graph stopped at a different step limit" in late and "max_steps=" in late
    assert "wrong order" not in late and f"hint: {RUN_MISSED['limit']}" in late
    early = check_fails("lab13.run_graph_limits", _namespace(tmp_path, ONE_STEP_TOO_FEW)["run_graph"])
    assert "run_graph stopped at" in early and "max_steps=" in early and f"hint: {RUN_MISSED['limit']}" in early


def test_a_checkpoint_message_names_the_field_that_differs(solution):
    text = check_fails("lab13.run_graph", _runner(solution, checkpoint_before_merge=True))
    assert "is the first that differs, in its state: expected" in text, text
    assert "as expected" in text  # the count was right: the message says so instead of repeating two equal numbers


def test_a_node_changing_its_state_in_place_is_explained(tmp_path):
    shallow = check_fails("lab13.run_graph", _namespace(tmp_path, SHALLOW_COPY)["run_graph"])
    assert "a node's change to the state it was handed reached the run's state" in shallow
    assert "a new dict that still holds the run's lists" in shallow
    own = check_fails("lab13.run_graph", _namespace(tmp_path, NO_COPY)["run_graph"])
    assert "the node was handed the run's own state dict" in own


def test_a_runner_that_changes_the_callers_dict_is_caught(solution):
    reference = _runner(solution)

    def in_place(graph, state, **kwargs):  # keeps the caller's log list and appends to it
        final = reference(graph, state, **kwargs)
        state["log"].extend(final["log"])
        return final

    text = check_fails("lab13.run_graph", in_place)
    assert "run_graph changed the state dict it was given" in text and f"hint: {RUN_MISSED['input']}" in text


def test_the_recorded_first_run_is_the_reference_runners_crash_run(monkeypatch):
    """Task 4's checks write the reference's recorded first run into the thread instead of running a runner of
    the course's in the kernel: every record equals what a live run of the reference's crash leaves."""
    from grading.check import drive
    from grading.checks.lab13 import runs
    from grading.checks.lab13.graphs import build_graph, typed_outcome
    from grading.registry import get_check
    from infra_lib.apps.agents.runner import run_graph

    def live(case, checkpointer, events, sleeps):
        graph = build_graph(case["spec"], events, crash_at_call=case.get("crash_at"), flaky=case.get("flaky"))
        return typed_outcome(
            run_graph,
            graph,
            {"x": case["x"], "log": []},
            checkpointer=checkpointer,
            thread_id="t",
            max_steps=case["max_steps"],
            sleep=sleeps.append,
        )

    for seed in range(3):
        for check_id in ("lab13.run_graph_resume", "lab13.run_graph_resume_sqlite"):
            registered = get_check(check_id)
            inputs = registered.inputs(seed)
            replayed = drive(registered, registered.reference(), inputs)
            with monkeypatch.context() as patch:
                patch.setattr(runs, "_replay_first_run", live)
                assert drive(registered, registered.reference(), inputs) == replayed, (check_id, seed)
