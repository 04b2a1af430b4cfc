"""Retrieval-augmented generation (L6, chapter 12): give the model the passages it needs.

loaders.py     Document; plain text, Markdown and HTML files; a folder
chunking.py    chunk_text (fixed windows with overlap, in characters or tokens), chunk_documents
embedders.py   MiniLMEmbedder (all-MiniLM-L6-v2, offline), HashingEmbedder, embed_cached
search.py      top_k_cosine and ExactIndex (brute force, the faiss IndexFlatIP equivalent)
ivf.py         kmeans and IVFIndex (approximate: scan nprobe of nlist lists)
context.py     Hit, assemble_context (numbered passages within a token budget), citations
pipeline.py    RAGPipeline: index_documents, retrieve, answer (through infra_lib.serving.LLM)
evaluate.py    recall_at_k, mrr, evaluate_retrieval
corpus.py      the shipped corpus (Python's language reference) and its question set
"""

from infra_lib.apps.rag.chunking import Chunk, ChunkRecord, chunk_documents, chunk_text
from infra_lib.apps.rag.context import Hit, assemble_context, build_messages, parse_citations
from infra_lib.apps.rag.corpus import Question, check_questions, load_corpus, load_questions
from infra_lib.apps.rag.embedders import HashingEmbedder, MiniLMEmbedder, cache_path, default_cache_dir, embed_cached
from infra_lib.apps.rag.evaluate import evaluate_retrieval, mrr, recall_at_k
from infra_lib.apps.rag.ivf import IVFIndex, kmeans
from infra_lib.apps.rag.loaders import Document, load_html, load_markdown, load_path, load_text
from infra_lib.apps.rag.pipeline import Answer, RAGPipeline
from infra_lib.apps.rag.search import ExactIndex, top_k_cosine

__all__ = [
    "Answer",
    "Chunk",
    "ChunkRecord",
    "Document",
    "ExactIndex",
    "HashingEmbedder",
    "Hit",
    "IVFIndex",
    "MiniLMEmbedder",
    "Question",
    "RAGPipeline",
    "assemble_context",
    "build_messages",
    "cache_path",
    "check_questions",
    "chunk_documents",
    "chunk_text",
    "default_cache_dir",
    "embed_cached",
    "evaluate_retrieval",
    "kmeans",
    "load_corpus",
    "load_html",
    "load_markdown",
    "load_path",
    "load_questions",
    "load_text",
    "mrr",
    "parse_citations",
    "recall_at_k",
    "top_k_cosine",
]
