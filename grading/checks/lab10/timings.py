"""Lab 10's inputs as plain data: synthetic request timings (streams of 0, 1 or many chunks, several
tokens per chunk, stalls, failed and abandoned requests) and the simulated engine's traces and window
statistics (``run_scenario``), made before any learner code runs."""

from __future__ import annotations

import functools
import random

from grading.checks.common import outcome, reference
from grading.checks.lab10.results import LATENCY, TASKS, compare_results, fmt

FAULTS = ("healthy", "slow_dependency", "kv_pressure", "head_of_line", "overload")  # as infra_lib.ops.diagnose
NAN = float("nan")  # no value: no chunk, fewer than two tokens, no end time


def timing_of(d: dict):
    """The ``RequestTiming`` a plain-data timing stands for."""
    from infra_lib.ops.latency import RequestTiming

    return RequestTiming(
        d["send_time"],
        list(d["chunk_times"]),
        d["end_time"],
        d["prompt_tokens"],
        d["output_tokens"],
        d["success"],
        d["error"],
    )


def describe_timing(d: dict) -> str:
    """One timing as a message names it, its chunk times cut after six."""
    chunks = d["chunk_times"]
    shown = ", ".join(fmt(c) for c in chunks[:6])
    if len(chunks) > 6:
        shown += f", ... {fmt(chunks[-1])}"
    failed = "" if d["success"] else f", success=False, error={d['error']!r}"
    return (
        f"RequestTiming(send_time={fmt(d['send_time'])}, chunk_times=[{shown}] ({len(chunks)} chunks), "
        f"end_time={fmt(d['end_time'])}, output_tokens={d['output_tokens']}{failed})"
    )


def synthetic(rng: random.Random, chunks: int, per_chunk: int = 1, stall: bool = False, failed: str = "") -> dict:
    """One request as a client saw it, times rounded to 0.1 ms. ``per_chunk`` > 1: the server flushes
    several tokens per chunk. ``failed``: "" (success), "rejected" (no chunk), "error" (the stream broke
    off) or "abandoned" (no end time)."""
    send = round(rng.uniform(0.0, 30.0), 3)
    t = send + rng.uniform(0.05, 0.8)
    stall_at = rng.randrange(1, chunks) if stall and chunks > 1 else -1
    times = []
    for i in range(chunks):
        if i:
            t += rng.uniform(0.015, 0.05) * per_chunk + (rng.uniform(0.4, 1.2) if i == stall_at else 0.0)
        times.append(round(t, 4))
    tokens = chunks * per_chunk - (rng.randrange(per_chunk) if chunks and per_chunk > 1 else 0)
    end = round(times[-1] + rng.uniform(0.0005, 0.004), 4) if times else round(send + rng.uniform(0.02, 0.3), 4)
    error = {
        "": "",
        "rejected": "HTTP 429: the server is at capacity",
        "error": "HTTP 500: engine error",
        "abandoned": "client timeout after 30 s",
    }[failed]
    return {
        "send_time": send,
        "chunk_times": times,
        "end_time": NAN if failed == "abandoned" else end,
        "prompt_tokens": rng.randint(16, 512),
        "output_tokens": tokens,
        "success": not failed,
        "error": error,
    }


def mixed_timings(rng: random.Random) -> list[dict]:
    """The visible cases of tasks 1 to 3: plain streams first, then the ones that tell mistakes apart."""
    return [
        synthetic(rng, rng.randint(8, 14)),  # one token per chunk
        synthetic(rng, rng.randint(6, 10), per_chunk=rng.randint(3, 5)),  # several tokens per chunk
        synthetic(rng, rng.randint(10, 16), stall=True),  # one long stall mid-stream
        synthetic(rng, 2),  # two tokens: one gap
        synthetic(rng, 1),  # a single token: no TPOT, no gap
        synthetic(rng, 1, per_chunk=rng.randint(12, 30)),  # not streamed: the whole answer in one chunk
        synthetic(rng, 0, failed="rejected"),  # refused before any token
        synthetic(rng, rng.randint(3, 8), failed="error"),  # the stream broke off
        synthetic(rng, rng.randint(3, 8), failed="abandoned"),  # the client gave up: no end time
    ]


@functools.cache
def scenario(name: str, seed: int) -> tuple[dict, tuple[dict, ...]]:
    """``run_scenario``'s window stats and client timings, as plain data (cached: every check of a
    grading run that picks the same scenario shares it)."""
    from infra_lib.ops.diagnose import run_scenario

    run = run_scenario(name, seed)
    return dict(run["stats"]), tuple(t.as_dict() for t in run["timings"])


def scenario_stats(name: str, seed: int) -> dict:
    """The window statistics of one run of a scenario (a copy of the cached ones)."""
    return dict(scenario(name, seed)[0])


def _merged(rng: random.Random, d: dict) -> dict:
    """The same request from a server that flushes ``group`` tokens per chunk."""
    group = rng.randint(2, 4)
    times = d["chunk_times"]
    merged = [times[min(i + group, len(times)) - 1] for i in range(0, len(times), group)]
    return {**d, "chunk_times": merged}


def _broken(rng: random.Random, d: dict) -> dict:
    """The same request failing part-way: an engine error, or a client that gave up."""
    keep = rng.randrange(len(d["chunk_times"]) + 1)
    times = d["chunk_times"][:keep]
    if rng.random() < 0.5:
        return {
            **d,
            "chunk_times": times,
            "end_time": NAN,
            "output_tokens": keep,
            "success": False,
            "error": "client timeout after 30 s",
        }
    end = (times[-1] if times else d["send_time"]) + 0.01
    return {
        **d,
        "chunk_times": times,
        "end_time": end,
        "output_tokens": keep,
        "success": False,
        "error": "HTTP 500: engine error",
    }


def traced(rng: random.Random, name: str | None = None, size: int | None = None) -> list[dict]:
    """Client timings of one scenario on the simulated engine, some re-chunked, a few failed."""
    name = name or rng.choice(FAULTS)
    timings = [dict(t) for t in scenario(name, rng.randrange(8))[1]]
    if size is not None:
        timings = rng.sample(timings, size)
    out = []
    for d in timings:
        d = {**d, "chunk_times": list(d["chunk_times"])}
        roll = rng.random()
        out.append(_merged(rng, d) if roll < 0.3 else _broken(rng, d) if roll < 0.4 else d)
    return out


def drive_per_request(fn, cases: list[dict]) -> list:
    """The outcome of ``fn`` on each timing (tasks 1 to 3 take one request each)."""
    return [outcome(fn, timing_of(d)) for d in cases]


def per_request_parts(name: str, problem) -> dict:
    """The fields the checks of one per-request metric (tasks 1 to 3) share: ``name``'s task and reference,
    each timing driven alone, results compared case by case with ``problem(timing, got, want)``."""

    def compare(got, expected, cases):
        return compare_results(name, got, expected, cases, describe_timing, problem)

    return {"task": TASKS[name], "reference": reference(LATENCY, name), "drive": drive_per_request, "compare": compare}


def trace_sample(rng: random.Random) -> list[dict]:
    """24 requests of one traced scenario."""
    return traced(rng, size=24)


def synthetic_run(rng: random.Random, size: int) -> list[dict]:
    """A run of ``size`` synthetic requests, with every kind (long, stalled, grouped, single, refused,
    broken) at least once, in any order."""
    kinds = [
        lambda: synthetic(rng, rng.randint(4, 30)),
        lambda: synthetic(rng, rng.randint(4, 30), stall=True),
        lambda: synthetic(rng, rng.randint(3, 8), per_chunk=rng.randint(2, 5)),
        lambda: synthetic(rng, 1),
        lambda: synthetic(rng, 0, failed="rejected"),
        lambda: synthetic(rng, rng.randint(2, 9), failed="error"),
    ]
    weights = [8, 3, 3, 2, 1, 1]
    run = [make() for make in kinds] + [rng.choices(kinds, weights)[0]() for _ in range(size - len(kinds))]
    rng.shuffle(run)  # every kind at least once, in any order
    return run
