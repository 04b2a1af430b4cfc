"""infra_lib.ops and the serving metrics, without the model: latency definitions, arrivals, cost,
capacity, the event log behind /metrics, and the diagnosis of injected faults."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra_lib.ops import (
    RequestTiming,
    arrival_times,
    cost_per_million_tokens,
    e2el,
    goodput,
    itl,
    max_rate_under_slo,
    meets_slo,
    percentile,
    plan_capacity,
    replicas_needed,
    summarize,
    tpot,
    ttft,
)
from infra_lib.ops.diagnose import FAULTS, Diagnosis, diagnose, run_scenario, window_stats
from infra_lib.serving import LLMEngine, SchedulerConfig, SimulatedRunner, StepCostModel, random_workload, replay
from infra_lib.serving.events import EventLog
from infra_lib.serving.observability import ServingMetrics, parse_metrics

COST = StepCostModel(0.01, 1e-4, 1e-3, 1e-6)


def timing(send, chunks, end, n=None, **kw) -> RequestTiming:
    return RequestTiming(
        send, list(chunks), end, prompt_tokens=kw.pop("prompt", 10), output_tokens=len(chunks) if n is None else n, **kw
    )


def test_vllm_definitions_on_a_worked_request():
    t = timing(1.0, [1.2, 1.3, 1.5, 1.6], 1.6)
    assert ttft(t) == pytest.approx(0.2) and e2el(t) == pytest.approx(0.6)
    assert tpot(t) == pytest.approx((0.6 - 0.2) / 3)
    assert itl(t) == pytest.approx([0.1, 0.2, 0.1])
    # chunks may carry several tokens: TPOT divides by tokens, ITL counts chunks
    t2 = timing(0.0, [0.5, 1.0], 1.0, n=11)
    assert tpot(t2) == pytest.approx(0.05) and itl(t2) == pytest.approx([0.5])
    assert math.isnan(tpot(timing(0.0, [0.3], 0.3))) and itl(timing(0.0, [0.3], 0.3)) == []
    assert math.isnan(ttft(timing(0.0, [], 0.3, n=0)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=40), st.floats(0, 100))
def test_percentile_matches_numpy(values, p):
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-9, abs=1e-6)


def test_percentile_edges():
    assert math.isnan(percentile([], 99))
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_goodput_counts_requests_meeting_every_slo():
    fast = timing(0.0, [0.1, 0.15, 0.2], 0.2)
    slow_start = timing(0.0, [0.9, 0.95], 0.95)
    slow_tokens = timing(0.0, [0.1, 0.6], 0.6)
    one_token = timing(0.0, [0.1], 0.1)
    failed = timing(0.0, [0.1, 0.12], 0.12, success=False, error="500")
    slo = {"ttft": 500, "tpot": 100}
    assert [meets_slo(t, slo) for t in (fast, slow_start, slow_tokens, one_token, failed)] == [
        True,
        False,
        False,
        True,
        False,
    ]
    assert goodput([fast, slow_start, slow_tokens, one_token, failed], 2.0, slo) == 1.0
    with pytest.raises(ValueError, match="unknown SLO"):
        meets_slo(fast, {"p99": 1})
    with pytest.raises(ValueError, match="positive"):
        goodput([fast], 0.0, slo)


def test_summary_has_vllm_keys_and_pools_itl():
    rng = random.Random(0)
    timings = []
    for _ in range(30):
        send = rng.random()
        chunks = sorted(send + 0.05 + rng.random() for _ in range(rng.randint(1, 12)))
        timings.append(timing(send, chunks, chunks[-1]))
    timings.append(timing(0.0, [], 0.5, n=0, success=False, error="429: busy"))
    s = summarize(timings, 4.0, {"ttft": 400})
    assert s["completed"] == 30 and s["failed"] == 1
    assert s["request_throughput"] == pytest.approx(30 / 4.0)
    assert s["output_throughput"] == pytest.approx(sum(t.output_tokens for t in timings) / 4.0)
    gaps = [g * 1000 for t in timings[:30] for g in itl(t)]
    assert s["mean_itl_ms"] == pytest.approx(statistics.fmean(gaps))
    assert s["p99_itl_ms"] == pytest.approx(float(np.percentile(gaps, 99)))
    per_request = [tpot(t) * 1000 for t in timings[:30] if t.output_tokens > 1]
    assert s["median_tpot_ms"] == pytest.approx(float(np.median(per_request)))
    assert s["request_goodput"] == pytest.approx(sum(meets_slo(t, {"ttft": 400}) for t in timings) / 4.0)
    for key in (
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p99_ttft_ms",
        "p99_e2el_ms",
        "total_token_throughput",
    ):
        assert key in s


def test_arrivals_follow_the_rate_and_burstiness():
    n = 4000
    for burstiness in (0.25, 1.0, 4.0):
        times = arrival_times(n, rate=10.0, burstiness=burstiness, seed=3)
        gaps = np.diff(times)
        assert times[0] == 0.0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(0.1, rel=0.1)
        cv = gaps.std() / gaps.mean()  # gamma: coefficient of variation 1/sqrt(shape)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    assert arrival_times(5, 2.0, seed=1) == arrival_times(5, 2.0, seed=1)
    for bad in ({"rate": 0}, {"rate": 1, "burstiness": 0}):
        with pytest.raises(ValueError):
            arrival_times(3, **{"burstiness": 1.0, **bad})


def test_cost_and_capacity():
    assert cost_per_million_tokens(3.6, 1000) == pytest.approx(1.0)
    assert cost_per_million_tokens(3.6, 1000, utilisation=0.5) == pytest.approx(2.0)
    curve = [
        {"request_rate": 1, "p99_ttft_ms": 50},
        {"request_rate": 2, "p99_ttft_ms": 80},
        {"request_rate": 4, "p99_ttft_ms": 300},
    ]
    assert max_rate_under_slo(curve, 80) == 2
    assert max_rate_under_slo(curve, 190) == pytest.approx(3.0)
    assert max_rate_under_slo(curve, 1000) == 4
    assert max_rate_under_slo(curve, 10) == 0.0
    assert replicas_needed(10, 2.5, headroom=0.2) == 5 and replicas_needed(10, 2.5, headroom=0.0) == 4
    assert replicas_needed(0, 2.5) == 0
    plan = plan_capacity(9, curve, 190, price_per_hour=2.0, tokens_per_request=100)
    assert plan["replicas"] == 4 and plan["cost_per_hour"] == 8.0
    assert plan["cost_per_million_tokens"] == pytest.approx(8.0 / (900 * 3600) * 1e6)
    with pytest.raises(ValueError, match="cannot meet the SLO"):
        plan_capacity(9, curve, 10)
    for bad in ((-1, 10), (1, 0), (1, 10, 0)):
        with pytest.raises(ValueError):
            cost_per_million_tokens(*bad)


def test_metrics_replayed_from_the_event_log_equal_the_engines_own_records():
    log = EventLog()
    metrics = ServingMetrics("sim", log, prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=6, num_blocks=24, block_size=16, enable_prefix_caching=True)
    engine = LLMEngine(SimulatedRunner(COST), config, events=log)
    outputs = replay(engine, random_workload(30, seed=2, rate=40, shared_prefix_len=32, output_len=(8, 40)))
    s = metrics.snapshot()
    assert s["vllm:time_to_first_token_seconds_count"] == 30
    assert s["vllm:time_to_first_token_seconds_sum"] == pytest.approx(sum(o.metrics.ttft for o in outputs))
    assert s["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(sum(o.metrics.e2e_latency for o in outputs))
    assert s["vllm:request_queue_time_seconds_sum"] == pytest.approx(sum(o.metrics.queue_time for o in outputs))
    tokens = sum(len(o.token_ids) for o in outputs)
    assert s["vllm:generation_tokens_total"] == tokens
    assert s["vllm:inter_token_latency_seconds_count"] == tokens - 30
    assert s["vllm:prompt_tokens_total"] == sum(len(o.prompt_ids) for o in outputs)
    preemptions = sum(o.metrics.num_preemptions for o in outputs)
    assert preemptions > 0 and s["vllm:num_preemptions_total"] == preemptions
    assert s["vllm:prefix_cache_hits_total"] == sum(o.metrics.num_cached_tokens for o in outputs) > 0
    assert s["vllm:prefix_cache_queries_total"] == s["vllm:prompt_tokens_total"]
    assert s['vllm:request_success_total{finished_reason="length"}'] == 30
    busy = sum(r.end - r.start for r in engine.steps)
    assert s["infra_lab:engine_busy_seconds_total"] == pytest.approx(busy)
    assert s["vllm:num_requests_running"] == 0 and s["vllm:kv_cache_usage_perc"] == 0.0
    # the exposition parses back to the same numbers
    assert parse_metrics(metrics.exposition().decode()) == s
    timelines = log.request_timelines()
    assert [len(timelines[o.request_id]["token_times"]) for o in outputs] == [len(o.token_ids) for o in outputs]
    assert sum(r["preemptions"] for r in timelines.values()) == preemptions


def test_event_log_bounds_and_rejects_unknown_kinds():
    log = EventLog(maxlen=3)
    seen = []
    log.subscribe(seen.append)
    for i in range(5):
        log.emit("arrived", float(i), i, prompt_tokens=1)
    assert len(log) == 3 and log.total == 5 and len(seen) == 5
    assert [e.request_id for e in log.events()] == [2, 3, 4]
    with pytest.raises(ValueError, match="unknown event kind"):
        log.emit("exploded", 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_diagnosis_names_every_injected_fault(seed):
    for fault in FAULTS:
        result = run_scenario(fault, seed=seed)
        diagnosis = result["diagnosis"]
        assert isinstance(diagnosis, Diagnosis)
        assert diagnosis.fault == fault, f"{fault} (seed {seed}) diagnosed as {diagnosis}"
        assert diagnosis.evidence[0].startswith("engine busy") and diagnosis.advice


def test_the_faults_raise_p99_and_busy_versus_idle_splits_them():
    stats = {f: run_scenario(f)["stats"] for f in FAULTS}
    healthy = stats["healthy"]
    for fault in ("slow_dependency", "head_of_line", "kv_pressure", "overload"):
        assert stats[fault]["p99_e2el_ms"] > healthy["p99_e2el_ms"], fault
    assert stats["slow_dependency"]["busy_fraction"] < 0.9 <= stats["overload"]["busy_fraction"]
    assert stats["kv_pressure"]["preemptions"] > 0 == healthy["preemptions"]
    assert stats["head_of_line"]["max_step_ms"] > 10 * healthy["median_step_ms"]


def test_diagnose_and_window_stats_refuse_incomplete_input():
    with pytest.raises(ValueError, match="lacks"):
        diagnose({"busy_fraction": 0.5})
    with pytest.raises(ValueError, match="no steps"):
        window_stats(EventLog())
    with pytest.raises(ValueError, match="unknown scenario"):
        run_scenario("gremlins")
