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

from grading.registry import register_shortcuts

from . import (  # noqa: F401  (each task's module registers its checks, in task order)
    task1_ttft_e2el,
    task2_tpot,
    task3_itl,
    task4_percentile,
    task5_latency_percentiles,
    task6_goodput,
    task7_diagnose,
    task8_gate,
    task9_canary,
)

# The library's metrics, the diagnosis and the release rules; the canary policy's verdict is one method
# of RolloutPolicy, whose other methods the rollout simulation runs.
register_shortcuts(
    "lab10",
    [
        "infra_lib.ops.latency:ttft",
        "infra_lib.ops.latency:e2el",
        "infra_lib.ops.latency:tpot",
        "infra_lib.ops.latency:itl",
        "infra_lib.ops.latency:percentile",
        "infra_lib.ops.latency:meets_slo",
        "infra_lib.ops.latency:goodput",
        "infra_lib.ops.latency:summarize",
        "infra_lib.ops.diagnose:diagnose",
        "infra_lib.ops.diagnose:p99_latency_ms",
        "infra_lib.ops.llmops:gate",
        "infra_lib.ops.llmops:p99",
        "infra_lib.ops.llmops:RolloutPolicy.judge",
    ],
)
