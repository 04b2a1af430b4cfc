"""Agents and orchestration (L7): a small state-graph runtime, tools, model clients, routing.

    graph.py       StateGraph (nodes, edges, conditional edges, reducers), compile -> CompiledGraph
    runner.py      run_graph: run a node, merge its update, pick the next edge, checkpoint, repeat;
                   interrupt / Command for a human in the loop
    retry.py       RetryPolicy, exponential backoff, call_with_retry, node timeouts
    checkpoint.py  Checkpoint, MemoryCheckpointer, SqliteCheckpointer (resume after a crash)
    tools.py       Tool, @tool (JSON schema from type hints), argument validation, tool-error messages
    models.py      ChatReply, OpenAIChatModel (the course server, tool calls parsed from JSON), ScriptedModel
    agent.py       ToolAgent: model -> tools -> model ... built as a StateGraph
    router.py      Router: cheap or strong model per request, with token cost accounting

The runtime follows LangGraph's semantics for sequential graphs, and the tests run the same
graphs through LangGraph to show it.
"""

from infra_lib.apps.agents.agent import AgentResult, ToolAgent
from infra_lib.apps.agents.checkpoint import Checkpoint, MemoryCheckpointer, SqliteCheckpointer
from infra_lib.apps.agents.graph import CompiledGraph, Node, StateGraph
from infra_lib.apps.agents.models import ChatReply, OpenAIChatModel, ScriptedModel, parse_tool_calls
from infra_lib.apps.agents.retry import NodeTimeout, RetryPolicy, backoff_delays, call_with_retry, with_timeout
from infra_lib.apps.agents.router import Price, Router, keyword_rule, length_rule
from infra_lib.apps.agents.runner import (
    END,
    START,
    Command,
    GraphInterrupt,
    GraphRecursionError,
    Interrupt,
    TraceEvent,
    interrupt,
    merge_update,
    next_node,
    run_graph,
)
from infra_lib.apps.agents.tools import Tool, ToolCall, run_tool_call, tool

__all__ = [
    # the runtime
    "END",
    "START",
    "Checkpoint",
    "Command",
    "CompiledGraph",
    "GraphInterrupt",
    "GraphRecursionError",
    "Interrupt",
    "MemoryCheckpointer",
    "Node",
    "NodeTimeout",
    "RetryPolicy",
    "SqliteCheckpointer",
    "StateGraph",
    "TraceEvent",
    "backoff_delays",
    "call_with_retry",
    "interrupt",
    "merge_update",
    "next_node",
    "run_graph",
    "with_timeout",
    # tools, models, the agent, routing
    "AgentResult",
    "ChatReply",
    "OpenAIChatModel",
    "Price",
    "Router",
    "ScriptedModel",
    "Tool",
    "ToolAgent",
    "ToolCall",
    "keyword_rule",
    "length_rule",
    "parse_tool_calls",
    "run_tool_call",
    "tool",
]
