"""A chat workload whose prompts share prefixes, as a router in front of replicas sees them.

Real chat traffic repeats itself at the front: every conversation of one product starts with the
same system prompt, and every turn of a conversation resends all the turns before it. A replica
that served the previous turn holds that history in its prefix cache; another replica has to
prefill it again. ``chat_workload`` draws such traffic from a seed: a few system prompts, and
conversations whose turns each extend the previous turn's messages (the assistant's replies are
scripted, so every run, whatever replica answers, sends exactly the same prompts).

``replay`` plays it against a server: ``concurrency`` users, each taking the next conversation and
sending its turns one after another (a turn leaves once the previous answer is complete), every
request streamed and stamped like ``infra_lib.ops.loadgen`` does.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

from infra_lib.ops.latency import RequestTiming

SYSTEM_PROMPTS = (
    "You are the support assistant of a company that rents out cargo bikes in three cities. Answer in "
    "short, friendly sentences. Customers ask about prices, opening hours, damage, insurance and how "
    "to book a bike; when you do not know something, say so and point them to the counter staff.",
    "You are a tutor for a first course in operating systems. Explain one idea at a time with a small "
    "example, ask the student a question back when the idea is new, and never hand out a full "
    "solution to an exercise: give a hint that names the concept they missed.",
    "You are a travel planner for trains across Europe. Suggest routes with their changes, say how long "
    "each leg takes and whether a reservation is needed, mention night trains where they fit, and keep "
    "every answer to a few lines unless the traveller asks for details.",
    "You are a kitchen assistant for a small restaurant. You help the cooks scale recipes, convert "
    "units, plan the prep list for the evening and check which dishes contain common allergens. "
    "Be precise with quantities and always repeat the unit you used.",
)

_TOPICS = (
    "the weekend price",
    "a flat tyre",
    "the child seat",
    "paging and virtual memory",
    "a race between two threads",
    "the night train to Vienna",
    "a change in Munich",
    "a gluten-free dessert",
    "scaling the soup for forty",
    "what a deadlock is",
    "the deposit",
    "the first train on Sunday",
)
_ASKS = (
    "Can you tell me more about {topic}?",
    "I still do not understand {topic}; could you explain it another way?",
    "What should I know about {topic} before tomorrow?",
    "My friend asked me about {topic} and I was not sure what to say.",
    "Is there anything special about {topic} in winter?",
)
_WORDS = (
    "usually, really, quickly, maybe, honestly, also, later, today, again, still, exactly, only, "
    "first, then, carefully, together, anyway, already, perhaps, simply"
).split(", ")


@dataclass(frozen=True)
class Conversation:
    """One conversation: its system prompt and its turns, each a (user message, scripted reply) pair."""

    system: str
    turns: tuple[tuple[str, str], ...]

    def messages(self, turn: int) -> list[dict]:
        """The chat messages of request ``turn`` (0-based): the system prompt, every earlier turn with
        its reply, then this turn's user message."""
        if not 0 <= turn < len(self.turns):
            raise ValueError(f"turn must lie in [0, {len(self.turns)}), got {turn}")
        messages = [{"role": "system", "content": self.system}]
        for user, reply in self.turns[:turn]:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        return messages + [{"role": "user", "content": self.turns[turn][0]}]


def chat_workload(num_conversations: int, turns: int, seed: int = 0, num_system_prompts: int = 3) -> list[Conversation]:
    """``num_conversations`` conversations of ``turns`` turns each, spread over the first
    ``num_system_prompts`` system prompts, drawn from ``seed``."""
    if num_conversations < 1 or turns < 1:
        raise ValueError(f"num_conversations and turns must be positive, got {num_conversations} and {turns}")
    if not 1 <= num_system_prompts <= len(SYSTEM_PROMPTS):
        raise ValueError(f"num_system_prompts must lie in [1, {len(SYSTEM_PROMPTS)}], got {num_system_prompts}")
    rng = random.Random(seed)

    def sentence(words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."

    conversations = []
    for c in range(num_conversations):
        pairs = []
        for _ in range(turns):
            user = rng.choice(_ASKS).format(topic=rng.choice(_TOPICS)) + " " + sentence(rng.randint(4, 12))
            reply = " ".join(sentence(rng.randint(6, 14)) for _ in range(rng.randint(3, 6)))
            pairs.append((user, reply))
        conversations.append(Conversation(SYSTEM_PROMPTS[c % num_system_prompts], tuple(pairs)))
    return conversations


async def _stream_chat(client, url: str, body: dict, timing: RequestTiming) -> None:
    """Stream one chat request into ``timing`` (chunks with content stamped; usage from the last chunk)."""
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            timing.success, timing.error = False, f"{response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: ") :])
            if "error" in data:
                timing.success, timing.error = False, f"stream error: {data['error'].get('message')}"
                return
            if any("content" in (choice.get("delta") or {}) for choice in data.get("choices") or ()):
                timing.chunk_times.append(time.perf_counter())
            if data.get("usage"):
                timing.prompt_tokens = data["usage"]["prompt_tokens"]
                timing.output_tokens = data["usage"]["completion_tokens"]


async def replay(
    base_url: str,
    conversations: list[Conversation],
    *,
    model: str,
    concurrency: int = 4,
    max_tokens: int = 16,
    timeout_s: float = 600.0,
) -> tuple[list[RequestTiming], float]:
    """Play ``conversations`` against ``base_url`` (no ``/v1``) with ``concurrency`` users, closed loop.

    Every request is greedy and produces exactly ``max_tokens`` tokens (``ignore_eos``), so runs are
    comparable. Returns each request's timing, in conversation-then-turn order, and the run's
    duration in seconds."""
    import httpx

    if concurrency < 1:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    url = base_url.rstrip("/") + "/v1/chat/completions"
    timings: dict[tuple[int, int], RequestTiming] = {}
    queue = list(range(len(conversations)))[::-1]

    async def user(client) -> None:
        while queue:
            c = queue.pop()
            for turn in range(len(conversations[c].turns)):
                body = {
                    "model": model,
                    "messages": conversations[c].messages(turn),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                timing = timings[c, turn] = RequestTiming(send_time=time.perf_counter())
                try:
                    await _stream_chat(client, url, body, timing)
                except httpx.HTTPError as exc:
                    timing.success, timing.error = False, f"{type(exc).__name__}: {exc}"
                timing.end_time = time.perf_counter()

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        start = time.perf_counter()
        await asyncio.gather(*(user(client) for _ in range(concurrency)))
        duration = time.perf_counter() - start
    return [timings[key] for key in sorted(timings)], duration
