"""Measuring retrieval: did the right chunks come back, how high, and how fast.

recall@k   of the chunks that answer a question, the fraction found in the top k; averaged
           over questions. The number that matters for RAG: a passage the model never sees
           cannot help it.
MRR        mean reciprocal rank: 1 / the rank of the first relevant chunk (0 if none came
           back). Rewards putting the answer first, which matters when few passages fit.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from infra_lib.apps.rag.pipeline import RETRIEVE_STAGES
from infra_lib.ops.latency import percentile


def _check_pairs(retrieved: Sequence[Sequence], relevant: Sequence[set]) -> None:
    if len(retrieved) != len(relevant):
        raise ValueError(
            f"got {len(retrieved)} retrieved lists for {len(relevant)} relevant sets: give one of each per query"
        )
    if not retrieved:
        raise ValueError("no queries: retrieved and relevant are empty")
    empty = [i for i, r in enumerate(relevant) if not r]
    if empty:
        raise ValueError(
            f"query {empty[0]} has no relevant items ({len(empty)} such queries): recall is undefined "
            "for them; drop them or fix their labels"
        )


def recall_at_k(retrieved: Sequence[Sequence], relevant: Sequence[set], k: int) -> float:
    """Mean over queries of ``|relevant_i & set(retrieved_i[:k])| / |relevant_i|``.

    Args:
        retrieved: per query, the retrieved ids, best first.
        relevant: per query, the set of relevant ids (non-empty).
        k: how many retrieved ids count (>= 1).
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    _check_pairs(retrieved, relevant)
    return statistics.fmean(len(set(rel) & set(list(ret)[:k])) / len(rel) for ret, rel in zip(retrieved, relevant))


def mrr(retrieved: Sequence[Sequence], relevant: Sequence[set]) -> float:
    """Mean over queries of 1 / (rank of the first relevant id), 0 for a query with none."""
    _check_pairs(retrieved, relevant)
    total = 0.0
    for ret, rel in zip(retrieved, relevant):
        total += next((1.0 / rank for rank, item in enumerate(ret, start=1) if item in rel), 0.0)
    return total / len(retrieved)


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    """Mean, P50 and P95 of a list of durations, in milliseconds."""
    ms = [s * 1000 for s in seconds]
    return {"mean_ms": statistics.fmean(ms), "p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95)}


def evaluate_retrieval(pipeline, questions: Sequence, ks: Sequence[int] = (1, 3, 5, 10)) -> dict:
    """Ask every question, one at a time as a user would, and score the retrieved chunks.

    Args:
        pipeline: an indexed ``RAGPipeline``.
        questions: ``Question``s (each says which chunks are relevant: ``relevant_chunks``).
        ks: the cut-offs for recall@k; the pipeline retrieves ``max(ks)`` chunks, which is also
            MRR's depth.

    Returns:
        ``{"recall@k": ..., for each k, "mrr": ..., "questions": n, "latency": {stage: {mean_ms,
        p50_ms, p95_ms}}, "retrieved": [[chunk ids]], "relevant": [[chunk ids]]}``.
    """
    if not questions:
        raise ValueError("no questions to evaluate")
    if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks must be ints >= 1, got {ks!r}")
    depth = max(ks)
    retrieved, relevant = [], []
    stage_seconds: dict[str, list[float]] = {stage: [] for stage in RETRIEVE_STAGES}
    for question in questions:
        hits = pipeline.retrieve(question.question, k=depth)
        retrieved.append([hit.chunk.chunk_id for hit in hits])
        relevant.append(question.relevant_chunks(pipeline.chunks))
        for stage in RETRIEVE_STAGES:
            stage_seconds[stage].append(pipeline.last_timings[stage])
    result: dict = {f"recall@{k}": recall_at_k(retrieved, relevant, k) for k in ks}
    result["mrr"] = mrr(retrieved, relevant)
    result["questions"] = len(questions)
    result["latency"] = {stage: latency_summary(values) for stage, values in stage_seconds.items()}
    result["retrieved"] = retrieved
    result["relevant"] = [sorted(r) for r in relevant]
    return result
