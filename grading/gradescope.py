"""A lab's autograder on Gradescope, the half that runs in its container:
``python -m grading.gradescope run --lab LAB`` (what the bundle's ``run_autograder`` calls) grades the
submission under ``/autograder`` and writes ``/autograder/results/results.json``. The bundle itself
(``autograder.zip``: ``setup.sh``, ``run_autograder``, the course's grader and library, the lab's
instructor notebook) is built by ``infra-lab gradescope LAB`` (:mod:`course_tools.gradescope_bundle`).
``INFRA_AUTOGRADER_ROOT`` moves ``/autograder`` elsewhere, and ``INFRA_AUTOGRADER_PYTHON`` picks the
interpreter, so that the bundle can be run on an emulated tree.

**No grading outside the sandbox by default.** Each learner's kernel runs in bubblewrap
(:mod:`grading.run.bwrap`), whose view holds no ``solutions/``. Where bubblewrap cannot run (a
container that may not create namespaces), ``run_autograder`` refuses: every test scores 0, the
learner's output says only that the autograder is misconfigured and to tell the instructor, and
the reason and the fixes go to run_autograder's standard output, which Gradescope shows to
instructors only. A bundle built with ``--allow-unsandboxed`` (its ``run_autograder`` passes the
flag on) grades there anyway, and still keeps the answer key from the kernel: the grader, which
Gradescope runs as root, locks ``solutions/`` to root (folders 0700, files 0600) and runs the
kernel as the unprivileged user ``nobody`` (:func:`grading.run.sandbox.prepare_for_user`), after
checking, as ``nobody``, that the course's Python runs and the key cannot be read. It refuses when
it is not root, and it refuses a result whose kernel did not run as ``nobody``.

**Hidden checks' points are held apart until grades are published.** The course's grader gives a
task (a test cell) its points only when every check in it passes, visible and hidden alike. Here a
task becomes two Gradescope tests: a visible one worth the visible checks' share of the points and
scored on the visible checks alone, and one shown after publication (``after_published``) worth
the rest, the hidden checks' share, which settles the task's total. A share is in proportion to
the number of checks (rounded to 0.01 point; the hidden share takes the remainder). The hidden test
scores the task's points minus what the visible test gave: its share when every check passed, 0
when a visible check failed, and minus the visible share when the visible checks passed but a
hidden one did not (it takes those points back, and says so). Each task's two tests therefore add
up to exactly what ``infra-lab grade`` and nbgrader give it, and results.json's ``score`` is the sum
of the tests' scores (Gradescope takes a top-level score over the tests' sum). Before publication
a learner sees only the visible tests, whose scores are the same whatever the hidden checks did,
and no total (Gradescope shows none while tests are hidden); the summary line says only the
visible share.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from grading.course import REPO_ROOT

ROOT_ENV = "INFRA_AUTOGRADER_ROOT"
PYTHON_ENV = "INFRA_AUTOGRADER_PYTHON"
DEFAULT_ROOT = "/autograder"
# Gradescope's documented values for a test's "visibility"; hidden checks show once grades are published.
VISIBILITIES = ("hidden", "after_due_date", "after_published", "visible")
HIDDEN_CHECKS_VISIBILITY = "after_published"
# The opt-out that lets a bundle grade where bubblewrap cannot run, and the user its kernels run as then.
ALLOW_UNSANDBOXED = "--allow-unsandboxed"
KERNEL_USER = "nobody"
MISCONFIGURED = (
    "Nothing was graded: the autograder is misconfigured. This is not your mistake: please tell "
    "your instructor, who can grade your submission again once it is fixed."
)
# Gradescope stops an autograder at the assignment's time limit (10 minutes unless raised): the
# notebook's budget leaves time to start the grader and write the results.
BUDGET_S = 480.0


def split_points(points: float, visible: int, hidden: int) -> tuple[float, float]:
    """A task's points as (the visible checks' share, the hidden checks' share), in proportion to the
    number of checks of each kind; the visible share is rounded to 0.01 and the hidden one is the rest."""
    if not hidden:
        return points, 0.0
    shown = round(points * visible / (visible + hidden), 2)
    return shown, round(points - shown, 2)


def gradescope_tests(report) -> list[dict]:
    """Gradescope tests for a GradeReport: per test cell, a visible test scored on its visible checks
    with their share of the points, and, where it has hidden checks, a test shown once grades are
    published with the rest, which brings the pair to the cell's own score (see the module's notes)."""
    tests = []
    for test in report.tests:
        shown = [c for c in test.checks if not c.hidden]
        hidden = [c for c in test.checks if c.hidden]
        share, rest = split_points(test.max_score, len(shown), len(hidden))
        shown_passed = all(c.passed for c in shown)
        earned = share if shown_passed and share else 0.0
        if not hidden:
            earned = test.score
        output = [c.message for c in shown] or [
            f"This task has hidden checks only; its {_pts(rest)} point(s) show once grades are published."
        ]
        if hidden and shown:
            output.append(
                f"This task's other {_pts(rest)} point(s) rest on {len(hidden)} hidden check(s): "
                f"their results show once grades are published."
            )
        tests.append(_test(test.grade_id, earned, share, shown_passed, "\n".join(output), shown, "visible"))
        if hidden:
            settled = round(test.score - earned, 2)
            if settled < 0:
                why = (
                    f"A hidden check did not pass, and a task earns its points only when every check passes: "
                    f"the task gets none of its {_pts(test.max_score)} points, so this test takes back the "
                    f"{_pts(earned)} point(s) of the visible test above."
                )
            elif not shown_passed:
                why = (
                    f"The visible checks did not all pass, so the task gets none of its "
                    f"{_pts(test.max_score)} points, whatever the hidden checks gave."
                )
            else:
                why = ""
            text = "\n".join([why, *(c.message for c in hidden)] if why else [c.message for c in hidden])
            tests.append(
                _test(
                    f"{test.grade_id} (hidden checks)",
                    settled,
                    rest,
                    all(c.passed for c in hidden),
                    text,
                    hidden,
                    HIDDEN_CHECKS_VISIBILITY,
                )
            )
    return tests


def _pts(value: float) -> str:
    return f"{value:g}"


def _test(name: str, score: float, max_score: float, passed: bool, output: str, checks, visibility: str) -> dict:
    return {
        "name": name,
        "score": score,
        "max_score": max_score,
        "status": "passed" if passed else "failed",
        "output": output,
        "tags": sorted({c.reason for c in checks if not c.passed}),
        "visibility": visibility,
    }


def submission_results(report) -> dict:
    """results.json for a graded submission: the tests of :func:`gradescope_tests`, ``score`` their sum
    (equal to the course grader's), and a summary that gives the visible share only."""
    from grading.report import gradescope_results

    results = gradescope_results(report)
    tests = gradescope_tests(report)
    shown = [t for t in tests if t["visibility"] == "visible"]
    held = sum(t["max_score"] for t in tests) - sum(t["max_score"] for t in shown)
    summary = (
        f"{report.lab_id}: {_pts(round(sum(t['score'] for t in shown), 2))}/"
        f"{_pts(round(sum(t['max_score'] for t in shown), 2))} from the visible checks"
    )
    if held > 0:
        summary += (
            f"; {_pts(round(held, 2))} more point(s) rest on hidden checks, whose results show once "
            f"grades are published"
        )
    results.update(
        tests=tests,
        output=summary,
        score=round(sum(t["score"] for t in tests), 4),
        max_score=round(sum(t["max_score"] for t in tests), 4),
    )
    return results


def _protections_text(protections: dict) -> str:
    return "Protections while the notebook ran:\n" + "\n".join(f"- {k}: {v}" for k, v in protections.items())


def problem_results(lab_id: str, source_dir: Path, problem: str) -> dict:
    """results.json for a submission that could not be graded: 0 on every test cell, saying why."""
    from grading.notebook import NotebookError, read_notebook, test_cells

    try:
        cells = test_cells(read_notebook(source_dir / lab_id / f"{lab_id}.ipynb"))
    except NotebookError:  # no answer key to count the points from: the problem is still reported
        cells = []
    tests = []
    for cell in cells:
        hidden = sum(call.hidden for call in cell.checks)
        share, rest = split_points(cell.points, len(cell.checks) - hidden, hidden)
        tests.append(_not_graded(cell.grade_id, share, problem, "visible"))
        if hidden:
            tests.append(_not_graded(f"{cell.grade_id} (hidden checks)", rest, problem, HIDDEN_CHECKS_VISIBILITY))
    return {"score": 0.0, "max_score": round(sum(t["max_score"] for t in tests), 4), "output": problem, "tests": tests}


def _not_graded(name: str, max_score: float, problem: str, visibility: str) -> dict:
    return {
        "name": name,
        "score": 0.0,
        "max_score": max_score,
        "status": "failed",
        "output": problem,
        "tags": ["not graded"],
        "visibility": visibility,
    }


def submitted_notebook(submission: Path) -> Path:
    """The one notebook in the submission folder; ValueError saying what was found otherwise."""
    found = sorted(p.name for p in submission.iterdir()) if submission.is_dir() else []
    notebooks = [name for name in found if name.endswith(".ipynb")]
    if len(notebooks) == 1:
        return submission / notebooks[0]
    what = (
        f"{len(notebooks)} notebooks ({', '.join(notebooks)})"
        if notebooks
        else f"no notebook (.ipynb) ({'found: ' + ', '.join(found) if found else 'the submission is empty'})"
    )
    raise ValueError(
        f"Nothing was graded: the submission holds {what}. Submit exactly one file, "
        f"your lab notebook (.ipynb), and nothing else."
    )


def refusal_text(why: str, opt_out_problem: str = "") -> str:
    """What the instructor reads (run_autograder's standard output) when grading without bubblewrap
    is refused: ``why`` bubblewrap cannot run; ``opt_out_problem``, for a bundle that allows grading
    without it, why the answer key still could not be kept from the kernel."""
    lines = [f"REFUSED: nothing was graded, because the learner's kernel cannot run in bubblewrap here ({why})."]
    if opt_out_problem:
        lines.append(
            f"The bundle allows grading without bubblewrap ({ALLOW_UNSANDBOXED}), but then the kernel must "
            f"run as the user {KERNEL_USER}, kept from the answer key, and here {opt_out_problem}."
        )
    else:
        lines.append(
            "Without it the kernel would run as this grader's user and could read the answer key "
            "(source/solutions/) and change its own grade."
        )
    lines.append(
        "Each learner saw only that the autograder is misconfigured and to tell you. Fix it, then regrade "
        "all submissions: use a base image whose container may create namespaces (setup.sh's last line "
        "says whether bubblewrap works)"
        + (
            "."
            if opt_out_problem
            else f", or, knowing the kernel then runs outside any sandbox, rebuild the bundle with `infra-lab "
            f"gradescope LAB {ALLOW_UNSANDBOXED}`: it runs each kernel as the unprivileged user {KERNEL_USER}, "
            f"with solutions/ locked to root."
        )
    )
    return "\n".join(lines)


def _refused(lab_id: str, source_dir: Path, text: str) -> dict:
    """results.json when grading is refused: ``text`` to the instructor (standard output), every test 0,
    and to the learner only that the autograder is misconfigured."""
    print(text)
    return {**problem_results(lab_id, source_dir, MISCONFIGURED), "extra_data": {"status": "failed"}}


def lock_answer_key(folder: Path) -> list[Path]:
    """Make ``folder`` (the bundle's solutions/) root's alone: folders 0700, files 0600, owned by
    this process's user. Returns what it holds, itself included (links are left alone)."""
    locked = [folder]
    for parent, folders, files in os.walk(folder):
        locked += [Path(parent) / name for name in (*folders, *files)]
    for path in locked:
        if not path.is_symlink():
            os.chown(path, os.geteuid(), os.getegid())
            os.chmod(path, 0o700 if path.is_dir() else 0o600)
    return locked


# Run as the kernel's user: the course's Python and code must work for it, and none of the paths
# given may be open to it (a folder searchable, a file readable).
_PROBE = """import os, sys
import grading.run.sandbox
open_to_me = [p for p in sys.argv[1:] if os.access(p, os.X_OK if os.path.isdir(p) else os.R_OK)]
print("\\n".join(open_to_me))
sys.exit(3 if open_to_me else 0)
"""


def unsandboxed_problem(key_folder: Path, user: str = KERNEL_USER) -> str:
    """Why grading without bubblewrap cannot keep the answer key from the kernel here ("" when it can):
    this process must be root, ``user`` must exist and run the course's Python, and after
    :func:`lock_answer_key` nothing under ``key_folder`` may be open to it."""
    import pwd

    if os.geteuid() != 0:
        return (
            f"the grader runs as uid {os.geteuid()}, not root, so it cannot run the kernel as another user "
            f"and the kernel could read the answer key"
        )
    try:
        account = pwd.getpwnam(user)
    except KeyError:
        return f"there is no user {user!r} to run the kernel as"
    paths = lock_answer_key(key_folder)
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, *map(str, paths)],
            user=account.pw_uid,
            group=account.pw_gid,
            extra_groups=[],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{user} cannot run the course's Python ({sys.executable}): {exc}"
    if probe.returncode == 3:
        return f"the answer key stays open to {user} after locking it: {probe.stdout.split()[:3]}"
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        return (
            f"{user} cannot run the course's Python ({sys.executable}): {tail}; make the course and its "
            f"environment readable by every user"
        )
    return ""


def kernel_user_problem(protections: dict, user: str = KERNEL_USER) -> str:
    """Why a result graded without bubblewrap is not to be trusted ("" when it is): its kernel's
    launcher must have said that the kernel ran as ``user`` (``protections`` is the report's sandbox)."""
    ran_as = protections.get("user", "")
    if ran_as.startswith(f"the kernel ran as {user} "):
        return ""
    return f"the kernel's launcher said {ran_as or 'nothing'!r} of the user it ran as, so the result is not trusted"


def grade_submission(root: Path, lab_id: str, allow_unsandboxed: bool = False) -> dict:
    """Grade ``root/submission``'s one notebook as ``lab_id`` against ``root/source``; results.json's dict.

    In bubblewrap where it runs; else refused (every test 0, the reason printed for the instructor),
    unless ``allow_unsandboxed``: then the kernel runs as ``nobody`` with the answer key locked."""
    from grading.grader import GradingError, grade_notebook
    from grading.report import table
    from grading.run import bwrap
    from grading.run.sandbox import Limits

    source_dir = root / "source" / "solutions"
    sandboxed, why = bwrap.availability()
    if not sandboxed:
        problem = unsandboxed_problem(source_dir, KERNEL_USER) if allow_unsandboxed else ""
        if problem or not allow_unsandboxed:
            return _refused(lab_id, source_dir, refusal_text(why, problem))
    try:
        notebook = submitted_notebook(root / "submission")
    except ValueError as exc:
        return problem_results(lab_id, source_dir, str(exc))
    limits = Limits(budget=BUDGET_S, bwrap=sandboxed, kernel_user="" if sandboxed else KERNEL_USER)
    try:
        report = grade_notebook(notebook, lab_id=lab_id, source_dir=source_dir, limits=limits)
    except (GradingError, ValueError) as exc:
        return problem_results(lab_id, source_dir, f"Nothing was graded: {exc}")
    print(table(report))  # Gradescope shows run_autograder's output to instructors only
    if not sandboxed:
        untrusted = kernel_user_problem(report.sandbox, KERNEL_USER)
        if untrusted:
            return _refused(lab_id, source_dir, refusal_text(why, untrusted))
        report.sandbox["view"] = (
            f"no sandbox (the bundle allows grading without bubblewrap): the kernel could read "
            f"what every user may; solutions/, the answer key, was locked to root and checked "
            f"closed to {KERNEL_USER} before grading"
        )
    report.sandbox["sandbox"] = (
        f"bubblewrap ({why})"
        if sandboxed
        else (f"NOT used: {why}; graded anyway, as the bundle allows ({ALLOW_UNSANDBOXED})")
    )
    results = submission_results(report)
    results["output"] = "\n\n".join([results["output"], *report.notes, _protections_text(report.sandbox)])
    results["extra_data"]["course"] = str(REPO_ROOT)  # the source that graded
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m grading.gradescope run --lab LAB``: grade the submission under $INFRA_AUTOGRADER_ROOT."""
    parser = argparse.ArgumentParser(prog="python -m grading.gradescope")
    parser.add_argument("action", choices=["run"])
    parser.add_argument("--lab", required=True)
    parser.add_argument(
        ALLOW_UNSANDBOXED,
        action="store_true",
        help=f"where bubblewrap cannot run, grade anyway, the kernel run as {KERNEL_USER}",
    )
    args = parser.parse_args(argv)
    root = Path(os.environ.get(ROOT_ENV, DEFAULT_ROOT))
    try:
        results = grade_submission(root, args.lab, allow_unsandboxed=args.allow_unsandboxed)
    except Exception as exc:  # a grader bug: the learner still gets a result, the log the traceback
        import traceback

        traceback.print_exc()
        results = problem_results(
            args.lab,
            root / "source" / "solutions",
            f"Nothing was graded: internal grader error ({type(exc).__name__}: {exc}). Please tell your instructor.",
        )
    out = root / "results" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"{args.lab}: {results['score']:g}/{results['max_score']:g}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
