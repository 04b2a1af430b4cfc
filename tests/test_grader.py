"""The notebook grader end to end: real kernels, real lab 01, learner notebooks built per test."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import nbformat
import pytest
from conftest import LAB01, REPO, SOLUTION01, write_learner_notebook

from course_tools.release import lab_ids
from grading import grading_times
from grading.grader import (
    CheckResult,
    GradeReport,
    GradingError,
    grade_notebook,
    infer_lab,
    trusted_source,
    unreadable_report,
)
from grading.grader import TestResult as GradedTest  # (not named Test*: pytest would collect it)
from grading.notebook import clear_solutions, is_solution_cell, read_notebook, splice
from grading.report import default_out_dir, feedback_markdown, gradescope_results, table, write_reports
from grading.run.sandbox import Limits


def _scores(report) -> dict[str, float]:
    return {t.grade_id: t.score for t in report.tests}


def _with(solution_answers, **replace) -> dict[str, str]:
    answers = dict(solution_answers)
    answers.update(replace)
    return answers


def test_hidden_failures_name_the_check_but_not_inputs_or_expected(tmp_path, solution_answers):
    # A dominant_op that ignores device time passes the visible check, fails a hidden one.
    cpu_only = solution_answers["task3_dominant_op"].replace("on_device = any(", "on_device = False and any(")
    path = write_learner_notebook(tmp_path / "lab01_gemm.ipynb", _with(solution_answers, task3_dominant_op=cpu_only))
    report = grade_notebook(path, seed=11)
    assert report.score == 7
    checks = {c.check_id: c for t in report.tests for c in t.checks}
    assert checks["lab01.dominant_op_real"].passed
    hidden = checks["lab01.dominant_op_device"]
    assert hidden.hidden and not hidden.passed
    assert "dominant_op named the wrong op" in hidden.message
    out = tmp_path / "report"
    write_reports(report, out)
    for text in ((out / "feedback.md").read_text(), (out / "results.json").read_text(), table(report)):
        assert "lab01.dominant_op_device" in text
        assert "sm90_xmma" not in text and "expected" not in text.split("dominant_op_device")[1][:400]


def test_a_hanging_answer_is_interrupted_and_grading_goes_on(tmp_path, solution_answers):
    hang = "def dominant_op(prof):\n    while True:\n        pass\n"
    path = write_learner_notebook(tmp_path / "lab01_gemm.ipynb", _with(solution_answers, task3_dominant_op=hang))
    report = grade_notebook(path, seed=5, limits=Limits(cell_timeout=8, check_timeout=120))
    assert report.score == 7
    message = report.tests[2].checks[0].message
    assert "(time-out)" in message and "KeyboardInterrupt" in message


def test_an_answer_that_ignores_the_interrupt_is_stopped(tmp_path, solution_answers):
    stubborn = (
        "def achieved_tflops(m, n, k, seconds):\n"
        "    import time\n"
        "    while True:\n"
        "        try:\n"
        "            time.sleep(0.1)\n"
        "        except KeyboardInterrupt:\n"
        "            pass\n"
    )
    path = write_learner_notebook(
        tmp_path / "lab01_gemm.ipynb", _with(solution_answers, task4_achieved_tflops=stubborn)
    )
    report = grade_notebook(path, seed=5, limits=Limits(cell_timeout=4, check_timeout=120))
    assert _scores(report) == {
        "test_task1_gemm_flops": 2,
        "test_task2_time_op": 3,
        "test_task3_dominant_op": 3,
        "test_task4_achieved_tflops": 0,
    }
    assert "ignored the interrupt" in report.tests[3].checks[0].message
    assert report.tests[3].checks[0].reason == "time-out"


def test_a_cell_is_timed_in_processor_time_so_a_short_wait_costs_nothing(tmp_path, solution_answers):
    """A cell's limit counts the kernel's processor time, not the wall clock: an answer cell that waits 6 s
    (under three times the limit) and computes little passes under a 4 s limit, where a wall-clock limit
    would have interrupted it; one that computes for longer is still interrupted
    (test_a_hanging_answer_is_interrupted_and_grading_goes_on), and time spent waiting for a core is not
    waiting (tests/test_warm.py::test_a_process_starved_of_a_core_is_not_waiting)."""
    waits = "import time\n\ntime.sleep(6)\n\n" + solution_answers["task4_achieved_tflops"]
    path = write_learner_notebook(tmp_path / "lab01_gemm.ipynb", _with(solution_answers, task4_achieved_tflops=waits))
    report = grade_notebook(path, seed=5, limits=Limits(cell_timeout=4, check_timeout=120))
    assert report.score == report.max_score, [c.message for t in report.tests for c in t.checks if not c.passed]
    assert report.sandbox["time"].startswith("processor time:") and "4 s per cell" in report.sandbox["time"]


def test_grading_never_modifies_the_learner_file(tmp_path, solution_answers):
    path = write_learner_notebook(tmp_path / "lab01_gemm.ipynb", solution_answers)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    grade_notebook(path, seed=1)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab01_gemm.ipynb"]


def test_reports_have_gradescope_fields(tmp_path):
    report = grade_notebook(LAB01, seed=1)
    results = gradescope_results(report)
    assert results["score"] == 0 and results["max_score"] == 10
    for test in results["tests"]:
        assert set(test) >= {"name", "score", "max_score", "status", "output", "visibility"}
        assert test["status"] == "failed"
    paths = write_reports(report, tmp_path)
    assert json.loads(paths[0].read_text()) == results
    md = feedback_markdown(report)
    assert md.startswith("# Feedback: lab01_gemm") and "**Score: 0 / 10**" in md


def test_missing_answer_cell_is_graded_as_the_stub(tmp_path, solution_answers):
    nb = read_notebook(LAB01)
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "task4_achieved_tflops"]
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if gid in solution_answers:
            cell.source = solution_answers[gid]
    path = tmp_path / "lab01_gemm.ipynb"
    nbformat.write(nb, path)
    spliced = splice(read_notebook(SOLUTION01), read_notebook(path))
    assert any("task4_achieved_tflops" in n and "missing" in n for n in spliced.notes)
    report = grade_notebook(path, seed=2)
    assert report.score == 8


def test_clear_solutions_matches_what_nbgrader_releases():
    released = {
        c.metadata["nbgrader"]["grade_id"]: c.source
        for c in read_notebook(LAB01).cells
        if c.metadata.get("nbgrader", {}).get("solution")
    }
    trusted = {
        c.metadata["nbgrader"]["grade_id"]: c.source
        for c in read_notebook(SOLUTION01).cells
        if c.metadata.get("nbgrader", {}).get("solution")
    }
    assert released.keys() == trusted.keys()
    for gid, source in trusted.items():
        assert clear_solutions(source) == released[gid]


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid notebook JSON"),
        ('{"cells": 3, "nbformat": 4, "nbformat_minor": 5, "metadata": {}}', "notebook"),
        ("", "not valid notebook JSON"),
    ],
)
def test_malformed_notebooks_score_zero_with_a_clear_reason(tmp_path, content, message):
    path = tmp_path / "lab01_gemm.ipynb"
    path.write_text(content)
    report = grade_notebook(path)
    assert (report.score, report.max_score) == (0, 10)
    assert all(c.reason == "unreadable notebook" for t in report.tests for c in t.checks)
    assert message in report.notes[0]


def test_unknown_lab_and_missing_file():
    with pytest.raises(GradingError, match="lab01_gemm"):
        grade_notebook(LAB01, lab_id="lab99_nothing")
    report = grade_notebook(LAB01.with_name("missing.ipynb"), lab_id="lab01_gemm")
    assert report.score == 0 and "no notebook at" in report.notes[0]


@pytest.mark.parametrize("lab_id", lab_ids())
def test_static_scan_knows_each_labs_reference_by_its_full_id(lab_id):
    """The grader scans answers with the lab's full id ("lab06_kv_cache"); shortcuts are
    registered under the short one ("lab06"): both must find the same reference modules."""
    from grading import tamper
    from grading.registry import shortcut_modules

    modules, names = shortcut_modules(lab_id)
    assert names and (modules, names) == shortcut_modules(lab_id.split("_")[0])
    name = sorted(names)[0]
    # A lab that names only methods (lab 08's Scheduler.schedule) bans no module: calling one is the shortcut.
    source = f"from {sorted(modules)[0]} import {name}\n" if modules else f"planner.{name}(batch)\n"
    findings = tamper.scan(source, modules, names)
    assert findings and findings[0].kind == tamper.SHORTCUT


def test_writing_into_a_tensor_at_an_index_made_by_a_module_is_no_monkeypatching():
    """``probs[torch.arange(n), ids] -= 1`` writes into ``probs``; replacing ``torch.arange`` itself, or an entry of a
    module's table, is tampering."""
    from grading import tamper

    modules = {"torch", "math"}
    for innocent in (
        "probs[torch.arange(n), ids] -= 1\n",
        "grad[torch.arange(3)] = 0\n",
        "a, b[math.floor(x)] = 1, 2\n",
    ):
        assert tamper.scan(innocent, set(), set(), modules) == [], innocent
    for patch in ("torch.arange = fake\n", "torch.ops.table[0] = fake\n", "x, torch.exp = 1, fake\n"):
        findings = tamper.scan(patch, set(), set(), modules)
        assert [f.kind for f in findings] == [tamper.TAMPERING] and "monkeypatching" in findings[0].detail, patch


def test_lab_is_inferred_from_the_cells_grade_ids_when_no_name_says_it(tmp_path):
    copy = write_learner_notebook(tmp_path / "alice.ipynb", {})  # lab 01's cells, under a name of no lab
    with pytest.raises(GradingError, match="no lab named 'alice'"):
        trusted_source(copy)
    assert infer_lab(copy) == "lab01_gemm"

    lab02 = read_notebook(REPO / "labs" / "lab02_roofline" / "lab02_roofline.ipynb")
    both = read_notebook(copy)
    both.cells += [cell for cell in lab02.cells if is_solution_cell(cell)]
    nbformat.write(both, tmp_path / "both.ipynb")
    with pytest.raises(GradingError, match=r"several labs \(lab01_gemm, lab02_roofline\); pass --lab LAB_ID"):
        infer_lab(tmp_path / "both.ipynb")

    shared = read_notebook(copy)  # only cells whose grade_ids every lab has ("setup", "progress", ...)
    shared.cells = [
        cell
        for cell in shared.cells
        if cell.metadata.get("nbgrader", {}).get("grade_id") in {"setup", "progress", "intro"}
    ]
    nbformat.write(shared, tmp_path / "shared.ipynb")
    with pytest.raises(
        GradingError,
        match=r"none of its cells' grade_ids belong to a lab \(labs: lab01_gemm, .*"
        r"lab18_resilient_training\); pass --lab LAB_ID",
    ):
        infer_lab(tmp_path / "shared.ipynb")

    (tmp_path / "broken.ipynb").write_text('{"cells": [')
    with pytest.raises(
        GradingError,
        match=r"names no lab, and its cells cannot be read .*not valid notebook JSON.*"
        r"pass --lab LAB_ID",
    ):
        infer_lab(tmp_path / "broken.ipynb")


def test_reports_of_any_other_file_go_beside_the_labs_own_record():
    grades = Path("grades")
    assert default_out_dir("lab01_gemm", LAB01, grades) == grades / "lab01_gemm"
    assert default_out_dir("lab01_gemm", LAB01.with_name("copy.ipynb"), grades) == grades / "lab01_gemm" / "copy"
    assert default_out_dir("lab01_gemm", Path.home() / "alice.ipynb", grades) == grades / "lab01_gemm" / "alice"


def test_time_estimate_comes_from_the_labs_last_grading_else_the_measured_table(tmp_path):
    table_path = grading_times.record({"lab01_gemm": 31.04}, tmp_path / "times.json")
    grades = tmp_path / "grades"
    assert (
        grading_times.estimate("lab01_gemm", grades, table_path)
        == "about 31 s on a quiet machine (as measured for the course)"
    )
    assert grading_times.estimate("lab42_new", grades, table_path) == "no time recorded for lab42_new yet"

    check = CheckResult("lab01.gemm_flops", False, False, "lab01.gemm_flops failed", "wrong result")
    graded = GradeReport("lab01_gemm", "alice.ipynb", 1, [GradedTest("test_task1", 0.0, 2.0, [check])], seconds=47.2)
    write_reports(graded, grades / "lab01_gemm" / "alice")
    assert (
        grading_times.estimate("lab01_gemm", grades, table_path)
        == "about 47 s on a quiet machine (from its last grading here)"
    )

    # Newer records that ran no kernel say nothing of the lab's time: an unreadable notebook, a refusal.
    unreadable = unreadable_report("lab01_gemm", Path("lab01_gemm.ipynb"), read_notebook(SOLUTION01), "bad JSON", 0.01)
    write_reports(unreadable, grades / "lab01_gemm")
    (grades / "lab01_gemm" / "refused").mkdir()
    (grades / "lab01_gemm" / "refused" / "results.json").write_text('{"score": 0, "max_score": 0, "tests": []}')
    for newer in (grades / "lab01_gemm" / "results.json", grades / "lab01_gemm" / "refused" / "results.json"):
        os.utime(newer, (os.path.getmtime(newer) + 60,) * 2)
    assert (
        grading_times.estimate("lab01_gemm", grades, table_path)
        == "about 47 s on a quiet machine (from its last grading here)"
    )

    grading_times.record({"lab02_roofline": 12}, table_path)
    assert json.loads(table_path.read_text())["seconds"] == {"lab01_gemm": 31.0, "lab02_roofline": 12.0}


def test_measured_table_has_every_lab():
    seconds = json.loads(grading_times.TABLE.read_text())["seconds"]
    assert sorted(seconds) == lab_ids(), "grade each new lab's solution once: grading_times.record(measure([lab]))"
    assert all(value > 0 for value in seconds.values())


LEARNER_SCRIPT = """
import json, os, sys
from pathlib import Path
from grading import tamper
from grading.progress_panel import grades_folder

config = json.loads(sys.argv[1])
tamper.watch(json.dumps(config))
here = Path(config["here"])
# The learner's own code: what a cheat looks for, found or not, and a write into the course.
for folder in (here, here / "course"):
    (folder / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb").is_file()
os.path.exists(here / "submitted" / "bob")
open(f"/proc/{os.getppid()}/cmdline", "rb").read()
open(f"/proc/{os.getpid()}/status").read()  # its own process: nothing to see
(here / "course" / "grading" / "check.py").write_text("rewritten")
(here / "scratch.txt").write_text("its own folder: nothing to see")
# The course's own code looking for a grades folder, and an import from a folder named like the key:
grades_folder("lab01_gemm", here / "submitted")
sys.path.insert(0, str(here / "course" / "solutions"))
import helper_module
print(json.dumps(sorted(os.listdir(here))))
"""


def _watched_attempts(tmp_path: Path, sandboxed: bool) -> set[tuple[str, str, str, str]]:
    """(what, op, path with <tmp> for tmp_path, outcome) of each attempt LEARNER_SCRIPT makes under the watch."""
    import subprocess
    import sys

    from grading import tamper

    (tmp_path / "course" / "solutions" / "lab01_gemm").mkdir(parents=True)
    (tmp_path / "course" / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb").write_text("{}")
    (tmp_path / "course" / "solutions" / "helper_module.py").write_text("X = 1\n")
    (tmp_path / "course" / "grading").mkdir()
    (tmp_path / "course" / "grading" / "check.py").write_text("original")
    (tmp_path / "learner.py").write_text(LEARNER_SCRIPT)
    record = tmp_path / "answers.jsonl"
    config = json.loads(
        tamper.watch_config(
            str(record),
            {"solutions": "the answer key", "submitted": "classmates' submissions", "grades": "the class's grades"},
            {},
            {str(tmp_path / "course"): "the course's files"},
            sandboxed=sandboxed,
        )
    )
    done = subprocess.run(
        [sys.executable, str(tmp_path / "learner.py"), json.dumps({**config, "here": str(tmp_path)})],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    attempts = tamper.read_attempts(record.read_text().splitlines())
    return {(a["what"], a["op"], a["path"].replace(str(tmp_path), "<tmp>"), a["outcome"]) for a in attempts}


def test_the_watch_records_what_the_learners_code_reaches_for_and_nothing_else(tmp_path):
    """The kernel-side watch (grading.tamper.watch) notes the learner's own looks at the answer key
    (found or not), a classmate's folder and another process's /proc entry, and a write into the
    course; not the learner's own process or scratch, not the course's own code, not an import."""
    parent = f"/proc/{os.getpid()}"
    found = _watched_attempts(tmp_path, sandboxed=False)
    assert found == {
        ("the answer key", "looked for", "<tmp>/solutions/lab01_gemm/lab01_gemm.ipynb", "not found"),
        ("the answer key", "looked for", "<tmp>/course/solutions/lab01_gemm/lab01_gemm.ipynb", "found"),
        ("classmates' submissions", "looked for", "<tmp>/submitted/bob", "not found"),
        (f"another process ({parent})", "opened", f"{parent}/cmdline", "found"),
        ("the course's files", "wrote", "<tmp>/course/grading/check.py", "allowed"),
    }, found


def test_in_the_sandbox_what_the_kernel_finds_in_its_private_tmp_is_its_own(tmp_path):
    """In bubblewrap the kernel's only writable places are its own folder and its private /tmp: a
    course that lives under /tmp (a fresh clone made by mktemp) has its paths there too, so a file
    found or written at such a path is one the kernel made itself, never the course's. The watch says
    "only the sandbox's own" (a blocked attempt), as it does for another process in its PID namespace."""
    from grading import tamper

    assert str(tmp_path).startswith("/tmp/")
    parent = f"/proc/{os.getpid()}"
    assert _watched_attempts(tmp_path, sandboxed=True) == {
        ("the answer key", "looked for", "<tmp>/solutions/lab01_gemm/lab01_gemm.ipynb", "not found"),
        ("the answer key", "looked for", "<tmp>/course/solutions/lab01_gemm/lab01_gemm.ipynb", tamper.SANDBOX_ONLY),
        ("classmates' submissions", "looked for", "<tmp>/submitted/bob", "not found"),
        (f"another process ({parent})", "opened", f"{parent}/cmdline", tamper.SANDBOX_ONLY),
        ("the course's files", "wrote", "<tmp>/course/grading/check.py", tamper.SANDBOX_ONLY),
    }


def test_flags_and_status_say_what_the_instructor_should_look_at():
    """One flag per protection that did not hold, per thing reached for (blocked or reached), per
    answer the scan refused and per test that caught one while it ran; the status is the first of
    STATUSES that applies, and no flag changes the score."""
    from grading.grader import NOT_HELD, STATUSES

    def check(reason: str, message: str = "") -> CheckResult:
        return CheckResult("lab01.gemm_flops", False, reason == "passed", message, reason)

    tests = [
        GradedTest(
            "test_task1_gemm_flops",
            0.0,
            2.0,
            [check("tampering detected", "answer task1 was not run: it imports grading (line 1)")],
        ),
        GradedTest("test_task4_achieved_tflops", 0.0, 2.0, [check("reference shortcut", "called the reference")]),
        GradedTest("test_task2_time_op", 3.0, 3.0, [check("passed")]),
    ]
    key = [
        {"what": "the answer key", "op": "looked for", "path": f"/k{i}/solutions/x.ipynb", "outcome": "not found"}
        for i in range(3)
    ]
    report = GradeReport(
        "lab01_gemm",
        "x.ipynb",
        1,
        tests,
        refused={"task1_gemm_flops": "tampering detected: it imports grading, line 1"},
        attempts=key,
    )
    assert report.flags == [
        "blocked: the answer key (looked for not found x3; e.g. /k0/solutions/x.ipynb)",
        "refused: task1_gemm_flops (tampering detected: it imports grading, line 1)",
        "caught: test_task4_achieved_tflops (reference shortcut)",
    ]
    assert report.status == "refused" and report.score == 3
    found = {**key[0], "path": "/course/solutions/x.ipynb", "outcome": "found"}
    report.attempts = [*key, found]
    assert report.status == "reached" and report.flags[0].endswith("; found: /course/solutions/x.ipynb)")
    report.sandbox = {"network": f"{NOT_HELD}isolated: unshare failed", "memory": "address space limited"}
    assert report.status == "unprotected" and report.flags[0] == "unprotected: network: NOT isolated: unshare failed"
    assert list(STATUSES)[-2:] == ["flagged", "graded"] and report.score == 3
    clean = GradeReport("lab01_gemm", "x.ipynb", 1, tests[2:])
    assert clean.flags == [] and clean.status == "graded"
    assert gradescope_results(clean)["extra_data"].get("flags") is None
    assert gradescope_results(report)["extra_data"]["flags"] == report.flags
