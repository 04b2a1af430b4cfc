"""Running a class with the course's grader: a scores.csv an instructor can act on, a gradebook
across labs with a Canvas export, reproducible seeds, kept history, and lab updates mid-course
that re-grade as described instead of silently."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import nbformat
from conftest import LAB01, REPO, SOLUTION01, answer_cells, write_learner_notebook

from course_tools.gradebook import build_gradebook
from grading.batch import grade_batch
from grading.lab_version import lab_files, lab_version, lab_version_parts
from grading.run.sandbox import Limits

LIMITS = Limits(check_timeout=30, cell_timeout=60, budget=300, max_processes=16)


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_scores_csv_and_gradebook_for_a_class_of_two_labs(tmp_path):
    """Statuses an instructor can act on (graded or flagged, unreadable with its reason once, not
    submitted from the roster), the seed and real time kept on cached rows, a seed that re-grades
    and reproduces, and a gradebook of two labs with a Canvas export."""
    answers = answer_cells(SOLUTION01)
    submitted = tmp_path / "submitted"
    write_learner_notebook(submitted / "alice" / "lab01_gemm" / "lab01_gemm.ipynb", answers)
    (submitted / "bob").mkdir(parents=True)
    (submitted / "bob" / "lab01_gemm.ipynb").write_text('{"cells": [', encoding="utf-8")
    (submitted / "dan").mkdir()  # a folder, no notebook
    grades = tmp_path / "grades"
    roster = ["alice", "bob", "carol", "dan"]
    rows = grade_batch(
        submitted,
        "lab01_gemm",
        grades / "lab01_gemm",
        source_dir=REPO / "solutions",
        limits=LIMITS,
        workers=2,
        progress=False,
        roster=roster,
    )
    status = {r.learner: r.status for r in rows}
    assert [r.learner for r in rows] == roster
    assert status == {"alice": "flagged", "bob": "unreadable", "carol": "not submitted", "dan": "not submitted"}
    table = {row["learner"]: row for row in _csv(grades / "lab01_gemm" / "scores.csv")}
    assert table["alice"]["score"] == "10" and table["alice"]["cached"] == "no" and table["alice"]["seed"]
    assert table["alice"]["course_version"] and table["alice"]["graded_at"]
    assert "not valid notebook JSON" in table["bob"]["note"] and table["carol"]["max_score"] == "10"
    feedback = (grades / "lab01_gemm" / "bob" / "feedback.md").read_text()
    assert feedback.count("not valid notebook JSON") == 1, "an unreadable notebook's reason is said once"
    results = json.loads((grades / "lab01_gemm" / "alice" / "results.json").read_text())
    seed = results["extra_data"]["seed"]
    assert f"seed {seed}" in (grades / "lab01_gemm" / "alice" / "feedback.md").read_text()
    assert table["alice"]["seed"] == str(seed)

    again = {
        r.learner: r
        for r in grade_batch(
            submitted,
            "lab01_gemm",
            grades / "lab01_gemm",
            source_dir=REPO / "solutions",
            limits=LIMITS,
            workers=2,
            progress=False,
            roster=roster,
        )
    }
    assert again["alice"].cached and again["alice"].seed == seed and again["alice"].seconds > 0
    assert again["bob"].cached and again["bob"].status == "unreadable" and "JSON" in again["bob"].note
    reseeded = {
        r.learner: r
        for r in grade_batch(
            submitted,
            "lab01_gemm",
            grades / "lab01_gemm",
            source_dir=REPO / "solutions",
            limits=LIMITS,
            workers=1,
            progress=False,
            seed=seed,
            roster=roster,
        )
    }
    assert not reseeded["alice"].cached and reseeded["alice"].seed == seed and reseeded["alice"].score == 10
    kept = sorted((grades / "lab01_gemm" / "alice" / "history").iterdir())
    assert len(kept) == 1 and json.loads((kept[0] / "results.json").read_text())["extra_data"]["seed"] == seed

    # A second lab, graded for one learner: the gradebook has every learner for both labs.
    lab02 = REPO / "solutions" / "lab02_roofline" / "lab02_roofline.ipynb"
    write_learner_notebook(
        tmp_path / "submitted02" / "alice.ipynb",
        answer_cells(lab02),
        base=REPO / "labs" / "lab02_roofline" / "lab02_roofline.ipynb",
    )
    grade_batch(
        tmp_path / "submitted02",
        "lab02_roofline",
        grades / "lab02_roofline",
        source_dir=REPO / "solutions",
        limits=LIMITS,
        workers=1,
        progress=False,
    )
    book, written = build_gradebook(grades)
    assert book.labs == ["lab01_gemm", "lab02_roofline"] and book.learners == ["alice", "bob", "carol", "dan"]
    merged = {(row["learner"], row["lab"]): row for row in _csv(written[0])}
    assert len(merged) == 8
    assert merged[("alice", "lab02_roofline")]["status"] in ("graded", "flagged")
    assert float(merged[("alice", "lab02_roofline")]["score"]) == float(
        merged[("alice", "lab02_roofline")]["max_score"]
    )
    assert merged[("bob", "lab02_roofline")]["status"] == "not submitted"
    with open(written[1], newline="", encoding="utf-8") as f:
        canvas = list(csv.reader(f))
    assert canvas[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "lab01_gemm", "lab02_roofline"]
    assert canvas[1][0] == "Points Possible" and canvas[1][5] == "10"
    assert canvas[2][:6] == ["alice", "", "", "alice", "", "10"] and canvas[3][5:] == ["0", "0"]


def _release(
    source: Path,
    *,
    points: float | None = None,
    rename: tuple[str, str] | None = None,
    prose: str | None = None,
    test_code: str | None = None,
) -> None:
    """Re-release lab 01 in a copy of the instructor notebooks: task 1's points, an answer cell's id,
    a sentence added to the introduction's prose, a line added to task 1's test cell."""
    path = source / "lab01_gemm" / "lab01_gemm.ipynb"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if points is not None and meta.get("grade_id") == "test_task1_gemm_flops":
            meta["points"] = points
        if test_code is not None and meta.get("grade_id") == "test_task1_gemm_flops":
            cell.source += test_code
        if rename and meta.get("grade_id") == rename[0]:
            meta["grade_id"] = rename[1]
    if prose is not None:
        nb.cells[0].source += prose
        nb.cells[0]["id"] = "renumbered-intro"
    nbformat.write(nb, path)


def test_a_lab_changed_mid_course_regrades_as_described(tmp_path):
    """A re-release changes task 1's points and renames its answer cell: everyone is re-graded, the
    note says the score moved and the earlier feedback is kept in history/; a notebook made for the
    earlier release is not blamed (reason "earlier release", the note says so) until a release note
    maps the old id, and then it gets the new points."""
    source = tmp_path / "solutions"
    shutil.copytree(REPO / "solutions" / "lab01_gemm", source / "lab01_gemm")
    answers = answer_cells(SOLUTION01)
    submitted = tmp_path / "submitted"
    write_learner_notebook(submitted / "alice.ipynb", answers)
    out = tmp_path / "grades"
    grade = lambda: {
        r.learner: r
        for r in grade_batch(submitted, "lab01_gemm", out, source_dir=source, limits=LIMITS, workers=1, progress=False)
    }
    assert grade()["alice"].score == 10
    version = lab_version("lab01_gemm", source)

    # A text-only edit (the introduction's time estimate) is no new release: nobody is graded again.
    _release(source, prose="\n\nThis lab takes about 75 minutes, not 60.")
    assert lab_version("lab01_gemm", source) == version
    assert grade()["alice"].cached

    # One re-release: task 1 now worth 4 points, and its answer cell renamed.
    _release(source, points=4, rename=("task1_gemm_flops", "task1_flops"))
    assert lab_version("lab01_gemm", source) != version
    row = grade()["alice"]
    assert not row.cached and row.status == "earlier release" and row.score == 8 and row.max_score == 12, row
    assert "re-graded: 10 before" in row.note and len(list((out / "alice" / "history").iterdir())) == 1
    assert row.note.endswith("; the lab's tests changed"), row.note  # not the submission, not the course's code
    results = json.loads((out / "alice" / "results.json").read_text())
    task1 = next(t for t in results["tests"] if t["name"] == "test_task1_gemm_flops")
    assert task1["tags"] == ["earlier release"] and "not your mistake" in task1["output"]
    feedback = (out / "alice" / "feedback.md").read_text()
    assert "made for an earlier release of this lab" in feedback and "is missing from your notebook" not in feedback

    (source / "lab01_gemm" / "release_notes.json").write_text(
        json.dumps({"renamed": {"task1_gemm_flops": "task1_flops"}})
    )
    row = grade()["alice"]
    assert row.status == "flagged" and row.score == 12, row  # flagged: the answers are the solution's
    assert "graded as 'task1_flops'" in (out / "alice" / "feedback.md").read_text()
    assert len(list((out / "alice" / "history").iterdir())) == 2


def test_the_cache_key_follows_what_a_lab_runs_and_nothing_else(tmp_path):
    """A lab's cache key covers its notebook, its check module, the course modules those run and the
    grader, so a changed check invalidates its lab's grades (the progress cache's too), and an edit
    to a module the lab never runs does not."""
    for folder in ("grading", "infra_lib", "solutions"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    key = lambda lab: lab_version(lab, tmp_path / "solutions", root=tmp_path)
    before = {lab: key(lab) for lab in ("lab01_gemm", "lab08_scheduler")}
    files = {str(p.relative_to(tmp_path)) for p in lab_files("lab01_gemm", tmp_path / "solutions", root=tmp_path)}
    assert {
        "grading/checks/lab01.py",
        "infra_lib/timing.py",
        "infra_lib/hardware/flops.py",
        "grading/grader.py",
    } <= files
    assert "infra_lib/serving/engine.py" not in files

    engine = tmp_path / "infra_lib" / "serving" / "engine.py"
    engine.write_text(engine.read_text() + "\n# an edit\n")
    assert key("lab01_gemm") == before["lab01_gemm"] and key("lab08_scheduler") != before["lab08_scheduler"]
    check = tmp_path / "grading" / "checks" / "lab01.py"
    check.write_text(check.read_text() + "\n# a fixed check\n")
    assert key("lab01_gemm") != before["lab01_gemm"]

    # A lab's checks may be a package: a course module named only in a string of one of its task
    # modules (a reference target, "module:name") is part of the lab's key too.
    named = lambda: {
        str(p.relative_to(tmp_path)) for p in lab_files("lab08_scheduler", tmp_path / "solutions", root=tmp_path)
    }
    task = sorted(p for p in (tmp_path / "grading" / "checks" / "lab08").glob("*.py") if p.name != "__init__.py")[-1]
    assert "infra_lib/apps/rag/chunking.py" not in named()
    task.write_text(task.read_text() + '\nNAMED = "infra_lib.apps.rag.chunking:chunk_text"\n')
    assert "infra_lib/apps/rag/chunking.py" in named()


def test_a_lab_versions_parts_follow_what_grading_reads(tmp_path):
    """The lab's key has two parts, so a re-grade can say which changed: the lab's tests (the
    instructor notebook's code, test cells, points and answer ids; not its prose or cell ids) and
    the course's code (the check module and what it runs). A learner's key adds the submission and
    the limits, and a re-grade's note names each part that differs."""
    from grading.batch import _cache_key, changed_parts

    shutil.copytree(REPO / "solutions" / "lab01_gemm", tmp_path / "solutions" / "lab01_gemm")
    source = tmp_path / "solutions"
    parts = lambda: lab_version_parts("lab01_gemm", source)
    before = parts()
    _release(source, prose="\n\nAbout 75 minutes.")
    assert parts() == before, "a prose edit changed the lab's key"
    _release(source, test_code="\n# one more line a check reads\n")
    after = parts()
    assert after["tests"] != before["tests"] and after["course"] == before["course"]
    _release(source, points=5)
    assert parts()["tests"] != after["tests"]

    notebook = write_learner_notebook(tmp_path / "alice.ipynb", answer_cells(SOLUTION01))
    key = _cache_key(notebook, before, LIMITS)
    assert changed_parts(key, key) == []
    assert changed_parts(key, _cache_key(notebook, after, LIMITS)) == ["the lab's tests"]
    assert changed_parts(key, _cache_key(notebook, {**before, "course": "edited"}, LIMITS)) == ["the course's code"]
    assert changed_parts(key, _cache_key(notebook, before, Limits(budget=100))) == ["the limits"]
    notebook.write_text(notebook.read_text().replace("2 * m * n * k", "m * n * k * 2"))
    assert changed_parts(key, _cache_key(notebook, after, LIMITS)) == ["the submission", "the lab's tests"]
    assert changed_parts("0123abcd", key) == ["the earlier grading's record"]  # a key an older grader wrote


def test_canvas_csv_takes_ids_and_sections_from_a_roster(tmp_path, capsys):
    """`infra-lab gradebook --roster` with a CSV roster (learner, Canvas id, SIS ids, section) fills
    canvas.csv's ID, SIS User ID, SIS Login ID and Section, lists a learner on the roster with no
    grade as not submitted (0), keeps a graded learner missing from it, and carries each row's
    flags into gradebook.csv; the one-id-per-line roster still works."""
    from course_tools.cli import main

    grades = tmp_path / "grades"
    (grades / "lab01_gemm").mkdir(parents=True)
    (grades / "lab01_gemm" / "scores.csv").write_text(
        "learner,score,max_score,status,flags,note\n"
        "alice,10,10,flagged,copy: task2_time_op: bob 1.00,\n"
        "bob,0,10,blocked,blocked: the answer key (looked for not found; /solutions/x.ipynb),\n"
        "zed,4,10,graded,,\n"
    )
    roster = tmp_path / "roster.csv"
    roster.write_text(
        "learner,canvas_id,sis_user_id,sis_login_id,section\n"
        "bob,1002,S-2,bob@uni.example,Lab B\n"
        "alice,1001,S-1,alice@uni.example,Lab A\n"
        "carol,1003,,,Lab A\n"
    )
    assert main(["gradebook", str(grades), "--roster", str(roster)]) == 0
    said = capsys.readouterr().out
    assert "4 learners x 1 labs" in said and "3 learners, 3 with Canvas or SIS ids" in said, said
    canvas = list(csv.reader((grades / "canvas.csv").open(newline="", encoding="utf-8")))
    assert canvas[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "lab01_gemm"]
    assert canvas[2:] == [
        ["bob", "1002", "S-2", "bob@uni.example", "Lab B", "0"],
        ["alice", "1001", "S-1", "alice@uni.example", "Lab A", "10"],
        ["carol", "1003", "", "carol", "Lab A", "0"],
        ["zed", "", "", "zed", "", "4"],
    ]
    book = {row["learner"]: row for row in _csv(grades / "gradebook.csv")}
    assert book["carol"]["status"] == "not submitted" and book["carol"]["score"] == "0"
    assert book["bob"]["flags"].startswith("blocked: the answer key") and book["zed"]["flags"] == ""

    plain = tmp_path / "roster.txt"
    plain.write_text("learner\n# the class of 2027\nalice\n\nbob\n")
    from grading.batch import read_roster

    assert read_roster(plain) == ["alice", "bob"] and read_roster(roster) == ["bob", "alice", "carol"]
    assert main(["gradebook", str(grades), "--roster", str(plain)]) == 0
    assert list(csv.reader((grades / "canvas.csv").open(newline="", encoding="utf-8")))[2] == [
        "alice",
        "",
        "",
        "alice",
        "",
        "10",
    ]
    roster.write_text("learner,canvas_id\nbob,1\nbob,2\n")
    assert main(["gradebook", str(grades), "--roster", str(roster)]) != 0
    assert "bob is listed twice with different ids" in capsys.readouterr().err


def test_progress_regrades_when_the_lab_changed(tmp_path, monkeypatch):
    from grading import lab_version as versions
    from grading.progress import UNCHANGED, grade_lab

    notebook = write_learner_notebook(tmp_path / "lab01_gemm.ipynb", answer_cells(SOLUTION01), base=LAB01)
    out = tmp_path / "grades" / "lab01_gemm"
    assert grade_lab(notebook, out, limits=LIMITS).score == 10
    assert grade_lab(notebook, out, limits=LIMITS).note == UNCHANGED
    real = versions.lab_version
    monkeypatch.setattr(versions, "lab_version", lambda *args, **kwargs: real(*args, **kwargs) + "-fixed-check")
    regraded = grade_lab(notebook, out, limits=LIMITS)
    assert regraded.note != UNCHANGED and regraded.score == 10


def test_readme_table_of_statuses_is_statuses():
    """README's table of statuses lists exactly grading.grader.STATUSES, in their order of precedence."""
    import re

    from grading.batch import STATUSES as batch_statuses
    from grading.grader import STATUSES

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme.split("| status | meaning |", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^\| `([^`]+)` \|", table, re.M) == list(STATUSES)
    assert batch_statuses is STATUSES
