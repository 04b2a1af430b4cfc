"""Chunking: cutting documents into overlapping windows that each fit the embedder.

An embedder turns a passage into one vector, so the passage must be short enough to be about
one thing (and to fit the embedder's input, 256 tokens for MiniLM). Fixed-size windows are the
baseline every retrieval system starts from: windows of ``size`` units start every
``step = size - overlap`` units, so consecutive windows share ``overlap`` units and a sentence
cut by one boundary is whole in the neighbouring window. The units are characters, or tokens
(words, or an embedder's own tokens), but a chunk always records character offsets into its
source, ``text == source[start:end]``, so a hit can be shown in place and cited.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from infra_lib.apps.rag.loaders import Document


class Chunk(NamedTuple):
    """A window of a text: ``text == source[start:end]`` (character offsets)."""

    text: str
    start: int
    end: int


@dataclass
class ChunkRecord:
    """A chunk of one document, numbered across the whole collection.

    Attributes:
        chunk_id: its position in the collection (0, 1, ...): the id the index returns.
        doc_id: the document it was cut from.
        text: ``document.text[start:end]``.
        start, end: character offsets into the document's text.
    """

    chunk_id: int
    doc_id: str
    text: str
    start: int
    end: int


def _check_window(size: int, overlap: int) -> None:
    for name, value in (("size", size), ("overlap", overlap)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got size={size}")
    if overlap < 0:
        raise ValueError(f"overlap must be >= 0, got overlap={overlap}")
    if overlap >= size:
        raise ValueError(
            f"overlap must be smaller than size (or windows never advance), got size={size}, overlap={overlap}"
        )


def window_starts(n: int, size: int, overlap: int) -> list[int]:
    """Where the windows over ``n`` units start: 0, step, 2*step, ... until one reaches the end."""
    step = size - overlap
    starts = []
    start = 0
    while n > 0:
        starts.append(start)
        if start + size >= n:
            break
        start += step
    return starts


def token_spans(text: str, tokenizer=None) -> list[tuple[int, int]]:
    """Character spans of the tokens of ``text``.

    Args:
        tokenizer: None for words (runs of non-space characters); a Hugging Face fast tokenizer
            (its offset mapping); or anything with a ``tokenizer`` attribute that is one (an
            embedder such as ``MiniLMEmbedder``).
    """
    if tokenizer is None:
        return [m.span() for m in re.finditer(r"\S+", text)]
    hf = getattr(tokenizer, "tokenizer", tokenizer)
    if not callable(hf):
        raise TypeError(
            f"token chunking needs a Hugging Face fast tokenizer (or an embedder that has one), got "
            f"{type(tokenizer).__name__}; pass tokenizer=None to count words"
        )
    encoded = hf(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return [(int(a), int(b)) for a, b in encoded["offset_mapping"] if b > a]


def chunk_text(text: str, size: int, overlap: int = 0, *, unit: str = "chars", tokenizer=None) -> list[Chunk]:
    """Cut ``text`` into windows of ``size`` units, consecutive windows sharing ``overlap`` units.

    Windows start at ``0, step, 2*step, ...`` with ``step = size - overlap``; each is
    ``[start, min(start + size, n))``; the last one is the first that reaches the end.

    Args:
        text: the source.
        size: units per window (>= 1).
        overlap: units shared by consecutive windows (0 <= overlap < size).
        unit: "chars" or "tokens". With tokens, each token owns the characters from its start to
            the next token's start (the first also owns any leading space), so the chunks still
            cover every character and overlap by exactly ``overlap`` tokens.
        tokenizer: for ``unit="tokens"``: see ``token_spans``.

    Returns:
        Chunks in order; ``[]`` for an empty text. ``chunk.text == text[chunk.start:chunk.end]``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    _check_window(size, overlap)
    if unit == "chars":
        return [
            Chunk(text[s : min(s + size, len(text))], s, min(s + size, len(text)))
            for s in window_starts(len(text), size, overlap)
        ]
    if unit != "tokens":
        raise ValueError(f"unit must be 'chars' or 'tokens', got {unit!r}")
    spans = token_spans(text, tokenizer)
    if not spans:
        return [Chunk(text, 0, len(text))] if text else []
    # Token i owns [bounds[i], bounds[i + 1]): from its start to the next token's start.
    bounds = [0] + [start for start, _ in spans[1:]] + [len(text)]
    chunks = []
    for s in window_starts(len(spans), size, overlap):
        start, end = bounds[s], bounds[min(s + size, len(spans))]
        chunks.append(Chunk(text[start:end], start, end))
    return chunks


def chunk_documents(
    docs: Sequence[Document],
    size: int,
    overlap: int = 0,
    *,
    chunker: Callable[..., Sequence] = chunk_text,
    unit: str = "chars",
    tokenizer=None,
) -> list[ChunkRecord]:
    """Chunk every document with ``chunker(doc.text, size, overlap)`` and check what it returns.

    Any chunker with that signature plugs in (yours from lab 12, for instance); each item it
    returns must be a ``(text, start, end)`` triple with ``text == doc.text[start:end]``.

    Args:
        docs: the documents.
        size, overlap: passed to the chunker.
        chunker: the chunking function.
        unit, tokenizer: passed on as keywords only when ``unit`` is not "chars".

    Returns:
        ``ChunkRecord``s numbered 0, 1, ... across all documents, in document order.
    """
    records: list[ChunkRecord] = []
    for doc in docs:
        extra = {} if unit == "chars" else {"unit": unit, "tokenizer": tokenizer}
        for i, item in enumerate(chunker(doc.text, size, overlap, **extra)):
            try:
                text, start, end = item
            except (TypeError, ValueError):
                raise ValueError(
                    f"chunker returned {item!r} as item {i} of document {doc.doc_id!r}; each item must "
                    "be a (text, start, end) triple"
                ) from None
            if not (isinstance(start, int) and isinstance(end, int)):
                raise ValueError(
                    f"item {i} of document {doc.doc_id!r} has start={start!r}, end={end!r}; "
                    "they must be int character offsets"
                )
            if not 0 <= start <= end <= len(doc.text):
                raise ValueError(
                    f"item {i} of document {doc.doc_id!r} has offsets ({start}, {end}) outside "
                    f"0 <= start <= end <= {len(doc.text)} (the document's length)"
                )
            if doc.text[start:end] != text:
                raise ValueError(
                    f"item {i} of document {doc.doc_id!r} is ({str(text)[:40]!r}, {start}, {end}), but "
                    f"document.text[{start}:{end}] is {doc.text[start:end][:40]!r}: text must equal "
                    "document.text[start:end]"
                )
            records.append(ChunkRecord(len(records), doc.doc_id, text, start, end))
    return records
