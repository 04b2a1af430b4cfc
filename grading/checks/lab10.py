"""Checks for lab 10 (serving latency metrics and P99 diagnosis): the learner writes plain functions
over ``RequestTiming`` records (``ttft``, ``e2el``, ``tpot``, ``itl``), ``percentile``, the P-th
percentile latencies of a run, ``goodput``, and ``diagnose(stats) -> str``.

Inputs are seeded synthetic timings (streams of 0, 1 or many chunks, chunks carrying several
tokens, failed and abandoned requests, stalls, ties) and real traces and window statistics of the
simulated engine (``run_scenario``). Traces are made into plain data in ``make_inputs``, before any
learner code runs: ``run_scenario`` calls the reference functions itself, which would count as a
shortcut inside a driver. Drivers record each call as ``["value", result]`` or
``["raised", "Type: message"]``, so that a raised exception names the input it came from.
"""

from __future__ import annotations

import functools
import math
import random

from grading.checks.common import is_number, outcome, reference, unwrap
from grading.registry import Check, Mismatch, register, register_shortcuts

_LATENCY = "infra_lib.ops.latency"
_DIAGNOSE = "infra_lib.ops.diagnose"

register_shortcuts("lab10", [f"{_LATENCY}:{name}" for name in
                             ("ttft", "e2el", "tpot", "itl", "percentile", "meets_slo", "goodput", "summarize")]
                   + [f"{_DIAGNOSE}:diagnose", f"{_DIAGNOSE}:p99_latency_ms"]
                   + ["infra_lib.ops.llmops:gate", "infra_lib.ops.llmops:p99", "infra_lib.ops.llmops:RolloutPolicy.judge"])

FAULTS = ("healthy", "slow_dependency", "kv_pressure", "head_of_line", "overload")  # as infra_lib.ops.diagnose
_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
_TASKS = {"ttft": "lab10 task 1: ttft", "e2el": "lab10 task 1: e2el", "tpot": "lab10 task 2: tpot",
          "itl": "lab10 task 3: itl", "percentile": "lab10 task 4: percentile",
          "latency_percentiles": "lab10 task 5: latency_percentiles", "goodput": "lab10 task 6: goodput",
          "diagnose": "lab10 task 7: diagnose", "passes_gate": "lab10 task 8: passes_gate",
          "canary_verdict": "lab10 task 9: canary_verdict"}
_NAN = float("nan")


# --- calling the implementation, comparing numbers ------------------------------------------------

def _same(got, expected: float, rel: float = 1e-9) -> bool:
    """Equal numbers (nan equals nan; a tolerance for the order of float operations)."""
    if not is_number(got):
        return False
    if math.isnan(expected) or math.isnan(got):
        return math.isnan(expected) and math.isnan(got)
    return math.isclose(got, expected, rel_tol=rel, abs_tol=1e-12)


def _fmt(value) -> str:
    if is_number(value):
        return "nan" if math.isnan(value) else repr(round(value, 6))
    return repr(value)


def _compare_results(name: str, got, expected, cases, describe, value_problem) -> Mismatch | None:
    """Case by case: an exception where a value was due (or the reverse), then ``value_problem``."""
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from {name}, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        (got_kind, got_value), (want_kind, want) = unwrap(g), unwrap(e)
        where = describe(case)
        if want_kind == "raised":
            error = str(want).split(":")[0]
            if got_kind == "raised" and str(got_value).split(":")[0] == error:
                continue
            got_text = f"it raised {got_value}" if got_kind == "raised" else f"it returned {_fmt(got_value)}"
            return Mismatch(f"{name} should raise {error} on an invalid input", f"on {where}: {got_text}")
        if got_kind == "raised":
            return Mismatch(f"{name} raised an exception on a valid input",
                            f"on {where}: expected {_fmt(want)}, your code raised {got_value}")
        if got_kind != "value":
            return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
        problem = value_problem(case, got_value, want)
        if problem is not None:
            what, detail = problem
            return Mismatch(what, f"on {where}: {detail}")
    return None


# --- timings as plain data --------------------------------------------------------------------------

def _timing(d: dict):
    from infra_lib.ops.latency import RequestTiming

    return RequestTiming(d["send_time"], list(d["chunk_times"]), d["end_time"], d["prompt_tokens"],
                         d["output_tokens"], d["success"], d["error"])


def _describe_timing(d: dict) -> str:
    chunks = d["chunk_times"]
    shown = ", ".join(_fmt(c) for c in chunks[:6])
    if len(chunks) > 6:
        shown += f", ... {_fmt(chunks[-1])}"
    failed = "" if d["success"] else f", success=False, error={d['error']!r}"
    return (f"RequestTiming(send_time={_fmt(d['send_time'])}, chunk_times=[{shown}] ({len(chunks)} chunks), "
            f"end_time={_fmt(d['end_time'])}, output_tokens={d['output_tokens']}{failed})")


def _synthetic(rng: random.Random, chunks: int, per_chunk: int = 1, stall: bool = False,
               failed: str = "") -> dict:
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
    error = {"": "", "rejected": "HTTP 429: the server is at capacity", "error": "HTTP 500: engine error",
             "abandoned": "client timeout after 30 s"}[failed]
    return {"send_time": send, "chunk_times": times, "end_time": _NAN if failed == "abandoned" else end,
            "prompt_tokens": rng.randint(16, 512), "output_tokens": tokens, "success": not failed, "error": error}


def _mixed_timings(rng: random.Random) -> list[dict]:
    """The visible cases of tasks 1 to 3: plain streams first, then the ones that tell mistakes apart."""
    return [
        _synthetic(rng, rng.randint(8, 14)),  # one token per chunk
        _synthetic(rng, rng.randint(6, 10), per_chunk=rng.randint(3, 5)),  # several tokens per chunk
        _synthetic(rng, rng.randint(10, 16), stall=True),  # one long stall mid-stream
        _synthetic(rng, 2),  # two tokens: one gap
        _synthetic(rng, 1),  # a single token: no TPOT, no gap
        _synthetic(rng, 1, per_chunk=rng.randint(12, 30)),  # not streamed: the whole answer in one chunk
        _synthetic(rng, 0, failed="rejected"),  # refused before any token
        _synthetic(rng, rng.randint(3, 8), failed="error"),  # the stream broke off
        _synthetic(rng, rng.randint(3, 8), failed="abandoned"),  # the client gave up: no end time
    ]


@functools.cache
def _scenario(name: str, seed: int) -> tuple[dict, tuple[dict, ...]]:
    """``run_scenario``'s window stats and client timings, as plain data (cached: every check of a
    grading run that picks the same scenario shares it)."""
    from infra_lib.ops.diagnose import run_scenario

    run = run_scenario(name, seed)
    return dict(run["stats"]), tuple(t.as_dict() for t in run["timings"])


def _stats(name: str, seed: int) -> dict:
    return dict(_scenario(name, seed)[0])


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
        return {**d, "chunk_times": times, "end_time": _NAN, "output_tokens": keep, "success": False,
                "error": "client timeout after 30 s"}
    end = (times[-1] if times else d["send_time"]) + 0.01
    return {**d, "chunk_times": times, "end_time": end, "output_tokens": keep, "success": False,
            "error": "HTTP 500: engine error"}


def _trace(rng: random.Random, name: str | None = None, size: int | None = None) -> list[dict]:
    """Client timings of one scenario on the simulated engine, some re-chunked, a few failed."""
    name = name or rng.choice(FAULTS)
    timings = [dict(t) for t in _scenario(name, rng.randrange(8))[1]]
    if size is not None:
        timings = rng.sample(timings, size)
    out = []
    for d in timings:
        d = {**d, "chunk_times": list(d["chunk_times"])}
        roll = rng.random()
        out.append(_merged(rng, d) if roll < 0.3 else _broken(rng, d) if roll < 0.4 else d)
    return out


# --- task 1: ttft and e2el ---------------------------------------------------------------------------

def _drive_per_request(fn, cases: list[dict]) -> list:
    return [outcome(fn, _timing(d)) for d in cases]


def _ttft_problem(d: dict, got, want):
    if _same(got, want):
        return None
    chunks = d["chunk_times"]
    note = ""
    if math.isnan(want):
        note = "; with no chunk there is no first token: return float('nan')"
    elif _same(got, chunks[0]):
        note = "; that is when the first chunk arrived: subtract send_time"
    elif _same(got, d["end_time"] - d["send_time"]):
        note = "; that is the end-to-end latency: TTFT stops at the first chunk"
    return "ttft returned the wrong time to first token", f"expected {_fmt(want)}, got {_fmt(got)}{note}"


def _e2el_problem(d: dict, got, want):
    if _same(got, want):
        return None
    note = ""
    if d["chunk_times"] and _same(got, d["end_time"] - d["chunk_times"][0]):
        note = "; that starts at the first chunk: E2EL starts when the request was sent"
    elif d["chunk_times"] and _same(got, d["chunk_times"][-1] - d["send_time"]):
        note = "; that stops at the last chunk: E2EL stops at end_time"
    return "e2el returned the wrong end-to-end latency", f"expected {_fmt(want)}, got {_fmt(got)}{note}"


def _compare_ttft(got, expected, cases):
    return _compare_results("ttft", got, expected, cases, _describe_timing, _ttft_problem)


def _compare_e2el(got, expected, cases):
    return _compare_results("e2el", got, expected, cases, _describe_timing, _e2el_problem)


def _trace_sample(rng: random.Random) -> list[dict]:
    return _trace(rng, size=24)


_TTFT_HINT = ("TTFT runs from sending the request to the arrival of its first chunk, in seconds, whatever that chunk "
              "carries; with no chunk at all (a request refused, or failed before its first token) there is no first "
              "token and the answer is nan.")
_E2EL_HINT = ("E2EL runs from sending the request to the end of its response, not from the first chunk nor to the "
              "last one, for every request, failed or not; a request the client abandoned has no end time (nan), so "
              "its E2EL is nan too.")

for check_id, task, make, compare, hint in (
        ("lab10.ttft", "ttft", _mixed_timings, _compare_ttft, _TTFT_HINT),
        ("lab10.e2el", "e2el", _mixed_timings, _compare_e2el, _E2EL_HINT),
        ("lab10.ttft_real_traces", "ttft", _trace_sample, _compare_ttft,
         _TTFT_HINT + " Traces of the simulated engine, some failed, some several tokens per chunk."),
        ("lab10.e2el_real_traces", "e2el", _trace_sample, _compare_e2el,
         _E2EL_HINT + " Traces of the simulated engine, some failed, some several tokens per chunk.")):
    register(Check(check_id=check_id, task=_TASKS[task], reference=reference(_LATENCY, task), make_inputs=make,
                   drive=_drive_per_request, compare=compare, hint=hint))


# --- task 2: tpot ------------------------------------------------------------------------------------

def _tpot_problem(d: dict, got, want):
    if _same(got, want):
        return None
    chunks, n = d["chunk_times"], d["output_tokens"]
    e2el = d["end_time"] - d["send_time"]
    after_first = e2el - (chunks[0] - d["send_time"]) if chunks else _NAN
    note = ""
    if math.isnan(want) and n < 2:
        note = f"; with {n} output token(s) there is no time between tokens: return float('nan')"
    elif len(chunks) > 1 and _same(got, after_first / (len(chunks) - 1)):
        note = (f"; you divided by the number of chunks minus 1 ({len(chunks) - 1}), but these {len(chunks)} chunks "
                f"carry {n} tokens: divide by output_tokens - 1")
    elif _same(got, after_first / n):
        note = "; you divided by output_tokens: n tokens leave n - 1 intervals after the first one"
    elif _same(got, e2el / n) or _same(got, e2el / (n - 1)):
        note = "; that includes the wait for the first token: subtract TTFT from E2EL first"
    return "tpot returned the wrong time per output token", f"expected {_fmt(want)}, got {_fmt(got)}{note}"


def _compare_tpot(got, expected, cases):
    return _compare_results("tpot", got, expected, cases, _describe_timing, _tpot_problem)


_TPOT_HINT = ("TPOT is the pace after the first token: the wait for the first token is left out, and the rest of "
              "the request's time is shared by the tokens after the first one. Count tokens, not chunks (a chunk can "
              "carry several tokens); with fewer than two output tokens there is no time between tokens: nan.")

register(Check(check_id="lab10.tpot", task=_TASKS["tpot"], reference=reference(_LATENCY, "tpot"),
               make_inputs=_mixed_timings, drive=_drive_per_request, compare=_compare_tpot, hint=_TPOT_HINT))
register(Check(check_id="lab10.tpot_real_traces", task=_TASKS["tpot"], reference=reference(_LATENCY, "tpot"),
               make_inputs=_trace_sample, drive=_drive_per_request, compare=_compare_tpot,
               hint=_TPOT_HINT + " Traces of the simulated engine, some failed, some several tokens per chunk."))


# --- task 3: itl -------------------------------------------------------------------------------------

def _itl_problem(d: dict, got, want):
    chunks = d["chunk_times"]
    if type(got) is not list:
        note = "; return the list of gaps (the run's summary pools them later)" if is_number(got) else ""
        return "itl must return a list of gaps", f"got {_fmt(got)}{note}"
    if len(got) != len(want):
        note = ""
        if len(got) == len(want) + 1 and got and chunks and _same(got[0], chunks[0] - d["send_time"]):
            note = "; your first gap is the TTFT: the gaps start at the first chunk"
        elif len(got) == len(want) + 1 and got and chunks and _same(got[-1], d["end_time"] - chunks[-1]):
            note = "; your last gap runs to end_time: only gaps between chunks count"
        elif len(got) == max(d["output_tokens"] - 1, 0) != len(want):
            note = "; one gap per pair of successive chunks, not per token"
        return "itl returned the wrong number of gaps", (f"expected {len(want)} gaps ({len(chunks)} chunks give "
                                                          f"{max(len(chunks) - 1, 0)}), got {len(got)}{note}")
    for k, (g, e) in enumerate(zip(got, want)):
        if not _same(g, e):
            note = ""
            if all(is_number(x) for x in got) and sorted(got) == sorted(want):
                note = "; the gaps are right but out of order: keep the order in which the chunks arrived"
            return "itl returned a wrong gap", (f"gap {k} (from the chunk at {_fmt(chunks[k])} to the one at "
                                                f"{_fmt(chunks[k + 1])}): expected {_fmt(e)}, got {_fmt(g)}{note}")
    return None


def _compare_itl(got, expected, cases):
    return _compare_results("itl", got, expected, cases, _describe_timing, _itl_problem)


_ITL_HINT = ("ITL is the list of one request's gaps between successive chunks, in seconds and in arrival order; "
             "0 or 1 chunk give no gap. The wait before the first chunk is TTFT and the time after the last one is "
             "not a gap either, and a gap is per chunk, not per token.")

register(Check(check_id="lab10.itl", task=_TASKS["itl"], reference=reference(_LATENCY, "itl"),
               make_inputs=_mixed_timings, drive=_drive_per_request, compare=_compare_itl, hint=_ITL_HINT))
register(Check(check_id="lab10.itl_real_traces", task=_TASKS["itl"], reference=reference(_LATENCY, "itl"),
               make_inputs=_trace_sample, drive=_drive_per_request, compare=_compare_itl,
               hint=_ITL_HINT + " Traces of the simulated engine, some several tokens per chunk."))


# --- task 4: percentile ------------------------------------------------------------------------------

def _values(rng: random.Random, n: int, ties: bool = False) -> list[float]:
    if ties:
        return [float(rng.choice([12, 12, 15, 15, 15, 40])) for _ in range(n)]
    return [round(rng.lognormvariate(4.0, 0.6), 1) for _ in range(n)]


def _percentile_cases(rng: random.Random) -> list[list]:
    return [
        [_values(rng, 9), 50], [_values(rng, 11), 90], [_values(rng, 8), 99], [_values(rng, 10, ties=True), 75],
        [_values(rng, 7), 0], [_values(rng, 7), 100], [[round(rng.uniform(10, 90), 1)], 99], [[], 99],
        [_values(rng, 5), 101], [_values(rng, 5), -1],
    ]


def _percentile_edges(rng: random.Random) -> list[list]:
    big = _values(rng, rng.randint(900, 1100))
    return [
        [big, 99], [big, 99.9], [big, 50], [_values(rng, 101), 99], [_values(rng, 12, ties=True), 99],
        [[7.0] * rng.randint(2, 9), 37.5], [[rng.randint(1, 9) for _ in range(6)], 62.5], [_values(rng, 2), 99],
        [[], 0], [[], 100], [[], 150], [_values(rng, 4), 100.5], [_values(rng, 4), -0.25], [_values(rng, 3), 0.0],
    ]


def _drive_percentile(fn, cases: list[list]) -> list:
    def run(values, p):
        given = list(values)
        result = fn(given, p)
        return {"reordered": given} if given != list(values) else result  # the caller's list, changed

    return [outcome(run, values, p) for values, p in cases]


def _describe_values(case: list) -> str:
    values, p = case
    if len(values) <= 12:
        return f"values={values}, p={p}"
    return f"{len(values)} values ({', '.join(map(str, values[:5]))}, ...; from {min(values)} to {max(values)}), p={p}"


def _percentile_problem(case: list, got, want):
    values, p = case
    if type(got) is dict and "reordered" in got:
        return ("percentile changed the list it was given",
                f"the caller's list reads {got['reordered']!r:.120} after the call: sort a copy (sorted(values)), "
                "not the caller's list in place (list.sort)")
    if _same(got, want):
        return None
    note = ""
    if math.isnan(want):
        note = "; with no values there is no percentile: return float('nan')"
    elif is_number(got) and values:
        import numpy

        xs, n = sorted(values), len(values)
        rank = (n - 1) * p / 100

        def interpolate(seq, r):  # the mistakes' readings: seq's values placed at ranks 0..n-1, read at r
            return float(numpy.interp(r, range(len(seq)), seq))

        if not _same(interpolate(values, rank), want) and _same(got, interpolate(values, rank)):
            note = "; you interpolated between the values in the order given: sort them first"
        elif got in xs and rank != int(rank):
            note = (f"; that is one of the values: the rank (n - 1) * p / 100 = {rank:g} falls between two sorted "
                    "values, so interpolate linearly between them")
        elif got in xs:
            note = f"; sorted, the value at rank (n - 1) * p / 100 = {rank:g} (counting from 0) is the answer"
        elif _same(got, interpolate(xs, min(n * p / 100, n - 1))):
            note = f"; the rank is (n - 1) * p / 100 = {rank:g} (counting from 0), not n * p / 100"
        elif _same(got, interpolate(xs, min(max((n + 1) * p / 100 - 1, 0), n - 1))):
            note = ("; that places the sorted values at p = 100 (k + 1) / (n + 1), as statistics.quantiles' default "
                    "(exclusive) method does: here the smallest value sits at p = 0 and the largest at p = 100")
    return "percentile returned the wrong value", f"expected {_fmt(want)}, got {_fmt(got)}{note}"


def _compare_percentile(got, expected, cases):
    return _compare_results("percentile", got, expected, cases, _describe_values, _percentile_problem)


_PERCENTILE_HINT = ("the values come in any order and the percentile reads them sorted, with p = 0 on the smallest "
                    "and p = 100 on the largest, moving linearly between neighbours (numpy's default method): a "
                    "rank that falls between two values is interpolated, not rounded to one of them. No values: "
                    "nan; p outside [0, 100]: raise ValueError, whatever the values.")

register(Check(check_id="lab10.percentile", task=_TASKS["percentile"], reference=reference(_LATENCY, "percentile"),
               make_inputs=_percentile_cases, drive=_drive_percentile, compare=_compare_percentile,
               hint=_PERCENTILE_HINT))
register(Check(check_id="lab10.percentile_edges", task=_TASKS["percentile"],
               reference=reference(_LATENCY, "percentile"), make_inputs=_percentile_edges, drive=_drive_percentile,
               compare=_compare_percentile,
               hint=_PERCENTILE_HINT + " Large inputs, ties, integers, p = 99.9, empty lists and invalid p."))


# --- task 5: latency_percentiles ---------------------------------------------------------------------

def reference_latency_percentiles(timings: list, p: float = 99.0) -> dict[str, float]:
    """The reference's answer to task 5, read off ``summarize``."""
    from infra_lib.ops.latency import summarize

    summary = summarize(timings, 1.0, percentiles=(p,))
    return {key: summary[f"p{p:g}_{key}"] for key in _KEYS}


def _synthetic_run(rng: random.Random, size: int) -> list[dict]:
    kinds = [lambda: _synthetic(rng, rng.randint(4, 30)), lambda: _synthetic(rng, rng.randint(4, 30), stall=True),
             lambda: _synthetic(rng, rng.randint(3, 8), per_chunk=rng.randint(2, 5)), lambda: _synthetic(rng, 1),
             lambda: _synthetic(rng, 0, failed="rejected"), lambda: _synthetic(rng, rng.randint(2, 9), failed="error")]
    weights = [8, 3, 3, 2, 1, 1]
    run = [make() for make in kinds] + [rng.choices(kinds, weights)[0]() for _ in range(size - len(kinds))]
    rng.shuffle(run)  # every kind at least once, in any order
    return run


def _run_cases(rng: random.Random) -> list[dict]:
    return [{"timings": _synthetic_run(rng, 8), "p": 90}, {"timings": _synthetic_run(rng, 30), "p": 99}]


def _trace_runs(rng: random.Random) -> list[dict]:
    faults = rng.sample(FAULTS, 2)
    return [{"timings": _trace(rng, faults[0]), "p": 99}, {"timings": _trace(rng, faults[1]), "p": 99.9},
            {"timings": _synthetic_run(rng, 40), "p": 50},
            {"timings": [_synthetic(rng, 0, failed="rejected") for _ in range(3)], "p": 99},  # nothing succeeded
            {"timings": [_synthetic(rng, 1) for _ in range(4)], "p": 99},  # single tokens: no TPOT, no gap
            {"timings": [], "p": 99}]  # an empty run: every key nan


def _drive_runs(fn, cases: list[dict]) -> list:
    return [outcome(fn, [_timing(d) for d in case["timings"]], case["p"]) for case in cases]


def _describe_run(case: dict) -> str:
    timings = case["timings"]
    failed = sum(not d["success"] for d in timings)
    single = sum(d["success"] and d["output_tokens"] < 2 for d in timings)
    grouped = sum(d["success"] and len(d["chunk_times"]) != d["output_tokens"] for d in timings)
    return (f"a run of {len(timings)} requests ({failed} failed, {single} with a single output token, {grouped} "
            f"streaming several tokens per chunk), p={case['p']}")


def _alternatives(case: dict, key: str) -> dict[str, float]:
    """What common mistakes would give for one key (computed with the reference, for the message only)."""
    from infra_lib.ops.latency import e2el, itl, percentile, tpot, ttft

    timings = [_timing(d) for d in case["timings"]]
    ok = [t for t in timings if t.success]
    p = case["p"]

    def pct(values):
        return percentile([v * 1000 for v in values if not math.isnan(v)], p)

    metric = {"ttft_ms": ttft, "tpot_ms": tpot, "e2el_ms": e2el}.get(key)
    out = {}
    if key == "itl_ms":
        out["you averaged each request's gaps first: pool every gap of every successful request into one list "
            "(long requests weigh more, and a stall stays one big gap)"] = pct(
            [sum(itl(t)) / len(itl(t)) for t in ok if itl(t)])
        out["you included the failed requests: latencies are over the successful ones only"] = pct(
            [g for t in timings for g in itl(t)])
    else:
        out["you included the failed requests: latencies are over the successful ones only"] = pct(
            [metric(t) for t in timings])
    return out


_YOURS = "; this uses your functions from tasks 1 to 4: if one of their checks fails, fix that first"


def _run_problem(case: dict, got, want):
    if type(got) is not dict or set(got) != set(_KEYS):
        keys = sorted(got) if type(got) is dict else f"a {type(got).__name__}"
        return ("latency_percentiles must return a dict with the keys ttft_ms, tpot_ms, itl_ms, e2el_ms",
                f"got {keys}")
    for key in _KEYS:
        g, e = got[key], want[key]
        if _same(g, e):
            continue
        note = ""
        if is_number(g) and math.isnan(g) and not math.isnan(e):
            note = "; leave out the nan values (no chunk, or fewer than two tokens) before taking the percentile"
        elif is_number(g) and not math.isnan(e) and _same(g * 1000, e):
            note = "; the values are in seconds: the keys ask for milliseconds"
        elif is_number(g):
            note = next((f"; {why}" for why, value in _alternatives(case, key).items()
                         if not _same(value, e) and _same(g, value)), _YOURS)
        return f"latency_percentiles returned the wrong {key}", f"expected {_fmt(e)}, got {_fmt(g)}{note}"
    return None


def _compare_runs(got, expected, cases):
    return _compare_results("latency_percentiles", got, expected, cases, _describe_run, _run_problem)


_RUN_HINT = ("a run's percentiles are over the successful requests only, in milliseconds, with nan values (no "
             "chunk, fewer than two tokens) left out; a metric with no values left is nan. ITL pools every gap of "
             "every successful request, so a stall stays one big gap and long requests weigh more; averaging each "
             "request's gaps first hides exactly that. Build on your functions from tasks 1 to 4.")

register(Check(check_id="lab10.latency_percentiles", task=_TASKS["latency_percentiles"],
               reference=lambda: reference_latency_percentiles, make_inputs=_run_cases, drive=_drive_runs,
               compare=_compare_runs, hint=_RUN_HINT))
register(Check(check_id="lab10.latency_percentiles_traces", task=_TASKS["latency_percentiles"],
               reference=lambda: reference_latency_percentiles, make_inputs=_trace_runs, drive=_drive_runs,
               compare=_compare_runs,
               hint=_RUN_HINT + " Whole traces of the simulated engine, p = 99.9 and 50, a run where nothing "
                                "succeeded (every key nan) and one of single tokens."))


# --- task 6: goodput ---------------------------------------------------------------------------------

def _limits_near(rng: random.Random, timings: list[dict]) -> dict[str, float]:
    """SLO limits (ms) that some successful requests of the run meet and some miss."""
    ok = [d for d in timings if d["success"] and d["chunk_times"]]
    ttfts = sorted((d["chunk_times"][0] - d["send_time"]) * 1000 for d in ok)
    tpots = sorted((d["end_time"] - d["chunk_times"][0]) * 1000 / (d["output_tokens"] - 1)
                   for d in ok if d["output_tokens"] > 1)
    e2els = sorted((d["end_time"] - d["send_time"]) * 1000 for d in ok)

    def between(xs):  # halfway between two neighbours well apart: no latency lies near the limit
        apart = [i for i in range(len(xs) - 1) if xs[i + 1] - xs[i] > 0.01]
        if not apart:
            return round(xs[-1] + 1.0, 3) if xs else 100.0
        i = rng.choice(apart)
        return round((xs[i] + xs[i + 1]) / 2, 3)

    return {"ttft": between(ttfts), "tpot": between(tpots), "e2el": between(e2els)}


def _goodput_cases(rng: random.Random) -> list[dict]:
    timings = _synthetic_run(rng, 24)
    limits = _limits_near(rng, timings)
    duration = round(max(d["end_time"] for d in timings if not math.isnan(d["end_time"])) + 1.0, 3)
    subsets = [("ttft",), ("tpot",), ("ttft", "tpot"), ("e2el",), ("ttft", "tpot", "e2el"), ()]
    return [{"timings": timings, "duration_s": duration, "slo_ms": {k: limits[k] for k in keys}} for keys in subsets]


def _dyadic(send: float, first: float, gap: float, chunks: int, success: bool = True) -> dict:
    """A request whose times are exact in binary, so that a limit equal to a latency is exactly equal."""
    times = [send + first + i * gap for i in range(chunks)]
    return {"send_time": send, "chunk_times": times, "end_time": times[-1] if times else send + first,
            "prompt_tokens": 32, "output_tokens": chunks, "success": success,
            "error": "" if success else "HTTP 500: engine error"}


def _goodput_edges(rng: random.Random) -> list[dict]:
    send = float(rng.randint(0, 40)) / 2
    at_limit = [_dyadic(send, 0.25, 0.03125, rng.randint(3, 9)) for _ in range(3)]  # TTFT 250 ms, TPOT 31.25 ms
    above = [_dyadic(send, 0.5, 0.0625, 5), _dyadic(send, 0.125, 0.125, 4)]
    single = [_dyadic(send, 0.125, 0.03125, 1) for _ in range(2)]  # one token: no TPOT to judge
    failed_fast = [_dyadic(send, 0.0625, 0.015625, 6, success=False)]
    no_chunk = [{**_synthetic(rng, 0), "success": True}]  # succeeded without a chunk: no TTFT
    batch = at_limit + above + single + failed_fast + no_chunk
    trace = _trace(rng)
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
    return [outcome(fn, [_timing(d) for d in case["timings"]], case["duration_s"], dict(case["slo_ms"]))
            for case in cases]


def _describe_goodput(case: dict) -> str:
    timings = case["timings"]
    failed = sum(not d["success"] for d in timings)
    single = sum(d["success"] and d["output_tokens"] < 2 for d in timings)
    return (f"{len(timings)} requests ({failed} failed, {single} with fewer than two output tokens), "
            f"duration_s={case['duration_s']}, slo_ms={case['slo_ms']}")


def _variant_goodput(case: dict, *, count_failed=False, nan_tpot_fails=False, nan_meets=False, strict=False,
                     seconds=False) -> float:
    """Goodput computed with one common mistake, for the message."""
    met = 0
    for d in case["timings"]:
        chunks = d["chunk_times"]
        first = chunks[0] - d["send_time"] if chunks else _NAN
        e2el = d["end_time"] - d["send_time"]
        tpot = (e2el - first) / (d["output_tokens"] - 1) if d["output_tokens"] > 1 and chunks else _NAN
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
    if _same(got, want):
        return None
    mistakes = {"you counted failed requests: a request that failed never meets an SLO": {"count_failed": True},
                "a request with fewer than two tokens has no TPOT (nan) and meets any TPOT SLO":
                    {"nan_tpot_fails": True},
                "you counted a request without a TTFT or an E2EL (nan: no chunk, or no end): nan meets no TTFT or "
                "E2EL limit, and a test such as value > limit lets it through": {"nan_meets": True},
                "a latency equal to its limit meets the SLO (<=, not <)": {"strict": True},
                "the limits are in milliseconds and the latencies in seconds: multiply by 1000": {"seconds": True}}
    fits = [why for why, flags in mistakes.items()
            if is_number(got) and not _same(_variant_goodput(case, **flags), want)
            and _same(got, _variant_goodput(case, **flags))]
    note = "".join(f"; {why}" for why in fits) if len(fits) < 2 else (
        "; this rate fits more than one mistake: " + "; or ".join(f"({i}) {why}" for i, why in enumerate(fits, 1)))
    per_request = want * case["duration_s"] / len(case["timings"]) if case["timings"] else _NAN
    if not note and _same(got, per_request) and not _same(per_request, want):
        note = "; divide the count by duration_s (requests per second), not by the number of requests"
    return "goodput returned the wrong rate", f"expected {_fmt(want)} requests/s, got {_fmt(got)}{note or _YOURS}"


def _compare_goodput(got, expected, cases):
    return _compare_results("goodput", got, expected, cases, _describe_goodput, _goodput_problem)


_GOODPUT_HINT = ("goodput counts the requests that succeeded and met every SLO present in slo_ms (limits in "
                 "milliseconds; a latency equal to its limit meets it) per second of the run, not per request. A "
                 "nan TPOT (fewer than two tokens) meets any TPOT limit, a nan TTFT or E2EL meets none, a failed "
                 "request never counts, with no SLO every successful request counts, and a duration of zero or less "
                 "raises ValueError.")

register(Check(check_id="lab10.goodput", task=_TASKS["goodput"], reference=reference(_LATENCY, "goodput"),
               make_inputs=_goodput_cases, drive=_drive_goodput, compare=_compare_goodput, hint=_GOODPUT_HINT))
register(Check(check_id="lab10.goodput_edges", task=_TASKS["goodput"], reference=reference(_LATENCY, "goodput"),
               make_inputs=_goodput_edges, drive=_drive_goodput, compare=_compare_goodput,
               hint=_GOODPUT_HINT + " Latencies exactly at their limits, single tokens, a failed fast request, a "
                                    "success without a chunk, no requests, a non-positive duration, a real trace."))


# --- task 7: diagnose --------------------------------------------------------------------------------

def reference_diagnose(stats: dict) -> str:
    """The reference's answer to task 7: the name of the fault ``diagnose`` finds."""
    from infra_lib.ops.diagnose import diagnose

    return diagnose(stats).fault


_RULE_KEYS = ("busy_fraction", "p99_ttft_ms", "engine_p99_ttft_ms", "preemptions", "kv_usage_peak", "max_step_ms",
              "median_step_ms", "max_prefill_tokens", "p99_queue_ms")


def _scenario_cases(rng: random.Random, seeds_per_fault: int = 1, pool: int = 8) -> list[dict]:
    cases = []
    for name in FAULTS:
        for seed in rng.sample(range(pool), seeds_per_fault):
            cases.append({"label": f"the window stats of scenario {name!r} (seed {seed})", "stats": _stats(name, seed)})
    return cases


def _more_scenarios(rng: random.Random) -> list[dict]:
    cases = _scenario_cases(rng, 2, 40)
    rng.shuffle(cases)
    return cases


def _window(rng: random.Random, **changes) -> dict:
    """Window stats of a calm engine (every rule false), with ``changes`` applied. Whole numbers of ms and
    binary-exact fractions, so that a value placed on a threshold is exactly on it."""
    median = float(rng.randint(20, 60))
    engine_ttft = float(rng.randint(150, 400))
    stats = {"duration_s": float(rng.randint(30, 120)), "busy_fraction": rng.choice([0.375, 0.5, 0.625, 0.75]),
             "steps": rng.randint(500, 3000), "preemptions": 0, "kv_usage_peak": rng.choice([0.125, 0.25, 0.5]),
             "max_prefill_tokens": rng.randint(64, 512), "median_step_ms": median,
             "p99_step_ms": median * 3, "max_step_ms": median * rng.randint(3, 6), "p99_queue_ms": median * 2,
             "engine_p99_ttft_ms": engine_ttft, "engine_p99_e2el_ms": engine_ttft * 8,
             "p99_ttft_ms": engine_ttft + rng.randint(0, 40), "p99_tpot_ms": median * 2, "p99_itl_ms": median * 3,
             "p99_e2el_ms": engine_ttft * 8}
    for key, value in changes.items():
        stats[key] = value(stats) if callable(value) else value
    return stats


def _threshold_cases(rng: random.Random) -> list[dict]:
    def outside(extra):  # the clients' P99 TTFT, ``extra`` ms beyond rule 1's threshold
        return lambda s: s["engine_p99_ttft_ms"] + max(100.0, s["engine_p99_ttft_ms"]) + extra

    def queue(extra):
        return lambda s: 10 * s["median_step_ms"] + extra

    def step(extra):
        return lambda s: 10 * s["median_step_ms"] + extra

    long_wait = {"p99_ttft_ms": outside(rng.randint(50, 900))}
    windows = [
        ("rule 1 on its threshold", _window(rng, p99_ttft_ms=outside(0))),
        ("rule 1 just past its threshold", _window(rng, p99_ttft_ms=outside(1))),
        ("rule 1 with a fast engine (the 100 ms floor)",
         _window(rng, engine_p99_ttft_ms=40.0, p99_ttft_ms=lambda s: 40.0 + rng.randint(60, 99))),
        ("rule 1 with a fast engine, past the floor",
         _window(rng, engine_p99_ttft_ms=40.0, p99_ttft_ms=lambda s: 40.0 + rng.randint(101, 300))),
        ("a busy engine with a long wait outside it", _window(rng, busy_fraction=0.9, **long_wait)),
        ("a busy, queueing engine with a long wait outside it",
         _window(rng, busy_fraction=rng.choice([0.9, 0.9375]), p99_queue_ms=queue(rng.randint(1, 5000)), **long_wait)),
        ("rule 2 on its threshold", _window(rng, preemptions=rng.randint(1, 4), kv_usage_peak=0.9)),
        ("preemptions without a full KV cache", _window(rng, preemptions=rng.randint(1, 30), kv_usage_peak=0.875)),
        ("a full KV cache without preemptions", _window(rng, kv_usage_peak=1.0)),
        ("rule 3 on its step threshold", _window(rng, max_step_ms=step(0), max_prefill_tokens=2048)),
        ("rule 3 just past both thresholds", _window(rng, max_step_ms=step(1), max_prefill_tokens=1024)),
        ("a long step without a long prefill", _window(rng, max_step_ms=step(500), max_prefill_tokens=1023)),
        ("rule 4 on the busy threshold", _window(rng, busy_fraction=0.9, p99_queue_ms=queue(1))),
        ("rule 4 on the queue threshold", _window(rng, busy_fraction=0.96875, p99_queue_ms=queue(0))),
        ("a long queue on an idle engine", _window(rng, busy_fraction=0.875, p99_queue_ms=queue(rng.randint(1, 9000)))),
        ("rules 1 and 2 both hold",
         _window(rng, busy_fraction=0.75, preemptions=3, kv_usage_peak=0.96875, **long_wait)),
        ("rules 2 and 3 both hold",
         _window(rng, preemptions=2, kv_usage_peak=1.0, max_step_ms=step(300), max_prefill_tokens=1500)),
        ("rules 3 and 4 both hold", _window(rng, busy_fraction=0.96875, max_step_ms=step(300),
                                            max_prefill_tokens=1500, p99_queue_ms=queue(2000))),
        ("rules 2 and 4 both hold", _window(rng, busy_fraction=1.0, preemptions=9, kv_usage_peak=0.9375,
                                            p99_queue_ms=queue(4000))),
    ]
    rng.shuffle(windows)
    return [{"label": f"a window with {label}", "stats": stats} for label, stats in windows]


def _drive_diagnose(fn, cases: list[dict]) -> list:
    return [outcome(fn, dict(case["stats"])) for case in cases]


def _describe_stats(case: dict) -> str:
    numbers = ", ".join(f"{key}={_fmt(case['stats'][key])}" for key in _RULE_KEYS)
    return f"{case['label']} ({numbers})"


def _diagnose_problem(case: dict, got, want):
    if type(got) is not str:
        return "diagnose must return the fault's name, a string such as 'kv_pressure'", f"got {_fmt(got)}"
    if got not in FAULTS:
        return ("diagnose returned a name that is not one of " + ", ".join(FAULTS)), f"got {got!r}"
    if got == want:
        return None
    from infra_lib.ops.diagnose import diagnose

    evidence = "; ".join(diagnose(dict(case["stats"])).evidence)
    return "diagnose named the wrong fault", f"expected {want!r}, got {got!r}\n  the reference's evidence: {evidence}"


def _compare_diagnose(got, expected, cases):
    return _compare_results("diagnose", got, expected, cases, _describe_stats, _diagnose_problem)


_DIAGNOSE_HINT = ("the answer is the first rule of the lab's table that holds, in the table's order, even when a "
                  "later one holds as well; each comparison is exactly as the table writes it (strict or not), rule "
                  "1's floor of 100 ms included. Busy versus idle comes first: rules 1 and 4 both read how busy the "
                  "engine was, since a long wait outside a busy engine is not a slow dependency, and a queue in "
                  "front of an idle one is not overload. "
                  "chapter 11, section “5 · The drill: P99 jumped, find the layer”.")

register(Check(check_id="lab10.diagnose_scenarios", task=_TASKS["diagnose"], reference=lambda: reference_diagnose,
               make_inputs=_scenario_cases, drive=_drive_diagnose, compare=_compare_diagnose, hint=_DIAGNOSE_HINT))
register(Check(check_id="lab10.diagnose_thresholds", task=_TASKS["diagnose"], reference=lambda: reference_diagnose,
               make_inputs=_threshold_cases, drive=_drive_diagnose, compare=_compare_diagnose,
               hint=_DIAGNOSE_HINT + " Windows placed on and just past each threshold, and windows where two rules "
                                     "hold at once."))
register(Check(check_id="lab10.diagnose_more_scenarios", task=_TASKS["diagnose"],
               reference=lambda: reference_diagnose, make_inputs=_more_scenarios, drive=_drive_diagnose,
               compare=_compare_diagnose, hint=_DIAGNOSE_HINT + " More seeds of every scenario."))


# --- task 8: the evaluation gate ----------------------------------------------------------------------

_SCORES = ("perplexity", "evidence_nll")


def reference_passes_gate(candidate, current, tolerance: float = 0.05) -> bool:
    """The reference's answer to task 8: whether ``gate`` lets the candidate serve."""
    from infra_lib.ops.llmops import gate

    return gate(candidate, current, perplexity_tolerance=tolerance, evidence_tolerance=tolerance).passed


def _card(name: str, scores: dict):
    from infra_lib.ops.llmops import VersionCard

    return VersionCard(name=name, weights="int8 g64" if name != "production" else "fp32",
                       perplexity=scores["perplexity"], evidence_nll=scores["evidence_nll"],
                       tokens_per_s=scores.get("tokens_per_s", 20.0), weight_mb=scores.get("weight_mb", 540.0))


def _gate_case(label: str, current: tuple[float, float], candidate: tuple[float, float], tolerance: float) -> dict:
    return {"label": label, "current": dict(zip(_SCORES, current)), "candidate": dict(zip(_SCORES, candidate)),
            "tolerance": tolerance}


def _gate_cases(rng: random.Random) -> list[dict]:
    """Cards like chapter 11's (perplexity near 16, evidence NLL near 2), each score placed relative to
    its limit. Binary-exact values (whole numbers of 1/64), so a score placed on its limit is on it."""
    def near(base: float) -> float:
        return base + rng.randint(-16, 16) / 64

    cases = []
    for tolerance in (0.0625, 0.125):
        ppl, nll = near(16.0), near(2.0)
        lim_p, lim_n = ppl * (1 + tolerance), nll * (1 + tolerance)
        cases += [
            _gate_case("a candidate better on both scores", (ppl, nll), (ppl - 1, nll - 0.25), tolerance),
            _gate_case("a candidate a little worse on both, within the tolerance", (ppl, nll),
                       (ppl + (lim_p - ppl) / 2, nll + (lim_n - nll) / 2), tolerance),
            _gate_case("a candidate past the limit on perplexity only", (ppl, nll), (lim_p + 0.25, nll), tolerance),
            _gate_case("a candidate past the limit on the evidence score only", (ppl, nll), (ppl, lim_n + 0.125),
                       tolerance),
            _gate_case("a broken candidate (rows shuffled: perplexity in the thousands)", (ppl, nll),
                       (rng.randint(2000, 9000) + 0.5, nll * 3), tolerance),
        ]
    rng.shuffle(cases)
    return cases


def _divided(candidate: float, current: float, tolerance: float) -> bool:
    """The gate written as a relative difference, (candidate - current) / current <= tolerance: the same rule on
    paper, but its rounding differs from the product's, so it disagrees on some scores on the limit."""
    return (candidate - current) / current <= tolerance


def _on_the_limit(rng: random.Random, want_disagreement: int, past: bool = False) -> list[tuple[float, float, float]]:
    """(current, candidate, tolerance) with the candidate exactly on the limit current * (1 + tolerance), as
    floating point computes it (``past``: the next float above it), drawn until the division form gives the
    other verdict: on the limit it rejects what the rule passes; just past it, it passes what the rule rejects."""
    found = []
    while len(found) < want_disagreement:
        current = round(rng.uniform(1.5, 60.0), rng.choice([1, 2, 3]))
        tolerance = rng.choice([0.01, 0.02, 0.025, 0.03, 0.05, 0.1, 0.15, 0.2])
        limit = current * (1 + tolerance)
        candidate = math.nextafter(limit, math.inf) if past else limit
        if _divided(candidate, current, tolerance) == past:
            found.append((current, candidate, tolerance))
    return found


def _gate_edges(rng: random.Random) -> list[dict]:
    ppl, nll = 16.0 + rng.randint(-8, 8) / 8, 2.0 + rng.randint(-8, 8) / 32
    t = 0.0625
    cases = [
        _gate_case("a candidate exactly on both limits", (ppl, nll), (ppl * (1 + t), nll * (1 + t)), t),
        _gate_case("a candidate exactly on the perplexity limit, better on evidence", (ppl, nll),
                   (ppl * (1 + t), nll - 0.5), t),
        _gate_case("a candidate whose perplexity is nan (its evaluation diverged)", (ppl, nll), (_NAN, nll), t),
        _gate_case("a candidate whose evidence score is nan", (ppl, nll), (ppl, _NAN), t),
        _gate_case("a candidate whose perplexity is infinite", (ppl, nll), (float("inf"), nll), t),
        _gate_case("a candidate whose evidence score is minus infinity", (ppl, nll), (ppl, float("-inf")), t),
        _gate_case("a tolerance of zero and an identical candidate", (ppl, nll), (ppl, nll), 0.0),
        _gate_case("a tolerance of zero and a candidate worse by 1/64", (ppl, nll), (ppl + 1 / 64, nll), 0.0),
        _gate_case("a large tolerance (1.0: twice as bad still passes)", (ppl, nll), (2 * ppl, 2 * nll - 0.25), 1.0),
        _gate_case("a large tolerance and a candidate just past twice the perplexity", (ppl, nll),
                   (2 * ppl + 0.25, nll), 1.0),
        _gate_case("an absolute gap of 0.5 that is within a relative tolerance of 0.0625 at perplexity 16",
                   (16.0, 2.0), (16.5, 2.0), t),
        _gate_case("a gap of 0.0625 in evidence NLL that is past a relative tolerance of 0.0625 at 0.5",
                   (16.0, 0.5), (16.0, 0.5625), t),
        _gate_case("the lab's own example on the limit: perplexity 16.8 against 16.0 at 5%", (16.0, nll), (16.8, nll),
                   0.05),
        _gate_case("a current evidence score of 0 and a candidate at 0 too", (ppl, 0.0), (ppl, 0.0), t),
        _gate_case("a current evidence score of 0 and a candidate just above it", (ppl, 0.0), (ppl, 0.015625), t),
        _gate_case("a candidate evidence score of 0 (better than any positive one)", (ppl, nll), (ppl, 0.0), t),
        _gate_case("a negative tolerance", (ppl, nll), (ppl, nll), -0.05),
        _gate_case("a tolerance that is nan", (ppl, nll), (ppl, nll), _NAN),
        _gate_case("a current perplexity that is nan (production's card is broken)", (_NAN, nll), (ppl, nll), t),
        _gate_case("a current evidence score that is infinite", (ppl, float("inf")), (ppl, nll), t),
        _gate_case("a current perplexity that is negative", (-ppl, nll), (ppl, nll), t),
    ]
    for current, candidate, tolerance in _on_the_limit(rng, 3):
        cases.append(_gate_case("a perplexity exactly on its limit (current times (1 + tolerance))",
                                (current, nll), (candidate, nll), tolerance))
    for current, candidate, tolerance in _on_the_limit(rng, 1):
        cases.append(_gate_case("an evidence score exactly on its limit (current times (1 + tolerance))",
                                (ppl, current), (ppl, candidate), tolerance))
    for current, candidate, tolerance in _on_the_limit(rng, 1, past=True):
        cases.append(_gate_case("a perplexity just past its limit (the next float above current times "
                                "(1 + tolerance))", (current, nll), (candidate, nll), tolerance))
    rng.shuffle(cases)
    return cases


def _drive_gate(fn, cases: list[dict]) -> list:
    return [outcome(fn, _card("candidate", case["candidate"]), _card("production", case["current"]),
                    case["tolerance"]) for case in cases]


def _describe_gate(case: dict) -> str:
    c, p = case["candidate"], case["current"]
    exact = repr  # every digit: a score on its limit must read as on it
    return (f"{case['label']}: candidate perplexity {exact(c['perplexity'])}, evidence_nll "
            f"{exact(c['evidence_nll'])}; current perplexity {exact(p['perplexity'])}, evidence_nll "
            f"{exact(p['evidence_nll'])}; tolerance {case['tolerance']!r}")


def _variant_gate(case: dict, *, absolute=False, strict=False, nan_passes=False, only=None, higher=False,
                  divided=False) -> bool | None:
    """The gate with one common mistake, for the message (None where that mistake would raise)."""
    t = case["tolerance"]
    for key in _SCORES if only is None else (only,):
        ours, theirs = case["candidate"][key], case["current"][key]
        if higher:
            ok = ours >= theirs * (1 - t)
        elif divided:
            if theirs == 0:
                return None
            ok = _divided(ours, theirs, t)
        else:
            limit = theirs + t if absolute else theirs * (1 + t)
            ok = ours < limit if strict else ours <= limit
        if nan_passes:
            ok = ok or math.isnan(ours)
        if not ok:
            return False
    return True


def _gate_problem(case: dict, got, want):
    if type(got) is not bool:
        return "passes_gate must return a bool (True or False)", f"got {got!r:.60}"
    if got == want:
        return None
    mistakes = {
        "the tolerance is relative: a fraction of the current version's score, not an amount added to it":
            {"absolute": True},
        "a score exactly on its limit passes (<=, not <)": {"strict": True},
        "a score that is nan must fail: nan compares False with everything, so a test such as score > limit lets "
        "it through": {"nan_passes": True},
        "you judged perplexity only: the evidence score must be within the tolerance too": {"only": "perplexity"},
        "you judged the evidence score only: perplexity must be within the tolerance too": {"only": "evidence_nll"},
        "both scores are better when lower (a negative log-likelihood and its exponential)": {"higher": True},
        "the limit is the current score times (1 + tolerance), compared with <=: a relative difference, the gap "
        "divided by the current score, rounds differently in floating point and puts some scores that sit exactly "
        "on the limit past it (or some just past it within it)": {"divided": True},
    }
    fits = [why for why, flags in mistakes.items() if _variant_gate(case, **flags) == got]
    note = "; " + "; or ".join(fits) if fits else ""
    verdict = {True: "pass", False: "fail"}
    return "passes_gate gave the wrong verdict", f"expected the candidate to {verdict[want]}, it would {verdict[got]}{note}"


def _compare_gate(got, expected, cases):
    return _compare_results("passes_gate", got, expected, cases, _describe_gate, _gate_problem)


_GATE_HINT = ("a candidate passes when each of its two scores, perplexity and evidence_nll (both lower is better), is a "
              "number no larger than the current version's times (1 + tolerance), that product as floating point "
              "gives it; a score on its limit passes, and a nan or infinite candidate score fails whatever the "
              "comparison says. A negative or nan tolerance, and a current score that is nan, infinite or negative, "
              "are invalid input (ValueError). "
              "chapter 11, section “7 · LLMOps: a registry, an evaluation gate, a canary, a rollback”.")

register(Check(check_id="lab10.passes_gate", task=_TASKS["passes_gate"],
               reference=lambda: reference_passes_gate, make_inputs=_gate_cases, drive=_drive_gate,
               compare=_compare_gate, hint=_GATE_HINT))
register(Check(check_id="lab10.gate_edges", task=_TASKS["passes_gate"],
               reference=lambda: reference_passes_gate, make_inputs=_gate_edges, drive=_drive_gate,
               compare=_compare_gate,
               hint=_GATE_HINT + " Scores exactly on their limits (the product, not a relative difference, decides), "
                                 "nan and infinite scores, scores of 0, tolerances of 0 and 1, and invalid tolerances "
                                 "and current scores."))


# --- task 9: the canary's verdict ---------------------------------------------------------------------

def reference_canary_verdict(candidate, production, policy) -> str:
    """The reference's answer to task 9: the verdict of ``RolloutPolicy.judge``."""
    from infra_lib.ops.llmops import RolloutPolicy

    return RolloutPolicy.judge(policy, candidate, production)[0]


_POLICY = {"window": 10, "max_error_rate": 0.1, "max_p99_ratio": 2.0, "max_p99_added_s": 1.0, "min_p99_s": 0.05}


def _served(version: str, requests: list[list]):
    from infra_lib.ops.llmops import Served

    return [Served(version, float(i), latency, ok, 0, 0.1) for i, (latency, ok) in enumerate(requests)]


def _policy(d: dict):
    from infra_lib.ops.llmops import RolloutPolicy

    return RolloutPolicy(shares=(0.1, 0.5, 1.0), baseline=50, **d)


def _lognormal(rng: random.Random, n: int, median: float, delay: float = 0.0, errors: int = 0) -> list[list]:
    """``n`` requests: latencies in whole milliseconds, ``errors`` of them failed (at random places)."""
    failed = set(rng.sample(range(n), errors))
    return [[round(median * math.exp(rng.gauss(0, 0.35)) + delay, 3), i not in failed] for i in range(n)]


def _canary_case(label: str, candidate: list[list], production: list[list], **policy) -> dict:
    return {"label": label, "candidate": candidate, "production": production, "policy": {**_POLICY, **policy}}


def _drawn(rng: random.Random, want: str, label: str, candidate, production: list[list], also=None,
           **policy) -> dict:
    """A case whose candidate requests are drawn by ``candidate(rng)`` until the rules give ``want`` (and
    ``also(case)`` holds), so that the label stays true for every seed."""
    while True:
        case = _canary_case(label, candidate(rng), production, **policy)
        if _judged(case) == want and (also is None or also(case)):
            return case


def _between(rng: random.Random, requests: list[list], low: float, high: float, shift: bool = False) -> list[list]:
    """``requests`` moved so that the P99 of their successful ones lands a random way between ``low`` and
    ``high`` (well clear of both): every latency shifted by the same amount, or scaled by the same factor."""
    target = low + (high - low) * rng.uniform(0.2, 0.8)
    now = _successful_p99(requests)
    return [[round(latency + target - now if shift else latency * target / now, 4), ok] for latency, ok in requests]


def _canary_cases(rng: random.Random) -> list[dict]:
    prod = _lognormal(rng, 50, 0.8)
    fast_prod = _lognormal(rng, 50, 0.12)
    cases = [
        _drawn(rng, "advance", "a healthy window", lambda r: _lognormal(r, 10, 0.8), prod),
        _drawn(rng, "advance", "a faster candidate", lambda r: _lognormal(r, 10, 0.55), prod),
        _drawn(rng, "rollback", "a window with 3 failed requests of 10", lambda r: _lognormal(r, 10, 0.8, errors=3),
               prod),
        _canary_case("a candidate behind a fixed delay (past the added limit, within the ratio one)",
                     _between(rng, _lognormal(rng, 10, 0.8), _successful_p99(prod) + 1.0, 2 * _successful_p99(prod),
                              shift=True), prod),
        _canary_case("a candidate several times slower on a fast server (past the ratio limit, within the added one)",
                     _between(rng, _lognormal(rng, 10, 0.12), 2 * _successful_p99(fast_prod),
                              _successful_p99(fast_prod) + 1.0), fast_prod),
        _drawn(rng, "advance", "a window of 20 with 3 failed requests (15%), a policy allowing 15%",
               lambda r: _lognormal(r, 20, 0.8, errors=3), prod, window=20, max_error_rate=0.15),
        _drawn(rng, "advance", "a slow candidate under a lenient policy (ratio 4, 3 s added)",
               lambda r: _lognormal(r, 10, 0.8, delay=1.5), prod, max_p99_ratio=4.0, max_p99_added_s=3.0),
    ]
    rng.shuffle(cases)
    return cases


def _canary_edges(rng: random.Random) -> list[dict]:
    prod = _lognormal(rng, 50, 0.8)
    flat = [[0.5, True]] * 40
    cases = [
        _canary_case("an error rate exactly at max_error_rate (1 of 10 at 10%)", _lognormal(rng, 10, 0.8, errors=1),
                     prod),
        _drawn(rng, "advance", "failed requests that timed out after 30 s (2 of 10, a policy allowing 25%)",
               lambda r: [[30.0, False]] * 2 + _lognormal(r, 8, 0.8), prod, max_error_rate=0.25),
        _canary_case("a candidate P99 exactly twice production's (on the ratio limit)", [[1.0, True]] * 10, flat,
                     max_p99_added_s=5.0),
        _canary_case("a candidate P99 exactly 1 s above production's (on the added limit)", [[1.5, True]] * 10,
                     flat, max_p99_ratio=10.0),
        _canary_case("one slow request of 10: P99 interpolates, it is not the maximum",
                     [[1.0, True]] * 9 + [[2.0625, True]], [[1.0, True]] * 40, max_p99_added_s=5.0),
        _canary_case("latencies under min_p99_s (fast, and 4x production's)", [[0.04, True]] * 10,
                     [[0.01, True]] * 40),
        _canary_case("no production requests yet", _lognormal(rng, 10, 2.0), []),
        _canary_case("production's requests all failed", _lognormal(rng, 10, 2.0), [[0.5, False]] * 20),
        _canary_case("every candidate request failed", [[0.25, False]] * 10, prod),
        _canary_case("a policy that allows no error, one failure", _lognormal(rng, 10, 0.8, errors=1), prod,
                     max_error_rate=0.0),
        _drawn(rng, "rollback", "a strict latency policy (ratio 1.25, 0.25 s added)",
               lambda r: _lognormal(r, 10, 1.3), prod, max_p99_ratio=1.25, max_p99_added_s=0.25),
    ]
    rng.shuffle(cases)
    return cases


def _drive_canary(fn, cases: list[dict]) -> list:
    return [outcome(fn, _served("candidate", case["candidate"]), _served("production", case["production"]),
                    _policy(case["policy"])) for case in cases]


def _successful_p99(requests: list[list]) -> float:
    """The P99 latency of the successful requests, as the reference takes it (0 for none)."""
    from infra_lib.ops.llmops import p99

    return p99([latency for latency, ok in requests if ok])


def _describe_canary(case: dict) -> str:
    c, p, pol = case["candidate"], case["production"], case["policy"]
    failed = sum(not ok for _, ok in c)
    return (f"{case['label']}: {len(c)} candidate requests ({failed} failed, P99 of the successful ones "
            f"{_fmt(_successful_p99(c))} s), {len(p)} production requests (P99 {_fmt(_successful_p99(p))} s); "
            f"policy max_error_rate="
            f"{pol['max_error_rate']}, max_p99_ratio={pol['max_p99_ratio']}, max_p99_added_s={pol['max_p99_added_s']}, "
            f"min_p99_s={pol['min_p99_s']}")


def _judged(case: dict, *, at_least=False, with_failed=False, no_floor=False, rule=None, nearest=False,
            maximum=False) -> str:
    """The reference's verdict (``RolloutPolicy.judge``) on the case, or on the case as one common mistake reads
    it, for the message: a limit moved (``>=`` is ``>`` against the next float down, one rule alone is the other
    at infinity, no floor is a floor at minus infinity), or the latencies the P99s are taken over changed (the
    failed requests counted as well; a single request carrying the nearest-rank value or the maximum)."""
    policy = dict(case["policy"])
    if at_least:
        policy["max_error_rate"] = math.nextafter(policy["max_error_rate"], -math.inf)
    if no_floor:
        policy["min_p99_s"] = -math.inf
    if rule:
        policy["max_p99_added_s" if rule == "ratio" else "max_p99_ratio"] = math.inf
    candidate, production = case["candidate"], case["production"]
    if reference_canary_verdict(_served("candidate", candidate), [], _policy(policy)) == "rollback":
        return "rollback"  # the error rate alone: with no production latency, no latency rolls back

    def latencies(requests: list[list], top=None) -> list[list]:
        values = sorted(latency for latency, ok in requests if ok or with_failed)
        return [[top(values), True]] if top and values else [[value, True] for value in values]

    ranked = _nearest_rank if nearest else None
    return reference_canary_verdict(_served("candidate", latencies(candidate, max if maximum else ranked)),
                                    _served("production", latencies(production, ranked)), _policy(policy))


def _nearest_rank(values: list[float]) -> float:
    """The 99th percentile as the nearest rank (a common mistake's P99)."""
    return values[max(0, math.ceil(0.99 * len(values)) - 1)]


def _canary_problem(case: dict, got, want):
    if got not in ("rollback", "advance"):
        return "canary_verdict must return 'rollback' or 'advance'", f"got {got!r:.60}"
    if got == want:
        return None
    mistakes = {
        "an error rate equal to max_error_rate is not above it (>, not >=)": {"at_least": True},
        "the P99s are over successful requests only: a failed request counts in the error rate, not in the latency":
            {"with_failed": True},
        "below min_p99_s a latency is never a reason to roll back, whatever the ratio": {"no_floor": True},
        "you applied the ratio rule only: the candidate also rolls back past production's P99 plus "
        "max_p99_added_s, whichever limit is lower": {"rule": "ratio"},
        "you applied the added-seconds rule only: the candidate also rolls back past max_p99_ratio times "
        "production's P99, whichever limit is lower": {"rule": "added"},
        "P99 is the 99th percentile with linear interpolation (your percentile from task 4), not the nearest rank":
            {"nearest": True},
        "P99 is the 99th percentile with linear interpolation (your percentile from task 4), not the maximum":
            {"maximum": True},
    }
    fits = [why for why, flags in mistakes.items() if _judged(case, **flags) == got]
    if not fits and not any(ok for _, ok in case["production"]):
        fits = ["with no successful production request there is nothing to compare a latency with: its P99 is 0, "
                "and only the error rate can roll the candidate back"]
    note = "; " + "; or ".join(fits) if fits else ""
    return "canary_verdict gave the wrong verdict", f"expected {want!r}, got {got!r}{note}"


def _compare_canary(got, expected, cases):
    return _compare_results("canary_verdict", got, expected, cases, _describe_canary, _canary_problem)


def _rollout_cases(rng: random.Random) -> list[dict]:
    from infra_lib.ops.llmops import BEHAVIOURS

    return [{"behaviour": b, "seed": rng.randrange(10_000)} for b in BEHAVIOURS for _ in range(2)]


def _drive_rollouts(fn, cases: list[dict]) -> list:
    from infra_lib.ops.llmops import RolloutPolicy, simulate_rollout

    def run(behaviour, seed):
        rollout = simulate_rollout(behaviour, RolloutPolicy(), judge=fn, seed=seed)
        return {"outcome": rollout.outcome, "served": len(rollout.served),
                "decisions": [[d["step"], d["verdict"]] for d in rollout.decisions]}

    return [outcome(run, case["behaviour"], case["seed"]) for case in cases]


def _describe_rollout(case: dict) -> str:
    return f"simulate_rollout({case['behaviour']!r}, RolloutPolicy(), judge=canary_verdict, seed={case['seed']})"


def _rollout_problem(case: dict, got, want):
    if got == want:
        return None
    if type(got) is not dict:
        return "the rollout returned something unexpected", f"got {got!r:.80}"
    return ("the rollout driven by your canary_verdict ended differently from the reference's",
            f"expected {want['outcome']} after {want['served']} requests (decisions {want['decisions']}), got "
            f"{got['outcome']} after {got['served']} (decisions {got['decisions']})")


def _compare_rollouts(got, expected, cases):
    return _compare_results("canary_verdict", got, expected, cases, _describe_rollout, _rollout_problem)


_CANARY_HINT = ("roll back when the candidate's error rate (failed over all its requests) is above max_error_rate; "
                "else when the P99 latency of its successful requests is above min_p99_s, production's P99 (of its "
                "successful requests) is above 0, and the candidate's is above the lower of max_p99_ratio times "
                "production's and production's plus max_p99_added_s; else advance. Every threshold comes from the "
                "policy; an empty list's P99 is 0. "
                "chapter 11, section “7 · LLMOps: a registry, an evaluation gate, a canary, a rollback”.")

register(Check(check_id="lab10.canary_verdict", task=_TASKS["canary_verdict"],
               reference=lambda: reference_canary_verdict, make_inputs=_canary_cases, drive=_drive_canary,
               compare=_compare_canary, hint=_CANARY_HINT))
register(Check(check_id="lab10.canary_edges", task=_TASKS["canary_verdict"],
               reference=lambda: reference_canary_verdict, make_inputs=_canary_edges, drive=_drive_canary,
               compare=_compare_canary,
               hint=_CANARY_HINT + " Values exactly on each limit, timed-out failures, a single outlier, no "
                                   "production requests, policies other than the default."))
register(Check(check_id="lab10.canary_rollouts", task=_TASKS["canary_verdict"],
               reference=lambda: reference_canary_verdict, make_inputs=_rollout_cases, drive=_drive_rollouts,
               compare=_compare_rollouts,
               hint=_CANARY_HINT + " Whole simulated rollouts of every behaviour, your verdict deciding each step."))
