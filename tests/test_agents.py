"""The agent runtime (infra_lib.apps.agents): graph checks, the runner loop, crash-and-resume at every
step (an injected error, and a killed process), retries and timeouts, interrupts, checkpointers,
tools, the agent (scripted, and SmolLM2 through the course's server) and the router."""

from __future__ import annotations

import json
import operator
import subprocess
import sys
import threading
from typing import Annotated, TypedDict

import pytest
from conftest import REPO, SMOLLM2

from infra_lib.apps.agents import (
    END,
    START,
    ChatReply,
    Checkpoint,
    Command,
    GraphInterrupt,
    GraphRecursionError,
    MemoryCheckpointer,
    NodeTimeout,
    Price,
    RetryPolicy,
    Router,
    ScriptedModel,
    SqliteCheckpointer,
    StateGraph,
    ToolAgent,
    ToolCall,
    TraceEvent,
    backoff_delays,
    call_with_retry,
    interrupt,
    keyword_rule,
    length_rule,
    merge_update,
    next_node,
    parse_tool_calls,
    run_graph,
    run_tool_call,
    tool,
)
from infra_lib.apps.agents.models import to_wire, tool_example


class Job(TypedDict):
    items: list
    done: Annotated[list, operator.add]
    rounds: int
    report: str


# A multi-step graph, also written to a file for the killed-process test: fetch, then work on one
# item per step (a loop with a counter and an exit), then summarise. Eight steps for three items.
JOB_GRAPH = """
import operator
from typing import Annotated, TypedDict

from infra_lib.apps.agents import END, START, StateGraph


class Job(TypedDict):
    items: list
    done: Annotated[list, operator.add]
    rounds: int
    report: str


def fetch(state):
    return {"items": ["a", "b", "c"], "done": [], "rounds": 0}


def work(state):
    item = state["items"][len(state["done"])]
    return {"done": [item.upper()], "rounds": state["rounds"] + 1}


def check(state):
    return {"rounds": state["rounds"] + 10}


def summarise(state):
    return {"report": "+".join(state["done"]) + f" in {state['rounds']}"}


def build(wrap=lambda name, fn: fn):
    graph = StateGraph(Job)
    for name, fn in [("fetch", fetch), ("work", work), ("check", check), ("summarise", summarise)]:
        graph.add_node(name, wrap(name, fn))
    graph.add_edge(START, "fetch")
    graph.add_edge("fetch", "work")
    graph.add_edge("work", "check")
    graph.add_conditional_edges("check", lambda s: "work" if len(s["done"]) < len(s["items"]) else "summarise")
    graph.add_edge("summarise", END)
    return graph
"""
job = sys.modules.setdefault("test_agents_job_graph", type(sys)("test_agents_job_graph"))
exec(JOB_GRAPH, job.__dict__)  # the TypedDict's annotations resolve through sys.modules
FULL_RUN = ["fetch", "work", "check", "work", "check", "work", "check", "summarise"]
FINAL = {"items": ["a", "b", "c"], "done": ["A", "B", "C"], "rounds": 33, "report": "A+B+C in 33"}


class Crash(Exception):
    """An injected failure."""


def crash_at(k: int):
    """A wrap for job.build: the k-th node call (counting from 1) raises Crash."""
    calls = [0]

    def wrap(name, fn):
        def node(state):
            calls[0] += 1
            if calls[0] == k:
                raise Crash(f"injected at call {k} ({name})")
            return fn(state)

        return node

    return wrap


def visited(trace: list[TraceEvent]) -> list[str]:
    return [e.node for e in trace if e.error is None]


def make_checkpointer(kind: str, tmp_path):
    return MemoryCheckpointer() if kind == "memory" else SqliteCheckpointer(tmp_path / "checkpoints.db")


# --- the graph and its checks -----------------------------------------------------------------------


def test_uninterrupted_run_visits_every_step_and_checkpoints_each():
    saver, trace = MemoryCheckpointer(), []
    assert run_graph(job.build(), {}, checkpointer=saver, thread_id="t", trace=trace) == FINAL
    assert visited(trace) == FULL_RUN
    history = saver.history("t")
    assert [c.step for c in history] == list(range(1, 9))
    assert [c.node for c in history] == FULL_RUN
    assert [c.next_node for c in history] == FULL_RUN[1:] + [END]
    assert history[-1].state == FINAL


def test_graph_exposes_its_structure():
    graph = job.build()
    assert graph.entry == "fetch" and graph.edges == {"fetch": "work", "work": "check", "summarise": END}
    assert set(graph.branches) == {"check"} and graph.branches["check"][1] is None
    assert graph.reducers == {"done": operator.add} and set(graph.nodes) == {"fetch", "work", "check", "summarise"}
    node = graph.nodes["work"]
    assert (node.name, node.fn, node.retry, node.timeout) == ("work", job.work, None, None)


def test_compile_rejects_broken_graphs():
    def graph(*nodes):
        g = StateGraph(Job)
        for name in nodes:
            g.add_node(name, job.fetch)
        return g

    with pytest.raises(ValueError, match="no entry"):
        graph("a").add_edge("a", END).compile()
    with pytest.raises(ValueError, match="'nowhere', which is not a node"):
        graph("a").add_edge(START, "a").add_edge("a", "nowhere").compile()
    with pytest.raises(ValueError, match="'b' is a dead end"):
        graph("a", "b").add_edge(START, "a").add_edge("a", "b").compile()
    with pytest.raises(ValueError, match=r"\['b'\] cannot be reached"):
        graph("a", "b").add_edge(START, "a").add_edge("a", END).add_edge("b", END).compile()
    with pytest.raises(ValueError, match="no path leads to END"):
        graph("a", "b").add_edge(START, "a").add_edge("a", "b").add_edge("b", "a").compile()
    with pytest.raises(ValueError, match="one node at a time"):
        graph("a", "b").add_edge("a", "b").add_edge("a", END)
    with pytest.raises(ValueError, match="one node at a time"):
        graph("a", "b").add_edge("a", "b").add_conditional_edges("a", lambda s: END)
    with pytest.raises(ValueError, match="already exists"):
        graph("a").add_node("a", job.fetch)
    with pytest.raises(TypeError, match="TypedDict"):
        StateGraph(dict)


def test_merge_update_returns_a_new_state_and_applies_reducers():
    reducers = job.build().reducers
    state = {"done": ["A"], "rounds": 1}
    merged = merge_update(state, {"done": ["B"], "rounds": 2, "report": "r"}, reducers)
    assert merged == {"done": ["A", "B"], "rounds": 2, "report": "r"}
    assert state == {"done": ["A"], "rounds": 1}
    for empty in (None, {}):
        copy = merge_update(state, empty, reducers)
        assert copy == state and copy is not state
    with pytest.raises(ValueError, match="'colour'"):
        merge_update(state, {"colour": "red"}, reducers)
    with pytest.raises(TypeError, match="dict of state keys or None"):
        merge_update(state, ["done"], reducers)


def test_next_node_follows_edges_routers_and_mappings():
    graph = job.build()
    assert next_node(graph, "fetch", {}) == "work"
    assert next_node(graph, "check", {"done": [1], "items": [1, 2]}) == "work"
    assert next_node(graph, "check", {"done": [1, 2], "items": [1, 2]}) == "summarise"
    assert next_node(graph, "summarise", {}) == END
    mapped = StateGraph(Job).add_node("a", job.fetch).add_edge(START, "a")
    mapped.add_conditional_edges("a", lambda s: s["rounds"] > 2, {True: END, False: "a"})
    assert next_node(mapped, "a", {"rounds": 5}) == END and next_node(mapped, "a", {"rounds": 0}) == "a"
    mapped.branches["a"] = (lambda s: "x", {True: END, False: "a"})
    with pytest.raises(ValueError, match=r"returned 'x'.*allowed: \[True, False\]"):
        next_node(mapped, "a", {})
    graph.branches["check"] = (lambda s: "publish", None)
    with pytest.raises(ValueError, match="returned 'publish', which is not a node or END"):
        next_node(graph, "check", {})
    with pytest.raises(ValueError, match="dead end"):
        next_node(StateGraph(Job).add_node("a", job.fetch), "a", {})


def test_a_node_that_changes_its_state_in_place_changes_neither_the_run_nor_the_caller():
    """Each node is handed a deep copy: appending to a list of it in place reaches neither the run's state nor
    the caller's dict, in run_graph and in the compiled graph alike; only the returned update counts."""

    def meddle(state):
        state["done"].append("in place")
        state["rounds"] += 100
        return {"done": ["returned"]}

    graph = StateGraph(Job).add_node("meddle", meddle).add_node("again", meddle)
    graph.add_edge(START, "meddle").add_edge("meddle", "again").add_edge("again", END)
    for run in (
        lambda given: run_graph(graph, given, checkpointer=MemoryCheckpointer(), thread_id="t"),
        lambda given: graph.compile().invoke(given),
    ):
        given = {"done": ["first"], "rounds": 1}
        assert run(given) == {"done": ["first", "returned", "returned"], "rounds": 1}
        assert given == {"done": ["first"], "rounds": 1}


def test_endless_loop_stops_at_max_steps():
    graph = StateGraph(Job).add_node("spin", lambda s: {"rounds": s.get("rounds", 0) + 1}).add_edge(START, "spin")
    graph.add_conditional_edges("spin", lambda s: "spin")
    saver = MemoryCheckpointer()
    with pytest.raises(GraphRecursionError, match="max_steps=7"):
        run_graph(graph.compile(), {"rounds": 0}, checkpointer=saver, thread_id="t", max_steps=7)
    assert saver.latest("t").step == 7 and saver.latest("t").state == {"rounds": 7}


def test_stream_yields_each_step_as_it_finishes():
    steps = list(job.build().compile().stream({}))
    assert [(s, n) for s, n, _ in steps] == list(enumerate(FULL_RUN, start=1))
    assert steps[1][2] == {"done": ["A"], "rounds": 1}
    assert steps[0][2] == {"items": ["a", "b", "c"], "done": [], "rounds": 0}


# --- crash at every step, resume, same result ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_crash_at_every_step_then_resume_gives_the_uninterrupted_run(kind, tmp_path):
    for k in range(1, len(FULL_RUN) + 1):
        saver, first, second = make_checkpointer(kind, tmp_path), [], []
        with pytest.raises(Crash):
            run_graph(job.build(crash_at(k)), {}, checkpointer=saver, thread_id=f"k{k}", trace=first)
        assert visited(first) == FULL_RUN[: k - 1]
        assert run_graph(job.build(), {}, checkpointer=saver, thread_id=f"k{k}", trace=second) == FINAL
        assert visited(first) + visited(second) == FULL_RUN, f"crash at step {k}"
        assert [c.step for c in saver.history(f"k{k}")] == list(range(1, 9))


def test_compiled_graph_resumes_a_crashed_thread_with_invoke_none():
    app = job.build(crash_at(4)).compile(checkpointer=MemoryCheckpointer())
    with pytest.raises(Crash):
        app.invoke({}, thread_id="t")
    assert app.get_state("t").next_node == "work" and app.get_state("t").step == 3
    with pytest.raises(ValueError, match="stopped at step 3 before node 'work'"):
        app.invoke({}, thread_id="t")  # a new input would silently drop the work done
    assert app.invoke(None, thread_id="t") == FINAL
    assert visited(app.trace) == FULL_RUN[3:]


KILLER = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from job_graph import build
from infra_lib.apps.agents import SqliteCheckpointer, run_graph

calls = [0]
def wrap(name, fn):
    def node(state):
        calls[0] += 1
        if calls[0] == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(state)
    return node

run_graph(build(wrap), {}, checkpointer=SqliteCheckpointer(sys.argv[2]), thread_id="job")
"""


@pytest.mark.parametrize("k", [1, 5])
def test_a_killed_process_resumes_from_its_sqlite_checkpoints(tmp_path, k):
    (tmp_path / "job_graph.py").write_text(JOB_GRAPH)
    db = tmp_path / "runs.db"
    done = subprocess.run(
        [sys.executable, "-c", KILLER, str(tmp_path), str(db), str(k)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -9, done.stderr  # SIGKILL: no handler, no clean-up ran
    saver = SqliteCheckpointer(db)
    assert [c.node for c in saver.history("job")] == FULL_RUN[: k - 1]
    trace = []
    assert run_graph(job.build(), {}, checkpointer=saver, thread_id="job", trace=trace) == FINAL
    assert FULL_RUN[: k - 1] + visited(trace) == FULL_RUN


# --- retries and timeouts -----------------------------------------------------------------------------


def flaky(failures: int, error=ConnectionError):
    """fn(state) that raises ``error`` on its first ``failures`` calls; ``calls`` counts the calls."""

    def fn(state):
        fn.calls += 1
        if fn.calls <= failures:
            raise error(f"failure {fn.calls}")
        return {"rounds": fn.calls}

    fn.calls = 0
    return fn


def test_backoff_delays_are_exact_and_capped():
    assert backoff_delays(RetryPolicy(max_attempts=6, initial_interval=0.5, backoff_factor=2.0, max_interval=3.0)) == [
        0.5,
        1.0,
        2.0,
        3.0,
        3.0,
    ]
    assert backoff_delays(RetryPolicy(max_attempts=1)) == []
    for bad in (dict(max_attempts=0), dict(initial_interval=-1), dict(backoff_factor=0.5), dict(retry_on=("x",))):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


@pytest.mark.parametrize("failures", [0, 1, 3])
def test_retries_sleep_the_backoff_sequence(failures):
    policy = RetryPolicy(max_attempts=4, initial_interval=0.25, backoff_factor=3.0, max_interval=2.0)
    fn, sleeps, attempts = flaky(failures), [], []
    assert call_with_retry(
        fn, {}, policy, sleep=sleeps.append, on_attempt=lambda n, e: attempts.append((n, type(e).__name__))
    ) == {"rounds": failures + 1}
    assert fn.calls == failures + 1
    assert sleeps == backoff_delays(policy)[:failures] == [0.25, 0.75, 2.0][:failures]
    assert attempts == [(n, "ConnectionError") for n in range(1, failures + 1)] + [(failures + 1, "NoneType")]


def test_exhausted_retries_raise_the_last_error():
    policy = RetryPolicy(max_attempts=3, initial_interval=1.0)
    fn, sleeps = flaky(10), []
    with pytest.raises(ConnectionError, match="failure 3"):
        call_with_retry(fn, {}, policy, sleep=sleeps.append)
    assert fn.calls == 3 and sleeps == [1.0, 2.0]


def test_only_matching_errors_are_retried():
    sleeps = []
    for policy in (RetryPolicy(retry_on=(ConnectionError,)), RetryPolicy(retry_on=lambda e: "again" in str(e)), None):
        fn = flaky(2, error=ValueError)
        with pytest.raises(ValueError, match="failure 1"):
            call_with_retry(fn, {}, policy, sleep=sleeps.append)
        assert fn.calls == 1
    assert sleeps == []
    fn = flaky(2, error=lambda m: ValueError(f"{m}: try again"))
    assert call_with_retry(fn, {}, RetryPolicy(retry_on=lambda e: "again" in str(e)), sleep=sleeps.append) == {
        "rounds": 3
    }


def test_retries_inside_a_graph_are_traced():
    fn, sleeps = flaky(2), []
    policy = RetryPolicy(max_attempts=3, initial_interval=0.1)
    app = StateGraph(Job).add_node("call", fn, retry=policy).add_edge(START, "call").add_edge("call", END).compile()
    assert app.invoke({}, sleep=sleeps.append) == {"rounds": 3}
    assert sleeps == backoff_delays(policy)
    assert [(e.step, e.node, e.attempt) for e in app.trace] == [(1, "call", 1), (1, "call", 2), (1, "call", 3)]
    assert [e.error for e in app.trace] == ["ConnectionError: failure 1", "ConnectionError: failure 2", None]
    assert app.trace[-1].update == {"rounds": 3} and all(e.duration_s >= 0 for e in app.trace)


def test_a_slow_node_times_out_and_is_retried_when_configured():
    release = threading.Event()

    def slow_once(state):
        slow_once.calls += 1
        if slow_once.calls == 1:
            release.wait(5)
        return {"rounds": slow_once.calls}

    slow_once.calls = 0
    try:
        once = StateGraph(Job).add_node("n", slow_once, timeout=0.05).add_edge(START, "n").add_edge("n", END)
        with pytest.raises(NodeTimeout, match="'n' ran longer than its timeout of 0.05 s"):
            once.compile().invoke({})
        slow_once.calls, sleeps = 0, []
        retried = StateGraph(Job).add_node(
            "n",
            slow_once,
            timeout=0.05,
            retry=RetryPolicy(max_attempts=2, initial_interval=0.0, retry_on=(NodeTimeout,)),
        )
        app = retried.add_edge(START, "n").add_edge("n", END).compile()
        assert app.invoke({}, sleep=sleeps.append) == {"rounds": 2}
        assert sleeps == [0.0] and app.trace[0].error.startswith("NodeTimeout")
    finally:
        release.set()


# --- human in the loop ----------------------------------------------------------------------------------


def approval_graph(checkpointer):
    def draft(state):
        return {"report": "draft", "rounds": 0}

    def approve(state):
        try:  # an except-all in a node must not swallow the interrupt
            answer = interrupt({"question": "send it?", "report": state["report"]})
        except Exception:
            answer = "swallowed"
        return {"done": [answer], "rounds": state["rounds"] + 1}

    graph = StateGraph(Job).add_node("draft", draft)
    graph.add_node("approve", approve, retry=RetryPolicy(max_attempts=3, retry_on=(Exception,)))
    graph.add_edge(START, "draft").add_edge("draft", "approve").add_edge("approve", END)
    return graph.compile(checkpointer=checkpointer)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@pytest.mark.parametrize("answer", [0, "", False, None, [], {}, "yes", 2.5, {"edits": ["shorter"]}])
def test_interrupt_resumes_with_exactly_the_given_value(kind, answer, tmp_path):
    app = approval_graph(make_checkpointer(kind, tmp_path))
    paused = app.invoke({}, thread_id="t")
    [asked] = paused.pop("__interrupt__")
    assert (asked.value, asked.node) == ({"question": "send it?", "report": "draft"}, "approve")
    assert paused == {"report": "draft", "rounds": 0}
    pending = app.get_state("t")
    assert (pending.next_node, pending.pending_interrupt["question"]) == ("approve", "send it?")
    with pytest.raises(ValueError, match="waits for an answer"):
        app.invoke(None, thread_id="t")
    final = app.invoke(Command(resume=answer), thread_id="t")
    [given] = final["done"]
    assert given == answer and type(given) is type(answer)
    assert final["rounds"] == 1 and [e.attempt for e in app.trace] == [1]  # the interrupt was not retried
    with pytest.raises(ValueError, match="no pending interrupt"):
        app.invoke(Command(resume="again"), thread_id="t")


def test_interrupt_outside_a_graph_or_without_checkpointer_is_an_error():
    with pytest.raises(RuntimeError, match="only inside a node"):
        interrupt("hello?")
    with pytest.raises(RuntimeError, match="needs a checkpointer"):
        approval_graph(None).invoke({})
    assert issubclass(GraphInterrupt, BaseException) and not issubclass(GraphInterrupt, Exception)


# --- checkpointers -------------------------------------------------------------------------------------


def test_sqlite_checkpoints_read_back_equal_and_clear(tmp_path):
    saver = SqliteCheckpointer(tmp_path / "c.db")
    written = [
        Checkpoint(1, "a", "b", {"x": [1, 2.5, None, True], "y": {"k": "ü"}}),
        Checkpoint(1, "b", "b", {"x": []}, pending_interrupt={"q": 1}, resume_values=(0, "")),
        Checkpoint(2, "b", END, {"x": [3]}),
    ]
    for checkpoint in written:
        saver.put("t", checkpoint)
    saver.put("other", written[0])
    assert saver.history("t") == written and saver.latest("t") == written[-1]
    saver.clear("t")
    assert saver.latest("t") is None and saver.history("t") == [] and saver.latest("other") == written[0]


def test_sqlite_names_the_key_that_is_not_json(tmp_path):
    saver = SqliteCheckpointer(tmp_path / "c.db")
    with pytest.raises(TypeError, match=r"state\['when'\].*not JSON-serialisable"):
        saver.put("t", Checkpoint(1, "a", END, {"ok": 1, "when": {1, 2}}))
    with pytest.raises(TypeError, match=r"state\['pair'\].*comes back changed"):
        saver.put("t", Checkpoint(1, "a", END, {"pair": (1, 2)}))
    assert saver.latest("t") is None


def test_memory_checkpoints_are_not_changed_by_later_mutation():
    saver, state = MemoryCheckpointer(), {"x": [1]}
    saver.put("t", Checkpoint(1, "a", END, state))
    state["x"].append(2)
    saver.latest("t").state["x"].append(3)
    assert saver.latest("t").state == {"x": [1]}


def test_sqlite_checkpoints_survive_the_process(tmp_path):
    db = tmp_path / "c.db"
    code = (
        "import sys; from infra_lib.apps.agents import Checkpoint, SqliteCheckpointer; "
        "SqliteCheckpointer(sys.argv[1]).put('t', Checkpoint(3, 'a', 'b', {'x': [1, 'two'], 'y': None}))"
    )
    subprocess.run([sys.executable, "-c", code, str(db)], cwd=REPO, check=True, timeout=60)
    assert SqliteCheckpointer(db).latest("t") == Checkpoint(3, "a", "b", {"x": [1, "two"], "y": None})


# --- tools ----------------------------------------------------------------------------------------------


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor, which
            may be negative.
    """
    return a * b


@tool(name="price_of")
def price(item: str, currency: str = "USD") -> float:
    """Look up the price of an item."""
    return {"apple": 3.0}[item]


def test_tool_schema_comes_from_type_hints_and_docstring():
    assert multiply.schema() == {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["a", "b"],
            "properties": {
                "a": {"type": "integer", "description": "the first factor."},
                "b": {"type": "integer", "description": "the second factor, which may be negative."},
            },
        },
    }
    assert price.name == "price_of" and price.parameters["required"] == ["item"]
    with pytest.raises(TypeError, match="needs a type hint"):
        tool(lambda x: x)


@pytest.mark.parametrize(
    "call, expected",
    [
        (ToolCall("multiply", {"a": 6, "b": 7}, "c1"), "42"),
        (
            ToolCall("multiply", {"a": "six", "b": 7}, "c1"),
            "error: bad arguments for multiply: a: 'six' is not of type 'integer'",
        ),
        (
            ToolCall("multiply", {"a": 6}, "c1"),
            "error: bad arguments for multiply: arguments: 'b' is a required property",
        ),
        (
            ToolCall("multiply", {"a": 6, "b": 7, "c": 1}, "c1"),
            "error: bad arguments for multiply: arguments: Additional",
        ),
        (ToolCall("multiply", [6, 7], "c1"), "error: bad arguments for multiply: arguments must be a JSON object"),
        (
            ToolCall("divide", {"a": 6}, "c1"),
            "error: there is no tool named 'divide'; available tools: multiply, price_of",
        ),
        (ToolCall("price_of", {"item": "pear"}, "c1"), "error: price_of raised KeyError: 'pear'"),
        (ToolCall("price_of", {"item": "apple"}, "c1"), "3.0"),
    ],
)
def test_tool_calls_never_raise(call, expected):
    message = run_tool_call([multiply, price], call)
    assert message["role"] == "tool" and message["tool_call_id"] == "c1" and message["name"] == call.name
    assert message["content"].startswith(expected)


def test_parse_tool_calls_finds_the_first_json_object():
    fenced = 'Sure.\n```json\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n```\nDone {"name": "x"}'
    assert parse_tool_calls(fenced) == [ToolCall("multiply", {"a": 2, "b": 3}, "call_0")]
    assert parse_tool_calls('{"name": "f", "parameters": {"x": 1}}', "c7") == [ToolCall("f", {"x": 1}, "c7_0")]
    assert parse_tool_calls('{"value": 1} then {"name": "g"}') == [ToolCall("g", {}, "call_0")]
    for plain in ("The answer is 42.", "{broken", "{}", '{"name": 3}'):
        assert parse_tool_calls(plain) == []


def test_the_wire_format_has_only_roles_the_server_knows():
    conversation = [
        {"role": "system", "content": "Be brief."},
        *tool_example("What is 2 times 3?", ToolCall("multiply", {"a": 2, "b": 3}, "e1"), "6", "The answer is 6."),
    ]
    wire = to_wire(conversation, [multiply])
    assert [m["role"] for m in wire] == ["system", "user", "assistant", "user", "assistant"]
    assert (
        wire[0]["content"].startswith("Be brief.\nYou can call tools.") and '"name": "multiply"' in wire[0]["content"]
    )
    assert wire[2]["content"] == '{"name": "multiply", "arguments": {"a": 2, "b": 3}}'
    assert wire[3]["content"] == "Tool result (multiply): 6"


# --- the agent, scripted ------------------------------------------------------------------------------


def test_agent_turns_bad_calls_into_messages_and_recovers():
    model = ScriptedModel(
        [
            '{"name": "multiply", "arguments": {"a": "six", "b": 7}}',
            '{"name": "times", "arguments": {"a": 6, "b": 7}}',
            'Let me fix that: {"name": "multiply", "arguments": {"a": 6, "b": 7}}',
            "The answer is 42.",
        ]
    )
    result = ToolAgent(model, [multiply], system_prompt="Use tools.").run("What is 6 times 7?")
    assert result.answer == "The answer is 42."
    assert [c["arguments"] for c in result.tool_calls] == [{"a": "six", "b": 7}, {"a": 6, "b": 7}, {"a": 6, "b": 7}]
    contents = [m["content"] for m in result.tool_results]
    assert contents[0].startswith("error: bad arguments") and contents[1].startswith("error: there is no tool")
    assert contents[2] == "42"
    assert [e.node for e in result.trace] == ["model", "tools"] * 3 + ["model"]
    last_prompt = model.calls[-1][0]
    assert last_prompt[0] == {"role": "system", "content": "Use tools."} and last_prompt[-1]["content"] == "42"
    assert [u["model"] for u in result.usage] == ["scripted"] * 4 and result.total_tokens > 0


def test_agent_stops_after_max_turns():
    model = ScriptedModel(['{"name": "multiply", "arguments": {"a": 1, "b": 1}}'] * 5)
    result = ToolAgent(model, [multiply], max_turns=2).run("loop forever")
    assert result.answer == "" and len(model.calls) == 2 and len(result.tool_results) == 1


def test_agent_retries_a_flaky_model_and_keeps_a_thread():
    class Flaky:
        def __init__(self):
            self.inner, self.calls = ScriptedModel(["first answer", "second answer"]), 0

        def chat(self, messages, tools):
            self.calls += 1
            if self.calls == 1:
                raise ConnectionError("server restarting")
            return self.inner.chat(messages, tools)

    sleeps = []
    agent = ToolAgent(
        Flaky(), [multiply], retry=RetryPolicy(max_attempts=2, initial_interval=0.5), checkpointer=MemoryCheckpointer()
    )
    assert agent.run("hi", thread_id="u", sleep=sleeps.append).answer == "first answer" and sleeps == [0.5]
    again = agent.run("and now?", thread_id="u")
    assert again.answer == "second answer"
    assert [m["role"] for m in again.messages] == ["user", "assistant", "user", "assistant"]


# --- routing ---------------------------------------------------------------------------------------------


def test_router_sends_requests_by_rule_and_counts_cost():
    cheap = ScriptedModel([ChatReply("c1", [], 100, 10, "small"), ChatReply("c2", [], 200, 20, "small")])
    strong = ScriptedModel([ChatReply("s1", [], 1000, 100, "big")])
    router = Router(cheap, strong, keyword_rule(["prove"]), {"cheap": Price(0.1, 0.2), "strong": Price(3.0, 15.0)})
    for question in ("hi", "please prove it", "what time is it"):
        router.chat([{"role": "user", "content": question}])
    assert [r["route"] for r in router.records] == ["cheap", "strong", "cheap"]
    summary = router.summary()
    assert summary["cheap"] == {
        "requests": 2,
        "prompt_tokens": 300,
        "completion_tokens": 30,
        "cost": pytest.approx((300 * 0.1 + 30 * 0.2) / 1e6),
    }
    assert summary["strong"]["cost"] == pytest.approx((1000 * 3.0 + 100 * 15.0) / 1e6)
    assert summary["all_strong_cost_same_tokens"] == pytest.approx((1300 * 3.0 + 130 * 15.0) / 1e6)
    assert summary["saving"] == pytest.approx(1 - summary["total_cost"] / summary["all_strong_cost_same_tokens"])
    assert length_rule(5)([{"role": "user", "content": "short"}]) == "cheap"
    assert length_rule(5)([{"role": "user", "content": "longer"}]) == "strong"
    with pytest.raises(ValueError, match="'medium'"):
        Router(cheap, strong, lambda m, t: "medium", {"cheap": Price(0, 0), "strong": Price(0, 0)}).chat([])


# --- the agent on SmolLM2, through the course's server ----------------------------------------------------


@SMOLLM2
def test_smollm2_agent_calls_the_calculator_and_answers(smollm2):
    from infra_lib.apps.agents import OpenAIChatModel
    from infra_lib.serving.server import (
        DEFAULT_MODEL_NAME,
        ServerThread,
        build_engine,
        create_app,
    )

    example = tool_example(
        "What is 6 times 7?", ToolCall("multiply", {"a": 6, "b": 7}, "ex"), "42", "The answer is 42."
    )
    engine = build_engine(smollm2.model, smollm2.tokenizer, max_num_seqs=4, kv_blocks=128)
    with ServerThread(create_app(engine, DEFAULT_MODEL_NAME)) as server:
        model = OpenAIChatModel(server.url + "/v1", DEFAULT_MODEL_NAME, temperature=0, max_tokens=40, examples=example)
        result = ToolAgent(model, [multiply]).run("What is 17 times 23?")
    assert [(c["name"], c["arguments"]) for c in result.tool_calls] == [("multiply", {"a": 17, "b": 23})]
    assert [m["content"] for m in result.tool_results] == ["391"]
    assert "391" in result.answer, json.dumps(result.messages)
    assert len(result.usage) == 2 and all(u["prompt_tokens"] > 100 and u["completion_tokens"] > 0 for u in result.usage)
