"""Lab 12 task 2: top_k_cosine on random vectors of varied norms (so a dot product ranks them
differently), a 1-D query, k above the number of rows, zero rows and zero queries."""

from __future__ import annotations

import math
import random

from grading.checks.common import outcome, reference
from grading.registry import Check, Mismatch, register

from .outcomes import RAG, TASKS, cases_mismatch


def _search_case(
    rng: random.Random, n: int, d: int, k: int, queries: int | None, zero_row: bool = False, zero_query: bool = False
) -> dict:
    """``zero_row``: row n // 2 of the matrix is all zeros; ``zero_query``: so is the last query."""
    return {
        "n": n,
        "d": d,
        "k": k,
        "queries": queries,
        "seed": rng.randrange(10**6),
        "zero_row": zero_row,
        "zero_query": zero_query,
    }


def _search_cases(rng: random.Random) -> list[dict]:
    return [
        _search_case(rng, 50, 8, 5, 3),
        _search_case(rng, 200, 32, 10, 4),
        _search_case(rng, 30, 16, 1, 2),
        _search_case(rng, rng.randint(100, 400), rng.choice([24, 64]), rng.randint(2, 12), rng.randint(1, 6)),
    ]


def _search_edge_cases(rng: random.Random) -> list[dict]:
    return [
        _search_case(rng, 40, 8, 5, None),  # one query as a 1-D vector
        _search_case(rng, 6, 8, 10, 2),  # k larger than the number of rows
        _search_case(rng, 60, 12, 8, 3, zero_row=True),  # a zero row must score 0, not nan
        _search_case(rng, 60, 12, 0, 2),  # k < 1 raises ValueError
        _search_case(rng, 1, 4, 1, 1),
        _search_case(rng, 50, 12, 6, 3, zero_query=True),  # a zero query scores 0 against every row, not nan
        _search_case(rng, 30, 8, 4, None, zero_query=True),
    ]  # the same, as one 1-D query


def search_tensors(case: dict):
    """The case's queries and matrix: rows of very different norms, so a dot product ranks wrongly."""
    import torch

    gen = torch.Generator().manual_seed(case["seed"])
    matrix = torch.randn(case["n"], case["d"], generator=gen) * torch.exp(2 * torch.rand(case["n"], 1, generator=gen))
    if case["zero_row"]:
        matrix[case["n"] // 2] = 0.0
    shape = (case["d"],) if case["queries"] is None else (case["queries"], case["d"])
    queries = torch.randn(*shape, generator=gen) * 3.0
    if case.get("zero_query"):
        if queries.dim() == 1:
            queries.zero_()
        else:
            queries[-1] = 0.0  # the last query
    return queries, matrix


def _plain_search(result):
    import torch

    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return ["malformed", f"a {type(result).__name__}, not a (scores, indices) pair"]
    try:
        scores = torch.as_tensor(result[0], dtype=torch.float64)
        indices = torch.as_tensor(result[1])
    except (TypeError, ValueError, RuntimeError) as exc:
        return ["malformed", f"scores and indices must be tensors: {exc}"[:200]]
    if indices.is_floating_point() or indices.dtype == torch.bool:
        return ["malformed", f"indices must have an integer dtype (row numbers of matrix), got {indices.dtype}"]
    return [
        "value",
        {
            "scores": scores.tolist(),
            "indices": indices.to(torch.int64).tolist(),
            "shape": list(indices.shape),
            "score_shape": list(scores.shape),
        },
    ]


def _drive_search(top_k_cosine, cases: list[dict]) -> list:
    results = []
    for case in cases:
        queries, matrix = search_tensors(case)
        got = outcome(top_k_cosine, queries, matrix, case["k"])
        results.append(_plain_search(got[1]) if got[0] == "value" else got)
    return results


def _describe_search(case: dict) -> str:
    q = "one 1-D query" if case["queries"] is None else f"{case['queries']} queries"
    zero = " (row {} is all zeros)".format(case["n"] // 2) if case["zero_row"] else ""
    if case.get("zero_query"):
        zero += " (the query is all zeros)" if case["queries"] is None else " (the last query is all zeros)"
    return f"{q} of dimension {case['d']} against {case['n']} rows{zero}, k={case['k']}"


def _dot_product_ranking(case: dict, k: int) -> list:
    queries, matrix = search_tensors(case)
    scores = queries @ matrix.T
    return scores.topk(k, dim=-1).indices.tolist()


def _zero_query_problem(got: dict, case: dict, where: str) -> Mismatch | None:
    """A zero query ties every row at cosine 0: any k distinct rows are right, each scored 0."""
    indices = got["indices"] if case["queries"] is None else got["indices"][-1]
    scores = got["scores"] if case["queries"] is None else got["scores"][-1]
    if len(set(indices)) != len(indices) or not all(0 <= i < case["n"] for i in indices):
        return Mismatch(
            "a zero query did not return distinct rows",
            f"on {where}: the zero query's indices are {indices}; it ties every row at 0, so any "
            f"{len(indices)} distinct row numbers below {case['n']} will do",
        )
    if any(abs(s) > 1e-4 for s in scores):
        return Mismatch(
            "a zero query scored something other than 0",
            f"on {where}: the zero query's scores are {scores!s:.160}; a zero vector has no "
            "direction, so its cosine with every row is 0",
        )
    return None


def _search_problem(got: dict, expected: dict, case: dict, where: str) -> Mismatch | None:
    if got["shape"] != expected["shape"] or got["score_shape"] != expected["shape"]:
        return Mismatch(
            "wrong result shape",
            f"on {where}: expected scores and indices of shape {expected['shape']}, got scores "
            f"{got['score_shape']} and indices {got['shape']}",
        )
    flat = lambda rows: rows if case["queries"] is None else [x for row in rows for x in row]  # noqa: E731
    if any(math.isnan(s) for s in flat(got["scores"])):
        which = "the zero query" if case.get("zero_query") else f"row {case['n'] // 2}, all zeros,"
        return Mismatch(
            "a score is nan",
            f"on {where}: {which} has no direction; give it cosine 0 (divide by the norm clamped to a small epsilon)",
        )
    if case.get("zero_query"):
        problem = _zero_query_problem(got, case, where)
        if problem is not None:
            return problem
        # the tied rows came back right: compare the other queries only
        got = {
            **got,
            "indices": expected["indices"]
            if case["queries"] is None
            else got["indices"][:-1] + expected["indices"][-1:],
        }
    if got["indices"] != expected["indices"]:
        k = len(expected["indices"]) if case["queries"] is None else len(expected["indices"][0])
        rows = lambda x: [x] if case["queries"] is None else x  # noqa: E731
        got_rows, want_rows = rows(got["indices"]), rows(expected["indices"])  # one list per query
        if all(sorted(g) == sorted(e) for g, e in zip(got_rows, want_rows)):
            return Mismatch(
                "the right neighbours in the wrong order",
                f"on {where}: expected {expected['indices']!s:.200}, got {got['indices']!s:.200}; "
                "sort by score, highest first",
            )
        if got_rows == rows(_dot_product_ranking(case, k)):
            return Mismatch(
                "ranked by dot product, not cosine similarity",
                f"on {where}: your order is the raw dot product's; divide each row and each query by its norm first",
            )
        return Mismatch(
            "wrong neighbours",
            f"on {where}: expected indices {expected['indices']!s:.200}, got {got['indices']!s:.200}",
        )
    worst = max((abs(g - e) for g, e in zip(flat(got["scores"]), flat(expected["scores"]))), default=0.0)
    if worst > 1e-4:
        return Mismatch(
            "wrong scores",
            f"on {where}: scores differ from the cosine similarities by up to "
            f"{worst:.3g}; expected {expected['scores']!s:.160}",
        )
    return None


def _compare_search(got, expected, cases) -> Mismatch | None:
    return cases_mismatch("top_k_cosine", got, expected, cases, _describe_search, _search_problem)


_SEARCH_HINT = (
    "similarity is the cosine of the angle between two vectors, so a vector's length must not count: a raw "
    "dot product lets long rows win whatever their direction, and a zero vector, which has no direction, "
    "scores 0, never nan, whether it is a row or a query (chapter 12, section “Gotchas”: cosine is a "
    "dot product only on unit vectors). Return (scores, indices) tensors sorted highest first, shaped "
    "(q, k), or (k,) for a 1-D query, with indices of an integer dtype; when k exceeds the number of rows "
    "every row comes back, and k below 1 raises ValueError."
)

# what the checks of task 2 share
_SEARCH_PARTS = {
    "task": TASKS[2],
    "reference": reference(f"{RAG}.search", "top_k_cosine"),
    "drive": _drive_search,
    "compare": _compare_search,
}

register(Check(check_id="lab12.top_k_cosine", **_SEARCH_PARTS, make_inputs=_search_cases, hint=_SEARCH_HINT))
register(
    Check(
        check_id="lab12.top_k_cosine_edges",
        **_SEARCH_PARTS,
        make_inputs=_search_edge_cases,
        hint=_SEARCH_HINT + " Edges: a 1-D query, k above the number of rows, a zero row, k = 0, a single "
        "row and zero queries.",
    )
)
