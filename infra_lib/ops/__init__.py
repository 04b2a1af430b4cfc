"""Operations (L5): what a serving team measures, pays and debugs.

latency.py    TTFT, TPOT, ITL, E2EL, percentiles and goodput from client timestamps (vLLM's definitions)
loadgen.py    an open-loop load generator (Poisson or gamma arrivals, a concurrency cap) for the server
cost.py       cost per 1M tokens and replicas needed for a rate at a P99 SLO
diagnose.py   busy versus idle, then the fault: KV pressure, head-of-line blocking, a slow dependency
router_workload.py  seeded multi-turn chats over shared system prompts, replayed through a router (closed-loop
              users, streamed turns, TTFT per request)
router_sim.py routing policies raced on simulated replicas (LRU prefix caches, loads, replicas that die), no HTTP
"""

from infra_lib.ops.cost import cost_per_million_tokens, max_rate_under_slo, plan_capacity, replicas_needed
from infra_lib.ops.diagnose import FAULTS, Diagnosis, diagnose, run_scenario, window_stats
from infra_lib.ops.latency import RequestTiming, e2el, goodput, itl, meets_slo, percentile, summarize, tpot, ttft
from infra_lib.ops.loadgen import LoadResult, arrival_times, run_load, run_load_async

__all__ = [
    "FAULTS",
    "Diagnosis",
    "LoadResult",
    "RequestTiming",
    "diagnose",
    "run_scenario",
    "window_stats",
    "arrival_times",
    "cost_per_million_tokens",
    "e2el",
    "goodput",
    "itl",
    "max_rate_under_slo",
    "meets_slo",
    "percentile",
    "plan_capacity",
    "replicas_needed",
    "run_load",
    "run_load_async",
    "summarize",
    "tpot",
    "ttft",
]
