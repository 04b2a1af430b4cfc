"""Model routing: send each request to a cheap or a strong model by a stated rule, and count the cost.

Most requests to an assistant are easy; paying the strong model's price for all of them is
waste. A router decides per request, from what it can see before answering (the length of the
question, keywords, whether tools are involved), and keeps the books: requests, tokens and
cost per model, against the baseline of sending everything to the strong model. That baseline
prices the same token counts at the strong model's rates (the strong model would have written
different answers of different lengths; the estimate says so by its name).

A ``Router`` has the models' own interface, ``chat(messages, tools)``, so an agent can use one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from infra_lib.apps.agents.models import ChatReply
from infra_lib.apps.agents.tools import Tool

ROUTES = ("cheap", "strong")


@dataclass(frozen=True)
class Price:
    """Dollars per million input (prompt) and output (completion) tokens."""

    input_per_million: float
    output_per_million: float

    def __post_init__(self):
        if self.input_per_million < 0 or self.output_per_million < 0:
            raise ValueError(f"prices must be >= 0, got {self}")

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """Dollars for one request."""
        return (prompt_tokens * self.input_per_million + completion_tokens * self.output_per_million) / 1e6


def _last_user_text(messages: Sequence[dict]) -> str:
    return next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")


def length_rule(max_chars: int = 200) -> Callable[[Sequence[dict], Sequence[Tool]], str]:
    """Strong for a last user message longer than ``max_chars`` characters, cheap otherwise."""

    def rule(messages: Sequence[dict], tools: Sequence[Tool] = ()) -> str:
        return "strong" if len(_last_user_text(messages)) > max_chars else "cheap"

    rule.__doc__ = f"strong if the question is longer than {max_chars} characters"
    return rule


def keyword_rule(keywords: Iterable[str]) -> Callable[[Sequence[dict], Sequence[Tool]], str]:
    """Strong when the last user message contains one of ``keywords`` (case-insensitive), cheap otherwise."""
    words = [k.lower() for k in keywords]

    def rule(messages: Sequence[dict], tools: Sequence[Tool] = ()) -> str:
        text = _last_user_text(messages).lower()
        return "strong" if any(w in text for w in words) else "cheap"

    rule.__doc__ = f"strong if the question mentions one of {words}"
    return rule


class Router:
    """Route each request to ``cheap`` or ``strong`` by ``rule``; keep per-request token and cost records.

    Args:
        cheap: a model client (``chat(messages, tools) -> ChatReply``) for easy requests.
        strong: a model client for hard ones.
        rule: ``rule(messages, tools) -> "cheap" | "strong"``.
        prices: ``{"cheap": Price, "strong": Price}``.
    """

    def __init__(self, cheap, strong, rule: Callable[[Sequence[dict], Sequence[Tool]], str], prices: dict[str, Price]):
        missing = [r for r in ROUTES if r not in prices]
        if missing:
            raise ValueError(f"prices needs an entry for {missing}, got keys {sorted(prices)}")
        self.models = {"cheap": cheap, "strong": strong}
        self.rule, self.prices = rule, dict(prices)
        self.records: list[dict] = []

    def route(self, messages: Sequence[dict], tools: Sequence[Tool] = ()) -> str:
        """Which model the rule picks for this request."""
        choice = self.rule(messages, tools)
        if choice not in ROUTES:
            raise ValueError(f"the routing rule returned {choice!r}; it must return 'cheap' or 'strong'")
        return choice

    def chat(self, messages: Sequence[dict], tools: Sequence[Tool] = ()) -> ChatReply:
        """Answer with the chosen model and record the request's tokens and cost."""
        choice = self.route(messages, tools)
        reply = self.models[choice].chat(messages, tools)
        self.records.append(
            {
                "route": choice,
                "model": reply.model,
                "prompt_tokens": reply.prompt_tokens,
                "completion_tokens": reply.completion_tokens,
                "cost": self.prices[choice].cost(reply.prompt_tokens, reply.completion_tokens),
                "strong_cost": self.prices["strong"].cost(reply.prompt_tokens, reply.completion_tokens),
            }
        )
        return reply

    def summary(self) -> dict:
        """Per route: requests, prompt/completion tokens, cost; and the total against all-strong at the same tokens."""
        table = {route: {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0} for route in ROUTES}
        for record in self.records:
            row = table[record["route"]]
            row["requests"] += 1
            row["prompt_tokens"] += record["prompt_tokens"]
            row["completion_tokens"] += record["completion_tokens"]
            row["cost"] += record["cost"]
        total = sum(row["cost"] for row in table.values())
        baseline = sum(record["strong_cost"] for record in self.records)
        return {
            **table,
            "total_cost": total,
            "all_strong_cost_same_tokens": baseline,
            "saving": 1 - total / baseline if baseline else 0.0,
        }
