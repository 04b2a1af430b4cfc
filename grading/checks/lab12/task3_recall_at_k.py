"""Lab 12 task 3: recall_at_k on ranked lists with several relevant items per query, repeated ids,
and invalid inputs; a wrong value is named by the metric it matches (precision, hit rate, pooled)."""

from __future__ import annotations

import math
import random

from grading.checks.common import outcome, reference
from grading.registry import Check, Mismatch, register

from .outcomes import RAG, TASKS, cases_mismatch, plain_number


def _retrieval_case(rng: random.Random, queries: int, k: int, ids=range(50), repeats: bool = False) -> dict:
    """Ranked lists of distinct ids (with ``repeats``, some ids appear again further down, as a retriever that
    returns several chunks of one document under the document's id does)."""
    ids = list(ids)
    retrieved, relevant = [], []
    for _ in range(queries):
        ranked = rng.sample(ids, rng.randint(k // 2 + 1, min(len(ids), k + 5)))
        if repeats:
            for _ in range(rng.randint(1, 3)):
                ranked.insert(rng.randint(1, len(ranked)), ranked[rng.randrange(min(len(ranked), k))])
        wanted = set(rng.sample(ranked, rng.randint(0, min(3, len(ranked)))))
        wanted |= set(rng.sample(ids, rng.randint(1 if not wanted else 0, 2)))
        retrieved.append(ranked)
        relevant.append(sorted(wanted, key=str))
    return {"retrieved": retrieved, "relevant": relevant, "k": k}


def _recall_cases(rng: random.Random) -> list[dict]:
    return [
        {"retrieved": [[3, 1, 2]], "relevant": [[1]], "k": 1},
        {"retrieved": [[3, 1, 2]], "relevant": [[1]], "k": 2},
        {"retrieved": [[4, 5, 6, 7], [9, 8]], "relevant": [[5, 7, 11], [8]], "k": 3},
        _retrieval_case(rng, 8, 5),
        _retrieval_case(rng, 12, 10),
        _retrieval_case(rng, 6, 3, ids=[f"doc{i}#{j}" for i in range(6) for j in range(4)]),
        {"retrieved": [[3, 3, 1, 3], [7, 7, 7]], "relevant": [[3, 5], [7]], "k": 3},  # an id counts once
        _retrieval_case(rng, 8, 5, ids=[f"doc{i}" for i in range(12)], repeats=True),
    ]


def _recall_edge_cases(rng: random.Random) -> list[dict]:
    case = _retrieval_case(rng, 5, 4)
    return [
        _retrieval_case(rng, 4, 50),  # k beyond every list
        {"retrieved": [[], [1, 2]], "relevant": [[1], [2]], "k": 3},  # nothing retrieved for a query
        {"retrieved": case["retrieved"], "relevant": case["relevant"][:-1], "k": 4},  # lengths differ
        {"retrieved": case["retrieved"], "relevant": case["relevant"], "k": 0},
        {"retrieved": [[1, 2]], "relevant": [[]], "k": 2},  # nothing relevant: recall undefined
        {"retrieved": [], "relevant": [], "k": 5},
    ]


def _drive_recall(recall_at_k, cases: list[dict]) -> list:
    return [
        plain_number(
            outcome(recall_at_k, [list(r) for r in case["retrieved"]], [set(r) for r in case["relevant"]], case["k"])
        )
        for case in cases
    ]


def _describe_recall(case: dict) -> str:
    shown = [(r[:6], rel) for r, rel in zip(case["retrieved"][:2], case["relevant"][:2])]
    return f"{len(case['retrieved'])} queries, k={case['k']} (first ones, retrieved -> relevant: {shown!s:.200})"


def _precision(case: dict) -> float:
    k = case["k"]
    return sum(len(set(r[:k]) & set(rel)) / k for r, rel in zip(case["retrieved"], case["relevant"])) / len(
        case["retrieved"]
    )


def _hit_rate(case: dict) -> float:
    k = case["k"]
    return sum(bool(set(r[:k]) & set(rel)) for r, rel in zip(case["retrieved"], case["relevant"])) / len(
        case["retrieved"]
    )


def _pooled_recall(case: dict) -> float:
    k = case["k"]
    found = sum(len(set(r[:k]) & set(rel)) for r, rel in zip(case["retrieved"], case["relevant"]))
    return found / sum(len(set(rel)) for rel in case["relevant"])


def _counted_repeats(case: dict) -> float:
    """recall@k counting an id once for every time it appears in the first k."""
    k = case["k"]
    return sum(
        sum(i in set(rel) for i in r[:k]) / len(set(rel)) for r, rel in zip(case["retrieved"], case["relevant"])
    ) / len(case["retrieved"])


def _recall_problem(got: float, expected: float, case: dict, where: str) -> Mismatch | None:
    if math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12):
        return None
    if math.isclose(got, _counted_repeats(case), rel_tol=1e-9):
        return Mismatch(
            "an id was counted once for every time it appears",
            f"on {where}: expected {expected!r}, got {got!r}; an id counts once however often it "
            "appears in the first k, so no query's share can pass 1",
        )
    if not 0.0 <= got <= 1.0:
        return Mismatch(
            "recall@k outside [0, 1]",
            f"on {where}: expected {expected!r}, got {got!r}; recall@k is "
            "a share of each query's relevant items, between 0 and 1",
        )
    if math.isclose(got, _precision(case), rel_tol=1e-9):
        return Mismatch(
            "this is precision@k, not recall@k",
            f"on {where}: expected {expected!r}, got {got!r}; divide by the number of relevant "
            "items of each query, not by k",
        )
    if math.isclose(got, _hit_rate(case), rel_tol=1e-9):
        return Mismatch(
            "this is the hit rate, not recall@k",
            f"on {where}: expected {expected!r}, got {got!r}; count how many of the relevant items "
            "are in the top k, not whether any is",
        )
    if math.isclose(got, _pooled_recall(case), rel_tol=1e-9):
        return Mismatch(
            "this pools every query's relevant items together",
            f"on {where}: expected {expected!r}, got {got!r}; take each query's share of its own "
            "relevant items first, then average the shares, so that every query weighs the same",
        )
    return Mismatch("wrong recall@k", f"on {where}: expected {expected!r}, got {got!r}")


def _compare_recall(got, expected, cases) -> Mismatch | None:
    return cases_mismatch("recall_at_k", got, expected, cases, _describe_recall, _recall_problem)


_RECALL_HINT = (
    "recall@k is computed per query, as the share of that query's relevant items found among its first k "
    "results, and only then averaged over the queries: dividing by k gives precision@k, scoring a query 1 "
    "when any relevant item appears gives the hit rate, and pooling every query's items together weights "
    "queries with many relevant items more (chapter 12, section “2 · Why embeddings work”). An id "
    "counts once however often it appears in the first k. Return a float; raise ValueError when k is "
    "below 1, there are no queries, the two lists differ in length or a relevant set is empty."
)

# what the checks of task 3 share
_RECALL_PARTS = {
    "task": TASKS[3],
    "reference": reference(f"{RAG}.evaluate", "recall_at_k"),
    "drive": _drive_recall,
    "compare": _compare_recall,
}

register(Check(check_id="lab12.recall_at_k", **_RECALL_PARTS, make_inputs=_recall_cases, hint=_RECALL_HINT))
register(
    Check(
        check_id="lab12.recall_at_k_edges",
        **_RECALL_PARTS,
        make_inputs=_recall_edge_cases,
        hint=_RECALL_HINT + " Edges: k beyond every list, a query that retrieved nothing, and invalid inputs.",
    )
)
