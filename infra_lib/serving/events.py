"""One log of what happened to requests inside the engine, from which every serving metric is derived.

The engine appends an ``EngineEvent`` when a request arrives, is admitted (first time or again
after a preemption), is preempted, gets a token, or finishes, and one ``step`` event per engine
step with the queues and the KV pool after it. Prometheus counters and histograms
(``observability.py``), the notebooks' timelines and the latency diagnosis all read this one
log, so they cannot disagree about what happened.

    arrived    request_id  prompt_tokens
    admitted   request_id  cached_tokens, prompt_tokens, first (False after a preemption)
    preempted  request_id
    token      request_id  first (the request's first output token)
    finished   request_id  reason ("stop", "length", "abort"), prompt_tokens, output_tokens,
                           running, waiting, kv_usage (after its blocks were freed)
    step       -1          start, running, waiting, kv_usage, batched_tokens, prefill_tokens, decode_seqs
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

EVENT_KINDS = ("arrived", "admitted", "preempted", "token", "finished", "step")


@dataclass(frozen=True)
class EngineEvent:
    """Something that happened at ``time`` (seconds on the engine's clock) to ``request_id`` (-1: the engine)."""

    kind: str
    time: float
    request_id: int = -1
    data: dict = field(default_factory=dict)


class EventLog:
    """An append-only log of ``EngineEvent`` with subscribers.

    Args:
        maxlen: keep at most this many events (the oldest are dropped; subscribers still see all).
            None keeps everything, right for experiments; a long-running server bounds it.
    """

    def __init__(self, maxlen: int | None = None):
        self._events: deque[EngineEvent] = deque(maxlen=maxlen)
        self._subscribers: list = []
        self._lock = threading.Lock()
        self.total = 0  # events ever emitted

    def subscribe(self, callback) -> None:
        """Call ``callback(event)`` for every event emitted from now on (in the emitting thread)."""
        with self._lock:
            self._subscribers.append(callback)

    def emit(self, kind: str, time: float, request_id: int = -1, **data) -> EngineEvent:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {EVENT_KINDS}")
        event = EngineEvent(kind, float(time), int(request_id), data)
        with self._lock:
            self._events.append(event)
            self.total += 1
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback(event)
        return event

    def events(self, kind: str | None = None, request_id: int | None = None) -> list[EngineEvent]:
        """The kept events, oldest first, optionally only one kind or one request."""
        with self._lock:
            events = list(self._events)
        return [
            e for e in events if (kind is None or e.kind == kind) and (request_id is None or e.request_id == request_id)
        ]

    def __len__(self) -> int:
        return len(self._events)

    def request_timelines(self) -> dict[int, dict]:
        """Per request: arrival, first admission, token times, finish time and reason, preemptions.

        The same quantities a benchmark client measures from outside, here from inside the engine.
        """
        out: dict[int, dict] = {}
        for e in self.events():
            if e.request_id < 0:
                continue
            r = out.setdefault(
                e.request_id,
                {
                    "arrival": None,
                    "admitted": None,
                    "token_times": [],
                    "finish": None,
                    "reason": None,
                    "preemptions": 0,
                    "prompt_tokens": None,
                    "cached_tokens": 0,
                },
            )
            if e.kind == "arrived":
                r["arrival"], r["prompt_tokens"] = e.time, e.data.get("prompt_tokens")
            elif e.kind == "admitted" and r["admitted"] is None:
                r["admitted"], r["cached_tokens"] = e.time, e.data.get("cached_tokens", 0)
            elif e.kind == "preempted":
                r["preemptions"] += 1
            elif e.kind == "token":
                r["token_times"].append(e.time)
            elif e.kind == "finished":
                r["finish"], r["reason"] = e.time, e.data.get("reason")
        return out
