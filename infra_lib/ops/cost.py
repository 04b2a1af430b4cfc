"""What serving costs and how many replicas a load needs, from measured throughput and latency.

    cost per 1M tokens = price per hour / (tokens per second x 3600 x utilisation) x 1e6

Utilisation is the fraction of paid hours that carry traffic at the measured throughput (a
replica that idles half the night costs the same per hour). Capacity planning reads a
latency-versus-rate curve measured on one replica (``ops.loadgen`` at several rates), finds the
highest rate whose P99 still meets the SLO, and divides the target rate by it, with headroom
for bursts.
"""

from __future__ import annotations

import math


def cost_per_million_tokens(price_per_hour: float, tokens_per_s: float, utilisation: float = 1.0) -> float:
    """Dollars per million tokens for a replica that costs ``price_per_hour`` and serves ``tokens_per_s``."""
    if price_per_hour < 0:
        raise ValueError(f"price_per_hour must be >= 0, got {price_per_hour}")
    if not tokens_per_s > 0:
        raise ValueError(f"tokens_per_s must be positive, got {tokens_per_s}")
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must lie in (0, 1], got {utilisation}")
    return price_per_hour / (tokens_per_s * 3600 * utilisation) * 1e6


def max_rate_under_slo(
    curve: list[dict], slo_ms: float, metric: str = "p99_ttft_ms", rate_key: str = "request_rate"
) -> float:
    """The highest request rate at which ``metric`` stays within ``slo_ms`` on one replica.

    Args:
        curve: measurements, each a dict with ``rate_key`` and ``metric`` (a load test's summary
            plus the rate it was run at). Between the last rate that meets the SLO and the first
            that does not, the rate is interpolated linearly.
    Returns:
        The rate (0.0 if even the lowest measured rate misses the SLO).
    """
    points = sorted((float(p[rate_key]), float(p[metric])) for p in curve)
    if not points:
        raise ValueError("the curve has no points: measure latency at a few request rates first")
    best = 0.0
    for (r0, m0), (r1, m1) in zip([(0.0, points[0][1])] + points, points):
        if m1 <= slo_ms:
            best = r1
            continue
        if m0 <= slo_ms < m1 and r1 > r0:  # the SLO is crossed between r0 and r1
            best = r0 + (r1 - r0) * (slo_ms - m0) / (m1 - m0)
        break
    return best


def replicas_needed(target_rate: float, rate_per_replica: float, headroom: float = 0.2) -> int:
    """Replicas to carry ``target_rate`` when each carries ``rate_per_replica`` at the SLO, keeping
    ``headroom`` (a fraction) of each replica free for bursts."""
    if target_rate < 0:
        raise ValueError(f"target_rate must be >= 0, got {target_rate}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must lie in [0, 1), got {headroom}")
    if rate_per_replica <= 0:
        raise ValueError(
            "one replica cannot meet the SLO at any measured rate: lower the load per replica, "
            "relax the SLO or use faster hardware"
        )
    return max(1, math.ceil(target_rate / (rate_per_replica * (1 - headroom)) - 1e-9)) if target_rate else 0


def plan_capacity(
    target_rate: float,
    curve: list[dict],
    slo_ms: float,
    *,
    metric: str = "p99_ttft_ms",
    price_per_hour: float = 0.0,
    headroom: float = 0.2,
    tokens_per_request: float | None = None,
) -> dict:
    """Replicas, hourly cost and cost per 1M tokens to serve ``target_rate`` requests/s at the SLO."""
    per_replica = max_rate_under_slo(curve, slo_ms, metric)
    replicas = replicas_needed(target_rate, per_replica, headroom)
    plan = {
        "target_rate": target_rate,
        "slo_ms": slo_ms,
        "metric": metric,
        "rate_per_replica": per_replica,
        "headroom": headroom,
        "replicas": replicas,
        "cost_per_hour": replicas * price_per_hour,
    }
    if tokens_per_request and target_rate > 0:
        tokens_per_s = target_rate * tokens_per_request
        plan["cost_per_million_tokens"] = plan["cost_per_hour"] / (tokens_per_s * 3600) * 1e6
    return plan
