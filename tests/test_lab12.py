"""Lab 12's checks: the instructor's answers pass every check, and the classic retrieval mistakes
fail with messages that name them (windows that never reach the end, a dot product for a cosine,
precision or the hit rate for recall)."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, check_fails, solution_namespace

from grading import check

SOLUTION = REPO / "solutions" / "lab12_rag" / "lab12_rag.ipynb"
CHECKS = {
    "chunk_text": ["lab12.chunk_text", "lab12.chunk_text_edges", "lab12.chunk_text_corpus"],
    "top_k_cosine": ["lab12.top_k_cosine", "lab12.top_k_cosine_edges"],
    "recall_at_k": ["lab12.recall_at_k", "lab12.recall_at_k_edges"],
}


@pytest.fixture(scope="module")
def solution() -> dict:
    return solution_namespace(SOLUTION, torch=torch)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_instructor_answers_pass_every_check(solution, name):
    for check_id in CHECKS[name]:
        check(check_id, solution[name])


def test_the_pipeline_check_passes_the_instructor_answers(solution):
    check("lab12.pipeline", (solution["chunk_text"], solution["top_k_cosine"], solution["recall_at_k"]))


def test_task1_the_lab_examples_hold(solution):
    spans = [
        (s, e) for _, s, e in solution["chunk_text"]("Paged attention stores the KV cache in fixed-size blocks.", 20, 5)
    ]
    assert spans == [(0, 20), (15, 35), (30, 50), (45, 57)]
    assert solution["chunk_text"]("abc", 5, 2) == [("abc", 0, 3)]


def test_task1_a_window_that_repeats_the_tail_is_caught(solution):
    def one_too_many(text, size, overlap):  # loops while start < len(text): the tail comes back once more
        if size < 1 or overlap < 0 or overlap >= size:
            raise ValueError("bad window")
        return [(text[s : s + size], s, min(s + size, len(text))) for s in range(0, len(text), size - overlap)]

    text = check_fails("lab12.chunk_text", one_too_many)
    assert "too many chunks" in text and "stop after the window that reaches the end" in text


def test_task1_windows_without_overlap_are_caught(solution):
    def no_overlap(text, size, overlap):
        return solution["chunk_text"](text, size, 0)

    text = check_fails("lab12.chunk_text", no_overlap)
    assert "wrong chunk boundaries" in text and "should span" in text


def test_task1_offsets_must_match_the_text(solution):
    text = check_fails(
        "lab12.chunk_text",
        lambda t, size, overlap: [(c.strip(), s, e) for c, s, e in solution["chunk_text"](t, size, overlap)],
    )
    assert "text[start:end]" in text


def test_task2_a_dot_product_ranking_is_named(solution):
    def dot(queries, matrix, k):
        return (queries @ matrix.T).topk(min(k, matrix.shape[0]), dim=-1)

    text = check_fails("lab12.top_k_cosine", dot)
    assert "ranked by dot product, not cosine similarity" in text


def test_task2_ascending_order_and_nan_scores_are_caught(solution):
    def ascending(queries, matrix, k):
        scores, indices = solution["top_k_cosine"](queries, matrix, k)
        return scores.flip(-1), indices.flip(-1)

    assert "the right neighbours in the wrong order" in check_fails("lab12.top_k_cosine", ascending)

    def unclamped(queries, matrix, k):
        if k < 1:
            raise ValueError("k must be >= 1")
        q = queries / queries.norm(dim=-1, keepdim=True)
        m = matrix / matrix.norm(dim=-1, keepdim=True)  # a zero row divides by zero
        return torch.topk(q @ m.T, min(k, matrix.shape[0]), dim=-1)

    assert "nan" in check_fails("lab12.top_k_cosine_edges", unclamped)


def test_task3_precision_and_hit_rate_are_named(solution):
    def precision(retrieved, relevant, k):
        return sum(len(set(r[:k]) & rel) / k for r, rel in zip(retrieved, relevant)) / len(retrieved)

    def hit_rate(retrieved, relevant, k):
        return sum(bool(set(r[:k]) & rel) for r, rel in zip(retrieved, relevant)) / len(retrieved)

    assert "this is precision@k, not recall@k" in check_fails("lab12.recall_at_k", precision)
    assert "this is the hit rate, not recall@k" in check_fails("lab12.recall_at_k", hit_rate)


def test_task3_invalid_inputs_must_raise(solution):
    def lenient(retrieved, relevant, k):
        if not retrieved or k < 1:
            return 0.0
        return sum(len(set(r[:k]) & rel) / max(1, len(rel)) for r, rel in zip(retrieved, relevant)) / len(retrieved)

    assert "should raise ValueError" in check_fails("lab12.recall_at_k_edges", lenient)


def test_task4_a_different_chunker_fails_the_pipeline_check(solution):
    def shifted(text, size, overlap):
        return solution["chunk_text"](text, size + 1, overlap)

    text = check_fails("lab12.pipeline", (shifted, solution["top_k_cosine"], solution["recall_at_k"]))
    assert "your chunker cut the documents differently" in text


def test_task4_a_recall_off_by_one_fails_the_pipeline_check(solution):
    def one_more(retrieved, relevant, k):
        return solution["recall_at_k"](retrieved, relevant, k + 1)

    text = check_fails("lab12.pipeline", (solution["chunk_text"], solution["top_k_cosine"], one_more))
    assert "your recall@k differs from the reference's" in text


def test_task4_wrong_arguments_are_explained():
    text = check_fails("lab12.pipeline", lambda *a: None)
    assert "takes the tuple (chunk_text, top_k_cosine, recall_at_k)" in text


def test_task1_invalid_sizes_raise_even_for_an_empty_text(solution):
    def empty_first(text, size, overlap):  # returns [] for an empty text before checking the sizes
        return [] if not text else solution["chunk_text"](text, size, overlap)

    assert "should raise ValueError" in check_fails("lab12.chunk_text_edges", empty_first)


def test_task2_a_nan_for_a_zero_query_is_caught(solution):
    def rows_only(queries, matrix, k):  # clamps the rows' norms, not the query's
        if k < 1:
            raise ValueError("k must be >= 1")
        q = queries / queries.norm(dim=-1, keepdim=True)
        m = matrix / matrix.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return torch.topk(q @ m.T, min(k, matrix.shape[0]), dim=-1)

    text = check_fails("lab12.top_k_cosine_edges", rows_only)
    assert "a score is nan" in text and "zero query" in text


def test_task2_a_zero_query_may_return_any_rows(solution):
    """A zero query ties every row at 0: any k distinct rows pass, scored 0."""

    def reversed_ties(queries, matrix, k):
        scores, indices = solution["top_k_cosine"](queries, matrix, k)
        zero = (queries.reshape(-1, queries.shape[-1]).norm(dim=-1) == 0).reshape(scores.shape[:-1] + (1,))
        return scores, torch.where(zero, indices.flip(-1), indices)

    check("lab12.top_k_cosine_edges", reversed_ties)

    def repeated(queries, matrix, k):
        scores, indices = solution["top_k_cosine"](queries, matrix, k)
        zero = (queries.reshape(-1, queries.shape[-1]).norm(dim=-1) == 0).reshape(scores.shape[:-1] + (1,))
        return scores, torch.where(zero, torch.zeros_like(indices), indices)

    assert "zero query" in check_fails("lab12.top_k_cosine_edges", repeated)


def test_task2_float_indices_are_refused(solution):
    def float_indices(queries, matrix, k):
        scores, indices = solution["top_k_cosine"](queries, matrix, k)
        return scores, indices.float()

    assert "integer dtype" in check_fails("lab12.top_k_cosine", float_indices)


def test_task3_an_id_counted_twice_is_caught(solution):
    def counts_repeats(retrieved, relevant, k):
        if k < 1 or not retrieved or len(retrieved) != len(relevant) or not all(relevant):
            raise ValueError("bad input")
        return sum(sum(i in rel for i in r[:k]) / len(rel) for r, rel in zip(retrieved, relevant)) / len(retrieved)

    text = check_fails("lab12.recall_at_k", counts_repeats)
    assert "counted once" in text


def test_task3_an_int_is_not_a_float(solution):
    def whole(retrieved, relevant, k):
        value = solution["recall_at_k"](retrieved, relevant, k)
        return int(value) if value == int(value) else value

    assert "must return a float" in check_fails("lab12.recall_at_k", whole)
