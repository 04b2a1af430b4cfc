"""Documents from files: plain text, Markdown and HTML, read into one shape.

Retrieval does not care what a file looked like, only what it says. Each loader returns a
``Document``: an id (the file's stem), the text a reader would see, where it came from, and a
title. Markdown is kept as written (its ``#`` headings are useful context for the embedder);
HTML is reduced to its visible text: tags stripped, ``<script>`` and ``<style>`` dropped,
paragraphs and headings kept apart by blank lines, entities such as ``&amp;`` unescaped.
Line endings are normalised to ``\\n`` so character offsets mean the same on every platform.
"""

from __future__ import annotations

import html.parser
import re
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = {".md": "markdown", ".markdown": "markdown", ".txt": "text", ".html": "html", ".htm": "html"}


@dataclass
class Document:
    """One source document.

    Attributes:
        doc_id: a short unique name (the file's stem for loaded files).
        text: the readable text; chunks point into it by character offset.
        source: where it came from (a path, a URL).
        title: a human title (first heading), or "".
    """

    doc_id: str
    text: str
    source: str
    title: str = ""


def read_text_file(path: str | Path) -> str:
    """A file's contents as UTF-8 text with ``\\n`` line endings (a readable error otherwise)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; use load_path(folder) to load every file in it")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not UTF-8 text: byte 0x{raw[err.start]:02x} at position {err.start} cannot be "
            "decoded; re-save the file as UTF-8"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def load_text(path: str | Path) -> Document:
    """A plain-text file; its title is its first non-empty line."""
    text = read_text_file(path)
    title = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return Document(Path(path).stem, text, str(path), title)


def load_markdown(path: str | Path) -> Document:
    """A Markdown file, kept as written; its title is the first ``# `` heading (or "")."""
    text = read_text_file(path)
    match = re.search(r"^# +(.+?)\s*#*\s*$", text, flags=re.MULTILINE)
    return Document(Path(path).stem, text, str(path), match.group(1).strip() if match else "")


_BLOCK_TAGS = {
    "p",
    "div",
    "section",
    "article",
    "header",
    "footer",
    "main",
    "nav",
    "aside",
    "blockquote",
    "pre",
    "ul",
    "ol",
    "li",
    "dl",
    "dt",
    "dd",
    "table",
    "tr",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "hr",
    "figure",
    "figcaption",
    "body",
    "html",
}
_DROPPED_TAGS = {"script", "style", "template", "noscript"}


class _TextExtractor(html.parser.HTMLParser):
    """Collects visible text as blocks; whitespace collapses outside ``<pre>``."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.current: list[str] = []
        self.dropped = 0  # depth inside script/style
        self.pre = 0  # depth inside <pre>
        self.title = ""
        self.in_title = False
        self.h1 = ""
        self.in_h1 = False

    def flush(self) -> None:
        text = "".join(self.current)
        text = text.strip("\n") if self.pre else " ".join(text.split())
        if text.strip():
            self.blocks.append(text)
        self.current = []

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in _DROPPED_TAGS:
            self.dropped += 1
        elif tag == "title":
            self.in_title = True
        elif tag == "br" and not self.dropped:
            self.current.append("\n" if self.pre else " ")
        elif tag in _BLOCK_TAGS:
            self.flush()
            self.pre += tag == "pre"
            self.in_h1 = self.in_h1 or (tag == "h1" and not self.h1)

    def handle_endtag(self, tag: str) -> None:
        if tag in _DROPPED_TAGS:
            self.dropped = max(0, self.dropped - 1)
        elif tag == "title":
            self.in_title = False
        elif tag in _BLOCK_TAGS:
            self.flush()
            self.pre = max(0, self.pre - (tag == "pre"))
            self.in_h1 = self.in_h1 and tag != "h1"

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title += data
        elif not self.dropped:
            self.current.append(data)
            if self.in_h1:
                self.h1 += data


def html_to_text(markup: str) -> tuple[str, str]:
    """The visible text of an HTML page and its title (``<title>``, else the first ``<h1>``)."""
    parser = _TextExtractor()
    parser.feed(markup)
    parser.close()
    parser.flush()
    title = " ".join(parser.title.split()) or " ".join(parser.h1.split())
    return "\n\n".join(parser.blocks) + ("\n" if parser.blocks else ""), title


def load_html(path: str | Path) -> Document:
    """An HTML file reduced to its visible text, paragraphs and headings separated by blank lines."""
    text, title = html_to_text(read_text_file(path))
    return Document(Path(path).stem, text, str(path), title)


_LOADERS = {"markdown": load_markdown, "text": load_text, "html": load_html}


def load_path(path: str | Path) -> Document | list[Document]:
    """A file by its suffix (``.md``, ``.markdown``, ``.txt``, ``.html``, ``.htm``), or every such
    file in a folder (recursively, sorted by path).

    Returns:
        One ``Document`` for a file; a list of them for a folder.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
        if not files:
            raise ValueError(f"{path} holds no {', '.join(SUFFIXES)} files")
        docs = [load_path(p) for p in files]
        seen: dict[str, str] = {}
        for doc in docs:
            if doc.doc_id in seen:
                raise ValueError(
                    f"two files in {path} share the document id {doc.doc_id!r}: {seen[doc.doc_id]} "
                    f"and {doc.source}; rename one"
                )
            seen[doc.doc_id] = doc.source
        return docs
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ValueError(
            f"cannot load {path.name}: unsupported suffix {path.suffix or '(none)'!r}; supported: {', '.join(SUFFIXES)}"
        )
    return _LOADERS[kind](path)
