"""TeX in lesson markdown as MathML, converted when the site is built.

Chromium, Firefox and Safari draw MathML themselves, so a page needs no script (and no CDN) to
show a formula. ``$$...$$``, ``\\[...\\]`` and ``\\begin{env}...\\end{env}`` become
``<math display="block">``; ``$...$`` and ``\\(...\\)`` become inline ``<math>``. TeX that
latex2mathml cannot convert stays on the page as ``<code class="site-math-tex">$$...$$</code>``
(``$...$`` when inline), and is reported.

A dollar sign only opens inline maths when a non-space follows it, and only closes it when a
non-space precedes it and no digit follows it, so "$2 per hour, about $0.56" stays text; inline
maths never spans a backtick, so code spans keep their dollars (code blocks never hold maths).

Check every lesson: ``python -m course_tools.site.formulas notebooks``.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from xml.etree import ElementTree

import nbformat
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath, MathInlineParser

TEX_FALLBACK_CLASS = "site-math-tex"
# latex2mathml writes symbols as character references in the element text ("&#x0003D;");
# serialising escapes their "&", which this puts back.
_ESCAPED_REFERENCE = re.compile(r"&amp;(#x[0-9A-Fa-f]+;)")
_TEX_COMMAND = re.compile(r"\\[A-Za-z]+")


def tex_to_mathml(tex: str, *, display: bool) -> str:
    """One formula as a ``<math>`` element.

    Args:
        tex: the formula, without its delimiters.
        display: True for a display formula (``display="block"``), False for inline.

    Raises:
        ValueError: latex2mathml cannot parse ``tex``, or leaves a command it does not know.
    """
    from latex2mathml.converter import convert_to_element

    try:
        element = convert_to_element(tex.strip(), display="block" if display else "inline")
    except Exception as exc:  # latex2mathml raises its own errors, and IndexError/StopIteration on bad input
        raise ValueError(f"latex2mathml cannot parse `{tex.strip()}`: {type(exc).__name__} {exc}".rstrip()) from exc
    unknown = sorted(set(_TEX_COMMAND.findall("".join(element.itertext()))))
    if unknown:
        raise ValueError(f"latex2mathml does not know {', '.join(unknown)} in `{tex.strip()}`")
    return _ESCAPED_REFERENCE.sub(r"&\1", ElementTree.tostring(element, encoding="unicode"))


class MathMLRenderer(IPythonRenderer):
    """nbconvert's markdown renderer, drawing maths as MathML instead of leaving TeX for MathJax.

    ``unconverted`` lists the formulas (with their delimiters) left as TeX, for the caller to report.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.converted = 0
        self.unconverted: list[str] = []

    def _math(self, tex: str, *, display: bool, opening: str, closing: str) -> str:
        try:
            mathml = tex_to_mathml(tex, display=display)
        except ValueError as exc:
            source = f"{opening}{tex}{closing}"
            self.unconverted.append(source)
            return (f"<code class=\"{TEX_FALLBACK_CLASS}\" title=\"{html.escape(str(exc))}\">"
                    f"{html.escape(source, quote=False)}</code>")
        self.converted += 1
        return mathml

    def block_math(self, body: str) -> str:
        return self._math(body, display=True, opening="$$", closing="$$")

    def inline_math(self, body: str) -> str:
        return self._math(body, display=False, opening="$", closing="$")

    def latex_environment(self, name: str, body: str) -> str:
        return self._math(f"\\begin{{{name}}}{body}\\end{{{name}}}", display=True, opening="", closing="")


class DollarAwareInlineParser(MathInlineParser):
    """nbconvert's maths parser, with a stricter rule for where ``$...$`` starts and ends."""

    INLINE_MATH_TEX = r"(?<![$\\])\$(?![\s$])(?P<math_inline_tex>(?:\\.|[^$\\`])+?)(?<![\s\\])\$(?!\d)"
    SPECIFICATION = {**MathInlineParser.SPECIFICATION, "inline_math_tex": INLINE_MATH_TEX}


def markdown_to_html(source: str, renderer: MathMLRenderer) -> str:
    """A markdown cell's HTML, its maths drawn by ``renderer``."""
    return MarkdownWithMath(renderer=renderer, inline=DollarAwareInlineParser(hard_wrap=False)).render(source)


def unconverted_math(notebooks: list[Path]) -> tuple[int, list[str]]:
    """Render the maths of every markdown cell of ``notebooks``.

    Returns:
        How many formulas became MathML, and each one left as TeX as "NAME cell N: TEX".
    """
    converted, left = 0, []
    for path in notebooks:
        for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type != "markdown":
                continue
            renderer = MathMLRenderer(escape=False)
            markdown_to_html(cell.source, renderer)
            converted += renderer.converted
            left += [f"{path.name} cell {index}: {tex}" for tex in renderer.unconverted]
    return converted, left


def main(argv: list[str] | None = None) -> int:
    """``python -m course_tools.site.formulas [FOLDER]``: exit 1 if any formula of the lessons in FOLDER stays TeX."""
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0] if args else "notebooks")
    notebooks = sorted(folder.glob("*.ipynb"))
    converted, left = unconverted_math(notebooks)
    for line in left:
        print(f"left as TeX: {line}")
    print(f"{converted} formulas in {len(notebooks)} notebooks became MathML; {len(left)} stayed TeX")
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
