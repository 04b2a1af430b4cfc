"""Lab 10 task 5: ``latency_percentiles`` of a run, over the successful requests, in milliseconds."""

from __future__ import annotations

import math
import random

from grading.checks.common import is_number, outcome
from grading.checks.lab10.results import TASKS, YOURS, compare_results, fmt, same_number
from grading.checks.lab10.timings import FAULTS, synthetic, synthetic_run, timing_of, traced
from grading.registry import Check, register

_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def reference_latency_percentiles(timings: list, p: float = 99.0) -> dict[str, float]:
    """The reference's answer to task 5, read off ``summarize``."""
    from infra_lib.ops.latency import summarize

    summary = summarize(timings, 1.0, percentiles=(p,))
    return {key: summary[f"p{p:g}_{key}"] for key in _KEYS}


def _run_cases(rng: random.Random) -> list[dict]:
    return [{"timings": synthetic_run(rng, 8), "p": 90}, {"timings": synthetic_run(rng, 30), "p": 99}]


def _trace_runs(rng: random.Random) -> list[dict]:
    faults = rng.sample(FAULTS, 2)
    return [
        {"timings": traced(rng, faults[0]), "p": 99},
        {"timings": traced(rng, faults[1]), "p": 99.9},
        {"timings": synthetic_run(rng, 40), "p": 50},
        {"timings": [synthetic(rng, 0, failed="rejected") for _ in range(3)], "p": 99},  # nothing succeeded
        {"timings": [synthetic(rng, 1) for _ in range(4)], "p": 99},  # single tokens: no TPOT, no gap
        {"timings": [], "p": 99},
    ]  # an empty run: every key nan


def _drive_runs(fn, cases: list[dict]) -> list:
    return [outcome(fn, [timing_of(d) for d in case["timings"]], case["p"]) for case in cases]


def _describe_run(case: dict) -> str:
    timings = case["timings"]
    failed = sum(not d["success"] for d in timings)
    single = sum(d["success"] and d["output_tokens"] < 2 for d in timings)
    grouped = sum(d["success"] and len(d["chunk_times"]) != d["output_tokens"] for d in timings)
    return (
        f"a run of {len(timings)} requests ({failed} failed, {single} with a single output token, {grouped} "
        f"streaming several tokens per chunk), p={case['p']}"
    )


def _alternatives(case: dict, key: str) -> dict[str, float]:
    """What common mistakes would give for one key (computed with the reference, for the message only)."""
    from infra_lib.ops.latency import e2el, itl, percentile, tpot, ttft

    timings = [timing_of(d) for d in case["timings"]]
    ok = [t for t in timings if t.success]
    p = case["p"]

    def pct(values):
        return percentile([v * 1000 for v in values if not math.isnan(v)], p)

    metric = {"ttft_ms": ttft, "tpot_ms": tpot, "e2el_ms": e2el}.get(key)
    out = {}
    if key == "itl_ms":
        out[
            "you averaged each request's gaps first: pool every gap of every successful request into one list "
            "(long requests weigh more, and a stall stays one big gap)"
        ] = pct([sum(itl(t)) / len(itl(t)) for t in ok if itl(t)])
        out["you included the failed requests: latencies are over the successful ones only"] = pct(
            [g for t in timings for g in itl(t)]
        )
    else:
        out["you included the failed requests: latencies are over the successful ones only"] = pct(
            [metric(t) for t in timings]
        )
    return out


def _run_problem(case: dict, got, want):
    if type(got) is not dict or set(got) != set(_KEYS):
        keys = sorted(got) if type(got) is dict else f"a {type(got).__name__}"
        return ("latency_percentiles must return a dict with the keys ttft_ms, tpot_ms, itl_ms, e2el_ms", f"got {keys}")
    for key in _KEYS:
        g, e = got[key], want[key]
        if same_number(g, e):
            continue
        note = ""
        if is_number(g) and math.isnan(g) and not math.isnan(e):
            note = "; leave out the nan values (no chunk, or fewer than two tokens) before taking the percentile"
        elif is_number(g) and not math.isnan(e) and same_number(g * 1000, e):
            note = "; the values are in seconds: the keys ask for milliseconds"
        elif is_number(g):
            note = next(
                (
                    f"; {why}"
                    for why, value in _alternatives(case, key).items()
                    if not same_number(value, e) and same_number(g, value)
                ),
                YOURS,
            )
        return f"latency_percentiles returned the wrong {key}", f"expected {fmt(e)}, got {fmt(g)}{note}"
    return None


def _compare_runs(got, expected, cases):
    return compare_results("latency_percentiles", got, expected, cases, _describe_run, _run_problem)


_RUN_HINT = (
    "a run's percentiles are over the successful requests only, in milliseconds, with nan values (no "
    "chunk, fewer than two tokens) left out; a metric with no values left is nan. ITL pools every gap of "
    "every successful request, so a stall stays one big gap and long requests weigh more; averaging each "
    "request's gaps first hides exactly that. Build on your functions from tasks 1 to 4."
)
register(
    Check(
        check_id="lab10.latency_percentiles",
        task=TASKS["latency_percentiles"],
        reference=lambda: reference_latency_percentiles,
        make_inputs=_run_cases,
        drive=_drive_runs,
        compare=_compare_runs,
        hint=_RUN_HINT,
    )
)
register(
    Check(
        check_id="lab10.latency_percentiles_traces",
        task=TASKS["latency_percentiles"],
        reference=lambda: reference_latency_percentiles,
        make_inputs=_trace_runs,
        drive=_drive_runs,
        compare=_compare_runs,
        hint=_RUN_HINT + " Whole traces of the simulated engine, p = 99.9 and 50, a run where nothing "
        "succeeded (every key nan) and one of single tokens.",
    )
)
