"""One executed lesson notebook as a static HTML page that works offline.

nbconvert's lab template renders the notebook; three things change on the way:

- plotly outputs (``application/vnd.plotly.v1+json``, which nbconvert cannot show) become a
  ``<div>`` drawn by the site's own copy of plotly.js, so the charts stay interactive;
- ipywidgets outputs become a static picture of the control (its settings and what it showed
  when the page was built): a live control needs a kernel, and its JavaScript a CDN;
- TeX in markdown cells becomes MathML (``course_tools.site.formulas``), which the browser draws itself;
- every script the template would fetch from a CDN (require.js, MathJax, mermaid, the widget
  manager) is left out, and a bar links each page to the contents and to its neighbours.
"""

from __future__ import annotations

import copy
import html

import jinja2
import nbformat
from nbconvert import HTMLExporter

from course_tools.site.formulas import TEX_FALLBACK_CLASS, MathMLRenderer, markdown_to_html

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
PLOTLY_JS = "plotly.min.js"

_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}<script src="{{ resources.site.plotly_js }}" charset="utf-8"></script>{%- endblock -%}
{%- block jupyter_widgets -%}{%- endblock -%}
{%- block html_head_js_mathjax -%}{%- endblock -%}
{%- block html_head_js_mermaidjs -%}{%- endblock -%}
{%- block extra_css -%}<style>
.site-nav{display:flex;justify-content:space-between;gap:1em;padding:.6em 1em;margin:0 0 1em;
  border-bottom:1px solid #ddd;font-family:sans-serif;font-size:14px}
.site-nav a{text-decoration:none}
.site-widget{border:1px dashed #bbb;border-radius:4px;padding:.5em;margin:.3em 0}
.site-widget-note{color:#666;font-size:12px;margin:0 0 .4em}
.site-control{display:inline-block;margin:0 1em .3em 0;font-family:monospace}
math[display="block"]{margin:.8em 0;font-size:1.15em}
.{{ resources.site.tex_fallback_class }}{color:#b71c1c}
</style>{%- endblock -%}
{%- block body_header -%}{{ super() }}{{ resources.site.nav }}{%- endblock -%}
{%- block body_footer -%}{{ resources.site.nav }}{{ super() }}{%- endblock -%}
"""


def plotly_html(figure: dict, div_id: str) -> str:
    """A plotly figure (the JSON of its mimetype) as a div and the script that draws it.

    The page must load plotly.js itself (``<script src=...plotly.min.js>``); nothing here
    fetches anything.
    """
    import plotly.io as pio

    config = figure.get("config") or {}
    body = {k: v for k, v in figure.items() if k != "config"}
    return pio.to_html(body, config=config, include_plotlyjs=False, full_html=False, div_id=div_id,
                       validate=False, default_width="100%")


def _control_value(state: dict) -> str:
    labels = state.get("_options_labels")
    index = state.get("index")
    if labels and isinstance(index, int) and 0 <= index < len(labels):
        return str(labels[index])
    if labels and isinstance(index, (list, tuple)):
        return ", ".join(str(labels[i]) for i in index if isinstance(i, int) and 0 <= i < len(labels))
    return str(state.get("value", ""))


class _WidgetPicture:
    """Static HTML for a widget view, from the widget state papermill saved in the notebook."""

    def __init__(self, state: dict, page_id: str):
        self.state = state
        self.page_id = page_id
        self.figures = 0
        self.controls = 0  # controls a reader would want to move (sliders, menus, buttons...)

    def render(self, model_id: str, depth: int = 0) -> str:
        model = self.state.get(model_id, {})
        state = model.get("state", {})
        name = model.get("model_name") or state.get("_model_name", "")
        if depth > 20 or not model:
            return ""
        if "children" in state:
            inner = "".join(self.render(str(child).replace("IPY_MODEL_", ""), depth + 1) for child in state["children"])
            row = "display:flex;gap:.5em;align-items:center" if name == "HBoxModel" else ""
            return f"<div style=\"{row}\">{inner}</div>"
        if name == "OutputModel":
            return "".join(self.output(o) for o in state.get("outputs", []))
        if name in ("HTMLModel", "HTMLMathModel"):
            return f"<div>{state.get('value', '')}</div>"
        if name == "LabelModel":
            return f"<div>{html.escape(str(state.get('value', '')))}</div>"
        if name in ("FloatProgressModel", "IntProgressModel"):  # e.g. a tqdm bar
            return f"<progress value=\"{state.get('value', 0)}\" max=\"{state.get('max', 100)}\"></progress>"
        if name == "ButtonModel":
            self.controls += 1
            return f"<button disabled>{html.escape(str(state.get('description', '')))}</button>"
        if "value" in state or "index" in state:
            self.controls += 1
            label = html.escape(str(state.get("description", "")))
            return f"<span class=\"site-control\">{label} = {html.escape(_control_value(state))}</span>"
        return ""

    def output(self, out: dict) -> str:
        if out.get("output_type") == "stream":
            return f"<pre>{html.escape(str(out.get('text', '')))}</pre>"
        data = out.get("data", {})
        if PLOTLY_MIME in data:
            self.figures += 1
            return plotly_html(data[PLOTLY_MIME], f"{self.page_id}-widget-figure-{self.figures}")
        if "text/html" in data:
            return "".join(data["text/html"]) if isinstance(data["text/html"], list) else str(data["text/html"])
        if "image/png" in data:
            return f"<img src=\"data:image/png;base64,{data['image/png']}\">"
        if "text/plain" in data:
            text = data["text/plain"]
            return f"<pre>{html.escape(''.join(text) if isinstance(text, list) else str(text))}</pre>"
        return ""


def static_outputs(nb: nbformat.NotebookNode, page_id: str) -> nbformat.NotebookNode:
    """A copy of ``nb`` whose plotly and widget outputs are plain HTML, and without widget state."""
    nb = copy.deepcopy(nb)
    widget_state = nb.metadata.pop("widgets", {}).get(WIDGET_STATE_MIME, {}).get("state", {})
    pictures = _WidgetPicture(widget_state, page_id)
    figures = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data")
            if not data:
                continue
            if PLOTLY_MIME in data:
                figures += 1
                data["text/html"] = plotly_html(data.pop(PLOTLY_MIME), f"{page_id}-figure-{figures}")
            if WIDGET_VIEW_MIME in data:
                view = data.pop(WIDGET_VIEW_MIME)
                controls = pictures.controls
                inner = pictures.render(str(view.get("model_id", "")))
                note = ("<p class=\"site-widget-note\">An interactive control: open the notebook in JupyterLab to "
                        "use it. What it showed when this page was built:</p>") if pictures.controls > controls else ""
                data["text/html"] = f"<div class=\"site-widget\">{note}{inner}</div>"
    return nb


class _SiteExporter(HTMLExporter):
    """nbconvert's HTML exporter, with markdown maths drawn as MathML when the page is built.

    The lab template passes every code cell's highlighted source through ``clean_html`` (bleach),
    whatever ``sanitize_html`` says: nearly a third of the site's build time, spent on Pygments'
    already escaped output of the course's own code. Skipping it leaves every page byte for byte
    the same (measured on all the lessons) and saves that time.
    """

    def default_filters(self):
        for name, function in super().default_filters():
            yield name, (_unchanged if name == "clean_html" else function)

    @jinja2.pass_context
    def markdown2html(self, context, source: str) -> str:
        renderer = MathMLRenderer(
            escape=False, attachments=context.get("cell", {}).get("attachments", {}), embed_images=self.embed_images,
            path=context.get("resources", {}).get("metadata", {}).get("path", ""),
            anchor_link_text=self.anchor_link_text, exclude_anchor_links=self.exclude_anchor_links,
            **self.lexer_options)
        body = markdown_to_html(source, renderer)
        for tex in renderer.unconverted:
            self.log.warning("this formula stays TeX on the page (latex2mathml cannot convert it): %s", tex)
        return body


def _unchanged(html_text: str) -> str:
    return html_text


def nav_bar(previous: tuple[str, str] | None, following: tuple[str, str] | None, index: str = "index.html") -> str:
    """Links to the previous page, the contents and the next page; each given as (href, label)."""
    def link(item, arrow_left: bool) -> str:
        if item is None:
            return "<span></span>"
        href, label = item
        text = f"&larr; {html.escape(label)}" if arrow_left else f"{html.escape(label)} &rarr;"
        return f"<a href=\"{html.escape(href)}\">{text}</a>"
    return (f"<nav class=\"site-nav\">{link(previous, True)}<a href=\"{index}\">contents</a>"
            f"{link(following, False)}</nav>")


def render_page(nb: nbformat.NotebookNode, *, title: str, page_id: str, nav: str,
                plotly_js: str = PLOTLY_JS) -> str:
    """The HTML page of one (executed or not) notebook.

    Args:
        nb: the notebook.
        title: the page's ``<title>``.
        page_id: a prefix that makes the page's figure ids unique, e.g. "02".
        nav: the navigation bar's HTML (``nav_bar``), put at the top and the bottom.
        plotly_js: the relative URL of the site's plotly.js.
    """
    exporter = _SiteExporter(template_name="lab", extra_loaders=[jinja2.DictLoader({"site.html.j2": _TEMPLATE})])
    exporter.template_file = "site.html.j2"
    static = static_outputs(nb, page_id)
    static.metadata["title"] = title
    site = {"plotly_js": plotly_js, "nav": nav, "tex_fallback_class": TEX_FALLBACK_CLASS}
    body, _ = exporter.from_notebook_node(static, resources={"site": site})
    return body

