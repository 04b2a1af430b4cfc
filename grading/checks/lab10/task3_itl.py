"""Lab 10 task 3: ``itl``, one request's gaps between chunks, on synthetic timings and real traces."""

from __future__ import annotations

from grading.checks.common import is_number
from grading.checks.lab10.results import fmt, same_number
from grading.checks.lab10.timings import mixed_timings, per_request_parts, trace_sample
from grading.registry import Check, register


def _itl_problem(d: dict, got, want):
    chunks = d["chunk_times"]
    if type(got) is not list:
        note = "; return the list of gaps (the run's summary pools them later)" if is_number(got) else ""
        return "itl must return a list of gaps", f"got {fmt(got)}{note}"
    if len(got) != len(want):
        note = ""
        if len(got) == len(want) + 1 and got and chunks and same_number(got[0], chunks[0] - d["send_time"]):
            note = "; your first gap is the TTFT: the gaps start at the first chunk"
        elif len(got) == len(want) + 1 and got and chunks and same_number(got[-1], d["end_time"] - chunks[-1]):
            note = "; your last gap runs to end_time: only gaps between chunks count"
        elif len(got) == max(d["output_tokens"] - 1, 0) != len(want):
            note = "; one gap per pair of successive chunks, not per token"
        return "itl returned the wrong number of gaps", (
            f"expected {len(want)} gaps ({len(chunks)} chunks give {max(len(chunks) - 1, 0)}), got {len(got)}{note}"
        )
    for k, (g, e) in enumerate(zip(got, want)):
        if not same_number(g, e):
            note = ""
            if all(is_number(x) for x in got) and sorted(got) == sorted(want):
                note = "; the gaps are right but out of order: keep the order in which the chunks arrived"
            return "itl returned a wrong gap", (
                f"gap {k} (from the chunk at {fmt(chunks[k])} to the one at "
                f"{fmt(chunks[k + 1])}): expected {fmt(e)}, got {fmt(g)}{note}"
            )
    return None


_ITL_HINT = (
    "ITL is the list of one request's gaps between successive chunks, in seconds and in arrival order; "
    "0 or 1 chunk give no gap. The wait before the first chunk is TTFT and the time after the last one is "
    "not a gap either, and a gap is per chunk, not per token."
)

register(
    Check(check_id="lab10.itl", **per_request_parts("itl", _itl_problem), make_inputs=mixed_timings, hint=_ITL_HINT)
)
register(
    Check(
        check_id="lab10.itl_real_traces",
        **per_request_parts("itl", _itl_problem),
        make_inputs=trace_sample,
        hint=_ITL_HINT + " Traces of the simulated engine, some several tokens per chunk.",
    )
)
