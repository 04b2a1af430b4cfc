"""The runner: execute a node, merge its update, pick the next edge, checkpoint, repeat.

``run_graph`` is the whole loop, one node per step (this runtime is sequential):

    resume from the thread's latest checkpoint, or start at the entry node
    while the node is not END:
        run it (with its retry policy) on a deep copy of the state: nothing the node does to what it is
            handed, a list inside it changed in place included, reaches the run's state; only its update does
        merge its update into the state (reducers for annotated keys, overwrite for the rest)
        ask the edges for the next node
        save a checkpoint (step, node, next node, state)

Human in the loop: a node calls ``interrupt(payload)``; the first time it raises
``GraphInterrupt``, the compiled graph saves a checkpoint that points back at that node and
returns; ``invoke(Command(resume=value))`` runs the node again, and this time ``interrupt``
returns ``value``. Nodes that ask should therefore do nothing irreversible before asking.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from infra_lib.apps.agents.checkpoint import Checkpoint
from infra_lib.apps.agents.retry import call_with_retry

START = "__start__"
END = "__end__"


class GraphRecursionError(RecursionError):
    """A run took ``max_steps`` steps without reaching END (usually a loop whose exit never comes)."""


class GraphInterrupt(BaseException):
    """Raised by ``interrupt`` to stop the run until a human answers.

    A ``BaseException``, like ``KeyboardInterrupt``: an ``except Exception`` in a node or a retry
    policy must not swallow it. ``node`` is filled in by the compiled graph.
    """

    def __init__(self, value: Any, node: str | None = None):
        super().__init__(value)
        self.value, self.node = value, node


@dataclass(frozen=True)
class Interrupt:
    """A question waiting for an answer: what ``invoke`` returns under ``"__interrupt__"``."""

    value: Any
    node: str


@dataclass(frozen=True)
class Command:
    """Input to ``invoke`` that answers the pending interrupt of a thread: ``Command(resume=value)``."""

    resume: Any


@dataclass(frozen=True)
class TraceEvent:
    """One attempt of one node: its step, attempt number, duration, error (None if it succeeded) and update."""

    step: int
    node: str
    attempt: int
    duration_s: float
    error: str | None
    update: dict | None


class Reducers(dict):
    """``{key: reducer}`` for the annotated keys of a state schema, and the schema's keys (``schema``)."""

    def __init__(self, reducers: dict[str, Callable[[Any, Any], Any]], schema: frozenset[str]):
        super().__init__(reducers)
        self.schema = schema


class _Answers:
    """The resume values of the node being run, handed out in order to its ``interrupt`` calls."""

    def __init__(self, values: tuple):
        self.values, self.used = values, 0


_ANSWERS: contextvars.ContextVar[_Answers | None] = contextvars.ContextVar("interrupt_answers", default=None)


@contextlib.contextmanager
def answering(values: tuple) -> Iterator[None]:
    """Run a node inside this block so that its ``interrupt`` calls return ``values`` in order, then raise."""
    token = _ANSWERS.set(_Answers(tuple(values)))
    try:
        yield
    finally:
        _ANSWERS.reset(token)


def interrupt(payload: Any) -> Any:
    """Ask a human: stop the run with ``payload`` the first time, return their answer when the run resumes.

    Args:
        payload: what to show the human (JSON-friendly for SqliteCheckpointer; not None).

    Returns:
        The value given with ``invoke(Command(resume=value))``, exactly.
    """
    answers = _ANSWERS.get()
    if answers is None:
        raise RuntimeError("interrupt() works only inside a node run by a compiled graph (invoke or stream)")
    if payload is None:
        raise ValueError("interrupt(None): give a payload that says what the human is asked")
    if answers.used < len(answers.values):
        answers.used += 1
        return answers.values[answers.used - 1]
    raise GraphInterrupt(payload)


def merge_update(state: dict, update: dict | None, reducers: dict[str, Callable[[Any, Any], Any]]) -> dict:
    """A new state: ``state`` with ``update`` applied (``state`` itself is left alone).

    Keys with a reducer combine old and new (``operator.add`` appends lists); a key the state
    does not hold yet takes the new value; every other key is overwritten.

    Args:
        state: the current state.
        update: what a node returned: a dict of keys to change, or None (no change).
        reducers: ``{key: reducer}``; ``graph.reducers`` also knows the schema, and a key outside
            it is a ValueError.

    Returns:
        The merged state, a new dict.
    """
    if update is not None and not isinstance(update, dict):
        raise TypeError(f"a node must return a dict of state keys or None, got {type(update).__name__}: {update!r:.80}")
    merged = dict(state)
    schema = getattr(reducers, "schema", None)
    for key, value in (update or {}).items():
        if schema is not None and key not in schema:
            raise ValueError(
                f"the update sets {key!r}, which is not a key of the state schema {sorted(schema)}; "
                "add it to the TypedDict or fix the node"
            )
        reducer = reducers.get(key)
        merged[key] = reducer(merged[key], value) if reducer is not None and key in merged else value
    return merged


def next_node(graph, current: str, state: dict) -> str:
    """The node after ``current``: its conditional edge's choice (mapped if a mapping was given), else its plain edge.

    Raises:
        ValueError: the router chose something that is neither a node nor END, or ``current`` has no edge.
    """
    if current in graph.branches:
        router, mapping = graph.branches[current]
        choice = router(state)
        if mapping is not None:
            try:
                target = mapping[choice]
            except (KeyError, TypeError):
                raise ValueError(
                    f"the router of {current!r} returned {choice!r}, which is not a key of its "
                    f"mapping; allowed: {list(mapping)}"
                ) from None
        else:
            target = choice
        if not isinstance(target, str) or (target != END and target not in graph.nodes):
            raise ValueError(
                f"the router of {current!r} returned {choice!r}, which is not a node or END; "
                f"allowed targets: {sorted(graph.nodes) + [END]}"
            )
        return target
    if current in graph.edges:
        return graph.edges[current]
    raise ValueError(f"node {current!r} is a dead end: it has no outgoing edge; add graph.add_edge({current!r}, END)")


class AttemptLog:
    """Turns ``call_with_retry``'s callbacks into ``TraceEvent``s (the sleeps between attempts are not timed)."""

    def __init__(self, trace: list | None, step: int, node: str, sleep: Callable[[float], None]):
        self.trace = trace if trace is not None else []
        self.step, self.node, self._sleep = step, node, sleep
        self.started, self.succeeded = time.perf_counter(), None

    def sleep(self, seconds: float) -> None:
        self._sleep(seconds)
        self.started = time.perf_counter()

    def on_attempt(self, attempt: int, error: BaseException | None) -> None:
        event = TraceEvent(
            self.step,
            self.node,
            attempt,
            time.perf_counter() - self.started,
            None if error is None else f"{type(error).__name__}: {error}",
            None,
        )
        if error is None:
            self.succeeded = event  # recorded with its update in done()
        else:
            self.trace.append(event)

    def done(self, update: dict | None) -> None:
        self.trace.append(replace(self.succeeded, update=update))


def run_graph(
    graph,
    state: dict | None,
    *,
    checkpointer,
    thread_id: str,
    max_steps: int = 25,
    sleep: Callable[[float], None] = time.sleep,
    trace: list | None = None,
) -> dict:
    """Run ``graph`` to END, one node per step, checkpointing after each; resume if the thread has a checkpoint.

    Args:
        graph: a ``StateGraph`` or its compiled form (``nodes``, ``edges``, ``branches``, ``entry``, ``reducers``).
        state: the input state (ignored when the thread resumes; never changed).
        checkpointer: where checkpoints go (``MemoryCheckpointer``, ``SqliteCheckpointer``).
        thread_id: the run's name in the checkpointer.
        max_steps: the most steps a run may take (its steps before a resume count too).
        sleep: the backoff sleep (inject a recorder in tests).
        trace: if given, a ``TraceEvent`` is appended for every attempt of every node.

    Returns:
        The final state.
    """
    checkpoint = checkpointer.latest(thread_id)
    if checkpoint is not None:  # resume where the thread stopped
        state, node, step = checkpoint.state, checkpoint.next_node, checkpoint.step
    else:
        state, node, step = merge_update({}, state, graph.reducers), graph.entry, 0
    while node != END:
        if step >= max_steps:
            raise GraphRecursionError(
                f"the run took max_steps={max_steps} steps without reaching END (next node: "
                f"{node!r}); a loop that never exits? raise max_steps if it needs more"
            )
        log = AttemptLog(trace, step + 1, node, sleep)
        update = call_with_retry(
            graph.nodes[node].fn,
            copy.deepcopy(state),
            graph.nodes[node].retry,
            sleep=log.sleep,
            on_attempt=log.on_attempt,
        )
        log.done(update)
        state = merge_update(state, update, graph.reducers)
        following = next_node(graph, node, state)
        step += 1
        checkpointer.put(thread_id, Checkpoint(step=step, node=node, next_node=following, state=state))
        node = following
    return state
