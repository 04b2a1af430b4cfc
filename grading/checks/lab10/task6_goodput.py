"""Lab 10 task 6: ``goodput``, the requests per second that succeeded and met every SLO."""

from __future__ import annotations

import math
import random

from grading.checks.common import is_number, outcome, reference
from grading.checks.lab10.results import LATENCY, TASKS, YOURS, compare_results, fmt, same_number
from grading.checks.lab10.timings import NAN, synthetic, synthetic_run, timing_of, traced
from grading.registry import Check, register


def _limits_near(rng: random.Random, timings: list[dict]) -> dict[str, float]:
    """SLO limits (ms) that some successful requests of the run meet and some miss."""
    ok = [d for d in timings if d["success"] and d["chunk_times"]]
    ttfts = sorted((d["chunk_times"][0] - d["send_time"]) * 1000 for d in ok)
    tpots = sorted(
        (d["end_time"] - d["chunk_times"][0]) * 1000 / (d["output_tokens"] - 1) for d in ok if d["output_tokens"] > 1
    )
    e2els = sorted((d["end_time"] - d["send_time"]) * 1000 for d in ok)

    def between(xs):  # halfway between two neighbours well apart: no latency lies near the limit
        apart = [i for i in range(len(xs) - 1) if xs[i + 1] - xs[i] > 0.01]
        if not apart:
            return round(xs[-1] + 1.0, 3) if xs else 100.0
        i = rng.choice(apart)
        return round((xs[i] + xs[i + 1]) / 2, 3)

    return {"ttft": between(ttfts), "tpot": between(tpots), "e2el": between(e2els)}


def _goodput_cases(rng: random.Random) -> list[dict]:
    timings = synthetic_run(rng, 24)
    limits = _limits_near(rng, timings)
    duration = round(max(d["end_time"] for d in timings if not math.isnan(d["end_time"])) + 1.0, 3)
    subsets = [("ttft",), ("tpot",), ("ttft", "tpot"), ("e2el",), ("ttft", "tpot", "e2el"), ()]
    return [{"timings": timings, "duration_s": duration, "slo_ms": {k: limits[k] for k in keys}} for keys in subsets]


def _dyadic(send: float, first: float, gap: float, chunks: int, success: bool = True) -> dict:
    """A request whose times are exact in binary, so that a limit equal to a latency is exactly equal."""
    times = [send + first + i * gap for i in range(chunks)]
    return {
        "send_time": send,
        "chunk_times": times,
        "end_time": times[-1] if times else send + first,
        "prompt_tokens": 32,
        "output_tokens": chunks,
        "success": success,
        "error": "" if success else "HTTP 500: engine error",
    }


def _goodput_edges(rng: random.Random) -> list[dict]:
    send = float(rng.randint(0, 40)) / 2
    at_limit = [_dyadic(send, 0.25, 0.03125, rng.randint(3, 9)) for _ in range(3)]  # TTFT 250 ms, TPOT 31.25 ms
    above = [_dyadic(send, 0.5, 0.0625, 5), _dyadic(send, 0.125, 0.125, 4)]
    single = [_dyadic(send, 0.125, 0.03125, 1) for _ in range(2)]  # one token: no TPOT to judge
    failed_fast = [_dyadic(send, 0.0625, 0.015625, 6, success=False)]
    no_chunk = [{**synthetic(rng, 0), "success": True}]  # succeeded without a chunk: no TTFT
    batch = at_limit + above + single + failed_fast + no_chunk
    trace = traced(rng)
    duration = float(rng.randint(4, 20))
    return [
        {"timings": batch, "duration_s": duration, "slo_ms": {"ttft": 250.0, "tpot": 31.25}},
        {"timings": batch, "duration_s": duration, "slo_ms": {"tpot": 31.25}},
        {"timings": batch, "duration_s": duration, "slo_ms": {"ttft": 250.0}},
        {"timings": batch, "duration_s": duration, "slo_ms": {}},
        {"timings": [], "duration_s": duration, "slo_ms": {"ttft": 250.0}},
        {"timings": batch, "duration_s": 0.0, "slo_ms": {"ttft": 250.0}},
        {"timings": batch, "duration_s": -duration, "slo_ms": {}},
        {"timings": trace, "duration_s": round(trace[-1]["send_time"] + 5.0, 3), "slo_ms": _limits_near(rng, trace)},
    ]


def _drive_goodput(fn, cases: list[dict]) -> list:
    return [
        outcome(fn, [timing_of(d) for d in case["timings"]], case["duration_s"], dict(case["slo_ms"])) for case in cases
    ]


def _describe_goodput(case: dict) -> str:
    timings = case["timings"]
    failed = sum(not d["success"] for d in timings)
    single = sum(d["success"] and d["output_tokens"] < 2 for d in timings)
    return (
        f"{len(timings)} requests ({failed} failed, {single} with fewer than two output tokens), "
        f"duration_s={case['duration_s']}, slo_ms={case['slo_ms']}"
    )


def _variant_goodput(
    case: dict, *, count_failed=False, nan_tpot_fails=False, nan_meets=False, strict=False, seconds=False
) -> float:
    """Goodput computed with one common mistake, for the message."""
    met = 0
    for d in case["timings"]:
        chunks = d["chunk_times"]
        first = chunks[0] - d["send_time"] if chunks else NAN
        e2el = d["end_time"] - d["send_time"]
        tpot = (e2el - first) / (d["output_tokens"] - 1) if d["output_tokens"] > 1 and chunks else NAN
        measured = {"ttft": first, "tpot": tpot, "e2el": e2el}
        ok = d["success"] or count_failed
        for key, limit in case["slo_ms"].items():
            value = measured[key] * (1 if seconds else 1000)
            if math.isnan(value) and (nan_meets or (key == "tpot" and not nan_tpot_fails)):
                continue
            if not (value < limit if strict else value <= limit):
                ok = False
        met += ok
    return met / case["duration_s"]


def _goodput_problem(case: dict, got, want):
    if same_number(got, want):
        return None
    mistakes = {
        "you counted failed requests: a request that failed never meets an SLO": {"count_failed": True},
        "a request with fewer than two tokens has no TPOT (nan) and meets any TPOT SLO": {"nan_tpot_fails": True},
        "you counted a request without a TTFT or an E2EL (nan: no chunk, or no end): nan meets no TTFT or "
        "E2EL limit, and a test such as value > limit lets it through": {"nan_meets": True},
        "a latency equal to its limit meets the SLO (<=, not <)": {"strict": True},
        "the limits are in milliseconds and the latencies in seconds: multiply by 1000": {"seconds": True},
    }
    fits = [
        why
        for why, flags in mistakes.items()
        if is_number(got)
        and not same_number(_variant_goodput(case, **flags), want)
        and same_number(got, _variant_goodput(case, **flags))
    ]
    note = (
        "".join(f"; {why}" for why in fits)
        if len(fits) < 2
        else (
            "; this rate fits more than one mistake: " + "; or ".join(f"({i}) {why}" for i, why in enumerate(fits, 1))
        )
    )
    per_request = want * case["duration_s"] / len(case["timings"]) if case["timings"] else NAN
    if not note and same_number(got, per_request) and not same_number(per_request, want):
        note = "; divide the count by duration_s (requests per second), not by the number of requests"
    return "goodput returned the wrong rate", f"expected {fmt(want)} requests/s, got {fmt(got)}{note or YOURS}"


def _compare_goodput(got, expected, cases):
    return compare_results("goodput", got, expected, cases, _describe_goodput, _goodput_problem)


_GOODPUT_HINT = (
    "goodput counts the requests that succeeded and met every SLO present in slo_ms (limits in "
    "milliseconds; a latency equal to its limit meets it) per second of the run, not per request. A "
    "nan TPOT (fewer than two tokens) meets any TPOT limit, a nan TTFT or E2EL meets none, a failed "
    "request never counts, with no SLO every successful request counts, and a duration of zero or less "
    "raises ValueError."
)
register(
    Check(
        check_id="lab10.goodput",
        task=TASKS["goodput"],
        reference=reference(LATENCY, "goodput"),
        make_inputs=_goodput_cases,
        drive=_drive_goodput,
        compare=_compare_goodput,
        hint=_GOODPUT_HINT,
    )
)
register(
    Check(
        check_id="lab10.goodput_edges",
        task=TASKS["goodput"],
        reference=reference(LATENCY, "goodput"),
        make_inputs=_goodput_edges,
        drive=_drive_goodput,
        compare=_compare_goodput,
        hint=_GOODPUT_HINT + " Latencies exactly at their limits, single tokens, a failed fast request, a "
        "success without a chunk, no requests, a non-positive duration, a real trace.",
    )
)
