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

from grading.registry import register_shortcuts

from .outcomes import RAG

register_shortcuts("lab12", [f"{RAG}.chunking:chunk_text", f"{RAG}.search:top_k_cosine", f"{RAG}.evaluate:recall_at_k"])

# each task's module registers its checks, in task order
from . import task1_chunk_text, task2_top_k_cosine, task3_recall_at_k, task4_pipeline  # noqa: E402,F401
