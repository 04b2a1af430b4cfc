"""Lab 10 task 2: ``tpot``, the pace after the first token, on synthetic timings and real traces."""

from __future__ import annotations

import math

from grading.checks.lab10.results import fmt, same_number
from grading.checks.lab10.timings import NAN, mixed_timings, per_request_parts, trace_sample
from grading.registry import Check, register


def _tpot_problem(d: dict, got, want):
    if same_number(got, want):
        return None
    chunks, n = d["chunk_times"], d["output_tokens"]
    e2el = d["end_time"] - d["send_time"]
    after_first = e2el - (chunks[0] - d["send_time"]) if chunks else NAN
    note = ""
    if math.isnan(want) and n < 2:
        note = f"; with {n} output token(s) there is no time between tokens: return float('nan')"
    elif len(chunks) > 1 and same_number(got, after_first / (len(chunks) - 1)):
        note = (
            f"; you divided by the number of chunks minus 1 ({len(chunks) - 1}), but these {len(chunks)} chunks "
            f"carry {n} tokens: divide by output_tokens - 1"
        )
    elif same_number(got, after_first / n):
        note = "; you divided by output_tokens: n tokens leave n - 1 intervals after the first one"
    elif same_number(got, e2el / n) or same_number(got, e2el / (n - 1)):
        note = "; that includes the wait for the first token: subtract TTFT from E2EL first"
    return "tpot returned the wrong time per output token", f"expected {fmt(want)}, got {fmt(got)}{note}"


_TPOT_HINT = (
    "TPOT is the pace after the first token: the wait for the first token is left out, and the rest of "
    "the request's time is shared by the tokens after the first one. Count tokens, not chunks (a chunk can "
    "carry several tokens); with fewer than two output tokens there is no time between tokens: nan."
)

register(
    Check(check_id="lab10.tpot", **per_request_parts("tpot", _tpot_problem), make_inputs=mixed_timings, hint=_TPOT_HINT)
)
register(
    Check(
        check_id="lab10.tpot_real_traces",
        **per_request_parts("tpot", _tpot_problem),
        make_inputs=trace_sample,
        hint=_TPOT_HINT + " Traces of the simulated engine, some failed, some several tokens per chunk.",
    )
)
