"""The course's state-graph runtime against LangGraph: the same node functions, the same graphs,
the same visited nodes and the same final states (LangGraph is the oracle)."""

from __future__ import annotations

import operator
from typing import Annotated, TypedDict

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.errors import GraphRecursionError as LGRecursionError
from langgraph.graph import END as LG_END
from langgraph.graph import START as LG_START
from langgraph.graph import StateGraph as LGStateGraph
from langgraph.types import Command as LGCommand
from langgraph.types import interrupt as lg_interrupt

from infra_lib.apps.agents import END, START, Command, GraphRecursionError, MemoryCheckpointer, StateGraph, interrupt


class State(TypedDict):
    count: int
    flag: str
    log: Annotated[list, operator.add]
    seen: Annotated[list, lambda old, new: sorted(set(old) | set(new))]


def step(name: str, flag: str | None = None):
    """A node that counts, logs its name, records it in ``seen`` and may set ``flag``."""

    def fn(state: dict) -> dict:
        update = {"count": state["count"] + 1, "log": [name], "seen": [name]}
        if flag is not None:
            update["flag"] = flag
        return update

    return fn


def build(ours: bool, nodes: dict, edges: list, branches: dict, entry: str):
    """The same graph in our runtime or in LangGraph: edges are (src, dst), branches src -> (router, mapping)."""
    end, start = (END, START) if ours else (LG_END, LG_START)
    graph = StateGraph(State) if ours else LGStateGraph(State)
    for name, fn in nodes.items():
        graph.add_node(name, fn)
    graph.add_edge(start, entry)
    for src, dst in edges:
        graph.add_edge(src, end if dst == "END" else dst)
    for src, (router, mapping) in branches.items():
        if mapping is None:
            graph.add_conditional_edges(src, lambda s, r=router: end if r(s) == "END" else r(s))
        else:
            graph.add_conditional_edges(src, router, {k: end if v == "END" else v for k, v in mapping.items()})
    return graph.compile()


def run_both(nodes, edges, branches, entry, state, limit=25):
    """(visited nodes, final state or the error's class name) from each runtime."""
    ours = build(True, nodes, edges, branches, entry)
    visited, outcome = [], None
    try:
        for _, node, _ in ours.stream(state, max_steps=limit):
            visited.append(node)
        outcome = ours.invoke(state, max_steps=limit)
    except GraphRecursionError:
        outcome = "recursion"
    theirs = build(False, nodes, edges, branches, entry)
    lg_visited, lg_outcome = [], None
    try:
        for update in theirs.stream(state, {"recursion_limit": limit}, stream_mode="updates"):
            lg_visited.extend(update)
        lg_outcome = theirs.invoke(state, {"recursion_limit": limit})
    except LGRecursionError:
        lg_outcome = "recursion"
    return (visited, outcome), (lg_visited, lg_outcome)


START_STATE = {"count": 0, "flag": "", "log": [], "seen": []}

GRAPHS = {
    "linear": (dict(a=step("a"), b=step("b"), c=step("c")), [("a", "b"), ("b", "c"), ("c", "END")], {}, "a"),
    "branch": (
        dict(classify=step("classify", flag="long"), short=step("short"), long=step("long")),
        [("short", "END"), ("long", "END")],
        {"classify": (lambda s: s["flag"], None)},
        "classify",
    ),
    "loop_with_counter": (
        dict(work=step("work"), check=step("check")),
        [("work", "check")],
        {"check": (lambda s: "END" if s["count"] >= 7 else "work", None)},
        "work",
    ),
    "mapping_router": (
        dict(a=step("a"), b=step("b"), c=step("c")),
        [("b", "a"), ("c", "END")],
        {"a": (lambda s: s["count"] % 3, {0: "b", 1: "b", 2: "c"})},
        "a",
    ),
    "bool_mapping": (
        dict(a=step("a", flag="x"), b=step("b")),
        [("b", "a")],
        {"a": (lambda s: s["count"] < 4, {True: "b", False: "END"})},
        "a",
    ),
    # a router that never says END: compile cannot see it, max_steps / recursion_limit stop it
    "endless_loop": (dict(a=step("a"), b=step("b")), [("a", "b")], {"b": (lambda s: "a", None)}, "a"),
}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_same_nodes_and_final_state_as_langgraph(name):
    ours, theirs = run_both(*GRAPHS[name], dict(START_STATE))
    assert ours == theirs
    assert ours[0], "the graph ran no node"
    if name == "endless_loop":
        assert ours == (["a", "b"] * 12 + ["a"], "recursion")


def test_reducers_merge_as_langgraph_does():
    (_, ours), (_, theirs) = run_both(*GRAPHS["loop_with_counter"], {**START_STATE, "log": ["input"], "seen": ["z"]})
    assert ours == theirs
    assert ours["log"][:3] == ["input", "work", "check"] and ours["seen"] == ["check", "work", "z"]


@st.composite
def random_graphs(draw):
    """Up to six nodes; each with a plain edge, or a router on the count (mapped or not) that exits at 12."""
    n = draw(st.integers(1, 6))
    names = [f"n{i}" for i in range(n)]
    nodes = {name: (step(name) if draw(st.booleans()) else step(name, flag=name)) for name in names}
    edges, branches = [], {}
    for name in names:
        kind = draw(st.sampled_from(["edge", "router", "mapped"]))
        if kind == "edge":
            edges.append((name, draw(st.sampled_from(names + ["END"]))))
            continue
        targets = draw(st.lists(st.sampled_from(names + ["END"]), min_size=1, max_size=3))
        if kind == "router":
            branches[name] = (lambda s, t=tuple(targets): "END" if s["count"] >= 12 else t[s["count"] % len(t)], None)
        else:
            mapping = {f"k{j}": t for j, t in enumerate(targets)} | {"done": "END"}
            branches[name] = (lambda s, k=len(targets): "done" if s["count"] >= 12 else f"k{s['count'] % k}", mapping)
    return nodes, edges, branches, "n0"


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.filter_too_much])
@given(random_graphs())
def test_random_graphs_agree_with_langgraph(graph):
    nodes, edges, branches, entry = graph
    try:
        build(True, nodes, edges, branches, entry)
    except ValueError as error:  # our compile refuses unreachable nodes and graphs with no way to END
        assume(False) if ("cannot be reached" in str(error) or "no path" in str(error)) else pytest.fail(str(error))
    ours, theirs = run_both(nodes, edges, branches, entry, dict(START_STATE), limit=30)
    assert ours == theirs


def test_interrupt_and_resume_like_langgraph():
    """Two questions in one node, answered with falsy values: the same states and payloads as LangGraph."""
    answers = [0, ""]

    def ask(state: dict) -> dict:
        first = interrupt({"question": "approve?"})
        second = interrupt("and again?")
        return {"log": [repr(first), repr(second)], "count": state["count"] + 1}

    def lg_ask(state: dict) -> dict:
        first = lg_interrupt({"question": "approve?"})
        second = lg_interrupt("and again?")
        return {"log": [repr(first), repr(second)], "count": state["count"] + 1}

    ours = StateGraph(State)
    ours.add_node("a", step("a")).add_node("ask", ask).add_edge(START, "a").add_edge("a", "ask").add_edge("ask", END)
    ours = ours.compile(checkpointer=MemoryCheckpointer())
    theirs = LGStateGraph(State)
    theirs.add_node("a", step("a"))
    theirs.add_node("ask", lg_ask)
    theirs.add_edge(LG_START, "a")
    theirs.add_edge("a", "ask")
    theirs.add_edge("ask", LG_END)
    theirs = theirs.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t"}}

    def strip(result):
        payloads = [i.value for i in result.pop("__interrupt__", [])]
        return result, payloads

    assert strip(ours.invoke(dict(START_STATE), thread_id="t")) == strip(theirs.invoke(dict(START_STATE), config))
    for answer in answers:
        assert strip(ours.invoke(Command(resume=answer), thread_id="t")) == strip(
            theirs.invoke(LGCommand(resume=answer), config)
        )
    final = ours.get_state("t").state
    assert final["log"] == ["a", "0", "''"] and final["count"] == 2
    # a new input on the finished thread: merged into its state, as LangGraph does
    assert strip(ours.invoke({"count": 10}, thread_id="t")) == strip(theirs.invoke({"count": 10}, config))
