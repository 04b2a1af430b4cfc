"""`infra-lab gradescope LAB`: the autograder.zip Gradescope runs, and its run_autograder on an emulated
/autograder tree, grading with the bundled copy of the course (not the repository's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, SOLUTION01, answer_cells, write_learner_notebook
from grading.gradescope import PYTHON_ENV, ROOT_ENV, VISIBILITIES, build_bundle, gradescope_tests

LAB = "lab01_gemm"
WRONG_TASK1 = "def gemm_flops(m, n, k):\n    return m * n * k\n"
HOSTILE = REPO / "tests" / "adversarial" / "answer_key_reader.ipynb"


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
    assert sorted(n for n in names if n.startswith("solutions/")) == [f"solutions/{LAB}/{LAB}.ipynb"], \
        "the bundle must hold this lab's instructor notebook and no other lab's"
    assert not [n for n in names if "__pycache__" in n or ".ipynb_checkpoints" in n or n.endswith(".pyc")]
    assert {n.split("/")[0] for n in names} == {"setup.sh", "run_autograder", "pyproject.toml", "constraints.txt",
                                                 "README.md", "infra_lib", "grading", "solutions"}
    tracked = subprocess.run(["git", "ls-files", "infra_lib", "grading"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    missing = [n for n in tracked if (REPO / n).is_file() and n not in names]
    assert not missing, f"course files left out of the bundle: {missing}"


def test_bundle_leaves_out_checkpoints_caches_and_other_labs(tmp_path):
    course = tmp_path / "course"
    planted = ["pyproject.toml", "constraints.txt", "README.md", "infra_lib/__init__.py",
               "infra_lib/__pycache__/__init__.cpython-311.pyc", "grading/__init__.py", "grading/stray.pyc",
               f"solutions/{LAB}/{LAB}.ipynb", f"solutions/{LAB}/.ipynb_checkpoints/{LAB}-checkpoint.ipynb",
               "solutions/lab02_roofline/lab02_roofline.ipynb", "labs/lab01_gemm/lab01_gemm.ipynb", "tests/t.py"]
    for name in planted:
        (course / name).parent.mkdir(parents=True, exist_ok=True)
        (course / name).write_text("x")
    with zipfile.ZipFile(build_bundle(LAB, tmp_path / "out", course=course)) as archive:
        names = sorted(archive.namelist())
    assert names == sorted(["setup.sh", "run_autograder", "pyproject.toml", "constraints.txt", "README.md",
                            "infra_lib/__init__.py", "grading/__init__.py", f"solutions/{LAB}/{LAB}.ipynb"])
    with pytest.raises(ValueError, match="no lab named 'lab42'.*lab01_gemm, lab02_roofline"):
        build_bundle("lab42", tmp_path / "out", course=course)


def test_hidden_checks_are_their_own_tests_shown_after_publishing():
    from grading.grader import CheckResult, GradeReport, TestResult

    visible_ok = CheckResult("lab01.gemm_flops", False, True, "lab01.gemm_flops passed")
    hidden_bad = CheckResult("lab01.gemm_flops_shapes", True, False, "lab01.gemm_flops_shapes failed", "wrong result")
    report = GradeReport(LAB, "x.ipynb", 0, [TestResult("test_task1_gemm_flops", 0.0, 2.0, [visible_ok, hidden_bad])])
    shown, hidden = gradescope_tests(report)
    assert (shown["name"], shown["score"], shown["max_score"], shown["status"], shown["visibility"]) == \
        ("test_task1_gemm_flops", 0.0, 2.0, "failed", "visible")
    assert "gemm_flops_shapes" not in shown["output"] and "a hidden one did not" in shown["output"]
    assert (hidden["name"], hidden["max_score"], hidden["status"], hidden["visibility"], hidden["tags"]) == \
        ("test_task1_gemm_flops (hidden checks)", 0.0, "failed", "after_published", ["wrong result"])
    assert hidden["output"] == "lab01.gemm_flops_shapes failed"


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


def _autograder(bundle: Path, root: Path, files: dict[str, bytes]) -> subprocess.Popen:
    """Start the bundle's run_autograder on ``root`` (an emulated /autograder) with these submitted files."""
    _unzip(bundle, root / "source")
    (root / "submission").mkdir(parents=True)
    for name, data in files.items():
        (root / "submission" / name).write_bytes(data)
    # The grader starts its own kernels, as on Gradescope (not from this test worker's template).
    from grading import warm

    env = {k: v for k, v in os.environ.items() if k not in (warm.SOCKET_ENV, warm.TOKEN_ENV, "PYTHONPATH")}
    env.update({ROOT_ENV: str(root), PYTHON_ENV: sys.executable})
    return subprocess.Popen([str(root / "source" / "run_autograder")], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _results(process: subprocess.Popen, root: Path) -> dict:
    log = process.communicate(timeout=600)[0]
    assert process.returncode == 0, log
    return json.loads((root / "results" / "results.json").read_text())


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
    assert scores == {"honest": (10, 10), "wrong": (8, 10), "hostile": (0, 10), "empty": (0, 10), "two": (0, 10),
                      "malformed": (0, 10)}, {n: r["output"] for n, r in results.items()}
    for name in ("honest", "wrong", "hostile"):
        extra = results[name]["extra_data"]
        assert extra["course"] == str(tmp_path / name / "autograder" / "source"), "graded with the repository's code"
        assert extra["protections"]["view"].startswith("bubblewrap"), extra["protections"]
        assert "sandbox: bubblewrap" in results[name]["output"] and "view: bubblewrap" in results[name]["output"]
    for test in results["hostile"]["tests"]:  # the answers found no answer key, so they defined nothing
        assert test["status"] == "failed" and test["score"] == 0 and test["tags"] == ["error"], test
        assert test["name"].endswith("(hidden checks)") or "is not defined" in test["output"], test

    wrong = {t["name"]: t for t in results["wrong"]["tests"]}
    assert wrong["test_task1_gemm_flops"]["status"] == "failed" and wrong["test_task1_gemm_flops"]["tags"] == ["wrong result"]
    assert wrong["test_task1_gemm_flops (hidden checks)"]["visibility"] == "after_published"
    assert wrong["test_task2_time_op"]["score"] == 3
    for test in results["honest"]["tests"]:
        assert test["visibility"] in VISIBILITIES
        if test["name"].endswith("(hidden checks)"):  # shown once grades are published; the points are the cell's
            assert test["visibility"] == "after_published" and test["max_score"] == 0, test
        else:
            assert test["visibility"] == "visible" and test["max_score"] > 0, test
    assert sum(t["score"] for t in results["honest"]["tests"]) == 10

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
    cli = [sys.executable, "-m", "grading.cli", "gradescope"]
    built = subprocess.run([*cli, LAB, "--out", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert str(tmp_path / "autograder.zip") in built.stdout and "Upload it" in built.stdout
    assert zipfile.is_zipfile(tmp_path / "autograder.zip")
    refused = subprocess.run([*cli, "lab42_missing"], cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "lab42_missing" in refused.stderr
    assert "lab01_gemm" in refused.stderr  # names the labs there are
