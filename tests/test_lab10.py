"""Lab 10's checks catch the classic metric mistakes with messages that name them, and the diagnosis
checks insist on the busy-versus-idle split and the order of the rules."""

from __future__ import annotations

import json
import math

import numpy as np
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
    from infra_lib.ops.llmops import RolloutPolicy, Served, VersionCard

    return solution_namespace(
        SOLUTION, RequestTiming=RequestTiming, RolloutPolicy=RolloutPolicy, Served=Served, VersionCard=VersionCard
    )


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


def _contract(reading):
    """A percentile that keeps the contract's edges (p outside [0, 100] raises, no values give nan) and reads
    the values with ``reading(values, p)``."""

    def percentile(values, p):
        if not 0 <= p <= 100:
            raise ValueError(p)
        return float(reading(list(values), p)) if values else math.nan

    return percentile


@pytest.mark.parametrize(
    "reading, says",
    [
        (
            lambda xs, p: np.interp((len(xs) - 1) * p / 100, range(len(xs)), xs),
            "you interpolated between the values in the order given: sort them first",
        ),
        (lambda xs, p: np.interp(min(len(xs) * p / 100, len(xs) - 1), range(len(xs)), sorted(xs)), "not n * p / 100"),
        (
            lambda xs, p: np.percentile(xs, p, method="weibull"),
            "as statistics.quantiles' default (exclusive) method does",
        ),
    ],
)
def test_task4_the_usual_ranks_are_named(reading, says):
    message = _fails("lab10.percentile", _contract(reading))
    assert "percentile returned the wrong value" in message and says in message, message


def test_task4_sorting_the_callers_list_in_place_is_caught(solution):
    def in_place(values, p):
        values.sort()  # the caller's list, reordered
        return solution["percentile"](values, p)

    text = _fails("lab10.percentile", in_place)
    assert "changed the list it was given" in text and "sort a copy" in text
    check("lab10.percentile", solution["percentile"])
    check("lab10.percentile_edges", solution["percentile"])


def test_task5_an_empty_run_gives_nan_for_every_key(solution):
    def refuses_empty(timings, p=99.0):
        if not timings:
            raise ValueError("no requests")
        return solution["latency_percentiles"](timings, p)

    assert all(math.isnan(v) for v in solution["latency_percentiles"]([], 99).values())
    check("lab10.latency_percentiles_traces", solution["latency_percentiles"])
    assert "raised an exception on a valid input" in _fails("lab10.latency_percentiles_traces", refuses_empty)


def test_task5_per_request_mean_itl_instead_of_pooled_gaps_is_caught(solution):
    percentile, ttft, tpot, itl, e2el = (solution[name] for name in ("percentile", "ttft", "tpot", "itl", "e2el"))

    def mean_gap_per_request(timings, p=99.0):
        ok = [t for t in timings if t.success]

        def ms(values):
            return percentile([v * 1000 for v in values if not math.isnan(v)], p)

        return {
            "ttft_ms": ms([ttft(t) for t in ok]),
            "tpot_ms": ms([tpot(t) for t in ok]),
            "itl_ms": ms([sum(itl(t)) / len(itl(t)) for t in ok if itl(t)]),
            "e2el_ms": ms([e2el(t) for t in ok]),
        }

    text = _fails("lab10.latency_percentiles", mean_gap_per_request)
    assert "wrong itl_ms" in text and "averaged each request's gaps first" in text and "pool every gap" in text


def test_task6_single_token_requests_meet_a_tpot_slo(solution):
    ttft, tpot, e2el = solution["ttft"], solution["tpot"], solution["e2el"]

    def nan_tpot_fails(timings, duration_s, slo_ms):
        measured = [{"ttft": ttft(t), "tpot": tpot(t), "e2el": e2el(t)} for t in timings]
        good = sum(
            t.success and all(m[k] * 1000 <= limit for k, limit in slo_ms.items()) for t, m in zip(timings, measured)
        )
        return good / duration_s

    for check_id in ("lab10.goodput", "lab10.goodput_edges"):
        assert "meets any TPOT SLO" in _fails(check_id, nan_tpot_fails)


def _diagnose(
    *, busy_in_rule_1=True, busy_in_rule_4=True, order=("slow_dependency", "kv_pressure", "head_of_line", "overload")
):
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
    text = _fails(
        "lab10.diagnose_scenarios", _diagnose(order=("slow_dependency", "overload", "kv_pressure", "head_of_line"))
    )
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
    from grading.checks.lab10.timings import scenario
    from infra_lib.ops.latency import tpot

    scenario.cache_clear()
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


# --- tasks 8 and 9: the release rules ----------------------------------------------------------------


def _gate(
    *, absolute=False, strict=False, finite=True, scores=("perplexity", "evidence_nll"), validate=True, divided=False
):
    """passes_gate as a learner might write it, with one mistake switched on."""

    def passes_gate(candidate, current, tolerance=0.05):
        if validate:
            if not (math.isfinite(tolerance) and tolerance >= 0):
                raise ValueError(f"bad tolerance {tolerance}")
            for key in ("perplexity", "evidence_nll"):
                if not (math.isfinite(getattr(current, key)) and getattr(current, key) >= 0):
                    raise ValueError(f"bad current {key}")
        for key in scores:
            ours, theirs = getattr(candidate, key), getattr(current, key)
            if divided:  # the same rule on paper, as a relative difference ("guarded": no division by a zero score)
                if divided == "guarded" and theirs == 0:
                    if not ours <= 0:
                        return False
                elif not (math.isfinite(ours) and (ours - theirs) / theirs <= tolerance):
                    return False
                continue
            limit = theirs + tolerance if absolute else theirs * (1 + tolerance)
            if ours > limit if not strict else ours >= limit:
                return False
            if finite and not math.isfinite(ours):
                return False
        return True

    return passes_gate


def test_task8_the_solution_passes_and_the_classic_gate_mistakes_are_named(solution):
    check("lab10.passes_gate", solution["passes_gate"])
    check("lab10.gate_edges", solution["passes_gate"])
    check("lab10.gate_edges", _gate())
    text = _fails("lab10.passes_gate", _gate(absolute=True))
    assert "passes_gate gave the wrong verdict" in text and "the tolerance is relative" in text
    assert "candidate perplexity" in text and "tolerance 0." in text and "hint:" in text
    assert "a score exactly on its limit passes" in _fails("lab10.gate_edges", _gate(strict=True))
    assert "nan compares False with everything" in _fails("lab10.gate_edges", _gate(finite=False))
    assert "you judged perplexity only" in _fails("lab10.passes_gate", _gate(scores=("perplexity",)))
    assert "must return a bool" in _fails("lab10.passes_gate", lambda c, p, t=0.05: int(_gate()(c, p, t)))


def test_task8_a_gate_written_as_a_relative_difference_fails_on_the_limit():
    """(candidate - current) / current <= tolerance is the rule on paper, but rejects 16.8 against 16.0 at 5%,
    which the lab says passes: the hidden check must fail it, whatever the grader's seed."""
    from grading.registry import get_check
    from infra_lib.ops.llmops import VersionCard

    divided = _gate(divided="guarded")
    card = VersionCard("x", "fp32", 16.8, 2.0, 1.0, 1.0)
    assert not divided(card, VersionCard("p", "fp32", 16.0, 2.0, 1.0, 1.0))  # the case the lab names
    text = _fails("lab10.gate_edges", divided)
    assert "passes_gate gave the wrong verdict" in text and "rounds differently" in text
    registered = get_check("lab10.gate_edges")
    reference = registered.reference()
    for seed in range(40):
        inputs = registered.inputs(seed)
        expected = registered.drive(reference, inputs)
        assert registered.compare(registered.drive(divided, inputs), expected, inputs) is not None, seed
        assert registered.compare(registered.drive(_gate(), inputs), expected, inputs) is None, seed
        on_limit = [c for c in inputs if "exactly on its limit" in c["label"]]
        assert on_limit and all(_gate()(*(_as_cards(c)), c["tolerance"]) for c in on_limit)


def _as_cards(case):
    from infra_lib.ops.llmops import VersionCard

    return [
        VersionCard(name, "w", case[side]["perplexity"], case[side]["evidence_nll"], 1.0, 1.0)
        for name, side in (("candidate", "candidate"), ("production", "current"))
    ]


@pytest.mark.parametrize(
    "tolerance, current, candidate, outcome",
    [
        (-0.05, (16.0, 2.0), (16.0, 2.0), ValueError),
        (float("nan"), (16.0, 2.0), (16.0, 2.0), ValueError),
        (float("inf"), (16.0, 2.0), (16.0, 2.0), ValueError),
        (0.05, (float("nan"), 2.0), (16.0, 2.0), ValueError),
        (0.05, (16.0, float("inf")), (16.0, 2.0), ValueError),
        (0.05, (-16.0, 2.0), (16.0, 2.0), ValueError),
        (0.05, (16.0, 0.0), (16.0, 0.0), True),
        (0.05, (16.0, 0.0), (16.0, 1e-9), False),
        (0.05, (16.0, 2.0), (16.0, 0.0), True),
        (0.05, (16.0, 2.0), (16.0, float("-inf")), False),
        (0.05, (16.0, 2.0), (16.8, 2.0), True),
    ],
)
def test_task8_edges_as_the_text_states_them(solution, tolerance, current, candidate, outcome):
    """The lab's text, the solution, the library's gate and the check agree on nan, infinite and zero scores
    and on invalid tolerances."""
    from infra_lib.ops.llmops import VersionCard, gate

    cards = [VersionCard(name, "w", ppl, nll, 1.0, 1.0) for name, (ppl, nll) in (("c", candidate), ("p", current))]
    for judge in (
        solution["passes_gate"],
        lambda c, p, t: gate(c, p, perplexity_tolerance=t, evidence_tolerance=t).passed,
    ):
        if outcome is ValueError:
            with pytest.raises(ValueError):
                judge(*cards, tolerance)
        else:
            assert judge(*cards, tolerance) is outcome


def test_task8_a_gate_that_accepts_invalid_input_or_divides_by_a_zero_score_fails():
    assert "should raise ValueError on an invalid input" in _fails("lab10.gate_edges", _gate(validate=False))
    text = _fails("lab10.gate_edges", _gate(divided=True))
    assert "ZeroDivisionError" in text or "rounds differently" in text


def _verdict(solution, *, at_least=False, with_failed=False, floor=True, rule=None, use_max=False, defaults=False):
    """canary_verdict as a learner might write it, with one mistake switched on."""
    percentile = solution["percentile"]

    def canary_verdict(candidate, production, policy):
        from infra_lib.ops.llmops import RolloutPolicy

        if defaults:
            policy = RolloutPolicy()
        errors = sum(not s.ok for s in candidate) / len(candidate)
        if errors >= policy.max_error_rate if at_least else errors > policy.max_error_rate:
            return "rollback"

        def p99(served):
            values = [s.latency_s for s in served if s.ok or with_failed]
            return (max(values) if use_max else percentile(values, 99)) if values else 0.0

        ours, theirs = p99(candidate), p99(production)
        limits = {"ratio": policy.max_p99_ratio * theirs, "added": theirs + policy.max_p99_added_s}
        limit = limits[rule] if rule else min(limits.values())
        if (ours > policy.min_p99_s or not floor) and theirs > 0 and ours > limit:
            return "rollback"
        return "advance"

    return canary_verdict


def test_task9_the_solution_passes_every_check_and_the_rollouts_match(solution):
    for check_id in ("lab10.canary_verdict", "lab10.canary_edges", "lab10.canary_rollouts"):
        check(check_id, solution["canary_verdict"])
        check(check_id, _verdict(solution))


@pytest.mark.parametrize(
    "mistake, check_id, says",
    [
        ({"at_least": True}, "lab10.canary_edges", "(>, not >=)"),
        ({"with_failed": True}, "lab10.canary_edges", "the P99s are over successful requests only"),
        ({"floor": False}, "lab10.canary_edges", "below min_p99_s a latency is never a reason"),
        ({"rule": "ratio"}, "lab10.canary_verdict", "you applied the ratio rule only"),
        ({"rule": "added"}, "lab10.canary_verdict", "you applied the added-seconds rule only"),
        ({"use_max": True}, "lab10.canary_edges", "not the maximum"),
        ({"defaults": True}, "lab10.canary_verdict", "Every threshold comes from the policy"),
    ],
)
def test_task9_classic_canary_mistakes_fail_with_their_reason(solution, mistake, check_id, says):
    text = _fails(check_id, _verdict(solution, **mistake))
    assert "canary_verdict gave the wrong verdict" in text and "candidate requests" in text
    assert says in text


def test_task9_a_wrong_verdict_changes_a_whole_rollout():
    text = _fails("lab10.canary_rollouts", lambda candidate, production, policy: "advance")
    assert "ended differently from the reference's" in text and "expected rolled back" in text


def test_a_rollout_judge_plugs_into_the_router_code_and_must_answer_a_verdict():
    from infra_lib.ops.llmops import BEHAVIOURS, simulate_rollout

    for behaviour in BEHAVIOURS:
        reference = simulate_rollout(behaviour, seed=3)
        mine = simulate_rollout(behaviour, seed=3, judge=lambda c, p, policy: policy.judge(c, p)[0])
        assert (mine.outcome, len(mine.served)) == (reference.outcome, len(reference.served))
        assert [d["verdict"] for d in mine.decisions] == [d["verdict"] for d in reference.decisions]
    assert simulate_rollout("faster", seed=0).outcome == "promoted"
    assert simulate_rollout("slow", seed=0).outcome == "rolled back"
    with pytest.raises(ValueError, match="'rollback' or 'advance'"):
        simulate_rollout("same", judge=lambda c, p, policy: True)
    with pytest.raises(ValueError, match="unknown behaviour"):
        simulate_rollout("fast")


def test_a_release_answer_that_calls_the_reference_is_a_shortcut(tmp_path, monkeypatch):
    from infra_lib.ops.llmops import gate

    record = tmp_path / "answers.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "5")
    check("lab10.canary_verdict", lambda candidate, production, policy: policy.judge(candidate, production)[0])
    check(
        "lab10.passes_gate",
        lambda c, current, t=0.05: gate(c, current, perplexity_tolerance=t, evidence_tolerance=t).passed,
    )
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [row["kind"] for row in rows] == ["reference shortcut", "reference shortcut"]
