"""Lab 10 task 7: ``diagnose(stats)``, the first rule of the lab's table that holds for a window."""

from __future__ import annotations

import random

from grading.checks.common import outcome
from grading.checks.lab10.results import TASKS, compare_results, fmt
from grading.checks.lab10.timings import FAULTS, scenario_stats
from grading.registry import Check, register


def reference_diagnose(stats: dict) -> str:
    """The reference's answer to task 7: the name of the fault ``diagnose`` finds."""
    from infra_lib.ops.diagnose import diagnose

    return diagnose(stats).fault


_RULE_KEYS = (
    "busy_fraction",
    "p99_ttft_ms",
    "engine_p99_ttft_ms",
    "preemptions",
    "kv_usage_peak",
    "max_step_ms",
    "median_step_ms",
    "max_prefill_tokens",
    "p99_queue_ms",
)


def _scenario_cases(rng: random.Random, seeds_per_fault: int = 1, pool: int = 8) -> list[dict]:
    cases = []
    for name in FAULTS:
        for seed in rng.sample(range(pool), seeds_per_fault):
            cases.append(
                {"label": f"the window stats of scenario {name!r} (seed {seed})", "stats": scenario_stats(name, seed)}
            )
    return cases


def _more_scenarios(rng: random.Random) -> list[dict]:
    cases = _scenario_cases(rng, 2, 40)
    rng.shuffle(cases)
    return cases


def _window(rng: random.Random, **changes) -> dict:
    """Window stats of a calm engine (every rule false), with ``changes`` applied. Whole numbers of ms and
    binary-exact fractions, so that a value placed on a threshold is exactly on it."""
    median = float(rng.randint(20, 60))
    engine_ttft = float(rng.randint(150, 400))
    stats = {
        "duration_s": float(rng.randint(30, 120)),
        "busy_fraction": rng.choice([0.375, 0.5, 0.625, 0.75]),
        "steps": rng.randint(500, 3000),
        "preemptions": 0,
        "kv_usage_peak": rng.choice([0.125, 0.25, 0.5]),
        "max_prefill_tokens": rng.randint(64, 512),
        "median_step_ms": median,
        "p99_step_ms": median * 3,
        "max_step_ms": median * rng.randint(3, 6),
        "p99_queue_ms": median * 2,
        "engine_p99_ttft_ms": engine_ttft,
        "engine_p99_e2el_ms": engine_ttft * 8,
        "p99_ttft_ms": engine_ttft + rng.randint(0, 40),
        "p99_tpot_ms": median * 2,
        "p99_itl_ms": median * 3,
        "p99_e2el_ms": engine_ttft * 8,
    }
    for key, value in changes.items():
        stats[key] = value(stats) if callable(value) else value
    return stats


def _threshold_cases(rng: random.Random) -> list[dict]:
    def outside(extra):  # the clients' P99 TTFT, ``extra`` ms beyond rule 1's threshold
        return lambda s: s["engine_p99_ttft_ms"] + max(100.0, s["engine_p99_ttft_ms"]) + extra

    def queue(extra):
        return lambda s: 10 * s["median_step_ms"] + extra

    def step(extra):
        return lambda s: 10 * s["median_step_ms"] + extra

    long_wait = {"p99_ttft_ms": outside(rng.randint(50, 900))}
    windows = [
        ("rule 1 on its threshold", _window(rng, p99_ttft_ms=outside(0))),
        ("rule 1 just past its threshold", _window(rng, p99_ttft_ms=outside(1))),
        (
            "rule 1 with a fast engine (the 100 ms floor)",
            _window(rng, engine_p99_ttft_ms=40.0, p99_ttft_ms=lambda s: 40.0 + rng.randint(60, 99)),
        ),
        (
            "rule 1 with a fast engine, past the floor",
            _window(rng, engine_p99_ttft_ms=40.0, p99_ttft_ms=lambda s: 40.0 + rng.randint(101, 300)),
        ),
        ("a busy engine with a long wait outside it", _window(rng, busy_fraction=0.9, **long_wait)),
        (
            "a busy, queueing engine with a long wait outside it",
            _window(
                rng, busy_fraction=rng.choice([0.9, 0.9375]), p99_queue_ms=queue(rng.randint(1, 5000)), **long_wait
            ),
        ),
        ("rule 2 on its threshold", _window(rng, preemptions=rng.randint(1, 4), kv_usage_peak=0.9)),
        ("preemptions without a full KV cache", _window(rng, preemptions=rng.randint(1, 30), kv_usage_peak=0.875)),
        ("a full KV cache without preemptions", _window(rng, kv_usage_peak=1.0)),
        ("rule 3 on its step threshold", _window(rng, max_step_ms=step(0), max_prefill_tokens=2048)),
        ("rule 3 just past both thresholds", _window(rng, max_step_ms=step(1), max_prefill_tokens=1024)),
        ("a long step without a long prefill", _window(rng, max_step_ms=step(500), max_prefill_tokens=1023)),
        ("rule 4 on the busy threshold", _window(rng, busy_fraction=0.9, p99_queue_ms=queue(1))),
        ("rule 4 on the queue threshold", _window(rng, busy_fraction=0.96875, p99_queue_ms=queue(0))),
        ("a long queue on an idle engine", _window(rng, busy_fraction=0.875, p99_queue_ms=queue(rng.randint(1, 9000)))),
        (
            "rules 1 and 2 both hold",
            _window(rng, busy_fraction=0.75, preemptions=3, kv_usage_peak=0.96875, **long_wait),
        ),
        (
            "rules 2 and 3 both hold",
            _window(rng, preemptions=2, kv_usage_peak=1.0, max_step_ms=step(300), max_prefill_tokens=1500),
        ),
        (
            "rules 3 and 4 both hold",
            _window(
                rng, busy_fraction=0.96875, max_step_ms=step(300), max_prefill_tokens=1500, p99_queue_ms=queue(2000)
            ),
        ),
        (
            "rules 2 and 4 both hold",
            _window(rng, busy_fraction=1.0, preemptions=9, kv_usage_peak=0.9375, p99_queue_ms=queue(4000)),
        ),
    ]
    rng.shuffle(windows)
    return [{"label": f"a window with {label}", "stats": stats} for label, stats in windows]


def _drive_diagnose(fn, cases: list[dict]) -> list:
    return [outcome(fn, dict(case["stats"])) for case in cases]


def _describe_stats(case: dict) -> str:
    numbers = ", ".join(f"{key}={fmt(case['stats'][key])}" for key in _RULE_KEYS)
    return f"{case['label']} ({numbers})"


def _diagnose_problem(case: dict, got, want):
    if type(got) is not str:
        return "diagnose must return the fault's name, a string such as 'kv_pressure'", f"got {fmt(got)}"
    if got not in FAULTS:
        return ("diagnose returned a name that is not one of " + ", ".join(FAULTS)), f"got {got!r}"
    if got == want:
        return None
    from infra_lib.ops.diagnose import diagnose

    evidence = "; ".join(diagnose(dict(case["stats"])).evidence)
    return "diagnose named the wrong fault", f"expected {want!r}, got {got!r}\n  the reference's evidence: {evidence}"


def _compare_diagnose(got, expected, cases):
    return compare_results("diagnose", got, expected, cases, _describe_stats, _diagnose_problem)


_DIAGNOSE_HINT = (
    "the answer is the first rule of the lab's table that holds, in the table's order, even when a "
    "later one holds as well; each comparison is exactly as the table writes it (strict or not), rule "
    "1's floor of 100 ms included. Busy versus idle comes first: rules 1 and 4 both read how busy the "
    "engine was, since a long wait outside a busy engine is not a slow dependency, and a queue in "
    "front of an idle one is not overload. "
    "chapter 11, section “5 · The drill: P99 jumped, find the layer”."
)
register(
    Check(
        check_id="lab10.diagnose_scenarios",
        task=TASKS["diagnose"],
        reference=lambda: reference_diagnose,
        make_inputs=_scenario_cases,
        drive=_drive_diagnose,
        compare=_compare_diagnose,
        hint=_DIAGNOSE_HINT,
    )
)
register(
    Check(
        check_id="lab10.diagnose_thresholds",
        task=TASKS["diagnose"],
        reference=lambda: reference_diagnose,
        make_inputs=_threshold_cases,
        drive=_drive_diagnose,
        compare=_compare_diagnose,
        hint=_DIAGNOSE_HINT + " Windows placed on and just past each threshold, and windows where two rules "
        "hold at once.",
    )
)
register(
    Check(
        check_id="lab10.diagnose_more_scenarios",
        task=TASKS["diagnose"],
        reference=lambda: reference_diagnose,
        make_inputs=_more_scenarios,
        drive=_drive_diagnose,
        compare=_compare_diagnose,
        hint=_DIAGNOSE_HINT + " More seeds of every scenario.",
    )
)
