"""The line under a visible check's ✓: one per visible check, true to the cell's hidden checks."""

from __future__ import annotations

import pytest
from conftest import REPO, SOLUTIONS, answer_cells

from grading import check
from grading.check import RECORD_ENV, SEED_ENV
from grading.notebook import read_notebook
from grading.notebook import test_cells as solution_test_cells
from grading.registry import get_check
from grading.still_checked import ALSO_CHECKS, NOTHING_HIDDEN, STILL_CHECKED


def _cells() -> list[tuple[str, list[str], list[str]]]:
    """(notebook, visible check ids, hidden check ids) of every test cell of every solution notebook."""
    cells = []
    for path in SOLUTIONS:
        for cell in solution_test_cells(read_notebook(path)):
            cells.append(
                (
                    path.stem,
                    [c.check_id for c in cell.checks if not c.hidden],
                    [c.check_id for c in cell.checks if c.hidden],
                )
            )
    return cells


def _visible_without_hidden() -> list[str]:
    return [check_id for _, visible, hidden in _cells() if not hidden for check_id in visible]


def test_every_visible_check_has_a_line_and_nothing_else_does():
    visible = {check_id for _, ids, _ in _cells() for check_id in ids}
    assert visible, "no visible checks found in solutions/"
    missing = sorted(visible - set(STILL_CHECKED))
    extra = sorted(set(STILL_CHECKED) - visible)
    assert not missing, f"visible checks with no line in grading/still_checked.py: {missing}"
    assert not extra, f"grading/still_checked.py has lines for ids that are no visible check: {extra}"


def test_a_line_says_what_hidden_checks_add_or_that_there_are_none():
    for notebook, visible, hidden in _cells():
        for check_id in visible:
            line = STILL_CHECKED[check_id]
            if hidden:
                assert line.startswith(ALSO_CHECKS) and len(line) > len(ALSO_CHECKS) + 10, (
                    f"{notebook}: {check_id}'s cell has hidden checks {hidden}: its line must say what they add"
                )
            else:
                assert line == NOTHING_HIDDEN, f"{notebook}: {check_id}'s cell has no hidden checks: say so"


@pytest.mark.parametrize("check_id", _visible_without_hidden())
def test_a_check_without_hidden_ones_is_rerun_on_new_inputs(check_id):
    """NOTHING_HIDDEN promises new random inputs under the grader's seed: the inputs depend on the seed."""
    registered = get_check(check_id)
    assert registered.inputs(0) != registered.inputs(1), f"{check_id}'s inputs do not change with the seed"


def _lab02_answers() -> dict:
    namespace: dict = {}
    for source in answer_cells(REPO / "solutions" / "lab02_roofline" / "lab02_roofline.ipynb").values():
        exec(source, namespace)  # noqa: S102 (the course's own solution cells)
    return namespace


def test_a_passing_check_prints_what_the_grader_still_checks(capsys, monkeypatch):
    monkeypatch.delenv(RECORD_ENV, raising=False)
    check("lab02.kv_bytes_per_token", _lab02_answers()["kv_bytes_per_token"])
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["\N{CHECK MARK} lab02.kv_bytes_per_token passed", "  " + STILL_CHECKED["lab02.kv_bytes_per_token"]]
    assert "grouped-query" in lines[1]


def test_a_hidden_check_prints_no_extra_line(capsys, monkeypatch):
    monkeypatch.delenv(RECORD_ENV, raising=False)
    check("lab02.kv_bytes_per_token_gqa_fp8", _lab02_answers()["kv_bytes_per_token"])
    assert capsys.readouterr().out == "\N{CHECK MARK} lab02.kv_bytes_per_token_gqa_fp8 passed\n"


def test_under_the_grader_nothing_is_added(capsys, monkeypatch, tmp_path):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "7")
    check("lab02.kv_bytes_per_token", _lab02_answers()["kv_bytes_per_token"])
    recorded = "lab02.kv_bytes_per_token: answer recorded; the grader compares it with the reference\n"
    assert capsys.readouterr().out == recorded
    assert record.read_text().count("\n") == 1
