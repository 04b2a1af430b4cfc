"""Model clients with one interface: ``chat(messages, tools) -> ChatReply`` (text, tool calls, token usage).

``OpenAIChatModel`` talks to any OpenAI-compatible server, the course's own included. The
course's server has no native tool-call API (SmolLM2 was not trained with one), so tool use
is done in the prompt, as it was before such APIs existed: the system message lists the tools'
JSON schemas and asks for exactly ``{"name": ..., "arguments": {...}}`` when a tool is needed;
a worked example or two of the same tools (few-shot) makes a small model follow the format;
the reply is parsed for its first JSON object (code fences tolerated). Tool results go back as
user messages (``Tool result (name): ...``), since the server knows only system, user and
assistant roles. ``ScriptedModel`` replays fixed replies through the same parser, for tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from infra_lib.apps.agents.tools import Tool, ToolCall

TOOL_PROMPT = (
    "You can call tools. Tools:\n{tools}\n"
    'To call a tool, reply with only a JSON object: {{"name": "<tool name>", "arguments": {{...}}}}.\n'
    "When a tool result is given, reply with the final answer in one sentence."
)


@dataclass(frozen=True)
class ChatReply:
    """One model reply: its text, the tool calls parsed from it, and the tokens it used."""

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def parse_tool_calls(text: str, id_prefix: str = "call") -> list[ToolCall]:
    """The tool call in a reply: its first JSON object that has a ``"name"`` (``"arguments"`` defaults to ``{}``).

    Text around the object, and code fences, are ignored; a reply without such an object is a
    plain answer (an empty list). ``"parameters"`` is accepted for ``"arguments"``.
    """
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            arguments = value.get("arguments", value.get("parameters", {}))
            return [ToolCall(value["name"], arguments, f"{id_prefix}_0")]
        start = text.find("{", start + 1)
    return []


def tool_example(question: str, call: ToolCall, result: str, answer: str) -> list[dict]:
    """A worked exchange for few-shot prompting: question, tool call, tool result, final answer."""
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call.as_dict()]},
        {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result},
        {"role": "assistant", "content": answer},
    ]


def to_wire(messages: Sequence[dict], tools: Sequence[Tool] = (), examples: Sequence[dict] = ()) -> list[dict]:
    """The conversation as plain system/user/assistant messages, with the tool prompt and the examples.

    Assistant tool calls become their JSON text; tool results become ``Tool result (name): ...`` user messages.
    """
    system = [m["content"] for m in messages if m["role"] == "system"]
    if tools:
        system.append(TOOL_PROMPT.format(tools="\n".join(json.dumps(t.schema()) for t in tools)))
    wire = [{"role": "system", "content": "\n".join(system)}] if system else []
    for message in [*(examples if tools else ()), *(m for m in messages if m["role"] != "system")]:
        if message["role"] == "tool":
            wire.append({"role": "user", "content": f"Tool result ({message['name']}): {message['content']}"})
        elif message.get("tool_calls"):
            text = "\n".join(
                json.dumps({"name": c["name"], "arguments": c["arguments"]}) for c in message["tool_calls"]
            )
            wire.append({"role": "assistant", "content": text})
        else:
            wire.append({"role": message["role"], "content": message["content"]})
    return wire


class OpenAIChatModel:
    """A chat model behind an OpenAI-compatible server, with tool calls prompted and parsed (see the module doc).

    Args:
        base_url: the server's API root, e.g. ``server.url + "/v1"``.
        model: the model id the server serves.
        api_key: sent as the bearer token (the course's server ignores it).
        temperature: 0 is greedy: the same prompt gives the same reply.
        max_tokens: the most tokens in one reply.
        examples: few-shot exchanges (``tool_example``) shown before the conversation when tools are offered.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "x",
        temperature: float = 0.0,
        max_tokens: int = 96,
        examples: Sequence[dict] = (),
    ):
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key=api_key)
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.examples = list(examples)

    def chat(self, messages: Sequence[dict], tools: Sequence[Tool] = ()) -> ChatReply:
        """One reply to ``messages``; its tool calls are parsed only when ``tools`` are offered."""
        response = self.client.chat.completions.create(
            model=self.model,
            messages=to_wire(messages, tools, self.examples),
            temperature=self.temperature,
            max_tokens=self.max_tokens,
        )
        text = response.choices[0].message.content or ""
        calls = parse_tool_calls(text, f"call_{len(messages)}") if tools else []
        usage = response.usage
        return ChatReply(
            text, calls, usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0, self.model
        )


def count_words(text: str) -> int:
    """A stand-in token count for scripted replies: whitespace-separated words."""
    return len(text.split())


class ScriptedModel:
    """Replies from a script, in order: deterministic, for tests and demonstrations.

    Args:
        replies: each a ``ChatReply``, or a text parsed for a tool call exactly as a real model's reply is.
        name: the model's name in replies and cost tables.
        count_tokens: how tokens are counted for text replies (default: words).
    """

    def __init__(
        self,
        replies: Iterable[ChatReply | str],
        name: str = "scripted",
        count_tokens: Callable[[str], int] = count_words,
    ):
        self.replies, self.name, self.count_tokens = list(replies), name, count_tokens
        self.calls: list[tuple[list[dict], list[Tool]]] = []

    def chat(self, messages: Sequence[dict], tools: Sequence[Tool] = ()) -> ChatReply:
        if len(self.calls) >= len(self.replies):
            raise RuntimeError(
                f"ScriptedModel {self.name!r} has no reply left: it was scripted with "
                f"{len(self.replies)} and is asked for number {len(self.calls) + 1}"
            )
        reply = self.replies[len(self.calls)]
        self.calls.append((list(messages), list(tools)))
        if isinstance(reply, ChatReply):
            return reply
        prompt = sum(self.count_tokens(m["content"]) for m in to_wire(messages, tools))
        calls = parse_tool_calls(reply, f"call_{len(messages)}") if tools else []
        return ChatReply(reply, calls, prompt, self.count_tokens(reply), self.name)
