"""Lab 10's checks catch the classic metric mistakes with messages that name them, and the diagnosis
checks insist on the busy-versus-idle split and the order of the rules."""

from __future__ import annotations

import json
import math

import pytest

from conftest import REPO, check_fails, solution_namespace
from grading import check
from grading.check import RECORD_ENV, SEED_ENV
from grading.registry import all_checks

SOLUTION = REPO / "solutions" / "lab10_serving_metrics" / "lab10_serving_metrics.ipynb"


@pytest.fixture(scope="module")
def solution() -> dict:
    """The instructor's answers, run as the notebook runs them (setup first, then every answer cell)."""
    from infra_lib.ops.latency import RequestTiming

    return solution_namespace(SOLUTION, RequestTiming=RequestTiming)


_fails = check_fails


def test_task1_ttft_is_relative_to_send_time_and_nan_without_chunks(solution):
    text = _fails("lab10.ttft", lambda t: t.chunk_times[0] if t.chunk_times else math.nan)
    assert "subtract send_time" in text
    text = _fails("lab10.ttft", lambda t: t.chunk_times[0] - t.send_time if t.chunk_times else None)
    assert "expected nan, got None" in text and "float('nan')" in text


def test_task2_tpot_divided_by_chunks_is_caught_with_the_reason(solution):
    def per_chunk(t):
        if len(t.chunk_times) < 2:
            return math.nan
        return (solution["e2el"](t) - solution["ttft"](t)) / (len(t.chunk_times) - 1)

    text = _fails("lab10.tpot", per_chunk)
    assert "tpot returned the wrong time per output token" in text
    assert "divided by the number of chunks minus 1" in text and "divide by output_tokens - 1" in text
    assert "on RequestTiming(send_time=" in text and "hint:" in text


def test_task2_tpot_over_all_tokens_is_caught(solution):
    def over_n(t):
        return (solution["e2el"](t) - solution["ttft"](t)) / t.output_tokens if t.output_tokens > 1 else math.nan

    assert "you divided by output_tokens" in _fails("lab10.tpot", over_n)


def test_task3_itl_that_starts_at_send_time_is_caught():
    text = _fails("lab10.itl", lambda t: [b - a for a, b in zip([t.send_time, *t.chunk_times], t.chunk_times)])
    assert "wrong number of gaps" in text and "your first gap is the TTFT" in text


def test_task4_nearest_rank_and_unchecked_p_are_caught():
    def nearest_rank(values, p):
        if not 0 <= p <= 100:
            raise ValueError(p)
        xs = sorted(values)
        return xs[max(math.ceil(p / 100 * len(xs)) - 1, 0)] if xs else math.nan

    assert "interpolate linearly" in _fails("lab10.percentile", nearest_rank)

    def unchecked(values, p):
        xs = sorted(values)
        return xs[min(round((len(xs) - 1) * p / 100), len(xs) - 1)] if xs else math.nan

    text = _fails("lab10.percentile", unchecked)
    assert "should raise ValueError" in text or "interpolate" in text


def test_task5_per_request_mean_itl_instead_of_pooled_gaps_is_caught(solution):
    percentile, ttft, tpot, itl, e2el = (solution[name] for name in ("percentile", "ttft", "tpot", "itl", "e2el"))

    def mean_gap_per_request(timings, p=99.0):
        ok = [t for t in timings if t.success]

        def ms(values):
            return percentile([v * 1000 for v in values if not math.isnan(v)], p)

        return {"ttft_ms": ms([ttft(t) for t in ok]), "tpot_ms": ms([tpot(t) for t in ok]),
                "itl_ms": ms([sum(itl(t)) / len(itl(t)) for t in ok if itl(t)]), "e2el_ms": ms([e2el(t) for t in ok])}

    text = _fails("lab10.latency_percentiles", mean_gap_per_request)
    assert "wrong itl_ms" in text and "averaged each request's gaps first" in text and "pool every gap" in text


def test_task6_single_token_requests_meet_a_tpot_slo(solution):
    ttft, tpot, e2el = solution["ttft"], solution["tpot"], solution["e2el"]

    def nan_tpot_fails(timings, duration_s, slo_ms):
        measured = [{"ttft": ttft(t), "tpot": tpot(t), "e2el": e2el(t)} for t in timings]
        good = sum(t.success and all(m[k] * 1000 <= limit for k, limit in slo_ms.items())
                   for t, m in zip(timings, measured))
        return good / duration_s

    for check_id in ("lab10.goodput", "lab10.goodput_edges"):
        assert "meets any TPOT SLO" in _fails(check_id, nan_tpot_fails)


def _diagnose(*, busy_in_rule_1=True, busy_in_rule_4=True, order=("slow_dependency", "kv_pressure", "head_of_line",
                                                                     "overload")):
    def diagnose(stats):
        busy = stats["busy_fraction"]
        holds = {
            "slow_dependency": (busy < 0.9 or not busy_in_rule_1)
            and stats["p99_ttft_ms"] - stats["engine_p99_ttft_ms"] > max(100.0, stats["engine_p99_ttft_ms"]),
            "kv_pressure": stats["preemptions"] > 0 and stats["kv_usage_peak"] >= 0.9,
            "head_of_line": stats["max_step_ms"] > 10 * stats["median_step_ms"] and stats["max_prefill_tokens"] >= 1024,
            "overload": (busy >= 0.9 or not busy_in_rule_4) and stats["p99_queue_ms"] > 10 * stats["median_step_ms"],
        }
        return next((name for name in order if holds[name]), "healthy")

    return diagnose


def test_task7_the_rules_as_stated_pass_every_diagnosis_check():
    for check_id in ("lab10.diagnose_scenarios", "lab10.diagnose_thresholds", "lab10.diagnose_more_scenarios"):
        check(check_id, _diagnose())


@pytest.mark.parametrize("skipped", [{"busy_in_rule_1": False}, {"busy_in_rule_4": False}])
def test_task7_a_diagnosis_that_skips_the_busy_idle_split_fails(skipped):
    text = _fails("lab10.diagnose_thresholds", _diagnose(**skipped))
    assert "diagnose named the wrong fault" in text and "busy_fraction=" in text
    assert "Busy versus idle comes first" in text


def test_task7_rule_order_matters():
    text = _fails("lab10.diagnose_scenarios", _diagnose(order=("slow_dependency", "overload", "kv_pressure",
                                                                "head_of_line")))
    assert "expected 'kv_pressure', got 'overload'" in text and "the reference's evidence" in text


def test_inputs_are_plain_data_and_the_same_for_the_same_seed():
    for check_id, registered in all_checks().items():
        if check_id.startswith("lab10."):
            first = json.dumps(registered.inputs(7), sort_keys=True)
            assert first == json.dumps(registered.inputs(7), sort_keys=True), check_id
            assert first != json.dumps(registered.inputs(8), sort_keys=True), check_id


def test_scenario_inputs_are_made_before_the_learner_runs(solution, tmp_path, monkeypatch):
    """run_scenario calls the reference functions; it must run in make_inputs, outside the call monitor,
    so an honest answer is never recorded as a shortcut, while an answer calling the reference is."""
    from grading.checks import lab10
    from infra_lib.ops.latency import tpot

    lab10._scenario.cache_clear()
    record = tmp_path / "answers.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "5")
    check("lab10.diagnose_scenarios", solution["diagnose"])
    check("lab10.tpot_real_traces", solution["tpot"])
    check("lab10.tpot_real_traces", tpot)
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [row["kind"] for row in rows] == [None, None, "reference shortcut"]


def test_numpy_percentile_is_numpys_not_the_reference_but_infra_lib_aliases_are():
    from grading import tamper
    from grading.registry import shortcut_modules

    modules, names = shortcut_modules("lab10")
    source = "import numpy as np\n\ndef percentile(values, p):\n    return float(np.percentile(values, p))\n"
    assert tamper.scan(source, modules, names) == []
    aliased = "import infra_lib.ops.latency as L\n\ndef percentile(values, p):\n    return L.percentile(values, p)\n"
    assert {f.kind for f in tamper.scan(aliased, modules, names)} == {tamper.SHORTCUT}