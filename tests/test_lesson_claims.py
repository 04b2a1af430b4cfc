"""What the lessons say about the course and the field, held to the course itself: where a chapter
sits in the order, what the course builds, which layer a component belongs to, what a port to
another chip does to each layer, and the versions the state-of-the-art table names."""

from __future__ import annotations

import ast
import re

import nbformat
from conftest import REPO

from infra_lib.portability import census, device_specific_fraction


def lesson_text(chapter: str, cell_type: str = "markdown") -> str:
    """All cells of one kind of the lesson numbered ``chapter``, whitespace folded to single spaces."""
    path = next((REPO / "notebooks").glob(f"{chapter}_*.ipynb"))
    cells = nbformat.read(path, as_version=4).cells
    return re.sub(r"\s+", " ", "\n".join(c.source for c in cells if c.cell_type == cell_type))


def assigned_literal(chapter: str, name: str):
    """The literal value a code cell of the lesson assigns to ``name`` (one assignment expected)."""
    path = next((REPO / "notebooks").glob(f"{chapter}_*.ipynb"))
    values = [
        ast.literal_eval(node.value)
        for cell in nbformat.read(path, as_version=4).cells
        if cell.cell_type == "code"
        for node in ast.parse(cell.source).body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)
    ]
    assert len(values) == 1, f"chapter {chapter} should assign {name} once, found {len(values)}"
    return values[0]


def test_chapter_14_is_not_the_last_chapter_and_points_at_the_next():
    text = lesson_text("14")
    later = sorted(p.name[:2] for p in (REPO / "notebooks").glob("1[5-9]_*.ipynb"))
    assert later, "the test expects chapters after 14"
    assert "last chapter" not in text.lower(), (
        "chapter 14 calls itself the last chapter; chapters " + ", ".join(later) + " follow"
    )
    assert "## What's next: chapter 15" in text


def test_chapter_00_state_of_the_art_names_current_versions():
    text = lesson_text("00")
    for version in (
        "CUDA 13.3",
        "PyTorch 2.13",
        "the v0.25 line; the V0 engine has been removed",
        "fourth-generation NVSwitch",
    ):
        assert version in text, version
    assert not re.search(r"CUDA 13 \(", text), "CUDA 13 without its minor version"
    pinned = re.search(r'"torch==(\d+\.\d+)', (REPO / "pyproject.toml").read_text()).group(1)
    assert f"PyTorch {pinned} (the version this course pins)" in text, pinned


def test_chapter_00_does_not_list_what_chapter_11_builds_as_not_built():
    """Chapter 11 section 7 builds a model registry, an evaluation gate, a canary and a rollback."""
    section = re.search(r"## 7 · LLMOps: ([^#]*?)(?= The lesson's L5)", lesson_text("11")).group(1)
    built = ("registry", "evaluation gate", "canary", "rollback")
    assert all(part in section for part in built), section
    not_built = assigned_literal("00", "NOT_BUILT")["L5"]
    assert "the model registry and CI/CD (" not in not_built
    assert all(part in not_built for part in built), f"the figure's note should say chapter 11 builds {built}"
    row = lesson_text("00").split("| L5 MLOps/LLMOps |")[1].split("| L6 ")[0]
    assert all(part in row.split("|")[2] for part in built), f"the table's chapters column: {row.split('|')[2]}"
    assert "the model registry and CI/CD for models" not in row


def test_chapter_00_puts_a_gateway_in_front_of_the_engine_at_l5a():
    text = lesson_text("00")
    runtime = assigned_literal("00", "RUNTIME")
    assert "load balancing" in next(what for layer, _, what, _ in runtime if layer == "L5a")
    sentences = [s for s in re.split(r"(?<=[.?!]) ", text) if "gateway" in s]
    assert sentences and all("L5a" in s for s in sentences), sentences
    assert "(L6, L7), did a gateway" not in text


def test_a_port_adapts_the_serving_kernels_in_chapters_00_and_14():
    """Serving kernels (chapter 15's paged decode and 4-bit GEMV) are device code: a plugin supplies
    them, or they are rewritten; the L0.1 lesson marks the framework layer 'adapt'."""
    text = lesson_text("14")
    assert "| L5b algorithm-specific serving |" in text, "chapter 14's port table needs a row of its own for L5b"
    table = text.split("| L5b algorithm-specific serving |")[1].split("| L6")[0]
    assert "**adapted**" in table and "carries over;" not in table.split("|")[3], table
    for name in ("vLLM-Ascend", "MindIE", "paged decode", "GEMV", "kernels/paged_decode.py", "kernels/gemv_q4.py"):
        assert name in table, name
    assert "the same (vLLM through its hardware plugin for Ascend) | carries over" not in text
    answer = lesson_text("00").split("**4.** You are asked to move this service")[1].split("</details>")[0]
    assert "L5 to L8" not in answer and "L5b is adapted" in answer, answer
    for name in ("vLLM-Ascend", "MindIE", "paged decode", "4-bit GEMV"):
        assert name in answer, name
    paged, gemv = (next(m for m in census() if m.path == f"kernels/{name}.py") for name in ("paged_decode", "gemv_q4"))
    assert paged.category == gemv.category == "kernel", "the serving kernels the text names are kernel modules"


def test_chapter_14_readings_of_the_census_hold_on_this_code():
    """The readings chapter 14 states in prose; its cell prints a warning when one stops holding."""
    modules = census()
    by_path = {m.path: m for m in modules}
    assert all(m.package == "kernels" for m in modules if m.category == "kernel")
    assert all(m.package in ("training", "serving") for m in modules if m.category == "collective")
    assert by_path["backends.py"].category == "device" and not by_path["device.py"].device_specific
    assert 0.2 <= device_specific_fraction(modules) <= 1 / 3
    text = lesson_text("14")
    assert "about a quarter of `infra_lib`'s lines" in text
    assert "less than a fifth" not in text and "about a fifth" not in text
    assert "The device layer is one module" not in text


def test_chapter_16_checks_or_dates_what_it_says_of_the_instructors_speed():
    """Section 4's claim that the instructor's answers clear half the course's speed is checked by
    section 3's cell on every run, and the one figure it quotes names its run."""
    text, code = lesson_text("16"), lesson_text("16", "code")
    assert "about 15%" not in text and "0.85" not in text and "15% slower" not in text
    assert "the cell under it checks that it clears half" in text and "in the full run of 2026-12-06 on 2 cores" in text
    assert "step_ratio >= 0.5" in code and "section 4 says they clear" in code
