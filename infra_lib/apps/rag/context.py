"""Context assembly: from retrieved chunks to the prompt the model reads.

The retrieved passages are numbered in rank order, ``[1] (source) text``, and added one by one
until the next would push the context past its token budget (counted with the generating
model's own tokenizer: the budget is a share of *its* context window). The numbers are what the
model cites, and ``parse_citations`` maps the ``[n]`` in its answer back to the chunks, so an
answer can be checked against its sources.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from infra_lib.apps.rag.chunking import ChunkRecord

SYSTEM_PROMPT = (
    "You answer questions about Python using only the numbered passages you are given. "
    "Cite the passage that supports your answer by its number in square brackets, like [1]. "
    "If the passages do not contain the answer, say that you do not know."
)


@dataclass
class Hit:
    """A retrieved chunk: its rank (1 = best), its similarity score, and the chunk."""

    rank: int
    score: float
    chunk: ChunkRecord


def format_passage(number: int, hit: Hit) -> str:
    """``[n] (doc_id) text``, the chunk's text with its surrounding whitespace trimmed."""
    return f"[{number}] ({hit.chunk.doc_id}) {hit.chunk.text.strip()}"


def assemble_context(hits: Sequence[Hit], tokenizer, budget_tokens: int) -> tuple[str, list[Hit]]:
    """Number the hits' passages in rank order and keep as many as fit ``budget_tokens``.

    Args:
        hits: retrieved chunks, best first.
        tokenizer: anything with ``encode(text) -> list``: the generating model's tokenizer.
        budget_tokens: the most tokens the context may take (>= 1).

    Returns:
        (context, used): the passages separated by blank lines, and the hits they came from
        (passage ``[n]`` is ``used[n - 1]``). Stops before the first passage that would exceed
        the budget, so the context may be empty.
    """
    if not isinstance(budget_tokens, int) or budget_tokens < 1:
        raise ValueError(f"budget_tokens must be an int >= 1, got {budget_tokens!r}")
    passages: list[str] = []
    used: list[Hit] = []
    for hit in sorted(hits, key=lambda h: h.rank):
        candidate = "\n\n".join([*passages, format_passage(len(passages) + 1, hit)])
        if len(tokenizer.encode(candidate)) > budget_tokens:
            break
        passages.append(format_passage(len(passages) + 1, hit))
        used.append(hit)
    return "\n\n".join(passages), used


def build_messages(question: str, context: str, system: str = SYSTEM_PROMPT) -> list[dict]:
    """The chat for the model: the instructions, then the passages and the question in one user turn."""
    return [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": f"Passages:\n\n{context}\n\nQuestion: {question}\n"
            "Answer in one or two sentences and cite the passage number, like [1].",
        },
    ]


def parse_citations(text: str, used: Sequence[Hit]) -> dict[int, ChunkRecord]:
    """The passages an answer cites: ``{n: chunk}`` for every ``[n]`` (also ``[1, 2]``) with
    1 <= n <= len(used), in order of first citation; numbers outside that range are ignored."""
    cited: dict[int, ChunkRecord] = {}
    for group in re.findall(r"\[(\d+(?:\s*,\s*\d+)*)\]", text):
        for number in (int(n) for n in group.split(",")):
            if 1 <= number <= len(used) and number not in cited:
                cited[number] = used[number - 1].chunk
    return cited
