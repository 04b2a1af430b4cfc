"""Warm kernels (grading/run/warm.py): graded kernels fork from a template that has imported torch,
start from its pristine state every time, keep the sandbox's limits, and the grader still
counts and kills their processes; with the template turned off, kernels start cold as before."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from grading.grader import grade_notebook
from grading.run import warm
from grading.run.execute import STOP_BUDGET, execute
from grading.run.sandbox import Limits

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


def _notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _run(tmp_path: Path, name: str) -> tuple[dict, dict]:
    nb = _notebook("import json", PROBE)
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


def test_the_runner_forks_from_the_template_and_reports_how_the_run_ended(tmp_path, monkeypatch):
    """The process that drives a graded notebook (grading.run.execute) is forked by the template too, with
    papermill imported; its exit code (complete, the kernel died) comes back as a started runner's does."""
    from grading.run.execute import STOP_CRASH

    handles = []
    fork_runner = warm.fork_runner
    monkeypatch.setattr(warm, "fork_runner", lambda *a, **k: handles.append(fork_runner(*a, **k)) or handles[-1])
    first, _ = _run(tmp_path, "complete")
    assert isinstance(handles[0], warm.ForkedRunner) and handles[0].returncode == 0
    assert (tmp_path / "complete" / "runner.log.exit").read_text() == "0"
    assert first["parent"] == warm.template().process.pid  # its kernel, a sibling forked by the same template

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("import os\nos._exit(3)"),
        nbformat.v4.new_code_cell("y = 2"),
    ]
    (tmp_path / "dies").mkdir()
    died = execute(nb, tmp_path / "dies", parameters={}, env={}, limits=LIMITS, budget=120)
    assert isinstance(handles[1], warm.ForkedRunner)
    assert not died.complete and died.stop == STOP_CRASH and died.stopped_at == 1, (died.stop, died.reason)

    monkeypatch.setenv(warm.COLD_ENV, "1")  # no template: the runner starts as a process of its own
    assert fork_runner(["x"], tmp_path, {}, tmp_path / "log") is None


def test_the_template_forks_nothing_for_a_request_without_its_token():
    template = warm.template()
    if template is None:
        pytest.fail("no template: is the provisioner installed (`make`)?")
    deadline = time.monotonic() + 60
    while not template.socket_path.exists() and time.monotonic() < deadline:  # still importing torch
        time.sleep(0.1)
    before = {p.pid for p in psutil.Process(template.process.pid).children()}
    for message in (
        b'{"token": "guess", "cmd": [], "cwd": "/", "env": {}}\n',
        b"not json\n",
        json.dumps({"token": template.token, "cmd": ["sh", "-c", "id"], "cwd": "/", "env": {}}).encode() + b"\n",
        json.dumps(
            {"token": template.token, "runner": ["in.ipynb", 3], "cwd": "/", "env": {}, "log": "/l", "exit_file": "/e"}
        ).encode()
        + b"\n",
    ):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(10)
            client.connect(str(template.socket_path))
            client.sendall(message)
            assert client.makefile("rb").readline() == b"", "the template answered a request it should refuse"
    assert {p.pid for p in psutil.Process(template.process.pid).children()} == before


# What a plain kernel (a lesson's, nbgrader's) reports about itself.
PLAIN_PROBE = """
import json, os, resource, sys
print(json.dumps({"torch_before_import": "torch" in sys.modules, "parent": os.getppid(), "cwd": os.getcwd(),
                  "memory_limit": resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY,
                  "secrets": [k for k in os.environ if k.startswith("INFRA_LAB_WARM")],
                  "marker": os.environ.get("WARM_TEST_MARKER")}))
"""


def _plain_notebook(folder: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(PLAIN_PROBE)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / "probe.ipynb")
    return folder / "probe.ipynb"


def _probe_output(nb) -> dict:
    return json.loads("".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("output_type") == "stream"))


def test_a_lesson_kernel_is_a_plain_fork_and_starts_cold_on_request(tmp_path, monkeypatch):
    """papermill's kernels (the lessons in the suite and the site) fork from the template, torch
    imported, with no sandbox limits and without the template's socket and token; warm=False
    starts one cold."""
    import os

    monkeypatch.setenv("WARM_TEST_MARKER", "seen")
    source = _plain_notebook(tmp_path / "lesson")
    environ_before, probes = dict(os.environ), {}
    for warm_kernel in (True, False):
        out = warm.run_lesson(
            source,
            tmp_path / f"out-{warm_kernel}.ipynb",
            cwd=str(tmp_path / "lesson"),
            kernel_name="python3",
            progress_bar=False,
            warm=warm_kernel,
        )
        probes[warm_kernel] = _probe_output(out)
    assert environ_before == dict(os.environ), "plain_kernels() puts this process's environment back"
    forked, cold = probes[True], probes[False]
    assert forked["torch_before_import"] and forked["parent"] == warm.template().process.pid
    assert not cold["torch_before_import"] and cold["parent"] != warm.template().process.pid
    assert forked["secrets"] == [], "the template's socket and token stay out of the kernel"
    for probe in (forked, cold):
        assert probe["memory_limit"] and probe["marker"] == "seen"
        assert Path(probe["cwd"]).resolve() == (tmp_path / "lesson").resolve()


def test_nbgrader_config_forks_its_kernels_from_a_template_of_its_own(tmp_path, monkeypatch):
    """nbgrader_config.py's nbgrader_warm_kernels(): no template until the first kernel, then every
    python3 kernel forks from one the kernel manager's process started."""
    import os
    import subprocess
    import sys

    source = _plain_notebook(tmp_path / "nb")
    script = f"""
import json, os, sys
from grading.run import warm
assert warm.nbgrader_warm_kernels()
assert warm._template is None, "a template before any kernel"
from grading.run.papermill_ipc import run_with_papermill
outs = [run_with_papermill({str(source)!r}, {str(tmp_path)!r} + f"/out{{i}}.ipynb", cwd={str(tmp_path / "nb")!r},
                           kernel_name="python3", progress_bar=False) for i in range(2)]
probes = [json.loads(o.cells[0].outputs[0]["text"]) for o in outs]
print(json.dumps({{"template": warm._template.process.pid, "probes": probes}}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFRA_LAB_WARM")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for probe in report["probes"]:
        assert probe["torch_before_import"] and probe["parent"] == report["template"]
        assert probe["memory_limit"] and probe["secrets"] == []


def test_a_command_uses_the_template_its_environment_names():
    """A command run with a live template's socket and token in its environment (infra-lab grade from
    a test worker) forks its kernels from that template rather than starting its own; a stale name
    is ignored."""
    import os
    import subprocess
    import sys

    template = warm.template()
    deadline = time.monotonic() + 60
    while not template.socket_path.exists() and time.monotonic() < deadline:  # still importing torch
        time.sleep(0.1)
    script = "from grading.run import warm; t = warm.template(); print(type(t).__name__, t.socket_path)"
    base = {k: v for k, v in os.environ.items() if not k.startswith("INFRA_LAB_WARM")}
    named = subprocess.run(
        [sys.executable, "-c", script], env={**base, **template.env()}, capture_output=True, text=True, timeout=120
    )
    assert named.stdout.split() == ["_Inherited", str(template.socket_path)], named.stderr
    stale = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, warm.SOCKET_ENV: "/nonexistent/template.sock", warm.TOKEN_ENV: "x"},
    )
    assert stale.stdout.split()[0] == "Template" and stale.stdout.split()[1] != "/nonexistent/template.sock"


def test_the_watchdog_counts_a_process_tree_from_one_scan():
    """The runner's watchdog counts the kernel's processes from one pass over the process table per
    poll; it finds the same descendants psutil does, grandchildren included."""
    import subprocess

    from grading.run.execute import _count_descendants, _descendants, _process_tree

    shell = subprocess.Popen(["sh", "-c", "sleep 30 & (sleep 30 & wait) & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(_descendants(shell.pid)) < 3 and time.monotonic() < deadline:  # a sleep, a subshell and its sleep
            time.sleep(0.05)
        tree = _process_tree()
        assert _count_descendants(tree, shell.pid) == len(_descendants(shell.pid)) == 3
        assert _count_descendants(tree, -1) == 0
    finally:
        for proc in _descendants(shell.pid):
            proc.kill()
        shell.kill()
        shell.wait()


def test_the_template_refuses_to_fork_a_kernel_meant_to_run_as_another_user():
    """A forked kernel keeps the template's user (root where Gradescope grades): a kernel for another
    user must start cold, through the launcher, which drops privileges before the kernel runs."""
    cmd = [
        sys.executable,
        "-m",
        "grading.run.sandbox",
        "--status",
        "/s",
        "--memory-mb",
        "1",
        "--file-size-mb",
        "1",
        "--user",
        "nobody",
        "--",
        sys.executable,
        "-m",
        "ipykernel_launcher",
        "-f",
        "/c.json",
    ]
    with pytest.raises(ValueError, match="starts cold"):
        warm._valid({"cmd": cmd})
    warm._valid({"cmd": [a for a in cmd if a not in ("--user", "nobody")]})  # the same kernel as root forks


def test_a_cells_processor_time_counts_the_processes_it_starts(tmp_path):
    """The kernel itself only waits here, while a process it started computes: the cell is interrupted
    for its processor time (the child's counted), not after three times the limit of waiting."""
    nb = _notebook(
        "import subprocess, sys",
        "subprocess.run([sys.executable, '-c', 'while True: pass'])",
        "print('the next cell ran')",
    )
    limits = Limits(check_timeout=10, cell_timeout=3, budget=300, max_processes=16)
    result = execute(nb, tmp_path, parameters={}, env={}, limits=limits, budget=120)
    assert result.complete, result.reason
    assert result.cell_error(1) == ("KeyboardInterrupt", "the grader interrupted it after 3 s of processor time")
    assert "the next cell ran" in "".join(o.get("text", "") for o in result.notebook.cells[2].outputs)
    assert result.cpu_seconds >= 3


def test_the_notebooks_budget_is_processor_time(tmp_path):
    """Six cells compute for 1 s each, each under the cell's limit; together they pass the run's budget of
    3.5 s of processor time, which stops the run (the wall-clock budget, set far away, plays no part)."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1:\n    pass"
    nb = _notebook(*[burn] * 6)
    result = execute(nb, tmp_path, parameters={}, env={}, limits=LIMITS, budget=3.5, wall_budget=600)
    assert not result.complete and result.stop == STOP_BUDGET, (result.stop, result.reason)
    assert result.reason == "the notebook used its budget of 3.5 s of processor time"
    assert result.cpu_seconds > 3.5 and result.stopped_at is not None and result.stopped_at < 5


class _Found:
    """Stands for the forked kernel the clock follows: here, a process of the test's own."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)

    def _find(self):
        return self.proc


def test_a_process_starved_of_a_core_is_not_waiting():
    """A kernel ready to run that gets almost no core (three busy processes beside it on one core, at a
    higher priority) is not waiting: however little processor time it gets, the clock counts no waiting
    against its cell. A kernel asleep is waiting."""
    import os
    import subprocess

    from grading.run.execute import CellClock, _process_tree

    def start(code: str, nice: int = 0) -> subprocess.Popen:
        def pin():
            os.sched_setaffinity(0, {0})
            os.nice(nice)

        return subprocess.Popen([sys.executable, "-c", code], preexec_fn=pin, stdout=subprocess.PIPE, text=True)

    # Each says it is ready once Python has started (starting, it reads files: it waits, and rightly so).
    starved = start("print('ready', flush=True)\nwhile True: pass", nice=19)
    asleep = start("import time; print('ready', flush=True); time.sleep(60)")
    hogs = []
    try:
        assert starved.stdout.readline() == asleep.stdout.readline() == "ready\n"
        hogs = [start("while True: pass") for _ in range(3)]
        time.sleep(0.5)
        clocks = {
            name: CellClock(os.getpid(), _Found(p.pid), limit=100)
            for name, p in (("starved", starved), ("asleep", asleep))
        }
        first = None
        for _ in range(16):
            tree = _process_tree()
            for clock in clocks.values():
                assert clock.tick(("cell", 1), tree) == ""
            first = clocks["starved"].total if first is None else first
            time.sleep(0.25)
        assert clocks["starved"].waited < 0.5 < 3 < clocks["asleep"].waited, {n: c.waited for n, c in clocks.items()}
        got = clocks["starved"].total - first
        assert got < 0.05 * 3.75, got  # it got less of the core than counts as waiting: only its readiness did
    finally:
        for proc in (*hogs, starved, asleep):
            proc.kill()
            proc.wait()


def test_a_template_outlives_no_killed_grading_process():
    """The grading process is killed (SIGKILL: no clean-up runs) while a process it forked still holds the
    template's stdin open, so no end of file reaches the template: it exits all the same, its parent gone."""
    import os
    import signal
    import subprocess

    helper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "from grading.run import warm\n"
            "template = warm.Template()\n"
            "holder = os.fork()\n"  # a child of the grading process's own, holding every pipe it holds
            "if holder == 0:\n"
            "    time.sleep(120)\n"
            "    os._exit(0)\n"
            "print(template.process.pid, holder, flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    template, holder = (psutil.Process(int(pid)) for pid in helper.stdout.readline().split())
    try:
        helper.send_signal(signal.SIGKILL)
        helper.wait()
        assert holder.is_running() and holder.status() != psutil.STATUS_ZOMBIE, "the stdin holder must outlive it"
        template.wait(timeout=90)  # the template imports torch first (seconds), then sees its parent gone
    finally:
        for proc in (template, holder):
            try:
                proc.kill()
            except psutil.Error:
                pass
        os.killpg(helper.pid, signal.SIGKILL) if psutil.pid_exists(helper.pid) else None
