"""The shipped corpus and its question set: retrieval measured against known answers.

The corpus is a snapshot of Python's language-reference topics (the text behind ``help()``),
about fifty documents as plain text, Markdown and HTML files in ``data/corpus/``. Each of the
questions in ``data/questions.json`` names the document that answers it and an *evidence*
span: a short verbatim phrase of the answering passage, found at character ``start`` of that
document's text, exactly once. A chunk is relevant to a question when it belongs to that
document and contains the whole span; where no chunk contains it (chunks cut without enough
overlap can split it), the chunks that hold part of it count instead. This one definition
(``Question.relevant_chunks``) serves the tests, the lesson and the lab alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from infra_lib.apps.rag.chunking import ChunkRecord
from infra_lib.apps.rag.loaders import Document, load_path

DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_DIR = DATA_DIR / "corpus"
QUESTIONS_PATH = DATA_DIR / "questions.json"


@dataclass(frozen=True)
class Question:
    """A question with its known answer location.

    Attributes:
        qid: a short stable id.
        question: the question, in a learner's words.
        doc_id: the document that answers it.
        evidence: a verbatim phrase of the answer, unique in that document.
        start: the evidence's character offset in the document's text.
    """

    qid: str
    question: str
    doc_id: str
    evidence: str
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.evidence)

    def relevant_chunks(self, chunks: Sequence[ChunkRecord]) -> set[int]:
        """Ids of the chunks that answer this question: those of its document that contain the
        whole evidence span, or, when none does, those that contain part of it."""
        own = [c for c in chunks if c.doc_id == self.doc_id]
        whole = {c.chunk_id for c in own if c.start <= self.start and self.end <= c.end}
        return whole or {c.chunk_id for c in own if c.start < self.end and self.start < c.end}

    def check(self, doc: Document) -> None:
        """Raise ``ValueError`` unless the evidence sits at ``start`` of ``doc`` and nowhere else in it."""
        if doc.doc_id != self.doc_id:
            raise ValueError(f"question {self.qid} belongs to {self.doc_id!r}, not {doc.doc_id!r}")
        found = doc.text[self.start : self.end]
        if found != self.evidence:
            raise ValueError(
                f"question {self.qid}: {doc.doc_id}[{self.start}:{self.end}] is {found!r}, "
                f"not the evidence {self.evidence!r}"
            )
        if doc.text.count(self.evidence) != 1:
            raise ValueError(
                f"question {self.qid}: the evidence {self.evidence!r} occurs "
                f"{doc.text.count(self.evidence)} times in {doc.doc_id}; make it unique"
            )


def load_corpus(path: str | Path = CORPUS_DIR) -> list[Document]:
    """Every document of the corpus folder (the shipped one by default), sorted by file name."""
    docs = load_path(path)
    return docs if isinstance(docs, list) else [docs]


def load_questions(path: str | Path = QUESTIONS_PATH) -> list[Question]:
    """The question set (the shipped one by default)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no question file at {path}")
    rows = json.loads(path.read_text(encoding="utf-8"))
    try:
        return [Question(**row) for row in rows]
    except TypeError as err:
        raise ValueError(
            f"{path}: each question needs exactly the fields qid, question, doc_id, evidence, start ({err})"
        ) from None


def check_questions(questions: Sequence[Question], docs: Sequence[Document]) -> None:
    """Check every question against the corpus: its document exists and holds its evidence
    exactly once, at ``start``; question ids are unique."""
    by_id = {doc.doc_id: doc for doc in docs}
    seen: set[str] = set()
    for question in questions:
        if question.qid in seen:
            raise ValueError(f"question id {question.qid!r} is used twice")
        seen.add(question.qid)
        if question.doc_id not in by_id:
            raise ValueError(f"question {question.qid} names document {question.doc_id!r}, which is not in the corpus")
        question.check(by_id[question.doc_id])


def questions_to_json(questions: Sequence[Question]) -> str:
    """The question file's text for ``questions``."""
    return json.dumps([asdict(q) for q in questions], indent=1, ensure_ascii=False) + "\n"
