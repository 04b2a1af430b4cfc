"""A tool-using agent, built as a two-node state graph.

    START -> model --(the reply asks for tools, turns left)--> tools -> model -> ...
                   \\--(a plain answer, or out of turns)------> END

The ``model`` node asks the model for the next message, given the conversation and the tools'
schemas; the ``tools`` node runs the calls in that message (validated, errors returned as
messages) and appends the results. Because it is a graph, the agent gets the runtime's
checkpoints (a crashed conversation resumes), retries (a flaky model server), traces and
max_steps for free. The state is JSON (lists of message dicts), so SqliteCheckpointer can hold it.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, TypedDict

from infra_lib.apps.agents.graph import StateGraph
from infra_lib.apps.agents.retry import RetryPolicy
from infra_lib.apps.agents.runner import END, START, TraceEvent
from infra_lib.apps.agents.tools import Tool, run_tool_call


class AgentState(TypedDict):
    messages: Annotated[list, operator.add]  # the conversation: system, user, assistant and tool messages
    turns: int  # model replies so far in this run
    usage: Annotated[list, operator.add]  # one {"model", "prompt_tokens", "completion_tokens"} per reply


@dataclass(frozen=True)
class AgentResult:
    """What a run of the agent produced.

    Attributes:
        answer: the last assistant message without tool calls ("" if the run ran out of turns first).
        messages: the whole conversation.
        tool_calls: every tool call the model made, as ``{"id", "name", "arguments"}``.
        tool_results: the tool messages, in the same order.
        trace: one TraceEvent per node attempt.
        usage: the token usage of each model reply.
    """

    answer: str
    messages: list[dict]
    tool_calls: list[dict]
    tool_results: list[dict]
    trace: list[TraceEvent]
    usage: list[dict]

    @property
    def total_tokens(self) -> int:
        return sum(u["prompt_tokens"] + u["completion_tokens"] for u in self.usage)


class ToolAgent:
    """A model that may call tools, in a loop, until it answers or ``max_turns`` model replies are used.

    Args:
        model: anything with ``chat(messages, tools) -> ChatReply`` (``OpenAIChatModel``, ``ScriptedModel``,
            ``Router``).
        tools: the tools it may call.
        system_prompt: put before the conversation (the tool instructions are added by the model client).
        max_turns: the most model replies per run.
        retry: the retry policy of the model node (a flaky server).
        checkpointer: where the conversation is checkpointed (default: none kept between runs).
    """

    def __init__(
        self,
        model,
        tools: Sequence[Tool],
        system_prompt: str | None = None,
        max_turns: int = 4,
        retry: RetryPolicy | None = None,
        checkpointer=None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.model, self.tools = model, {t.name: t for t in tools}
        self.system_prompt, self.max_turns = system_prompt, max_turns
        graph = StateGraph(AgentState)
        graph.add_node("model", self.call_model, retry=retry)
        graph.add_node("tools", self.call_tools)
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", self.route, {"tools": "tools", END: END})
        graph.add_edge("tools", "model")
        self.graph = graph.compile(checkpointer=checkpointer)

    def call_model(self, state: dict) -> dict:
        """The ``model`` node: one reply, with its tool calls and token usage."""
        reply = self.model.chat(state["messages"], list(self.tools.values()))
        message = {"role": "assistant", "content": reply.text, "tool_calls": [c.as_dict() for c in reply.tool_calls]}
        usage = {
            "model": reply.model,
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
        }
        return {"messages": [message], "turns": state.get("turns", 0) + 1, "usage": [usage]}

    def call_tools(self, state: dict) -> dict:
        """The ``tools`` node: run each call of the last reply; results (or errors) become tool messages."""
        return {"messages": [run_tool_call(self.tools, call) for call in state["messages"][-1]["tool_calls"]]}

    def route(self, state: dict) -> str:
        """After the model: to the tools if it asked for any and turns are left, else the end."""
        asked = bool(state["messages"][-1].get("tool_calls"))
        return "tools" if asked and state["turns"] < self.max_turns else END

    def run(
        self, question: str, *, thread_id: str = "agent", sleep: Callable[[float], None] = time.sleep
    ) -> AgentResult:
        """Answer ``question`` (a new user message on ``thread_id``; a finished thread keeps its history)."""
        start = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if self.graph.get_state(thread_id) is not None:
            start = []  # the thread already has its system message
        state = self.graph.invoke(
            {"messages": [*start, {"role": "user", "content": question}], "turns": 0, "usage": []},
            thread_id=thread_id,
            max_steps=2 * self.max_turns + 1,
            sleep=sleep,
        )
        messages = state["messages"]
        answers = [m["content"] for m in messages if m["role"] == "assistant" and not m.get("tool_calls")]
        return AgentResult(
            answer=answers[-1] if answers and not messages[-1].get("tool_calls") else "",
            messages=messages,
            tool_calls=[c for m in messages if m["role"] == "assistant" for c in m.get("tool_calls", [])],
            tool_results=[m for m in messages if m["role"] == "tool"],
            trace=list(self.graph.trace),
            usage=state["usage"],
        )
