"""Lab 12 task 4: the learner's chunk_text and top_k_cosine inside the course's RAGPipeline on a slice
of the shipped corpus (hashing embedder), and their recall_at_k on what it retrieved."""

from __future__ import annotations

import math
import random

from grading.checks.common import first_difference, outcome, unwrap
from grading.registry import Check, Mismatch, register

from .outcomes import TASKS, kind_mismatch, plain_number


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
        recalls[str(k)] = plain_number(
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
    problem = kind_mismatch("the pipeline", where, got, expected)
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
        problem = kind_mismatch("recall_at_k", f"{where}, k={k}", g, e)
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
        task=TASKS[4],
        reference=_reference_functions,
        make_inputs=_pipeline_case,
        drive=_drive_pipeline,
        compare=_compare_pipeline,
        hint="pass your three functions as one tuple, in task order. The pipeline checks that every chunk is "
        "exactly its document's text between its offsets and calls your search with a single 1-D query; "
        "tasks 1 to 3's checks pinpoint a difference faster.",
    )
)
