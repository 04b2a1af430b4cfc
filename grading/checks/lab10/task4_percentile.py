"""Lab 10 task 4: ``percentile`` (linear interpolation between closest ranks), with its edges."""

from __future__ import annotations

import math
import random

from grading.checks.common import is_number, outcome, reference
from grading.checks.lab10.results import LATENCY, TASKS, compare_results, fmt, same_number
from grading.registry import Check, register


def _values(rng: random.Random, n: int, ties: bool = False) -> list[float]:
    if ties:
        return [float(rng.choice([12, 12, 15, 15, 15, 40])) for _ in range(n)]
    return [round(rng.lognormvariate(4.0, 0.6), 1) for _ in range(n)]


def _percentile_cases(rng: random.Random) -> list[list]:
    return [
        [_values(rng, 9), 50],
        [_values(rng, 11), 90],
        [_values(rng, 8), 99],
        [_values(rng, 10, ties=True), 75],
        [_values(rng, 7), 0],
        [_values(rng, 7), 100],
        [[round(rng.uniform(10, 90), 1)], 99],
        [[], 99],
        [_values(rng, 5), 101],
        [_values(rng, 5), -1],
    ]


def _percentile_edges(rng: random.Random) -> list[list]:
    big = _values(rng, rng.randint(900, 1100))
    return [
        [big, 99],
        [big, 99.9],
        [big, 50],
        [_values(rng, 101), 99],
        [_values(rng, 12, ties=True), 99],
        [[7.0] * rng.randint(2, 9), 37.5],
        [[rng.randint(1, 9) for _ in range(6)], 62.5],
        [_values(rng, 2), 99],
        [[], 0],
        [[], 100],
        [[], 150],
        [_values(rng, 4), 100.5],
        [_values(rng, 4), -0.25],
        [_values(rng, 3), 0.0],
    ]


def _drive_percentile(fn, cases: list[list]) -> list:
    def run(values, p):
        given = list(values)
        result = fn(given, p)
        return {"reordered": given} if given != list(values) else result  # the caller's list, changed

    return [outcome(run, values, p) for values, p in cases]


def _describe_values(case: list) -> str:
    values, p = case
    if len(values) <= 12:
        return f"values={values}, p={p}"
    return f"{len(values)} values ({', '.join(map(str, values[:5]))}, ...; from {min(values)} to {max(values)}), p={p}"


def _percentile_problem(case: list, got, want):
    values, p = case
    if type(got) is dict and "reordered" in got:
        return (
            "percentile changed the list it was given",
            f"the caller's list reads {got['reordered']!r:.120} after the call: sort a copy (sorted(values)), "
            "not the caller's list in place (list.sort)",
        )
    if same_number(got, want):
        return None
    note = ""
    if math.isnan(want):
        note = "; with no values there is no percentile: return float('nan')"
    elif is_number(got) and values:
        import numpy

        xs, n = sorted(values), len(values)
        rank = (n - 1) * p / 100

        def interpolate(seq, r):  # the mistakes' readings: seq's values placed at ranks 0..n-1, read at r
            return float(numpy.interp(r, range(len(seq)), seq))

        if not same_number(interpolate(values, rank), want) and same_number(got, interpolate(values, rank)):
            note = "; you interpolated between the values in the order given: sort them first"
        elif got in xs and rank != int(rank):
            note = (
                f"; that is one of the values: the rank (n - 1) * p / 100 = {rank:g} falls between two sorted "
                "values, so interpolate linearly between them"
            )
        elif got in xs:
            note = f"; sorted, the value at rank (n - 1) * p / 100 = {rank:g} (counting from 0) is the answer"
        elif same_number(got, interpolate(xs, min(n * p / 100, n - 1))):
            note = f"; the rank is (n - 1) * p / 100 = {rank:g} (counting from 0), not n * p / 100"
        elif same_number(got, interpolate(xs, min(max((n + 1) * p / 100 - 1, 0), n - 1))):
            note = (
                "; that places the sorted values at p = 100 (k + 1) / (n + 1), as statistics.quantiles' default "
                "(exclusive) method does: here the smallest value sits at p = 0 and the largest at p = 100"
            )
    return "percentile returned the wrong value", f"expected {fmt(want)}, got {fmt(got)}{note}"


def _compare_percentile(got, expected, cases):
    return compare_results("percentile", got, expected, cases, _describe_values, _percentile_problem)


_PERCENTILE_HINT = (
    "the values come in any order and the percentile reads them sorted, with p = 0 on the smallest "
    "and p = 100 on the largest, moving linearly between neighbours (numpy's default method): a "
    "rank that falls between two values is interpolated, not rounded to one of them. No values: "
    "nan; p outside [0, 100]: raise ValueError, whatever the values."
)
register(
    Check(
        check_id="lab10.percentile",
        task=TASKS["percentile"],
        reference=reference(LATENCY, "percentile"),
        make_inputs=_percentile_cases,
        drive=_drive_percentile,
        compare=_compare_percentile,
        hint=_PERCENTILE_HINT,
    )
)
register(
    Check(
        check_id="lab10.percentile_edges",
        task=TASKS["percentile"],
        reference=reference(LATENCY, "percentile"),
        make_inputs=_percentile_edges,
        drive=_drive_percentile,
        compare=_compare_percentile,
        hint=_PERCENTILE_HINT + " Large inputs, ties, integers, p = 99.9, empty lists and invalid p.",
    )
)
