"""Stopwatches around the serving engine's parts, built from their public classes.

Each wrapper does exactly what the part it wraps does and adds the wall time to a shared
``Stopwatch`` under one name, so a trace can say where a request's time went without changing
the serving code:

    TimedTokenizer     "tokenize" (chat template + BPE), "detokenize" (stream decoder push/flush)
    TimedScheduler     "scheduler" (add, schedule, commit, finish)
    TimedModelRunner   "forward" (the model's forward pass, inside a profiler range) and
                       "sampling" (the rest of ``run``: logits to the CPU, choosing tokens)
    KernelProfiler     an event-log subscriber: starts ``torch.profiler`` on the engine's thread when
                       the traced request arrives, stops it when it finishes, and sums the ATen
                       operators' self time inside the forward ranges, by operator
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from infra_lib.kernels.profiling import start_profiler
from infra_lib.serving.model_runner import ModelRunner
from infra_lib.serving.scheduler import Scheduler

FORWARD_RANGE = "infra_lib::forward"  # the profiler range around each forward pass


class Stopwatch:
    """Seconds and call counts per name; written by one thread (the engine's), read after."""

    def __init__(self):
        self._seconds: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] += seconds
        self._counts[name] += 1

    def seconds(self, name: str) -> float:
        return self._seconds.get(name, 0.0)

    def count(self, name: str) -> int:
        return self._counts.get(name, 0)

    def reset(self) -> None:
        self._seconds.clear()
        self._counts.clear()


class _TimedDecoder:
    def __init__(self, decoder, watch: Stopwatch):
        self._decoder, self._watch = decoder, watch

    def push(self, token_id: int) -> str:
        start = time.perf_counter()
        text = self._decoder.push(token_id)
        self._watch.add("detokenize", time.perf_counter() - start)
        return text

    def flush(self) -> str:
        start = time.perf_counter()
        text = self._decoder.flush()
        self._watch.add("detokenize", time.perf_counter() - start)
        return text


class TimedTokenizer:
    """A ``Tokenizer`` that times encoding and streamed decoding; everything else passes through."""

    def __init__(self, tokenizer, watch: Stopwatch):
        self._tokenizer, self._watch = tokenizer, watch

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        start = time.perf_counter()
        ids = self._tokenizer.encode_chat(messages, add_generation_prompt)
        self._watch.add("tokenize", time.perf_counter() - start)
        return ids

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        start = time.perf_counter()
        ids = self._tokenizer.encode(text, allow_special)
        self._watch.add("tokenize", time.perf_counter() - start)
        return ids

    def stream_decoder(self, skip_special: bool = True) -> _TimedDecoder:
        return _TimedDecoder(self._tokenizer.stream_decoder(skip_special), self._watch)


class TimedScheduler(Scheduler):
    """The course's scheduler, timing its four entry points (nested calls are counted once)."""

    def __init__(self, config, watch: Stopwatch, pool=None):
        super().__init__(config, pool)
        self.watch, self._depth = watch, 0

    def _timed(self, method, *args):
        self._depth += 1
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.watch.add("scheduler", time.perf_counter() - start)

    def add(self, seq) -> None:
        return self._timed(super().add, seq)

    def schedule(self):
        return self._timed(super().schedule)

    def commit(self, out) -> None:
        return self._timed(super().commit, out)

    def finish(self, seq, reason: str) -> None:
        return self._timed(super().finish, seq, reason)


class TimedModelRunner(ModelRunner):
    """The course's model runner, timing the forward pass and, apart from it, sampling."""

    def __init__(self, model, store, watch: Stopwatch):
        super().__init__(model, store)
        self.watch, self._forward_s = watch, 0.0

    def run(self, batch) -> dict[int, int]:
        start = time.perf_counter()
        self._forward_s = 0.0
        tokens = super().run(batch)
        self.watch.add("sampling", time.perf_counter() - start - self._forward_s)
        return tokens

    def forward(self, batch) -> torch.Tensor:
        start = time.perf_counter()
        with torch.profiler.record_function(FORWARD_RANGE):
            logits = super().forward(batch)
        self._forward_s = time.perf_counter() - start
        self.watch.add("forward", self._forward_s)
        return logits


@dataclass
class Capture:
    """What the profiler saw of one request: when it finished, what profiling cost, the profile."""

    request_id: int
    start_s: float  # starting the profiler (0 without one)
    finished_at: float | None = None  # perf_counter when the engine emitted the request's "finished"
    stop_s: float = 0.0  # stopping the profiler
    profile: object | None = field(default=None, repr=False)
    _ops: dict[str, float] | None = field(default=None, repr=False)

    @property
    def kernel_ops(self) -> dict[str, float]:
        """ATen operator -> seconds of self time inside forward ranges, largest first (empty without a profile)."""
        if self._ops is None:
            self._ops = kernel_self_times(self.profile) if self.profile is not None else {}
        return self._ops


def kernel_self_times(profile) -> dict[str, float]:
    """Per operator, the self CPU seconds of every event nested in a ``FORWARD_RANGE`` range.

    Reads the profiler's raw events (start, duration, thread) and rebuilds the nesting on each
    thread with a stack: an event's self time is its duration minus its direct children's.
    (``profile.events()`` builds the same tree in Python objects, a hundred times slower.)
    """
    by_thread: dict[int, list] = defaultdict(list)
    for event in profile.profiler.kineto_results.events():
        if event.device_type() == torch.autograd.DeviceType.CPU and event.duration_ns() >= 0:
            by_thread[event.start_thread_id()].append(event)
    totals: dict[str, float] = defaultdict(float)
    for events in by_thread.values():
        events.sort(key=lambda e: (e.start_ns(), -e.duration_ns()))
        stack: list[list] = []  # [end_ns, name, self_ns, inside_forward]
        for event in events:
            start, end, name = event.start_ns(), event.end_ns(), event.name()
            while stack and stack[-1][0] <= start:
                _close(stack.pop(), totals)
            inside = bool(stack) and (stack[-1][3] or stack[-1][1] == FORWARD_RANGE)
            if stack:
                stack[-1][2] -= end - start
            stack.append([end, name, end - start, inside])
        while stack:
            _close(stack.pop(), totals)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _close(frame: list, totals: dict[str, float]) -> None:
    _, name, self_ns, inside = frame
    if inside:
        totals[name] += self_ns / 1e9


class KernelProfiler:
    """Subscribe ``on_event`` to an engine's event log; ``arm()`` before sending the request to trace."""

    def __init__(self):
        self.capture: Capture | None = None
        self._armed: bool | None = None
        self._lock = threading.Lock()
        # The profiler's library initialises on first use and wants that to happen on the thread
        # that registered it (this one); the engine thread's start later finds it ready.
        primer = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        start_profiler(primer)
        primer.stop()

    def arm(self, profile: bool = True) -> None:
        """Capture the next request that arrives (with the profiler if ``profile``)."""
        with self._lock:
            self.capture, self._armed = None, profile

    def on_event(self, event) -> None:
        """Runs on the engine's thread, inside the engine's step or request intake."""
        if event.kind == "arrived":
            with self._lock:
                if self._armed is None or self.capture is not None:
                    return
                profile, self._armed = self._armed, None
            if not profile:
                self.capture = Capture(event.request_id, 0.0)
                return
            start = time.perf_counter()
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            start_profiler(profiler)
            self.capture = Capture(event.request_id, time.perf_counter() - start, profile=profiler)
        elif event.kind == "finished" and self.capture is not None and event.request_id == self.capture.request_id:
            finished = time.perf_counter()
            if self.capture.profile is not None:
                self.capture.profile.stop()
                self.capture.stop_s = time.perf_counter() - finished
            self.capture.finished_at = finished
