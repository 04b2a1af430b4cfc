"""Serving latency metrics from a client's timestamps, with vLLM's benchmark definitions.

A client that streams a request sees four kinds of moments: it sent the request, chunks
arrived (each carrying one or more tokens), and the stream ended. From them:

    TTFT   time to first token      first chunk - send
    E2EL   end-to-end latency       end - send
    TPOT   time per output token    (E2EL - TTFT) / (n - 1), n = output tokens; one value per request
    ITL    inter-token latency      the gaps between successive chunks, pooled over all requests

TPOT and ITL differ: TPOT averages inside one request, then requests are weighed equally; ITL
pools every gap, so long requests weigh more and a stall stays one big gap in the pool (its
maximum, and its high percentiles once stalls are frequent) instead of being averaged into a
request's TPOT. A request with one output token has no TPOT (it counts as meeting a TPOT
SLO). Percentiles interpolate linearly between order statistics (``numpy.percentile``'s
default). Goodput counts only the requests that met every SLO, per second.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class RequestTiming:
    """What a client saw of one request, in seconds on its own clock.

    Attributes:
        send_time: the request left the client.
        chunk_times: when each streamed chunk with tokens arrived (a whole response: one, at the end).
        end_time: the response was complete.
        prompt_tokens / output_tokens: from the response's usage.
        success: False for an error or a request the client abandoned.
        error: what went wrong (HTTP status and message), "" on success.
    """

    send_time: float
    chunk_times: list[float] = field(default_factory=list)
    end_time: float = float("nan")
    prompt_tokens: int = 0
    output_tokens: int = 0
    success: bool = True
    error: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def ttft(t: RequestTiming) -> float:
    """Seconds from sending to the first chunk (nan without chunks)."""
    return t.chunk_times[0] - t.send_time if t.chunk_times else float("nan")


def e2el(t: RequestTiming) -> float:
    """Seconds from sending to the end of the response."""
    return t.end_time - t.send_time


def tpot(t: RequestTiming) -> float:
    """(E2EL - TTFT) / (output_tokens - 1); nan with fewer than two output tokens."""
    if t.output_tokens < 2 or not t.chunk_times:
        return float("nan")
    return (e2el(t) - ttft(t)) / (t.output_tokens - 1)


def itl(t: RequestTiming) -> list[float]:
    """The gaps between successive chunks of one request."""
    return [b - a for a, b in zip(t.chunk_times, t.chunk_times[1:])]


def percentile(values, p: float) -> float:
    """The ``p``-th percentile (0..100) with linear interpolation; nan for no values."""
    xs = sorted(float(v) for v in values)
    if not 0 <= p <= 100:
        raise ValueError(f"p must lie in [0, 100], got {p}")
    if not xs:
        return float("nan")
    rank = (len(xs) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def meets_slo(t: RequestTiming, slo_ms: dict[str, float]) -> bool:
    """Whether a successful request met every SLO in ``slo_ms`` (keys "ttft", "tpot", "e2el", in ms)."""
    unknown = set(slo_ms) - {"ttft", "tpot", "e2el"}
    if unknown:
        raise ValueError(f"unknown SLO keys {sorted(unknown)}; use ttft, tpot, e2el (milliseconds)")
    if not t.success:
        return False
    measured = {"ttft": ttft(t), "tpot": tpot(t), "e2el": e2el(t)}
    for key, limit in slo_ms.items():
        value = measured[key]
        if key == "tpot" and math.isnan(value):  # one output token: no time between tokens to judge
            continue
        if not value * 1000 <= limit:
            return False
    return True


def goodput(timings: list[RequestTiming], duration_s: float, slo_ms: dict[str, float]) -> float:
    """Requests per second that succeeded and met every SLO."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    return sum(meets_slo(t, slo_ms) for t in timings) / duration_s


def _stats(name: str, seconds: list[float], percentiles) -> dict[str, float]:
    ms = [v * 1000 for v in seconds if not math.isnan(v)]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else float("nan"),
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": statistics.pstdev(ms) if ms else float("nan"),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def summarize(
    timings: list[RequestTiming], duration_s: float, slo_ms: dict[str, float] | None = None, percentiles=(50, 90, 99)
) -> dict[str, float]:
    """vLLM's benchmark summary of a run that lasted ``duration_s`` seconds.

    Latencies are over the successful requests; throughputs divide by the whole duration.
    """
    ok = [t for t in timings if t.success]
    out = {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": sum(t.prompt_tokens for t in ok),
        "total_output_tokens": sum(t.output_tokens for t in ok),
    }
    out["request_throughput"] = len(ok) / duration_s
    out["output_throughput"] = out["total_output_tokens"] / duration_s
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration_s
    if slo_ms:
        out["request_goodput"] = goodput(timings, duration_s, slo_ms)
    out.update(_stats("ttft", [ttft(t) for t in ok], percentiles))
    out.update(_stats("tpot", [tpot(t) for t in ok], percentiles))
    out.update(_stats("itl", [g for t in ok for g in itl(t)], percentiles))
    out.update(_stats("e2el", [e2el(t) for t in ok], percentiles))
    return out
