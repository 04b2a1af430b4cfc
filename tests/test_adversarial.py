"""The adversarial corpus (tests/adversarial/): each hostile, broken or cheating lab 01
notebook scores exactly what its honest content deserves, each failure says why, the
learner's file is never touched, and a class folder of them grades in one batch."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, size_for_ci

from grading.batch import grade_batch
from grading.grader import DEFAULT_SOURCE, grade_notebook
from grading.report import gradescope_results, write_reports
from grading.run import warm
from grading.run.sandbox import Limits

CORPUS = Path(__file__).resolve().parent / "adversarial"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())
# Tight limits keep the hostile entries short: honest checks need well under a second each, and
# the slowest honest cell (importing torch) about 2 s.
LIMITS = Limits(check_timeout=5, cell_timeout=15, budget=300, max_processes=16)


def _file(name: str) -> str:
    return next(case["file"] for case in EXPECTED if case["name"] == name)


# Graded here without the sandbox, as a learner grading their own work is. The entries that are
# never run outside the sandbox (they would rewrite the course or fill the machine with processes)
# are graded in it by tests/test_bwrap.py, with the whole corpus.
UNSANDBOXED = [case for case in EXPECTED if isinstance(case["unsandboxed"], dict)]


@pytest.mark.parametrize("case", UNSANDBOXED, ids=[c["name"] for c in UNSANDBOXED])
def test_corpus_entry_scores_what_its_honest_content_deserves(case, tmp_path):
    """Part one scores what its honest content deserves; part two's routes to the answer key and the
    reference work here (the sandbox closes them: tests/test_bwrap.py)."""
    path = CORPUS / case["file"]
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    report = grade_notebook(path, lab_id="lab01_gemm", limits=LIMITS)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before, "the learner's file was modified"
    summary = {t.grade_id: (t.score, sorted({c.reason for c in t.checks})) for t in report.tests}
    expected = case["unsandboxed"]
    for test in report.tests:
        want = expected["reasons"].get(test.grade_id)
        if want is None:
            assert test.passed, (case["name"], test.grade_id, [c.message for c in test.checks])
        else:
            assert test.score == 0, (case["name"], summary)
            assert {c.reason for c in test.checks} == {want}, (
                case["name"],
                test.grade_id,
                summary,
                [c.message for c in test.checks],
            )
    assert report.score == expected["score"], (case["name"], summary, report.notes)
    if case["note"]:
        assert any(case["note"] in note for note in report.notes), report.notes
    unread = any(note.startswith("the notebook could not be graded") for note in report.notes)
    assert report.sandbox == {} if unread else report.sandbox["view"].startswith("no sandbox"), report.sandbox
    write_reports(report, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results == gradescope_results(report) and results["score"] == expected["score"]


def test_hidden_check_feedback_never_shows_inputs_or_error_text(tmp_path):
    """A hidden check failing with the learner's own exception shows its type, not its message."""
    source = json.loads((CORPUS / _file("honest_full")).read_text())
    for cell in source["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "task1_gemm_flops":
            cell["source"] = (
                "def gemm_flops(m, n, k):\n"
                "    if m > 1000:\n"
                "        raise ValueError(f'secret input m={m}, n={n}, k={k}')\n"
                "    return 2 * m * n * k\n"
            )
    path = tmp_path / "lab01_gemm.ipynb"
    path.write_text(json.dumps(source))
    report = grade_notebook(path, seed=4, limits=LIMITS)
    hidden = next(c for t in report.tests for c in t.checks if c.check_id == "lab01.gemm_flops_shapes")
    assert not hidden.passed and hidden.reason == "error"
    assert "ValueError" in hidden.message and "secret input" not in hidden.message
    write_reports(report, tmp_path / "out")
    for name in ("feedback.md", "feedback.html", "results.json"):
        assert "secret input" not in (tmp_path / "out" / name).read_text()


def test_batch_grading_a_class_with_a_cache(tmp_path):
    submissions = tmp_path / "submitted"
    picks = {
        "alice": "honest_full",
        "bob": "wrong_answer",
        "carol": "os_exit",
        "dave": "malformed_json",
        "erin": "patched_grading",
    }
    for learner, name in picks.items():
        (submissions / learner).mkdir(parents=True)
        shutil.copy(CORPUS / _file(name), submissions / learner / "lab01_gemm.ipynb")
    out = tmp_path / "grades"
    limits = Limits(check_timeout=30, cell_timeout=60, budget=300, max_processes=16)
    rows = grade_batch(
        submissions, "lab01_gemm", out, source_dir=DEFAULT_SOURCE, limits=limits, workers=2, progress=False
    )
    scores = {r.learner: r.score for r in rows}
    expected = {learner: next(c["score"] for c in EXPECTED if c["name"] == name) for learner, name in picks.items()}
    assert scores == expected, {r.learner: _failures(out / r.learner) for r in rows}
    # the corpus is built from the solution, so its graded answers are flagged; dave's file is unreadable;
    # erin's task 1 was refused by the static scan, which her status and flags say before the copies
    assert {r.learner: r.status for r in rows} == {
        "alice": "flagged",
        "bob": "flagged",
        "carol": "flagged",
        "dave": "unreadable",
        "erin": "refused",
    }
    with open(out / "scores.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [row["learner"] for row in table] == list(picks)
    assert {row["learner"]: float(row["score"]) for row in table} == expected
    assert float(table[0]["test_task1_gemm_flops"]) == 2
    # the corpus is built from the course's solution: its answers are flagged as copies of it and of
    # each other (dave's notebook cannot be read, so it is not compared); the flag costs no point
    flags = {row["learner"]: row["flags"] for row in table}
    assert "task2_time_op: bob 1.00, carol 1.00, erin 1.00, the course's solution 1.00" in flags["alice"], flags
    assert flags["erin"].startswith("refused: task1_gemm_flops (tampering detected: it imports grading"), flags
    assert flags["erin"].split(" | ")[1].startswith("copy: task2_time_op: "), flags
    assert "task3_dominant_op: bob 1.00" in flags["alice"] and flags["dave"] == "", flags
    similarity = (out / "similarity.md").read_text()
    assert "| alice | task2_time_op | the course's solution | 1.00 |" in similarity
    assert "| alice | task2_time_op | reference infra_lib.timing.time_op |" in similarity
    for learner in picks:
        assert json.loads((out / learner / "results.json").read_text())["score"] == expected[learner]
        assert (out / learner / "feedback.md").exists()

    # A re-run grades only what changed.
    shutil.copy(CORPUS / _file("honest_full"), submissions / "bob" / "lab01_gemm.ipynb")
    again = grade_batch(
        submissions, "lab01_gemm", out, source_dir=DEFAULT_SOURCE, limits=limits, workers=2, progress=False
    )
    cached = {r.learner: r.cached for r in again}
    assert cached == {"alice": True, "bob": False, "carol": True, "dave": True, "erin": True}
    assert {r.learner: r.score for r in again}["bob"] == 10, _failures(out / "bob")
    note = {r.learner: r.note for r in again}["bob"]
    assert note.startswith("re-graded: 8 before (") and note.endswith("; the submission changed"), note


def _failures(folder: Path) -> list[str]:
    results = json.loads((folder / "results.json").read_text())
    return [t["output"] for t in results["tests"] if t["status"] != "passed"]


def _nbgrader_scores(names: list[str], course: Path) -> tuple[dict[str, float | str], str]:
    """Autograde the named corpus entries with nbgrader, as an instructor would; the scores, and
    nbgrader's log of errors (to say why a score differs)."""
    import os
    import re
    import subprocess
    import sys

    from nbgrader.api import Gradebook, MissingEntry

    from course_tools.release import CONFIG

    (course / "solutions").mkdir(parents=True)
    shutil.copytree(DEFAULT_SOURCE / "lab01_gemm", course / "solutions" / "lab01_gemm")
    size_for_ci(course / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb")  # the cells after the tests at CI's size
    (course / "nbgrader_config.py").write_text(f"load_subconfig({str(CONFIG)!r})\n")
    # nbgrader's kernels fork from this worker's template (grading.run.warm), as nbgrader_config.py
    # has them fork from a template of nbgrader's own.
    env = {
        **os.environ,
        **warm.plain_kernel_env(),
        "INFRA_COURSE_ROOT": str(course),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }

    def nbgrader(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "nbgrader", *args, "--log-level=WARN"],
            cwd=course,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )

    assert nbgrader("generate_assignment", "lab01_gemm", "--force").returncode == 0
    for name in names:
        target = course / "submitted" / name / "lab01_gemm"
        target.mkdir(parents=True)
        shutil.copy(CORPUS / _file(name), target / "lab01_gemm.ipynb")
    result = nbgrader("autograde", "lab01_gemm", "--create", "--force", "--Execute.timeout=15")
    failed = set(re.findall(r"for student '([^']+)'", result.stderr))
    failed |= set(re.findall(r"submitted/([^/\s]+)/lab01_gemm", result.stderr))
    scores: dict[str, float | str] = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id="infra-course") as gradebook:
        for name in names:
            try:
                scores[name] = "error" if name in failed else gradebook.find_submission("lab01_gemm", name).score
            except MissingEntry:
                scores[name] = "error"
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line or "Error" in line]
    return scores, "\n".join(errors[-40:])


@pytest.mark.parametrize("half", [0, 1])
def test_nbgrader_on_the_corpus_gives_the_documented_scores(half, tmp_path):
    """The comparison the README shows instructors, measured: where nbgrader can be fooled or fails."""
    # The entries nbgrader is never given would rewrite the course or fork without bound: nbgrader
    # runs them as the instructor, with no sandbox.
    names = [case["name"] for case in EXPECTED if case["nbgrader"] != "not run"][half::2]
    scores, errors = _nbgrader_scores(names, tmp_path / "course")
    documented = {case["name"]: case["nbgrader"] for case in EXPECTED if case["name"] in names}
    assert scores == documented, f"nbgrader's errors:\n{errors}"


def test_corpus_is_what_make_corpus_builds_from_the_current_lab(tmp_path):
    """The corpus follows the released lab: rebuilt from labs/ today, every file is the same."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_corpus", CORPUS / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(tmp_path)
    built = sorted(p.name for p in tmp_path.iterdir())
    committed = sorted(p.name for p in CORPUS.iterdir() if p.name.endswith((".ipynb", ".broken", ".json")))
    assert built == committed
    stale = [name for name in built if (tmp_path / name).read_bytes() != (CORPUS / name).read_bytes()]
    assert not stale, (
        f"{stale} differ from what tests/adversarial/make_corpus.py builds from the current lab; "
        "rerun it (.venv/bin/python tests/adversarial/make_corpus.py) and check the scores"
    )


def test_readme_table_matches_the_corpus():
    readme = (REPO / "README.md").read_text()
    for case in EXPECTED:
        nbgrader = case["nbgrader"] if isinstance(case["nbgrader"], str) else f"{case['nbgrader']:g}"
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{case['name']}` |")), "")
        unsandboxed = case["unsandboxed"]
        unsandboxed = f"{unsandboxed['score']:g}" if isinstance(unsandboxed, dict) else "not run"
        assert f"| {case['score']:g} | {unsandboxed} | {nbgrader} |" in row, (
            f"README's corpus row for {case['name']} is wrong: {row!r}"
        )
