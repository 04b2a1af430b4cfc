"""`infra-lab gradescope LAB`: the autograder.zip Gradescope runs, and its run_autograder on an emulated
/autograder tree, grading with the bundled copy of the course (not the repository's)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, SOLUTION01, answer_cells, write_learner_notebook

from course_tools.gradescope_bundle import build_bundle
from grading.gradescope import (
    ALLOW_UNSANDBOXED,
    KERNEL_USER,
    MISCONFIGURED,
    PYTHON_ENV,
    ROOT_ENV,
    VISIBILITIES,
    gradescope_tests,
    submission_results,
)

LAB = "lab01_gemm"
WRONG_TASK1 = "def gemm_flops(m, n, k):\n    return m * n * k\n"
HOSTILE = REPO / "tests" / "adversarial" / "answer_key_reader.ipynb"
# What bubblewrap says in a container that may not create namespaces (Docker's default profile).
NO_NAMESPACES = "bwrap: Creating new namespace failed: Operation not permitted"
# Task 1's answer reads the answer key where Gradescope keeps it (beside the interpreter's
# environment, /autograder/source/.venv) and pastes the key's answer; where the key cannot be read it
# answers wrongly on purpose, so that the task's score says which happened.
KEY_READER_OR_WRONG = """import json
import sys
import tempfile
from pathlib import Path

_key = Path(sys.prefix).parent / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb"
try:
    _cells = {c["metadata"].get("nbgrader", {}).get("grade_id"): "".join(c["source"])
              for c in json.loads(_key.read_text())["cells"]}
    _folder = Path(tempfile.mkdtemp())
    (_folder / "_key_task1.py").write_text("import statistics, time\\n" + _cells["task1_gemm_flops"])
    sys.path.insert(0, str(_folder))
    from _key_task1 import *
except PermissionError:
    def gemm_flops(m, n, k):
        return m * n * k
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return build_bundle(LAB, tmp_path_factory.mktemp("bundle"))


def _mode(info: zipfile.ZipInfo) -> int:
    return (info.external_attr >> 16) & 0o777


def test_bundle_holds_the_scripts_the_course_and_only_this_labs_answer_key(bundle):
    with zipfile.ZipFile(bundle) as archive:
        infos = {info.filename: info for info in archive.infolist()}
    names = set(infos)
    assert {"setup.sh", "run_autograder", "pyproject.toml", "constraints.txt", "README.md"} <= names
    assert _mode(infos["run_autograder"]) & 0o111 == 0o111, "run_autograder must be executable in the zip"
    assert _mode(infos["setup.sh"]) & 0o111 == 0o111
    assert sorted(n for n in names if n.startswith("solutions/")) == [f"solutions/{LAB}/{LAB}.ipynb"], (
        "the bundle must hold this lab's instructor notebook and no other lab's"
    )
    assert not [n for n in names if "__pycache__" in n or ".ipynb_checkpoints" in n or n.endswith(".pyc")]
    assert {n.split("/")[0] for n in names} == {
        "setup.sh",
        "run_autograder",
        "pyproject.toml",
        "constraints.txt",
        "README.md",
        "infra_lib",
        "grading",
        "solutions",
    }
    tracked = subprocess.run(
        ["git", "ls-files", "infra_lib", "grading"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    missing = [n for n in tracked if (REPO / n).is_file() and n not in names]
    assert not missing, f"course files left out of the bundle: {missing}"
    tooling = subprocess.run(
        ["git", "ls-files", "course_tools"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert tooling and not set(tooling) & names, "the course's tooling has no place in a grader's bundle"


def test_bundle_leaves_out_checkpoints_caches_and_other_labs(tmp_path):
    course = tmp_path / "course"
    planted = [
        "pyproject.toml",
        "constraints.txt",
        "README.md",
        "infra_lib/__init__.py",
        "infra_lib/__pycache__/__init__.cpython-311.pyc",
        "grading/__init__.py",
        "grading/stray.pyc",
        "course_tools/__init__.py",
        "course_tools/cli.py",
        f"solutions/{LAB}/{LAB}.ipynb",
        f"solutions/{LAB}/.ipynb_checkpoints/{LAB}-checkpoint.ipynb",
        "solutions/lab02_roofline/lab02_roofline.ipynb",
        "labs/lab01_gemm/lab01_gemm.ipynb",
        "tests/t.py",
    ]
    for name in planted:
        (course / name).parent.mkdir(parents=True, exist_ok=True)
        (course / name).write_text("x")
    with zipfile.ZipFile(build_bundle(LAB, tmp_path / "out", course=course)) as archive:
        names = sorted(archive.namelist())
    assert names == sorted(
        [
            "setup.sh",
            "run_autograder",
            "pyproject.toml",
            "constraints.txt",
            "README.md",
            "infra_lib/__init__.py",
            "grading/__init__.py",
            f"solutions/{LAB}/{LAB}.ipynb",
        ]
    )
    with pytest.raises(ValueError, match="no lab named 'lab42'.*lab01_gemm, lab02_roofline"):
        build_bundle("lab42", tmp_path / "out", course=course)


def _task(visible_passed: bool, hidden_passed: list[bool], points: float = 3.0):
    from grading.grader import CheckResult, TestResult

    checks = [
        CheckResult(
            "lab01.gemm_flops",
            False,
            visible_passed,
            f"visible {visible_passed}",
            "passed" if visible_passed else "wrong result",
        )
    ]
    checks += [
        CheckResult(f"lab01.hidden_{i}", True, ok, f"hidden {i} {ok}", "passed" if ok else "time-out")
        for i, ok in enumerate(hidden_passed)
    ]
    passed = all(c.passed for c in checks)
    return TestResult("test_task1_gemm_flops", points if passed else 0.0, points, checks)


def test_hidden_checks_points_are_held_apart_until_grades_are_published():
    """A task of 3 points with one visible and two hidden checks: a visible test worth 1 and a test
    shown after publishing worth 2. The visible test is the same whatever the hidden checks did, and
    each pair adds up to the course grader's all-or-nothing score."""
    from grading.grader import GradeReport

    cases = {
        "all pass": (True, [True, True]),
        "hidden fails": (True, [True, False]),
        "visible fails": (False, [True, True]),
        "both fail": (False, [False, True]),
    }
    pairs = {}
    for name, (visible, hidden) in cases.items():
        test = _task(visible, hidden)
        pairs[name] = gradescope_tests(GradeReport(LAB, "x.ipynb", 0, [test]))
        shown, held = pairs[name]
        assert shown["score"] + held["score"] == test.score, name
        assert (shown["name"], shown["max_score"], shown["visibility"]) == ("test_task1_gemm_flops", 1.0, "visible")
        assert (held["name"], held["max_score"], held["visibility"]) == (
            "test_task1_gemm_flops (hidden checks)",
            2.0,
            "after_published",
        )
        assert "hidden_" not in shown["output"] and "2 hidden check(s)" in shown["output"], shown["output"]
    assert pairs["all pass"][0] == pairs["hidden fails"][0], "the visible test must not tell a hidden failure"
    assert pairs["visible fails"][0] == pairs["both fail"][0]
    assert [t["score"] for t in pairs["all pass"]] == [1.0, 2.0]
    hidden_fails = pairs["hidden fails"][1]
    assert (hidden_fails["score"], hidden_fails["status"], hidden_fails["tags"]) == (-1.0, "failed", ["time-out"])
    assert "takes back the 1 point(s) of the visible test" in hidden_fails["output"]
    assert "hidden 1 False" in hidden_fails["output"]
    visible_fails = pairs["visible fails"]
    assert [t["score"] for t in visible_fails] == [0.0, 0.0] and visible_fails[1]["status"] == "passed"
    assert "whatever the hidden checks gave" in visible_fails[1]["output"]


def test_results_score_is_the_sum_of_the_tests_and_the_summary_gives_the_visible_share_only():
    from grading.grader import CheckResult, GradeReport, TestResult

    visible_only = TestResult("test_task2_time_op", 3.0, 3.0, [CheckResult("lab01.time_op_warmup", False, True, "ok")])
    for hidden in ([True, True], [True, False]):
        report = GradeReport(LAB, "x.ipynb", 0, [_task(True, hidden, points=2.0), visible_only])
        results = submission_results(report)
        assert results["score"] == sum(t["score"] for t in results["tests"]) == report.score
        assert results["max_score"] == sum(t["max_score"] for t in results["tests"]) == report.max_score == 5.0
        assert [t["max_score"] for t in results["tests"]] == [0.67, 1.33, 3.0]
        # the visible share (1 check of 3 in task 1, all of task 2): the same line either way
        assert results["output"] == (
            "lab01_gemm: 3.67/3.67 from the visible checks; 1.33 more point(s) rest on "
            "hidden checks, whose results show once grades are published"
        )


def test_bundle_scripts_parse_and_setup_installs_the_pinned_course(bundle, tmp_path):
    with zipfile.ZipFile(bundle) as archive:
        archive.extractall(tmp_path)
    for script in ("setup.sh", "run_autograder"):
        checked = subprocess.run(["bash", "-n", str(tmp_path / script)], capture_output=True, text=True)
        assert checked.returncode == 0, f"{script}: {checked.stderr}"
    setup = (tmp_path / "setup.sh").read_text()
    assert "set -euo pipefail" in setup and "python3.11 -m venv" in setup and "bubblewrap" in setup
    assert '--constraint "$SOURCE/constraints.txt"' in setup and '-e "$SOURCE"' in setup
    assert "torch==2.13.0" in (tmp_path / "constraints.txt").read_text().splitlines()


def _unzip(bundle: Path, source: Path) -> None:
    """Unpack as Gradescope does, keeping each file's permissions (zipfile alone drops them)."""
    with zipfile.ZipFile(bundle) as archive:
        for info in archive.infolist():
            archive.extract(info, source)
            os.chmod(source / info.filename, _mode(info))


def _autograder(
    bundle: Path,
    root: Path,
    files: dict[str, bytes],
    *,
    unzip: bool = True,
    python: str | None = sys.executable,
    path: Path | None = None,
) -> subprocess.Popen:
    """Start the bundle's run_autograder on ``root`` (an emulated /autograder) with these submitted files.
    ``python``: the interpreter (None: the bundle's own source/.venv, as on Gradescope); ``path``: a
    folder put first on PATH."""
    if unzip:
        _unzip(bundle, root / "source")
    (root / "submission").mkdir(parents=True)
    for name, data in files.items():
        (root / "submission" / name).write_bytes(data)
    # The grader starts its own kernels, as on Gradescope (not from this test worker's template).
    from grading.run import warm

    env = {k: v for k, v in os.environ.items() if k not in (warm.SOCKET_ENV, warm.TOKEN_ENV, "PYTHONPATH")}
    env.update({ROOT_ENV: str(root), **({PYTHON_ENV: python} if python else {})})
    if path is not None:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    return subprocess.Popen(
        [str(root / "source" / "run_autograder")],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _results(process: subprocess.Popen, root: Path) -> dict:
    return _run(process, root)[0]


def _notebook(tmp_path: Path, answers: dict[str, str]) -> bytes:
    return write_learner_notebook(tmp_path / "learner" / f"{LAB}.ipynb", answers).read_bytes()


@pytest.mark.slow
def test_run_autograder_grades_in_the_sandbox_and_always_writes_results(bundle, tmp_path):
    """The honest notebook scores 10, task 1 wrong 8, the answer-key reader 0 (in bubblewrap); an empty
    submission, two notebooks and a malformed one score 0 and say why. All run side by side."""
    honest = answer_cells(SOLUTION01)
    submissions = {
        "honest": {f"{LAB}.ipynb": _notebook(tmp_path / "h", honest)},
        "wrong": {f"{LAB}.ipynb": _notebook(tmp_path / "w", {**honest, "task1_gemm_flops": WRONG_TASK1})},
        "hostile": {f"{LAB}.ipynb": HOSTILE.read_bytes()},
        "empty": {},
        "two": {f"{LAB}.ipynb": b"{}", "copy.ipynb": b"{}"},
        "malformed": {f"{LAB}.ipynb": b'{"cells": ['},
    }
    running = {name: _autograder(bundle, tmp_path / name / "autograder", files) for name, files in submissions.items()}
    results = {name: _results(process, tmp_path / name / "autograder") for name, process in running.items()}

    scores = {name: (r["score"], r["max_score"]) for name, r in results.items()}
    assert scores == {
        "honest": (10, 10),
        "wrong": (8, 10),
        "hostile": (0, 10),
        "empty": (0, 10),
        "two": (0, 10),
        "malformed": (0, 10),
    }, {n: r["output"] for n, r in results.items()}
    for name in ("honest", "wrong", "hostile"):
        extra = results[name]["extra_data"]
        assert extra["course"] == str(tmp_path / name / "autograder" / "source"), "graded with the repository's code"
        assert extra["protections"]["view"].startswith("bubblewrap"), extra["protections"]
        assert "sandbox: bubblewrap" in results[name]["output"] and "view: bubblewrap" in results[name]["output"]
    for test in results["hostile"]["tests"]:  # the answers found no answer key, so they defined nothing
        assert test["status"] == "failed" and test["score"] == 0 and test["tags"] == ["error"], test
        assert test["name"].endswith("(hidden checks)") or "is not defined" in test["output"], test

    wrong = {t["name"]: t for t in results["wrong"]["tests"]}
    assert wrong["test_task1_gemm_flops"]["status"] == "failed" and wrong["test_task1_gemm_flops"]["tags"] == [
        "wrong result"
    ]
    assert wrong["test_task1_gemm_flops (hidden checks)"]["visibility"] == "after_published"
    assert wrong["test_task2_time_op"]["score"] + wrong["test_task2_time_op (hidden checks)"]["score"] == 3
    for test in results["honest"]["tests"]:
        assert test["visibility"] in VISIBILITIES
        if test["name"].endswith("(hidden checks)"):  # shown once grades are published, with the hidden share
            assert test["visibility"] == "after_published" and test["max_score"] > 0, test
        else:
            assert test["visibility"] == "visible" and test["max_score"] > 0, test
    assert sum(t["score"] for t in results["honest"]["tests"]) == results["honest"]["score"] == 10
    # the visible tests carry the visible checks' share (one visible check of two, two, three, two)
    assert sum(t["max_score"] for t in results["honest"]["tests"] if t["visibility"] == "visible") == 4.5

    assert "the submission is empty" in results["empty"]["output"]
    assert "2 notebooks (copy.ipynb, lab01_gemm.ipynb)" in results["two"]["output"]
    assert "not valid notebook JSON" in results["malformed"]["output"]
    for name in ("empty", "two", "malformed"):
        assert all(t["score"] == 0 and t["status"] == "failed" for t in results[name]["tests"]), results[name]


def test_run_autograder_writes_a_result_even_when_the_grader_cannot_start(bundle, tmp_path):
    root = tmp_path / "autograder"
    _unzip(bundle, root / "source")
    (root / "submission").mkdir()
    env = {**os.environ, ROOT_ENV: str(root), PYTHON_ENV: str(tmp_path / "no-venv" / "python")}
    run = subprocess.run([str(root / "source" / "run_autograder")], env=env, capture_output=True, text=True)
    assert run.returncode != 0
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] == 0 and "failed before grading anything" in results["output"]


def test_cli_builds_the_bundle_and_refuses_an_unknown_lab(tmp_path):
    cli = [sys.executable, "-m", "course_tools.cli", "gradescope"]
    built = subprocess.run([*cli, LAB, "--out", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert str(tmp_path / "autograder.zip") in built.stdout and "Upload it" in built.stdout
    assert zipfile.is_zipfile(tmp_path / "autograder.zip")
    refused = subprocess.run([*cli, "lab42_missing"], cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "lab42_missing" in refused.stderr
    assert "lab01_gemm" in refused.stderr  # names the labs there are


def _no_namespaces(folder: Path) -> Path:
    """A folder holding a ``bwrap`` that fails as bubblewrap does in a container without namespaces."""
    folder.mkdir(parents=True, exist_ok=True)
    stub = folder / "bwrap"
    stub.write_text(f"#!/bin/sh\necho '{NO_NAMESPACES}' >&2\nexit 1\n")
    stub.chmod(0o755)
    return folder


def _run(process: subprocess.Popen, root: Path) -> tuple[dict, str]:
    log = process.communicate(timeout=600)[0]
    assert process.returncode == 0, log
    return json.loads((root / "results" / "results.json").read_text()), log


def test_run_autograder_refuses_where_bubblewrap_cannot_run(bundle, tmp_path):
    """The default bundle where bubblewrap cannot create namespaces: an honest notebook is not graded,
    every test scores 0, the learner reads only that the autograder is misconfigured, and the
    instructor's log says why and what to do. No kernel is started."""
    root = tmp_path / "autograder"
    honest = _notebook(tmp_path, answer_cells(SOLUTION01))
    results, log = _run(
        _autograder(bundle, root, {f"{LAB}.ipynb": honest}, path=_no_namespaces(tmp_path / "stub")), root
    )
    assert results["score"] == 0 and results["max_score"] == 10
    assert results["tests"] and all(t["score"] == 0 and t["status"] == "failed" for t in results["tests"])
    assert {t["output"] for t in results["tests"]} == {results["output"]} == {MISCONFIGURED}
    for learner_text in (results["output"], json.dumps(results["tests"])):
        assert "bubblewrap" not in learner_text and "solutions" not in learner_text
    assert "REFUSED: nothing was graded" in log and NO_NAMESPACES in log and ALLOW_UNSANDBOXED in log, log
    assert "protections" not in results.get("extra_data", {}), "a refusal runs nothing"


def test_an_opted_out_bundle_records_it_and_its_build_warns(tmp_path):
    cli = [sys.executable, "-m", "course_tools.cli", "gradescope", LAB, "--out"]
    built = subprocess.run([*cli, str(tmp_path / "out"), ALLOW_UNSANDBOXED], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert built.stderr.startswith("warning: this bundle grades even where bubblewrap cannot run")
    assert f"as the user {KERNEL_USER}" in built.stderr
    with zipfile.ZipFile(tmp_path / "out" / "autograder.zip") as archive:
        script = archive.read("run_autograder").decode()
    assert f"grading.gradescope run --lab {LAB} {ALLOW_UNSANDBOXED} ||" in script
    plain = build_bundle(LAB, tmp_path / "plain")
    with zipfile.ZipFile(plain) as archive:
        assert ALLOW_UNSANDBOXED not in archive.read("run_autograder").decode()


def test_opted_out_grading_refuses_when_it_cannot_keep_the_key_from_the_kernel(tmp_path, monkeypatch, capsys):
    """Allowed to grade without bubblewrap, the grader still refuses where the kernel's user does not
    exist, and refuses a result whose kernel did not say it ran as that user."""
    from grading import gradescope
    from grading.run import bwrap

    root = tmp_path / "autograder"
    (root / "source" / "solutions" / LAB).mkdir(parents=True)
    shutil.copy(SOLUTION01, root / "source" / "solutions" / LAB / f"{LAB}.ipynb")
    (root / "submission").mkdir()
    shutil.copy(SOLUTION01, root / "submission" / f"{LAB}.ipynb")
    monkeypatch.setattr(bwrap, "availability", lambda: (False, f"bwrap cannot create namespaces ({NO_NAMESPACES})"))

    monkeypatch.setattr(gradescope, "KERNEL_USER", "no-such-user-here")
    results = gradescope.grade_submission(root, LAB, allow_unsandboxed=True)
    assert results["score"] == 0 and results["output"] == MISCONFIGURED
    assert "there is no user 'no-such-user-here'" in capsys.readouterr().out

    # and a result is trusted only when the kernel's launcher said it ran as that user
    assert gradescope.kernel_user_problem({"network": "isolated"}, KERNEL_USER).endswith("result is not trusted")
    assert gradescope.kernel_user_problem({"user": "NOT dropped: EPERM"}, KERNEL_USER)
    assert not gradescope.kernel_user_problem({"user": f"the kernel ran as {KERNEL_USER} (uid 65534), ..."})


@pytest.fixture
def open_tmp():
    """A folder under /tmp that every user may enter (pytest's own are root's alone), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="autograder-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _runs_as(user: str, python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "pass"], user=user, cwd="/", capture_output=True).returncode == 0
    except OSError:
        return False


def _bundle_venv(source: Path, python: str, user: str | None = None) -> Path:
    """``source/.venv``, where Gradescope's setup.sh puts it, made from ``python`` (or, where ``user``
    cannot run that one, from the system's interpreter of the same version) and seeing this
    environment's packages. The course's environment here may live under root's home, which no other
    user may enter; on Gradescope it is made from the system's python3.11."""
    if user is not None and not _runs_as(user, python):
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        python = shutil.which(version, path="/usr/local/bin:/usr/bin") or ""
        assert python and _runs_as(user, python), f"no {version} here that {user} can run"
    venv = source / ".venv"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    (site_packages,) = venv.glob("lib/python3.*/site-packages")
    packages = sysconfig.get_paths()["purelib"]
    (site_packages / "course-environment.pth").write_text(f"import site; site.addsitedir({packages!r})\n")
    return venv / "bin" / "python"


def test_bubblewrap_hides_the_answer_key_in_the_gradescope_layout(bundle, open_tmp):
    """On Gradescope the environment sits inside the bundle (/autograder/source/.venv) beside
    solutions/: the kernel's view holds the environment and the course's code, and no answer key,
    submission or results."""
    root = open_tmp / "autograder"
    _unzip(bundle, root / "source")
    for folder in ("submission", "results"):
        (root / folder).mkdir()
    python = _bundle_venv(root / "source", sys.executable)
    scratch = open_tmp / "kernel"
    prefix = subprocess.run(
        [
            str(python),
            "-c",
            "import json, sys; from grading.run import bwrap; "
            "print(json.dumps([sys.prefix, bwrap.kernel_prefix(sys.argv[1])]))",
            str(scratch),
        ],
        cwd=root / "source",
        env={**os.environ, "PYTHONPATH": str(root / "source")},
        capture_output=True,
        text=True,
        check=True,
    )
    prefix_of_venv, command = json.loads(prefix.stdout)
    assert prefix_of_venv == str(root / "source" / ".venv")
    key = root / "source" / "solutions" / LAB / f"{LAB}.ipynb"
    assert key.is_file()
    seen = subprocess.run(
        [*command, "/bin/sh", "-c", f'ls -A "{root}" "{root}/source"; cat "{key}" >/dev/null'],
        capture_output=True,
        text=True,
    )
    assert seen.returncode != 0 and "No such file or directory" in seen.stderr, seen
    assert seen.stdout.split("\n\n") == [f"{root}:\nsource", f"{root}/source:\n.venv\ngrading\ninfra_lib\n"], (
        seen.stdout
    )


@pytest.fixture
def packages_open_to_others():
    """This environment's packages made reachable by another user for the test, as a Gradescope image's
    are: a checkout made by ``mktemp -d`` (mode 0700) shuts them in. Each folder above them that others
    may not enter gets the enter bit (x, not r) for the test's length, and its mode back after."""
    changed = []
    folder = Path(sysconfig.get_paths()["purelib"]).resolve()
    for parent in [folder, *folder.parents]:
        mode = stat.S_IMODE(parent.stat().st_mode)
        if not mode & stat.S_IXOTH:
            changed.append((parent, mode))
            parent.chmod(mode | stat.S_IXOTH)
    yield
    for parent, mode in changed:
        parent.chmod(mode)


@pytest.mark.slow
def test_an_opted_out_bundle_grades_as_nobody_and_the_key_stays_out_of_reach(
    open_tmp, tmp_path, packages_open_to_others
):
    """Built with --allow-unsandboxed, where bubblewrap cannot run: the honest answers score, and the
    answer that reads the key from where Gradescope keeps it meets a permission error (its wrong
    fallback loses task 1: 8 of 10, where the key read would have given 10)."""
    bundle = build_bundle(LAB, tmp_path / "bundle", allow_unsandboxed=True)
    root = open_tmp / "autograder"
    _unzip(bundle, root / "source")
    _bundle_venv(root / "source", sys.executable, user=KERNEL_USER)
    answers = {**answer_cells(SOLUTION01), "task1_gemm_flops": KEY_READER_OR_WRONG}
    run = _autograder(
        bundle,
        root,
        {f"{LAB}.ipynb": _notebook(tmp_path, answers)},
        unzip=False,
        python=None,
        path=_no_namespaces(tmp_path / "stub"),
    )
    results, log = _run(run, root)

    assert "REFUSED" not in log, log
    assert (results["score"], results["max_score"]) == (8, 10), results["output"]
    tests = {t["name"]: t for t in results["tests"]}
    assert tests["test_task1_gemm_flops"]["tags"] == ["wrong result"], tests["test_task1_gemm_flops"]
    assert sum(t["score"] for t in results["tests"]) == 8
    extra = results["extra_data"]
    assert extra["course"] == str(root / "source"), "graded with the repository's code"
    assert extra["protections"]["user"].startswith(f"the kernel ran as {KERNEL_USER} "), extra["protections"]
    assert extra["protections"]["sandbox"].startswith("NOT used") and NO_NAMESPACES in extra["protections"]["sandbox"]
    key = root / "source" / "solutions" / LAB / f"{LAB}.ipynb"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.parent.stat().st_mode) == 0o700
