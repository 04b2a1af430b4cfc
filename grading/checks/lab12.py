"""Checks for lab 12 (retrieval): the learner writes ``chunk_text(text, size, overlap)``,
``top_k_cosine(queries, matrix, k)`` and ``recall_at_k(retrieved, relevant, k)``, then plugs the
first two into the course's ``RAGPipeline`` and scores it with the third.

Inputs are seeded: texts of random words (and, hidden, a document of the shipped corpus),
random vectors of varied norms (so a dot product instead of a cosine ranks them differently),
and retrieval results with several relevant items per query. The pipeline check indexes a slice
of the shipped corpus with the hashing embedder (fast and deterministic) and asks the shipped
questions: the learner's chunker and search must retrieve what the reference retrieves, and
the learner's recall must equal the reference's. Drivers record each call as
``["value", result]`` or ``["raised", "Type: message"]``, so a raised exception names its input.
"""

from __future__ import annotations

import math
import random

from grading.checks.common import first_difference, outcome, reference, unwrap
from grading.registry import Check, Mismatch, register, register_shortcuts

_RAG = "infra_lib.apps.rag"

register_shortcuts(
    "lab12", [f"{_RAG}.chunking:chunk_text", f"{_RAG}.search:top_k_cosine", f"{_RAG}.evaluate:recall_at_k"]
)

_TASKS = {
    1: "lab12 task 1: chunk_text",
    2: "lab12 task 2: top_k_cosine",
    3: "lab12 task 3: recall_at_k",
    4: "lab12 task 4: your retriever in the pipeline",
}
_WORDS = (
    "the",
    "cache",
    "block",
    "token",
    "query",
    "vector",
    "index",
    "model",
    "batch",
    "prefill",
    "decode",
    "kernel",
    "memory",
    "tensor",
    "layer",
    "scheduler",
    "request",
    "latency",
    "a",
    "of",
    "to",
    "in",
)


def _words(rng: random.Random, n_chars: int) -> str:
    """Random words and punctuation, cut to exactly ``n_chars`` characters."""
    parts, length = [], 0
    while length < n_chars:
        word = rng.choice(_WORDS) + rng.choice([" ", " ", " ", ", ", ".\n", "\n\n"])
        parts.append(word)
        length += len(word)
    return "".join(parts)[:n_chars]


def _kind_mismatch(what: str, where: str, got, expected) -> Mismatch | None:
    """An exception where a value was due, or the reverse; None when both are values."""
    (got_kind, got_value), (want_kind, want) = unwrap(got), unwrap(expected)
    if got_kind == "malformed":
        return Mismatch(f"{what} returned something the check could not read", f"on {where}: {got_value!r:.120}")
    if want_kind == "raised" and got_kind != "raised":
        return Mismatch(f"{what} should raise {want.split(':')[0]} here", f"on {where}: the reference raised {want}")
    if got_kind == "raised" and want_kind != "raised":
        return Mismatch(f"{what} raised where a result was expected", f"on {where}: {got_value}")
    if got_kind == "raised" and got_value.split(":")[0] != want.split(":")[0]:
        return Mismatch(
            f"{what} raised the wrong kind of exception", f"on {where}: expected {want.split(':')[0]}, got {got_value}"
        )
    return None


def _cases_mismatch(name: str, got, expected, cases, describe, value_problem) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from {name}, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        where = describe(case)
        problem = _kind_mismatch(name, where, g, e)
        if problem is None and unwrap(g)[0] == "value":
            problem = value_problem(unwrap(g)[1], unwrap(e)[1], case, where)
        if problem is not None:
            return problem
    return None


# --- task 1: chunk_text ----------------------------------------------------------------------------


def _chunk_case(rng: random.Random, n_chars: int, size: int, overlap: int) -> dict:
    return {"text": _words(rng, n_chars), "size": size, "overlap": overlap}


def _chunk_cases(rng: random.Random) -> list[dict]:
    cases = [_chunk_case(rng, 100, 40, 10), _chunk_case(rng, 95, 30, 0), _chunk_case(rng, 25, 40, 10)]
    for _ in range(6):
        size = rng.randint(20, 300)
        cases.append(_chunk_case(rng, rng.randint(1, 2000), size, rng.randint(0, size - 1)))
    return cases


def _chunk_edge_cases(rng: random.Random) -> list[dict]:
    size = rng.randint(30, 80)
    overlap = rng.randint(1, size - 1)
    step = size - overlap
    cases = [
        _chunk_case(rng, size, size, overlap),  # exactly one window
        _chunk_case(rng, size + 3 * step, size, overlap),  # the last window ends exactly at the end
        _chunk_case(rng, size + 3 * step + 1, size, overlap),  # one character more
        _chunk_case(rng, 1, size, 0),
        _chunk_case(rng, 30, 5, 4),  # a step of one character
        {"text": "", "size": size, "overlap": overlap},
        {"text": "Grüße, 世界! 🙂\nNaïve café: déjà vu. " * 5, "size": 17, "overlap": 5},
        {"text": _words(rng, 50), "size": 0, "overlap": 0},
        {"text": _words(rng, 50), "size": 10, "overlap": -1},
        {"text": _words(rng, 50), "size": 10, "overlap": 10},
        {"text": _words(rng, 50), "size": 10, "overlap": 12},
        {"text": "", "size": 0, "overlap": 0},  # invalid sizes raise whatever the text, the empty one included
        {"text": "", "size": 6, "overlap": 6},
    ]
    return cases


def _corpus_chunk_cases(rng: random.Random) -> list[dict]:
    """Two documents of the shipped corpus, at the chunk sizes a pipeline uses."""
    from infra_lib.apps.rag import load_corpus

    docs = load_corpus()
    picked = rng.sample(docs, 2)
    return [
        {"text": picked[0].text, "size": 800, "overlap": 100},
        {"text": picked[1].text, "size": rng.choice([300, 500]), "overlap": rng.choice([0, 50])},
    ]


def _plain_chunks(result):
    """A list of [text, start, end]; anything else is "malformed" with a description."""
    if not isinstance(result, list):
        return ["malformed", f"a {type(result).__name__}, not a list of (text, start, end) tuples"]
    chunks = []
    for item in result:
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            return ["malformed", f"an item {item!r:.60}, not a (text, start, end) tuple"]
        text, start, end = item
        if not isinstance(text, str) or type(start) is not int or type(end) is not int:
            return ["malformed", f"an item {item!r:.60}: text must be a str, start and end ints"]
        chunks.append([text, start, end])
    return ["value", chunks]


def _drive_chunks(chunk_text, cases: list[dict]) -> list:
    results = []
    for case in cases:
        got = outcome(chunk_text, case["text"], case["size"], case["overlap"])
        results.append(_plain_chunks(got[1]) if got[0] == "value" else got)
    return results


def _describe_chunk_case(case: dict) -> str:
    return f"a text of {len(case['text'])} characters, size={case['size']}, overlap={case['overlap']}"


def _chunk_problem(got: list, expected: list, case: dict, where: str) -> Mismatch | None:
    text = case["text"]
    for i, (chunk, start, end) in enumerate(got):
        if chunk != text[start:end]:
            return Mismatch(
                "a chunk's text is not text[start:end]",
                f"on {where}: chunk {i} is ({start}, {end}) but its text differs from text[{start}:{end}]",
            )
    spans = [(s, e) for _, s, e in got]
    want = [(s, e) for _, s, e in expected]
    if spans == want:
        return None
    for i, (g, w) in enumerate(zip(spans, want)):
        if g != w:
            past = (
                f"; the text has {len(text)} characters, so no window ends after {len(text)}"
                if g[1] > len(text)
                else ""
            )
            return Mismatch(
                "wrong chunk boundaries",
                f"on {where}: chunk {i} should span {w}, got {g} (expected {len(want)} chunks: "
                f"{want[:4]}{' ...' if len(want) > 4 else ''}){past}",
            )
    if len(spans) > len(want):
        return Mismatch(
            "too many chunks",
            f"on {where}: expected {len(want)} chunks ending with {want[-1:]}, got {len(spans)}; "
            f"the extra ones start at {[s for s, _ in spans[len(want) :]][:4]}",
            hint="stop after the window that reaches the end of the text: a window starting after it "
            "adds only a repeat of the tail, or nothing at all.",
        )
    return Mismatch(
        "too few chunks",
        f"on {where}: expected {len(want)} chunks, got {len(spans)}; missing {want[len(spans) :][:4]}",
        hint="every character belongs to some window: the windows go on until one reaches the end of "
        "the text, even when that last window is shorter than size.",
    )


def _compare_chunks(got, expected, cases) -> Mismatch | None:
    return _cases_mismatch("chunk_text", got, expected, cases, _describe_chunk_case, _chunk_problem)


_CHUNK_HINT = (
    "neighbouring windows share overlap characters, so each starts that many characters before the previous "
    "one ends, and the last window is the first whose end reaches the end of the text: going on after it "
    "adds an empty window or one that only repeats the tail of the one before (chapter 12, section “1 · "
    "The pipeline, stage by stage”). Return (chunk, start, end) tuples in order, each chunk exactly the "
    "characters between its offsets, [] for an empty text, and raise ValueError when size is below 1, "
    "overlap is negative or overlap is not smaller than size."
)

# what the checks of task 1 share
_CHUNK_PARTS = {
    "task": _TASKS[1],
    "reference": reference(f"{_RAG}.chunking", "chunk_text"),
    "drive": _drive_chunks,
    "compare": _compare_chunks,
}

register(Check(check_id="lab12.chunk_text", **_CHUNK_PARTS, make_inputs=_chunk_cases, hint=_CHUNK_HINT))
register(
    Check(
        check_id="lab12.chunk_text_edges",
        **_CHUNK_PARTS,
        make_inputs=_chunk_edge_cases,
        hint=_CHUNK_HINT + " Edges: a text exactly one window long or ending exactly on a window, one "
        "character, a step of 1, non-ASCII text, an empty text and invalid sizes (with a "
        "text and with an empty one).",
    )
)
register(
    Check(
        check_id="lab12.chunk_text_corpus",
        **_CHUNK_PARTS,
        make_inputs=_corpus_chunk_cases,
        hint=_CHUNK_HINT + " Documents of the shipped corpus, 800/100 and others.",
    )
)


# --- task 2: top_k_cosine ---------------------------------------------------------------------------


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
    return _cases_mismatch("top_k_cosine", got, expected, cases, _describe_search, _search_problem)


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
    "task": _TASKS[2],
    "reference": reference(f"{_RAG}.search", "top_k_cosine"),
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


# --- task 3: recall_at_k ------------------------------------------------------------------------------


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


def _plain_number(got: list) -> list:
    """A recorded outcome whose value is a plain float (a 0-d tensor or numpy scalar is unwrapped)."""
    if got[0] != "value":
        return got
    value = got[1]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if type(value) is float:
        return ["value", value]
    return ["malformed", f"{value!r:.60} is a {type(value).__name__}: recall_at_k must return a float"]


def _drive_recall(recall_at_k, cases: list[dict]) -> list:
    return [
        _plain_number(
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
    return _cases_mismatch("recall_at_k", got, expected, cases, _describe_recall, _recall_problem)


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
    "task": _TASKS[3],
    "reference": reference(f"{_RAG}.evaluate", "recall_at_k"),
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


# --- task 4: the learner's chunker and search inside RAGPipeline --------------------------------------


def _pipeline_case(rng: random.Random) -> dict:
    """A seeded slice of the shipped corpus (the documents of 10 questions) and a window size."""
    from infra_lib.apps.rag import load_questions

    questions = rng.sample(load_questions(), 10)
    size, overlap = rng.choice([(800, 100), (600, 150), (1000, 200)])
    return {
        "questions": [q.question for q in questions],
        "doc_ids": sorted({q.doc_id for q in questions}),
        "size": size,
        "overlap": overlap,
    }


def _reference_functions():
    from infra_lib.apps.rag.chunking import chunk_text
    from infra_lib.apps.rag.evaluate import recall_at_k
    from infra_lib.apps.rag.search import top_k_cosine

    return chunk_text, top_k_cosine, recall_at_k


PIPELINE_KS = tuple(range(1, 11))  # every k: an off-by-one in k shows at some rank


def _drive_pipeline(functions, case: dict) -> list:
    """Index the slice with the given chunker and search (hashing embedder), ask every question."""
    if not (isinstance(functions, tuple) and len(functions) == 3 and all(callable(f) for f in functions)):
        return ["malformed", "check('lab12.pipeline', ...) takes the tuple (chunk_text, top_k_cosine, recall_at_k)"]
    chunk_text, top_k_cosine, recall_at_k = functions
    from infra_lib.apps.rag import HashingEmbedder, RAGPipeline, load_corpus, load_questions

    docs = [d for d in load_corpus() if d.doc_id in case["doc_ids"]]
    by_text = {q.question: q for q in load_questions()}
    questions = [by_text[text] for text in case["questions"]]
    built = outcome(
        lambda: RAGPipeline(
            HashingEmbedder(),
            chunk_size=case["size"],
            overlap=case["overlap"],
            chunker=chunk_text,
            search_fn=top_k_cosine,
        ).index_documents(docs)
    )
    if built[0] != "value":
        return ["raised", "indexing the documents: " + built[1]]
    pipeline = built[1]
    retrieved = []
    for q in questions:
        hits = outcome(pipeline.retrieve, q.question, max(PIPELINE_KS))
        if hits[0] != "value":
            return ["raised", f"retrieving for {q.question!r}: " + hits[1]]
        retrieved.append([hit.chunk.chunk_id for hit in hits[1]])
    relevant = [set(q.relevant_chunks(pipeline.chunks)) for q in questions]
    recalls = {}
    for k in PIPELINE_KS:
        recalls[str(k)] = _plain_number(
            outcome(recall_at_k, [list(r) for r in retrieved], [set(r) for r in relevant], k)
        )
    return [
        "value",
        {"spans": [[c.doc_id, c.start, c.end] for c in pipeline.chunks], "retrieved": retrieved, "recall": recalls},
    ]


def _describe_pipeline(case: dict) -> str:
    return (
        f"{len(case['doc_ids'])} documents of the shipped corpus ({', '.join(case['doc_ids'][:4])}...), "
        f"chunk_size={case['size']}, overlap={case['overlap']}, {len(case['questions'])} questions"
    )


def _compare_pipeline(got, expected, case) -> Mismatch | None:
    where = _describe_pipeline(case)
    problem = _kind_mismatch("the pipeline", where, got, expected)
    if problem is not None or unwrap(got)[0] == "raised":
        return problem
    got, expected = unwrap(got)[1], unwrap(expected)[1]
    if got["spans"] != expected["spans"]:
        first = first_difference(got["spans"], expected["spans"])
        return Mismatch(
            "your chunker cut the documents differently",
            f"on {where}: {len(got['spans'])} chunks against the reference's {len(expected['spans'])}; "
            f"the first difference is at chunk {first} (expected [doc, start, end] "
            f"{expected['spans'][first : first + 1]}, got {got['spans'][first : first + 1]})",
        )
    for text, g, e in zip(case["questions"], got["retrieved"], expected["retrieved"]):
        if g != e:
            return Mismatch(
                "your search ranked the chunks differently",
                f"on {where}: for {text!r} the reference retrieved chunks {e}, yours {g}",
            )
    for k in map(str, PIPELINE_KS):
        g, e = got["recall"][k], expected["recall"][k]
        problem = _kind_mismatch("recall_at_k", f"{where}, k={k}", g, e)
        if problem is not None:
            return problem
        if unwrap(g)[0] != "value" or not math.isclose(unwrap(g)[1], unwrap(e)[1], rel_tol=1e-9, abs_tol=1e-12):
            return Mismatch(
                "your recall@k differs from the reference's on the same retrieval",
                f"on {where}: recall@{k} should be {unwrap(e)[1]!r}, got {unwrap(g)[1]!r}",
            )
    return None


register(
    Check(
        check_id="lab12.pipeline",
        task=_TASKS[4],
        reference=_reference_functions,
        make_inputs=_pipeline_case,
        drive=_drive_pipeline,
        compare=_compare_pipeline,
        hint="pass your three functions as one tuple, in task order. The pipeline checks that every chunk is "
        "exactly its document's text between its offsets and calls your search with a single 1-D query; "
        "tasks 1 to 3's checks pinpoint a difference faster.",
    )
)
