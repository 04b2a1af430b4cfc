"""Warm kernels (grading/warm.py): graded kernels fork from a template that has imported torch,
start from its pristine state every time, keep the sandbox's limits, and the grader still
counts and kills their processes; with the template turned off, kernels start cold as before."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from grading import warm
from grading.grader import grade_notebook
from grading.runner import execute
from grading.sandbox import Limits

CORPUS = Path(__file__).resolve().parent / "adversarial"
LIMITS = Limits(check_timeout=10, cell_timeout=15, budget=300, max_processes=16)

pytestmark = pytest.mark.skipif(not warm.enabled(), reason="no fork on this platform: kernels always start cold")

# What one kernel leaves behind in a module the template imported, and whether the next kernel sees it.
PROBE = """
import os, random, torch
print(json.dumps({"left_by_an_earlier_kernel": getattr(torch, "_mark", None), "pid": os.getpid(),
                  "parent": os.getppid(), "draw": random.random()}))
torch._mark = os.getpid()
"""


def _run(tmp_path: Path, name: str) -> tuple[dict, dict]:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import json"), nbformat.v4.new_code_cell(PROBE)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    workdir = tmp_path / name
    workdir.mkdir()
    result = execute(nb, workdir, parameters={}, env={}, limits=LIMITS, budget=120)
    assert result.complete, result.reason
    text = "".join(o.get("text", "") for o in result.notebook.cells[1].outputs if o.get("output_type") == "stream")
    return json.loads(text), result.sandbox


def test_each_graded_kernel_is_a_fresh_fork_of_the_template(tmp_path):
    if not warm.provisioner_installed():
        pytest.fail("the infra-lab-warm kernel provisioner is not installed: run `make` (pip install -e .)")
    first, status = _run(tmp_path, "first")
    second, _ = _run(tmp_path, "second")
    template = warm.template()
    assert "forked" in status.get("kernel", ""), status
    assert "memory" in status and "network" in status, "the forked kernel applies the sandbox's limits"
    for probe in (first, second):
        assert probe["left_by_an_earlier_kernel"] is None, "a kernel saw what an earlier one left in torch"
        assert probe["parent"] == template.process.pid
    assert first["pid"] != second["pid"] and first["draw"] != second["draw"], "each kernel draws its own randoms"
    assert not psutil.pid_exists(first["pid"]) or psutil.Process(first["pid"]).status() == psutil.STATUS_ZOMBIE


def test_forked_kernels_keep_the_limits_and_their_processes_are_counted(tmp_path):
    for name, score, reason in (("memory_bomb", 7, "memory limit"), ("fork_bomb", 8, "process limit")):
        report = grade_notebook(CORPUS / f"{name}.ipynb", lab_id="lab01_gemm", limits=LIMITS)
        assert "forked" in report.sandbox.get("kernel", ""), report.sandbox
        assert report.score == score and reason in {c.reason for t in report.tests for c in t.checks}


def test_kernels_start_cold_when_the_template_is_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv(warm.COLD_ENV, "1")
    report = grade_notebook(CORPUS / "memory_bomb.ipynb", lab_id="lab01_gemm", limits=LIMITS)
    assert "kernel" not in report.sandbox and "memory" in report.sandbox
    assert report.score == 7 and "memory limit" in {c.reason for t in report.tests for c in t.checks}


def test_the_template_forks_nothing_for_a_request_without_its_token():
    template = warm.template()
    if template is None:
        pytest.fail("no template: is the provisioner installed (`make`)?")
    deadline = time.monotonic() + 60
    while not template.socket_path.exists() and time.monotonic() < deadline:  # still importing torch
        time.sleep(0.1)
    before = {p.pid for p in psutil.Process(template.process.pid).children()}
    for message in (b'{"token": "guess", "cmd": [], "cwd": "/", "env": {}}\n', b"not json\n",
                    json.dumps({"token": template.token, "cmd": ["sh", "-c", "id"], "cwd": "/", "env": {}}).encode()
                    + b"\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(10)
            client.connect(str(template.socket_path))
            client.sendall(message)
            assert client.makefile("rb").readline() == b"", "the template answered a request it should refuse"
    assert {p.pid for p in psutil.Process(template.process.pid).children()} == before
