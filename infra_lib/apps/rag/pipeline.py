"""The RAG pipeline: index documents once, then retrieve and answer with citations.

    index_documents:  load -> chunk -> embed -> index           (once, offline)
    retrieve:         embed the question -> search the index    (per question)
    answer:           retrieve -> assemble the context -> generate with the LLM

Every stage is a replaceable part (chunker, embedder, search function, index kind) and every
stage is timed, because in production the slow stage is rarely the one people guess.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infra_lib.apps.rag.chunking import ChunkRecord, chunk_documents, chunk_text
from infra_lib.apps.rag.context import Hit, assemble_context, build_messages, parse_citations
from infra_lib.apps.rag.embedders import cache_path, embed_cached
from infra_lib.apps.rag.ivf import IVFIndex
from infra_lib.apps.rag.loaders import Document
from infra_lib.apps.rag.search import ExactIndex, SearchFn, top_k_cosine
from infra_lib.model.sampling import SamplingParams

RETRIEVE_STAGES = ("embed_query", "search")
ANSWER_PREFIX = "According to passage ["
ANSWER_STAGES = ("embed_query", "search", "assemble", "generate")


@dataclass
class Answer:
    """A generated answer and everything needed to check it.

    Attributes:
        text: the model's answer.
        citations: ``{n: chunk}`` for each passage ``[n]`` the answer cites.
        hits: what retrieval returned, best first.
        context: the numbered passages the model saw.
        used_hits: the hits that fit the budget (passage ``[n]`` is ``used_hits[n - 1]``).
        messages: the chat sent to the model.
        timings: seconds per stage: embed_query, search, assemble, generate.
        finish_reason: "stop" (the model ended its turn) or "length" (max_new_tokens reached).
        token_ids: the generated tokens (after the answer prefix).
        prompt_tokens: tokens the model read before answering (chat, passages, prefix).
    """

    text: str
    citations: dict[int, ChunkRecord]
    hits: list[Hit]
    context: str
    used_hits: list[Hit]
    messages: list[dict]
    timings: dict[str, float]
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0


class RAGPipeline:
    """Retrieval-augmented generation over a document collection.

    Args:
        embedder: ``MiniLMEmbedder()`` or any object with ``name``, ``dim`` and ``embed``.
        chunk_size, overlap: the chunker's window and overlap (characters by default).
        chunker: ``chunk_text`` or any function ``(text, size, overlap) -> [(text, start, end)]``.
        search_fn: the exact index's search, ``top_k_cosine`` by default (ignored by IVF).
        index: "exact" (``ExactIndex``) or "ivf" (``IVFIndex``).
        nlist: IVF lists (default: about the square root of the number of chunks).
        nprobe: IVF lists scanned per query.
        cache_dir: a folder for cached chunk embeddings (``embed_cached``), or None for none.
        unit: "chars" or "tokens" (the embedder's tokens when it has a tokenizer).
    """

    def __init__(
        self,
        embedder,
        *,
        chunk_size: int = 800,
        overlap: int = 100,
        chunker: Callable[..., Sequence] = chunk_text,
        search_fn: SearchFn = top_k_cosine,
        index: str = "exact",
        nlist: int | None = None,
        nprobe: int = 4,
        cache_dir: str | Path | None = None,
        unit: str = "chars",
    ):
        if index not in ("exact", "ivf"):
            raise ValueError(f"index must be 'exact' or 'ivf', got {index!r}")
        if index == "ivf" and search_fn is not top_k_cosine:
            raise ValueError("search_fn plugs into the exact index; use index='exact' to try your own search")
        self.embedder = embedder
        self.chunk_size, self.overlap, self.unit = chunk_size, overlap, unit
        self.chunker, self.search_fn = chunker, search_fn
        self.index_kind, self.nlist, self.nprobe = index, nlist, nprobe
        self.cache_dir = cache_dir
        self.chunks: list[ChunkRecord] = []
        self.vectors: torch.Tensor | None = None  # (n_chunks, dim), row i embeds chunks[i]
        self.index: ExactIndex | IVFIndex | None = None
        self.index_timings: dict[str, float] = {}
        self.last_timings: dict[str, float] = {}
        self.cache_hit: bool | None = None  # whether index_documents found its embeddings in cache_dir

    def index_documents(self, docs: Sequence[Document], progress: bool = False) -> RAGPipeline:
        """Chunk, embed and index ``docs`` (replacing anything indexed before); returns self.

        ``index_timings`` then holds the seconds spent chunking, embedding and indexing, and
        ``cache_hit`` whether the embeddings came from ``cache_dir``.
        """
        docs = list(docs)
        if not docs:
            raise ValueError("no documents to index")
        started = time.perf_counter()
        tokenizer = getattr(self.embedder, "tokenizer", None) if self.unit == "tokens" else None
        chunks = chunk_documents(
            docs, self.chunk_size, self.overlap, chunker=self.chunker, unit=self.unit, tokenizer=tokenizer
        )
        if not chunks:
            raise ValueError("the documents produced no chunks (are they all empty?)")
        chunked = time.perf_counter()
        texts = [c.text for c in chunks]
        if self.cache_dir is None:
            self.cache_hit = None
            vectors = self.embedder.embed(texts, progress=progress)
        else:
            self.cache_hit = cache_path(self.embedder, texts, self.cache_dir).exists()
            vectors = embed_cached(self.embedder, texts, self.cache_dir, progress=progress)
        embedded = time.perf_counter()
        if self.index_kind == "exact":
            index = ExactIndex(vectors.shape[1], search_fn=self.search_fn)
        else:
            nlist = self.nlist or max(1, round(len(chunks) ** 0.5))
            index = IVFIndex(vectors.shape[1], nlist, nprobe=self.nprobe)
            index.train(vectors)
        index.add(vectors, [c.chunk_id for c in chunks])
        self.chunks, self.index, self.vectors = chunks, index, vectors
        self.index_timings = {
            "chunk": chunked - started,
            "embed": embedded - chunked,
            "index": time.perf_counter() - embedded,
        }
        return self

    def _require_index(self) -> ExactIndex | IVFIndex:
        if self.index is None:
            raise RuntimeError("nothing is indexed yet: call index_documents(docs) first")
        return self.index

    def retrieve(self, question: str, k: int = 5) -> list[Hit]:
        """The ``k`` chunks most similar to ``question``, best first (``last_timings`` holds the
        seconds spent embedding the question and searching)."""
        index = self._require_index()
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question must be a non-empty str, got {question!r}")
        started = time.perf_counter()
        query = self.embedder.embed([question])[0]
        embedded = time.perf_counter()
        scores, ids = index.search(query, k)
        self.last_timings = {"embed_query": embedded - started, "search": time.perf_counter() - embedded}
        return [
            Hit(rank, float(score), self.chunks[int(chunk_id)])
            for rank, (score, chunk_id) in enumerate(zip(scores.tolist(), ids.tolist()), start=1)
            if chunk_id >= 0
        ]

    def answer(
        self,
        question: str,
        llm,
        *,
        k: int = 3,
        budget_tokens: int = 1024,
        max_new_tokens: int = 128,
        answer_prefix: str = ANSWER_PREFIX,
    ) -> Answer:
        """Retrieve ``k`` chunks, fit them into ``budget_tokens``, and let ``llm`` answer greedily.

        Args:
            question: the user's question.
            llm: an ``infra_lib.serving.LLM`` (its engine must have a tokenizer).
            k: chunks to retrieve.
            budget_tokens: the most tokens the passages may take (the LLM's tokenizer counts).
            max_new_tokens: the longest answer.
            answer_prefix: the start of the model's reply, written for it (a response prefix).
                The default, "According to passage [", makes even a small model name a passage;
                which one is still its choice. "" leaves the whole reply to the model.

        Returns:
            An ``Answer`` with the text, its citations and the timings of every stage.
        """
        tokenizer = getattr(getattr(llm, "engine", None), "tokenizer", None)
        if tokenizer is None:
            raise ValueError("llm must be an infra_lib.serving.LLM built with a tokenizer: LLM(model, tokenizer)")
        hits = self.retrieve(question, k)
        timings = dict(self.last_timings)
        started = time.perf_counter()
        context, used = assemble_context(hits, tokenizer, budget_tokens)
        if not used:
            raise ValueError(
                f"not even the best passage fits budget_tokens={budget_tokens}; raise the budget or "
                "index with a smaller chunk_size"
            )
        messages = build_messages(question, context)
        prompt = tokenizer.encode_chat(messages) + (tokenizer.encode(answer_prefix) if answer_prefix else [])
        assembled = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        timings.update(assemble=assembled - started, generate=time.perf_counter() - assembled)
        text = answer_prefix + output.text
        return Answer(
            text,
            parse_citations(text, used),
            hits,
            context,
            used,
            messages,
            timings,
            output.finish_reason,
            list(output.token_ids),
            len(prompt),
        )
