"""`infra-lab site`: lessons executed and rendered to an offline static site with live plotly charts."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import NOTEBOOKS, REPO

from course_tools.site.build import build_site, find_lessons, lesson_info
from course_tools.site.formulas import TEX_FALLBACK_CLASS, unconverted_math
from course_tools.site.render import nav_bar, render_page

# The tests share one executed lesson: keep them on one worker so it runs once.
pytestmark = pytest.mark.xdist_group("site")
# Chapter 02 is the quickest lesson to run with QUICK=True (about 10 s).
QUICK_LESSON = "02"
CDN = re.compile(r"cdn\.|cdnjs|jsdelivr|unpkg|googleapis|plot\.ly/", re.I)


def _links(page: str) -> list[str]:
    return re.findall(r"<a href=\"([^\"#]+)\"", page)


def _scripts(page: str) -> list[str]:
    return re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", page)


@pytest.fixture(scope="module")
def quick_site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    lessons, failures = build_site(REPO / "notebooks", out, only={QUICK_LESSON}, progress=False)
    assert not failures, [f.describe() for f in failures]
    return out, lessons[0]


def test_executed_page_has_live_plotly_charts_from_the_local_plotly_js(quick_site):
    out, lesson = quick_site
    page = (out / lesson.page).read_text()
    assert _scripts(page) == ["plotly.min.js"]  # the only script fetched: the site's own copy
    plotly_js = (out / "plotly.min.js").read_text()
    assert len(plotly_js) > 1_000_000 and "plotly.js" in plotly_js[:500]
    assert not CDN.search(page), CDN.search(page)
    source = nbformat.read(lesson.path, as_version=4)
    shows = sum(c.source.count("fig.show()") for c in source.cells if c.cell_type == "code")
    assert page.count("Plotly.newPlot(") >= shows > 0  # every figure the lesson shows, drawn by plotly.js
    assert "H100 SXM roof" in page  # a trace of the roofline figure: its data is in the page
    assert "application/vnd.plotly.v1+json" not in page


def test_executed_page_keeps_answers_outputs_and_controls(quick_site):
    out, lesson = quick_site
    page = (out / lesson.page).read_text()
    source = nbformat.read(lesson.path, as_version=4)
    details = sum(c.source.count("<details>") for c in source.cells if c.cell_type == "markdown")
    assert details > 0 and page.count("<details>") == details and "<summary>Answer</summary>" in page
    text = html.unescape(re.sub(r"<[^>]+>", "", page))  # the code as a reader sees it, without highlighting
    assert "# Parameters\nQUICK = True" in text  # papermill's injected cell: it ran with the quick parameters
    assert 'class="site-widget"' in page and 'class="site-control"' in page  # the calculator's settings
    assert "KV capacity" in page  # ... and what it printed when the page was built
    assert f"<title>{lesson.number} · {lesson.title}</title>" in page


def test_contents_page_links_to_each_built_lesson(quick_site):
    out, lesson = quick_site
    index = (out / "index.html").read_text()
    assert _links(index) == [lesson.page]
    assert all((out / href).is_file() for href in _links(index))
    assert f"{lesson.title}</a>" in index and "Layers L0/L1 (hardware)" in index
    assert "<code>lab02_roofline</code>" in index  # the layer line's markdown, rendered
    assert _links((out / lesson.page).read_text()).count("index.html") == 2  # top and bottom bars


@pytest.fixture(scope="module")
def unexecuted_site(tmp_path_factory):
    """Every lesson rendered as it is in the repository, without running it."""
    out = tmp_path_factory.mktemp("unexecuted-site")
    lessons, failures = build_site(REPO / "notebooks", out, execute=False, progress=False)
    assert not failures
    return out, lessons


def test_contents_list_every_lesson_in_chapter_order_without_executing(unexecuted_site):
    tmp_path, lessons = unexecuted_site
    assert [lesson.path for lesson in lessons] == sorted(NOTEBOOKS, key=lambda p: int(p.name.split("_")[0]))
    index = (tmp_path / "index.html").read_text()
    pages = _links(index)
    assert pages == [p.stem + ".html" for p in sorted(NOTEBOOKS)]
    for i, href in enumerate(pages):
        links = _links((tmp_path / href).read_text())
        assert (tmp_path / href).is_file() and "index.html" in links
        if i > 0:
            assert pages[i - 1] in links, f"{href} should link back to {pages[i - 1]}"
        if i + 1 < len(pages):
            assert pages[i + 1] in links, f"{href} should link on to {pages[i + 1]}"
    numbers = re.findall(r"<span class=\"number\">(\d+)</span>", index)
    assert numbers == [lesson.number for lesson in lessons] == sorted(numbers, key=int)
    for lesson in lessons:
        assert lesson.title and not lesson.title.startswith(lesson.number) and "lesson notebook" in lesson.layer


def _lesson(path: Path, number: str, title: str, *code: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(f"# {number} · {title}\n*Layer L0 · lesson notebook · lab: –*"),
        nbformat.v4.new_code_cell("QUICK = False", metadata={"tags": ["parameters"]}),
        *(nbformat.v4.new_code_cell(c) for c in code),
    ]
    nbformat.write(nb, path / f"{number}_{title.lower()}.ipynb")
    return path / f"{number}_{title.lower()}.ipynb"


def test_a_failing_lesson_is_reported_and_the_others_still_get_pages(tmp_path):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    _lesson(notebooks, "10", "Later", "print('quick' if QUICK else 'slow')")
    _lesson(notebooks, "03", "Broken", "x = 1", "raise ValueError('broken on purpose')", "print('never')")
    out = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "course_tools.cli", "site", "--notebooks", str(notebooks), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(
        r"03_broken\.ipynb failed in cell In \[\d+\] \(`raise ValueError\('broken on purpose'\)`\): "
        r"ValueError: broken on purpose",
        result.stdout,
    ), result.stdout
    assert "10_later" not in result.stdout.split("failed;")[1]
    assert _links((out / "index.html").read_text()) == ["03_broken.html", "10_later.html"]
    assert "broken on purpose" in (out / "03_broken.html").read_text()
    assert "quick" in (out / "10_later.html").read_text()  # ran, with QUICK=True
    assert "this page shows a failed run" in (out / "index.html").read_text()


def test_only_and_bad_lesson_names_are_explained(tmp_path):
    assert [lesson.number for lesson in find_lessons(REPO / "notebooks", {"2", "01"})] == ["01", "02"]
    with pytest.raises(ValueError, match=r"no lesson numbered 99 .*there are .*01, 02"):
        find_lessons(REPO / "notebooks", {"99"})
    (tmp_path / "intro.ipynb").write_text("{}")
    with pytest.raises(ValueError, match="starts with its chapter number"):
        lesson_info(tmp_path / "intro.ipynb")


def test_widgets_become_a_static_picture_of_their_settings_and_output():
    import ipywidgets as widgets
    import plotly.graph_objects as go
    from ipywidgets.embed import embed_data

    from course_tools.site.render import WIDGET_STATE_MIME, WIDGET_VIEW_MIME, static_outputs
    from infra_lib.controls import live, show_in

    control = live(lambda n: print("n squared is", n * n), n=widgets.IntSlider(value=3, description="n"))
    figure = widgets.Output()
    show_in(figure, figure=go.Figure(go.Bar(x=["a", "b"], y=[1, 2], name="bars of the test")))
    bar = widgets.HBox([widgets.HTML("sweep: 100%"), widgets.FloatProgress(value=3, max=3), widgets.HTML("3/3")])
    state = embed_data(views=[control, figure, bar])["manager_state"]
    cell = nbformat.v4.new_code_cell(
        "...",
        outputs=[
            nbformat.v4.new_output(
                "display_data",
                {
                    WIDGET_VIEW_MIME: {"model_id": w.model_id, "version_major": 2, "version_minor": 0},
                    "text/plain": repr(w),
                },
            )
            for w in (control, figure, bar)
        ],
    )
    nb = nbformat.v4.new_notebook(cells=[cell], metadata={"widgets": {WIDGET_STATE_MIME: state}})
    static = static_outputs(nb, "t")
    assert all(WIDGET_VIEW_MIME not in o["data"] for o in static.cells[0].outputs)
    pictures = [o["data"]["text/html"] for o in static.cells[0].outputs]
    assert "n = 3" in pictures[0] and "n squared is 9" in pictures[0] and "An interactive control" in pictures[0]
    assert "Plotly.newPlot(" in pictures[1] and "bars of the test" in pictures[1]
    assert '<progress value="3.0" max="3.0">' in pictures[2] and "An interactive control" not in pictures[2]
    assert "widgets" not in static.metadata and "widgets" in nb.metadata  # the page loads no widget manager


def _markdown_page(*markdown: str) -> str:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(m) for m in markdown])
    return render_page(nb, title="maths", page_id="m", nav=nav_bar(None, None))


def _math_elements(page: str) -> list[str]:
    return re.findall(r"<math\b.*?</math>", page, re.S)


def test_markdown_maths_becomes_mathml_and_other_dollars_stay_text():
    page = _markdown_page(
        "The roofline:\n\n$$\\text{attainable}(I) = \\min(P,\\; I \\cdot W)$$\n\nwith $I = \\frac{F}{B}$ in FLOP/byte.",
        "A GPU costs $2.50/hour; at 1,000 tokens/s that is about $0.69 per million (`echo $HOME`, `x$`).",
        "```bash\nexport PORT=$((BASE + 1)); echo $PORT $$\n```",
        "Unknown to the converter: $$\\undefinedcommand{x}$$",
    )
    maths = _math_elements(page)
    assert len(maths) == 2, f"expected one display and one inline formula, got {maths}"
    display, inline = maths
    assert re.match(r"<math [^>]*display=\"block\"", display) and "<mfrac>" not in display
    assert "<mi>P</mi>" in display and "\\min" not in display and "attainable" in display
    assert re.match(r"<math [^>]*display=\"inline\"", inline) and "<mfrac>" in inline and "\\frac" not in inline
    assert "costs $2.50/hour; at 1,000 tokens/s that is about $0.69 per million" in page  # prices are not maths
    assert "<code>echo $HOME</code>" in page and "<code>x$</code>" in page
    assert "export PORT=$((BASE + 1)); echo $PORT $$" in re.sub(r"<[^>]+>", "", page)  # the code block, as written
    fallback = re.search(rf"<code class=\"{TEX_FALLBACK_CLASS}\" title=\"([^\"]*)\">(.*?)</code>", page)
    assert fallback and fallback.group(2) == "$$\\undefinedcommand{x}$$", "TeX that cannot convert stays, as code"
    assert "\\undefinedcommand" in fallback.group(1)  # the tooltip says what the converter did not know
    assert not _scripts(page)[1:] and "mathjax" not in page.lower()  # no script draws the maths


def test_every_lesson_formula_renders_as_mathml_and_no_raw_tex_remains(unexecuted_site):
    out, lessons = unexecuted_site
    converted, left = unconverted_math(NOTEBOOKS)
    assert not left, f"formulas latex2mathml cannot convert (run python -m course_tools.site.formulas): {left}"
    with_formulas = {}
    for lesson in lessons:
        cells = nbformat.read(lesson.path, as_version=4).cells
        source = "\n".join(c.source for c in cells if c.cell_type == "markdown")
        if "$$" in source:
            with_formulas[lesson.number] = source.count("$$") // 2
    assert {"01", "02", "03", "06", "11"} <= with_formulas.keys()
    for lesson in lessons:
        cells = (out / lesson.page).read_text().split('class="jp-Cell ')[1:]
        markdown = "".join(c for c in cells if c.startswith("jp-MarkdownCell"))
        assert "$$" not in markdown, f"{lesson.page} still shows raw TeX"
        assert f'class="{TEX_FALLBACK_CLASS}"' not in markdown, f"{lesson.page} has a formula left as TeX"
        blocks = [m for m in _math_elements(markdown) if 'display="block"' in m.split(">", 1)[0]]
        assert len(blocks) == with_formulas.get(lesson.number, 0), f"{lesson.page}: one <math> per display formula"
    assert converted >= sum(with_formulas.values())
    chapter11 = (out / next(lesson.page for lesson in lessons if lesson.number == "11")).read_text()
    assert "A GPU costs $2 per hour" in chapter11 and "about $0.56 (<code>cost_per_million_tokens" in chapter11
