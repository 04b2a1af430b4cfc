"""Lab 12 task 1: chunk_text on texts of random words, edge sizes, non-ASCII and invalid sizes, and
documents of the shipped corpus."""

from __future__ import annotations

import random

from grading.checks.common import outcome, reference
from grading.registry import Check, Mismatch, register

from .outcomes import RAG, TASKS, cases_mismatch

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
    return cases_mismatch("chunk_text", got, expected, cases, _describe_chunk_case, _chunk_problem)


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
    "task": TASKS[1],
    "reference": reference(f"{RAG}.chunking", "chunk_text"),
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
