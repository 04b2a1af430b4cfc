"""A state graph: nodes are functions of the state, edges say which node runs next.

    graph = StateGraph(State)              # State: a TypedDict; Annotated[list, operator.add] appends
    graph.add_node("plan", plan)           # plan(state) -> dict of keys to change, or None
    graph.add_node("act", act, retry=RetryPolicy(max_attempts=3), timeout=10.0)
    graph.add_edge(START, "plan")
    graph.add_conditional_edges("plan", lambda s: "act" if s["todo"] else END)
    graph.add_edge("act", "plan")
    app = graph.compile(checkpointer=SqliteCheckpointer("runs.db"))
    app.invoke({"todo": [...]}, thread_id="job-1")

The semantics are LangGraph's for sequential graphs (one node per step): a dict state, updates
merged by reducers, conditional edges chosen by a router, checkpoints per thread, and
``interrupt`` / ``Command(resume=...)`` for a human in the loop. ``compile`` checks the graph
(an entry, known targets, no dead ends, every node reachable) before anything runs.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from infra_lib.apps.agents.checkpoint import Checkpoint, MemoryCheckpointer
from infra_lib.apps.agents.retry import RetryPolicy, with_timeout
from infra_lib.apps.agents.runner import (
    END,
    START,
    Command,
    GraphInterrupt,
    Interrupt,
    Reducers,
    TraceEvent,
    answering,
    merge_update,
    run_graph,
)

_ONE_EDGE = (
    "this runtime runs one node at a time, so each node has exactly one outgoing edge; "
    "to choose among several next nodes, use one add_conditional_edges"
)


@dataclass(frozen=True)
class Node:
    """A node: its name, its function ``fn(state) -> dict | None``, retry policy and timeout (seconds)."""

    name: str
    fn: Callable[[dict], dict | None]
    retry: RetryPolicy | None = None
    timeout: float | None = None


def schema_reducers(schema: type) -> Reducers:
    """The reducers of a TypedDict's ``Annotated[type, reducer]`` keys, plus all its keys."""
    if not (isinstance(schema, type) and issubclass(schema, dict) and hasattr(schema, "__annotations__")):
        raise TypeError(f"the state schema must be a TypedDict class, got {schema!r}")
    hints = typing.get_type_hints(schema, include_extras=True)
    reducers = {
        key: hint.__metadata__[-1]
        for key, hint in hints.items()
        if typing.get_origin(hint) is typing.Annotated and callable(hint.__metadata__[-1])
    }
    return Reducers(reducers, frozenset(hints))


class StateGraph:
    """The builder: add nodes and edges, then ``compile``.

    Args:
        schema: a TypedDict class; each key annotated ``Annotated[T, reducer]`` is merged with
            ``reducer(old, new)``, every other key is overwritten.
    """

    def __init__(self, schema: type):
        self.schema = schema
        self.reducers = schema_reducers(schema)
        self.nodes: dict[str, Node] = {}
        self.edges: dict[str, str] = {}
        self.branches: dict[str, tuple[Callable[[dict], Any], dict | None]] = {}
        self.entry: str | None = None

    def add_node(
        self,
        name: str,
        fn: Callable[[dict], dict | None],
        *,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
    ) -> StateGraph:
        """Add node ``name`` running ``fn(state)``, tried again per ``retry``, cut off after ``timeout`` seconds."""
        if not isinstance(name, str) or not name or name in (START, END):
            raise ValueError(f"a node name must be a non-empty string other than START and END, got {name!r}")
        if name in self.nodes:
            raise ValueError(f"a node named {name!r} already exists")
        if not callable(fn):
            raise TypeError(f"node {name!r}: fn must be callable as fn(state), got {fn!r}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"node {name!r}: retry must be a RetryPolicy, got {retry!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"node {name!r}: timeout must be > 0 seconds, got {timeout}")
        self.nodes[name] = Node(name, fn, retry, timeout)
        return self

    def add_edge(self, src: str, dst: str) -> StateGraph:
        """After ``src`` (or at the start, for ``START``) run ``dst`` (a node or ``END``)."""
        if src == END or dst == START:
            raise ValueError(f"an edge cannot leave END or enter START, got {src!r} -> {dst!r}")
        if src == START:
            if self.entry is not None:
                raise ValueError(f"START already leads to {self.entry!r}: {_ONE_EDGE}")
            self.entry = dst
            return self
        self._check_free(src)
        self.edges[src] = dst
        return self

    def add_conditional_edges(
        self, src: str, router: Callable[[dict], Any], mapping: dict | list | None = None
    ) -> StateGraph:
        """After ``src`` run the node ``router(state)`` names (through ``mapping``, if given: its key -> node)."""
        if src in (START, END):
            raise ValueError(f"conditional edges must leave a node, not {src!r}; the entry is add_edge(START, node)")
        if not callable(router):
            raise TypeError(f"the router of {src!r} must be callable as router(state), got {router!r}")
        self._check_free(src)
        if isinstance(mapping, list):
            mapping = {name: name for name in mapping}
        self.branches[src] = (router, dict(mapping) if mapping is not None else None)
        return self

    def _check_free(self, src: str) -> None:
        if src in self.edges or src in self.branches:
            raise ValueError(f"node {src!r} already has an outgoing edge: {_ONE_EDGE}")

    def validate(self) -> None:
        """Raise ValueError unless the graph has an entry, known targets, no dead ends and no unreachable nodes."""
        if self.entry is None:
            raise ValueError("the graph has no entry: add graph.add_edge(START, '<first node>')")
        targets = {self.entry: "START"} | {dst: src for src, dst in self.edges.items()}
        targets |= {dst: src for src, (_, mapping) in self.branches.items() for dst in (mapping or {}).values()}
        for dst, src in targets.items():
            if dst != END and dst not in self.nodes:
                raise ValueError(
                    f"an edge from {src!r} goes to {dst!r}, which is not a node; nodes: {sorted(self.nodes)}"
                )
        for src in [*self.edges, *self.branches]:
            if src not in self.nodes:
                raise ValueError(f"an edge leaves {src!r}, which is not a node; add it with graph.add_node")
        for name in self.nodes:
            if name not in self.edges and name not in self.branches:
                raise ValueError(f"node {name!r} is a dead end: add graph.add_edge({name!r}, END) or an edge onward")
        seen, todo, open_router = set(), [self.entry], False
        while todo:
            name = todo.pop()
            if name in seen or name == END:
                seen.add(name)
                continue
            seen.add(name)
            if name in self.edges:
                todo.append(self.edges[name])
            else:
                mapping = self.branches[name][1]
                open_router |= mapping is None
                todo.extend((mapping or {}).values())
        if not open_router:  # with a router without a mapping, any node may come next
            unreachable = sorted(set(self.nodes) - seen)
            if unreachable:
                raise ValueError(f"nodes {unreachable} cannot be reached from START; connect them or remove them")
            if END not in seen:
                raise ValueError("no path leads to END: every run would loop until max_steps")

    def compile(self, checkpointer=None) -> CompiledGraph:
        """Check the graph and freeze it into something that runs (checkpoints go to ``checkpointer``)."""
        self.validate()
        return CompiledGraph(self, checkpointer)


# The resume values for the node about to run, by node name (set by invoke, one per run's context).
_RESUME: contextvars.ContextVar[dict[str, tuple] | None] = contextvars.ContextVar("resume_values", default=None)


class _NodeCall:
    """A node's function as the compiled graph calls it: with its timeout and its interrupt answers."""

    def __init__(self, node: Node):
        self.name = node.name
        self.fn = with_timeout(node.fn, node.timeout, node.name) if node.timeout is not None else node.fn

    def __call__(self, state: dict) -> dict | None:
        pending = _RESUME.get() or {}
        try:
            with answering(pending.get(self.name, ())):
                update = self.fn(state)
        except GraphInterrupt as asked:
            asked.node = self.name
            raise
        pending.pop(self.name, None)  # answers are spent; a later visit of this node asks again
        return update


class CompiledGraph:
    """A validated graph that runs: ``invoke`` (to the end or an interrupt), ``stream`` (step by step).

    ``nodes`` hold the wrapped functions (timeouts, interrupt answers), so ``run_graph(compiled, ...)``
    works as well. Without a checkpointer every ``invoke`` starts fresh and interrupts cannot resume.
    """

    def __init__(self, graph: StateGraph, checkpointer=None):
        self.schema, self.reducers, self.entry = graph.schema, graph.reducers, graph.entry
        self.nodes = {name: Node(name, _NodeCall(node), node.retry, node.timeout) for name, node in graph.nodes.items()}
        self.edges, self.branches = dict(graph.edges), dict(graph.branches)
        self.checkpointer = checkpointer
        self.trace: list[TraceEvent] = []

    def get_state(self, thread_id: str = "default") -> Checkpoint | None:
        """The latest checkpoint of ``thread_id`` (None if it has none, or without a checkpointer)."""
        return self.checkpointer.latest(thread_id) if self.checkpointer is not None else None

    def invoke(
        self,
        state_or_command: dict | Command | None,
        *,
        thread_id: str = "default",
        max_steps: int = 25,
        sleep: Callable[[float], None] = time.sleep,
    ) -> dict:
        """Run to END, or until a node interrupts (then the result holds ``"__interrupt__": [Interrupt]``).

        Args:
            state_or_command: an input state (a fresh thread, or a new run on a finished one: merged
                into its state as LangGraph does); None to resume a thread that stopped (a crash);
                ``Command(resume=value)`` to answer the thread's pending interrupt.
            thread_id: the conversation or job; checkpoints are kept per thread.
            max_steps: the most steps this run may take.
            sleep: the backoff sleep.

        Returns:
            The final state (plus ``"__interrupt__"`` if a human must answer first).
        """
        self.trace = []
        return self._run(state_or_command, thread_id, max_steps, sleep, self.trace)

    def stream(
        self,
        state_or_command: dict | Command | None,
        *,
        thread_id: str = "default",
        max_steps: int = 25,
        sleep: Callable[[float], None] = time.sleep,
    ) -> Iterator[tuple[int, str, dict | None]]:
        """Like ``invoke``, yielding ``(step, node, update)`` as each node finishes (the run goes on a worker thread).

        An interrupt is yielded last as ``(step, "__interrupt__", {"__interrupt__": [Interrupt]})``. A consumer
        that stops early does not stop the run: it finishes on its thread, checkpoints included.
        """
        events: queue.Queue = queue.Queue()

        class Feed(list):
            def append(self, event: TraceEvent) -> None:
                super().append(event)
                if event.error is None:
                    events.put(("step", event))

        self.trace = Feed()

        def work() -> None:
            try:
                events.put(("done", self._run(state_or_command, thread_id, max_steps, sleep, self.trace)))
            except BaseException as error:  # raised again in the consumer's thread
                events.put(("error", error))

        threading.Thread(target=work, name="graph-stream", daemon=True).start()
        while True:
            kind, item = events.get()
            if kind == "step":
                yield item.step, item.node, item.update
            elif kind == "error":
                raise item
            else:
                if "__interrupt__" in item:
                    yield self.get_state(thread_id).step, "__interrupt__", {"__interrupt__": item["__interrupt__"]}
                return

    def _run(self, given, thread_id: str, max_steps: int, sleep, trace: list) -> dict:
        checkpointer = self.checkpointer if self.checkpointer is not None else MemoryCheckpointer()
        resume = self._prepare(given, thread_id, checkpointer)
        token = _RESUME.set(resume)
        try:
            return run_graph(
                self,
                None if isinstance(given, Command) else given,
                checkpointer=checkpointer,
                thread_id=thread_id,
                max_steps=max_steps,
                sleep=sleep,
                trace=trace,
            )
        except GraphInterrupt as asked:
            if self.checkpointer is None:
                raise RuntimeError(
                    f"node {asked.node!r} called interrupt(), which needs a checkpointer to resume "
                    "from: compile(checkpointer=MemoryCheckpointer())"
                ) from None
            last = checkpointer.latest(thread_id)
            if last is not None:  # the state before the node that asked
                state, step = last.state, last.step
            else:
                state, step = merge_update({}, given, self.reducers), 0
            checkpointer.put(
                thread_id,
                Checkpoint(
                    step=step,
                    node=asked.node,
                    next_node=asked.node,
                    state=state,
                    pending_interrupt=asked.value,
                    resume_values=resume.get(asked.node, ()),
                ),
            )
            return {**state, "__interrupt__": [Interrupt(asked.value, asked.node)]}
        finally:
            _RESUME.reset(token)

    def _prepare(self, given, thread_id: str, checkpointer) -> dict[str, tuple]:
        """Check that ``given`` fits the thread's state; return the resume values by node."""
        last = checkpointer.latest(thread_id)
        where = f"thread {thread_id!r}"
        if isinstance(given, Command):
            if last is None or last.pending_interrupt is None:
                raise ValueError(f"{where} has no pending interrupt to answer; Command(resume=...) answers one")
            return {last.next_node: (*last.resume_values, given.resume)}
        if last is not None and last.pending_interrupt is not None:
            raise ValueError(
                f"{where} waits for an answer to {last.pending_interrupt!r} (node {last.next_node!r}): "
                "invoke(Command(resume=answer), thread_id=...)"
            )
        if given is None:
            if last is None:
                raise ValueError(f"{where} has no checkpoint to resume from: give an input state")
        elif not isinstance(given, dict):
            raise TypeError(f"invoke takes a state dict, None (resume) or Command(resume=...), got {given!r:.80}")
        elif last is not None and last.next_node != END:
            raise ValueError(
                f"{where} stopped at step {last.step} before node {last.next_node!r}: resume it with "
                "invoke(None, thread_id=...), or clear it / use a new thread_id to start over"
            )
        elif last is not None:  # a new run on a finished thread starts from its state, as in LangGraph
            checkpointer.put(
                thread_id,
                Checkpoint(
                    step=0, node=START, next_node=self.entry, state=merge_update(last.state, given, self.reducers)
                ),
            )
        return {}
