"""The course as a static web site: every lesson executed (QUICK) and rendered to HTML.

``infra-lab site`` runs each lesson notebook in ``notebooks/`` in a fresh kernel with
``QUICK=True`` (papermill, in a scratch folder, so nothing lands in the course folder),
renders it with ``course_tools.site.render`` and writes ``site/index.html``: the chapters in
order, each with its title and layer line. One lesson failing does not stop the others:
its page shows the error, and the build reports which notebook and which cell failed.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat

from grading.run.warm import run_lesson
from course_tools.site.render import PLOTLY_JS, nav_bar, render_page

CELL_TIMEOUT_S = 900


@dataclass(frozen=True)
class Lesson:
    """A lesson notebook and what the contents page shows of it."""

    path: Path
    number: str  # "02", from the file name
    title: str  # the first heading, without "#" and without the leading "02 ·"
    layer: str  # the italic line under the title, e.g. "Layers L0/L1 (hardware) · lesson notebook · lab: `lab02_roofline`"

    @property
    def page(self) -> str:
        return f"{self.path.stem}.html"

    @property
    def label(self) -> str:
        return f"{self.number} · {self.title}"


@dataclass(frozen=True)
class Failure:
    """A lesson that raised while it ran: where and what."""

    lesson: Lesson
    cell: str  # "In [7]", or "" when the kernel never got to a cell
    source: str  # the failing cell's first line
    error: str  # "ValueError: ..."

    def describe(self) -> str:
        where = f" in cell {self.cell} (`{self.source}`)" if self.cell else ""
        return f"{self.lesson.path.name} failed{where}: {self.error}"


def lesson_info(path: str | Path) -> Lesson:
    """Number, title and layer line of a lesson notebook, read from its first markdown cell."""
    path = Path(path)
    number = path.stem.split("_", 1)[0]
    if not number.isdigit():
        raise ValueError(f"a lesson's file name starts with its chapter number (NN_topic.ipynb), got {path.name}")
    nb = nbformat.read(path, as_version=4)
    text = next((c.source for c in nb.cells if c.cell_type == "markdown"), "")
    heading = next((line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")), path.stem)
    title = re.sub(rf"^{number}\s*[·:.-]\s*", "", heading)
    layer = next((line.strip().strip("*").strip() for line in text.splitlines()
                  if line.strip().startswith("*") and "lesson notebook" in line), "")
    return Lesson(path, number, title, layer)


def find_lessons(folder: str | Path, only: set[str] | None = None) -> list[Lesson]:
    """The lesson notebooks ``NN_*.ipynb`` in ``folder``, in chapter order.

    Args:
        folder: the lessons folder (``notebooks/``).
        only: chapter numbers to keep ("00", "12"; "2" means "02"); None keeps all.

    Raises:
        ValueError: ``only`` names a chapter that has no notebook.
    """
    lessons = sorted((lesson_info(p) for p in Path(folder).glob("[0-9]*_*.ipynb")), key=lambda l: (int(l.number), l.path.name))
    if only is None:
        return lessons
    wanted = {n.strip().zfill(2) for n in only if n.strip()}
    missing = wanted - {l.number for l in lessons}
    if missing:
        raise ValueError(f"no lesson numbered {', '.join(sorted(missing))} in {folder} "
                         f"(there are {', '.join(l.number for l in lessons) or 'none'})")
    return [l for l in lessons if l.number in wanted]


def execute_lesson(lesson: Lesson, out: Path, *, progress: bool = True) -> Failure | None:
    """Run a lesson with QUICK=True in a scratch folder; the executed notebook goes to ``out``.

    Returns:
        None when every cell ran, else where it failed (``out`` then holds the run so far).
    """
    from papermill.exceptions import PapermillExecutionError

    bar = {"desc": lesson.path.stem, "leave": True, "file": sys.stderr} if progress else False
    with tempfile.TemporaryDirectory(prefix=f"site-{lesson.number}-") as scratch:
        try:
            run_lesson(lesson.path, out, parameters={"QUICK": True}, kernel_name="python3",
                                       cwd=scratch, progress_bar=bar, execution_timeout=CELL_TIMEOUT_S)
        except PapermillExecutionError as exc:
            first = next((line for line in str(exc.source).splitlines() if line.strip()), "")
            return Failure(lesson, f"In [{exc.exec_count}]", first[:80], f"{exc.ename}: {str(exc.evalue)[:300]}")
        except Exception as exc:  # the kernel died, would not start, timed out...
            return Failure(lesson, "", "", f"{type(exc).__name__}: {str(exc)[:300]}")
    return None


def index_page(lessons: list[Lesson], failures: dict[str, Failure], plotly_js: str = PLOTLY_JS) -> str:
    """The contents page: one entry per lesson, in the order given, linking to its page."""
    import html

    import mistune

    inline = mistune.create_markdown(escape=True)
    items = []
    for lesson in lessons:
        layer = inline(lesson.layer).strip().removeprefix("<p>").removesuffix("</p>") if lesson.layer else ""
        broken = failures.get(lesson.number)
        note = f"<div class=\"failed\">this page shows a failed run: {html.escape(broken.describe())}</div>" if broken else ""
        items.append(f"<li><a href=\"{html.escape(lesson.page)}\"><span class=\"number\">{lesson.number}</span> "
                     f"{html.escape(lesson.title)}</a><div class=\"layer\">{layer}</div>{note}</li>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1.0\">"
            "<title>AI infrastructure, from silicon to agents: contents</title><style>"
            "body{font-family:sans-serif;max-width:52em;margin:2em auto;padding:0 1em;line-height:1.4}"
            "ol{list-style:none;padding:0}li{margin:0 0 1em}li a{font-size:1.15em;text-decoration:none}"
            ".number{display:inline-block;min-width:2em;font-weight:bold}.layer{color:#555;margin-left:2.3em}"
            ".failed{color:#b71c1c;margin-left:2.3em}</style></head>\n<body>\n"
            "<h1>AI infrastructure, from silicon to agents</h1>\n"
            "<p>One lesson per chapter, each run top to bottom on the machine that built this site "
            "(with small sizes: <code>QUICK=True</code>). Charts are live: hover and zoom them. Controls "
            "show the setting they were built with; open the notebook in JupyterLab to move them.</p>\n"
            f"<ol class=\"contents\">\n{chr(10).join(items)}\n</ol>\n</body></html>\n")


def copy_plotly_js(out_dir: Path) -> Path:
    """The installed plotly package's plotly.js, copied into the site once."""
    from plotly.offline import get_plotlyjs

    target = out_dir / PLOTLY_JS
    text = get_plotlyjs()
    if not target.is_file() or target.stat().st_size != len(text.encode("utf-8")):
        target.write_text(text, encoding="utf-8")
    return target


def build_site(notebooks: str | Path, out_dir: str | Path, *, only: set[str] | None = None, execute: bool = True,
               progress: bool = True) -> tuple[list[Lesson], list[Failure]]:
    """Execute (unless ``execute`` is False) and render every lesson; write the contents page.

    Args:
        notebooks: the lessons folder.
        out_dir: the site folder (created; pages already there for other lessons are kept).
        only: chapter numbers to build (see ``find_lessons``); the contents lists only them.
        execute: run each lesson with QUICK=True first; False renders the notebooks as they are.
        progress: show a progress bar per lesson (on stderr).

    Returns:
        The lessons built, in order, and the failures (empty when every lesson ran).
    """
    out_dir = Path(out_dir)
    lessons = find_lessons(notebooks, only)
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_plotly_js(out_dir)
    failures: dict[str, Failure] = {}
    with tempfile.TemporaryDirectory(prefix="site-") as work:
        for i, lesson in enumerate(lessons):
            path = lesson.path
            if execute:
                path = Path(work) / lesson.path.name
                failure = execute_lesson(lesson, path, progress=progress)
                if failure is not None:
                    failures[lesson.number] = failure
                    print(f"FAILED: {failure.describe()}", file=sys.stderr, flush=True)
                if not path.is_file():  # nothing ran: show the notebook as it is
                    shutil.copy(lesson.path, path)
            previous = (lessons[i - 1].page, lessons[i - 1].label) if i > 0 else None
            following = (lessons[i + 1].page, lessons[i + 1].label) if i + 1 < len(lessons) else None
            page = render_page(nbformat.read(path, as_version=4), title=lesson.label, page_id=f"ch{lesson.number}",
                               nav=nav_bar(previous, following))
            (out_dir / lesson.page).write_text(page, encoding="utf-8")
    (out_dir / "index.html").write_text(index_page(lessons, failures), encoding="utf-8")
    return lessons, list(failures.values())
