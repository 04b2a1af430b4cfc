"""Lab 10 task 1: ``ttft`` and ``e2el`` of one request, on synthetic timings and real traces."""

from __future__ import annotations

import math

from grading.checks.lab10.results import fmt, same_number
from grading.checks.lab10.timings import mixed_timings, per_request_parts, trace_sample
from grading.registry import Check, register


def _ttft_problem(d: dict, got, want):
    if same_number(got, want):
        return None
    chunks = d["chunk_times"]
    note = ""
    if math.isnan(want):
        note = "; with no chunk there is no first token: return float('nan')"
    elif same_number(got, chunks[0]):
        note = "; that is when the first chunk arrived: subtract send_time"
    elif same_number(got, d["end_time"] - d["send_time"]):
        note = "; that is the end-to-end latency: TTFT stops at the first chunk"
    return "ttft returned the wrong time to first token", f"expected {fmt(want)}, got {fmt(got)}{note}"


def _e2el_problem(d: dict, got, want):
    if same_number(got, want):
        return None
    note = ""
    if d["chunk_times"] and same_number(got, d["end_time"] - d["chunk_times"][0]):
        note = "; that starts at the first chunk: E2EL starts when the request was sent"
    elif d["chunk_times"] and same_number(got, d["chunk_times"][-1] - d["send_time"]):
        note = "; that stops at the last chunk: E2EL stops at end_time"
    return "e2el returned the wrong end-to-end latency", f"expected {fmt(want)}, got {fmt(got)}{note}"


_TTFT_HINT = (
    "TTFT runs from sending the request to the arrival of its first chunk, in seconds, whatever that chunk "
    "carries; with no chunk at all (a request refused, or failed before its first token) there is no first "
    "token and the answer is nan."
)
_E2EL_HINT = (
    "E2EL runs from sending the request to the end of its response, not from the first chunk nor to the "
    "last one, for every request, failed or not; a request the client abandoned has no end time (nan), so "
    "its E2EL is nan too."
)

_TRACES = " Traces of the simulated engine, some failed, some several tokens per chunk."

register(
    Check(check_id="lab10.ttft", **per_request_parts("ttft", _ttft_problem), make_inputs=mixed_timings, hint=_TTFT_HINT)
)
register(
    Check(check_id="lab10.e2el", **per_request_parts("e2el", _e2el_problem), make_inputs=mixed_timings, hint=_E2EL_HINT)
)
register(
    Check(
        check_id="lab10.ttft_real_traces",
        **per_request_parts("ttft", _ttft_problem),
        make_inputs=trace_sample,
        hint=_TTFT_HINT + _TRACES,
    )
)
register(
    Check(
        check_id="lab10.e2el_real_traces",
        **per_request_parts("e2el", _e2el_problem),
        make_inputs=trace_sample,
        hint=_E2EL_HINT + _TRACES,
    )
)
