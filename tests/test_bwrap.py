"""The graded kernel in bubblewrap: each protection tested from inside a kernel the grader started,
and a class graded by `infra-lab grade --submissions` where one learner reads the answer key."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import REPO

from grading.course import PACKAGES
from grading.run import warm
from grading.run.execute import execute
from grading.run.sandbox import Limits

PROBE = """
import json, os, socket, threading
from pathlib import Path

REPO, OUTSIDE, GRADER_PID, PORT = {repo!r}, {outside!r}, {grader_pid}, {port}
TEMPLATE, OUTSIDE_ROOT = {template!r}, os.path.dirname(OUTSIDE)
seen = {{}}
seen["solutions"] = os.path.exists(os.path.join(REPO, "solutions"))
seen["other learner"] = os.path.exists(os.path.join(OUTSIDE, "submissions", "bob", "lab01_gemm.ipynb"))
seen["grades"] = os.path.exists(os.path.join(OUTSIDE, "grades"))
seen["home"] = sorted(os.listdir(os.path.expanduser("~root"))) if os.path.isdir(os.path.expanduser("~root")) else []
seen["course folder"] = sorted(os.listdir(REPO))
wrote = {{}}
for target in ("infra_lib/_probe.py", "grading/_probe.py", "solutions/_probe.py", "_probe.py"):
    try:
        Path(REPO, target).write_text("written by a graded kernel")
        wrote[target] = True
    except OSError:
        wrote[target] = False
for target in ("/etc/_probe", "/usr/_probe", os.path.join(OUTSIDE, "_probe")):
    try:
        Path(target).write_text("x")
        wrote[target] = True
    except OSError:
        wrote[target] = False
Path("scratch_file").write_text("mine")
wrote["scratch"] = Path("scratch_file").read_text() == "mine"
try:
    socket.create_connection(("127.0.0.1", PORT), timeout=3).close()
    seen["grader's server"] = True
except OSError:
    seen["grader's server"] = False
try:
    os.kill(GRADER_PID, 0)
    seen["grader's process"] = True
except ProcessLookupError:
    seen["grader's process"] = False
seen["processes"] = len([p for p in os.listdir("/proc") if p.isdigit()])
seen["template"] = any(os.path.exists(path) for path in TEMPLATE)
seen["course modules"] = sorted(m for m in __import__("sys").modules if m.split(".")[0] in ("grading", "infra_lib"))
status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
seen["identity"] = {{**{{k: status[k].split() for k in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd",
                                                   "CapAmb", "NoNewPrivs", "Seccomp")}},
                    "host": socket.gethostname(), "root": sorted(os.listdir("/")),
                    "mounts": sorted(line.split()[4].replace(OUTSIDE_ROOT, "<tmp>") + " "
                                     + line.split(" - ")[1].split()[0]
                                     for line in Path("/proc/self/mountinfo").read_text().splitlines())}}
release, started = threading.Event(), 0
try:
    for _ in range(2000):
        threading.Thread(target=release.wait, daemon=True).start()
        started += 1
except RuntimeError:
    pass
release.set()
seen["threads started"] = started
print("PROBE " + json.dumps({{"seen": seen, "wrote": wrote}}))
"""


def _probe(tmp_path: Path, limits: Limits, template: Path | None = None) -> dict:
    """Run PROBE in a kernel the grader starts under ``limits``; ``template``: the socket of the
    grader's warm template, which the kernel must not see (nor its folder)."""
    template = [str(template), str(template.parent)] if template else []
    outside = tmp_path / "outside"
    (outside / "submissions" / "bob").mkdir(parents=True)
    (outside / "submissions" / "bob" / "lab01_gemm.ipynb").write_text("{}")
    (outside / "grades").mkdir()
    with socket.socket() as server:  # a server of the grader's, on the host's loopback
        server.bind(("127.0.0.1", 0))
        server.listen()
        nb = nbformat.v4.new_notebook()
        nb.cells.append(
            nbformat.v4.new_code_cell(
                PROBE.format(
                    repo=str(REPO),
                    outside=str(outside),
                    grader_pid=os.getpid(),
                    template=template,
                    port=server.getsockname()[1],
                )
            )
        )
        work = tmp_path / "work"
        work.mkdir()
        run = execute(nb, work, parameters={}, env={}, limits=limits, budget=120)
    assert run.complete, run.reason
    text = "".join(o.get("text", "") for o in run.notebook.cells[0].outputs)
    assert "PROBE " in text, run.notebook.cells[0].outputs
    return {**json.loads(text.split("PROBE ", 1)[1]), "sandbox": run.sandbox, "work": work}


def _assert_confined(found: dict, tmp_path: Path) -> None:
    seen, wrote = found["seen"], found["wrote"]
    assert not seen["solutions"], "the answer key is visible to the graded kernel"
    assert not seen["other learner"] and not seen["grades"], "other learners' work or the grades are visible"
    assert seen["course folder"] == sorted([".venv", "grading", "infra_lib"]) or set(seen["course folder"]) <= {
        ".venv",
        "grading",
        "infra_lib",
    }, seen["course folder"]
    assert seen["home"] in ([], [".pyenv"]), f"the instructor's home is visible: {seen['home']}"
    # The course root itself is a folder bubblewrap made to hold the read-only parts: read-only when it
    # sits on the view's root, on the kernel's private /tmp when the course lives under /tmp. Either
    # way nothing reaches the real folder (asserted below).
    wrote.pop("_probe.py")
    assert wrote == {
        "infra_lib/_probe.py": False,
        "grading/_probe.py": False,
        "solutions/_probe.py": False,
        "/etc/_probe": False,
        "/usr/_probe": False,
        str(tmp_path / "outside" / "_probe"): False,
        "scratch": True,
    }
    assert (found["work"] / "kernel" / "scratch_file").read_text() == "mine"  # the scratch is the real folder
    for written in ("infra_lib/_probe.py", "grading/_probe.py", "solutions/_probe.py", "_probe.py"):
        assert not (REPO / written).exists(), f"the graded kernel wrote {written} in the course"
    assert not (tmp_path / "outside" / "_probe").exists()
    assert not seen["grader's server"], "the kernel reached a server on the grader's loopback"
    assert not seen["grader's process"] and seen["processes"] <= 4, "the kernel sees the grader's processes"
    assert not seen["template"], "the kernel can reach the grader's template"
    assert found["sandbox"]["view"].startswith("bubblewrap") and "bubblewrap" in found["sandbox"]["network"]


def test_a_kernel_in_bubblewrap_sees_and_writes_only_its_scratch(tmp_path, monkeypatch):
    """The kernel forked from the grader's template (torch imported) and moved into bubblewrap's
    sandbox is confined exactly as one bubblewrap starts cold: same view and mounts, host name,
    user, groups, capabilities and no-new-privileges, and none of the course modules the template
    had imported (the kernel imports them again from its view, where a lab's reference is a stub)."""
    socket_path = warm.template().socket_path
    warm_found = _probe(tmp_path / "warm", Limits(bwrap=True, max_processes=8), socket_path)
    assert "forked from the grader's template" in warm_found["sandbox"]["kernel"], warm_found["sandbox"]
    assert "grading.run.execute" not in warm_found["seen"]["course modules"], warm_found["seen"]["course modules"]
    _assert_confined(warm_found, tmp_path / "warm")
    monkeypatch.setenv(warm.COLD_ENV, "1")
    cold_found = _probe(tmp_path / "cold", Limits(bwrap=True, max_processes=8), socket_path)
    assert "kernel" not in cold_found["sandbox"], cold_found["sandbox"]
    _assert_confined(cold_found, tmp_path / "cold")
    assert warm_found["seen"]["identity"] == cold_found["seen"]["identity"]


def test_the_os_caps_a_sandboxed_kernels_tasks(tmp_path):
    found = _probe(tmp_path, Limits(bwrap=True, max_processes=8))
    held = found["sandbox"]["processes"]
    assert "enforced by the OS" in held, f"no pids cgroup on this machine: {held}"
    cap = 8 + 128 + 2 * (os.cpu_count() or 1)
    assert f"at most {cap} tasks" in held
    assert 0 < found["seen"]["threads started"] < cap, found["seen"]["threads started"]
    assert found["sandbox"]["cgroup"] and not Path(found["sandbox"]["cgroup"]).exists(), "the cgroup was left behind"


CORPUS = REPO / "tests" / "adversarial"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())


def _tracked_files() -> dict[str, bytes]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", *PACKAGES, "solutions", "labs"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    return {name: (REPO / name).read_bytes() for name in listed if name and (REPO / name).is_file()}


def _git_status() -> str:
    """What git sees changed or added in the course's own folders (a file a kernel wrote shows here)."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--", *PACKAGES, "solutions", "labs"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _submit(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True)
    for case in EXPECTED:
        if case["name"] in names:
            (folder / f"{case['name']}.ipynb").write_bytes((CORPUS / case["file"]).read_bytes())


def _grade_class(submitted: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # Tight limits keep the hostile entries short (as in tests/test_adversarial.py); most of the
    # corpus's time is waiting on time-outs and sleeping processes, hence more workers than cores.
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "course_tools.cli",
            "grade",
            "--submissions",
            str(submitted),
            "--lab",
            "lab01_gemm",
            "--out",
            str(out),
            "--workers",
            "3",
            "--check-timeout",
            "5",
            "--cell-timeout",
            "15",
            "--budget",
            "300",
            "--max-processes",
            "16",
            *extra,
        ],
        cwd=submitted.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _flag_problems(row: dict[str, str], expected: dict) -> list[str]:
    """How a scores.csv row's status and flags differ from an entry's "class" expectation: the status,
    each expected flag as the start of one of the row's, no kind of flag more, and for a dressed copy
    the classmate named in its copy flag for each task."""
    flags = [flag for flag in row["flags"].split(" | ") if flag]
    problems = [] if row["status"] == expected["status"] else [f"status {row['status']}, not {expected['status']}"]
    problems += [
        f"no flag starting {want!r}" for want in expected["flags"] if not any(f.startswith(want) for f in flags)
    ]
    kinds = {flag.split(":", 1)[0] for flag in flags}
    problems += (
        [f"flags of kind {sorted(kinds - {w.split(':', 1)[0] for w in expected['flags']})}"]
        if kinds - {w.split(":", 1)[0] for w in expected["flags"]}
        else []
    )
    copies = next((flag[len("copy: ") :] for flag in flags if flag.startswith("copy: ")), "")
    by_task = dict(part.split(": ", 1) for part in copies.split("; ") if ": " in part)
    problems += [
        f"{task} not flagged as a copy of {other}"
        for task, other in expected["copy_of"].items()
        if f"{other} " not in by_task.get(task, "")
    ]
    return problems


def test_the_corpus_is_graded_exactly_in_bubblewrap_and_leaves_the_course_untouched(tmp_path):
    """`--submissions` grades in the sandbox by default. Every corpus entry, both parts, gets exactly
    its score and each failing task its reason: the answer key, the reference (re-run, copied or
    called from another process) and classmates' work are out of reach, the vandal's writes and the
    unbounded fork bomb harm nothing. Afterwards the course's tracked files, what git sees in its
    folders, and every submission are byte for byte the same.

    The class's scores.csv, and the gradebook built from it, show every cheat and copy: each entry
    has the status and flags its "class" expectation lists (an honest answer and its dressed copy
    flagged as copies of each other, a typical mistake and a blank lab as such, the answer-key
    reader and the classmate copier blocked with what they looked for, the answers the static scan
    refused, the unreadable file)."""
    assert Path(sys.prefix).parent == REPO  # the vandal's targets are the course's real files
    submitted = tmp_path / "submitted"
    _submit(submitted, [case["name"] for case in EXPECTED])
    submissions = {path.name: path.read_bytes() for path in submitted.iterdir()}
    tracked, status = _tracked_files(), _git_status()
    out = tmp_path / "grades" / "lab01_gemm"
    result = _grade_class(submitted, out)
    assert result.returncode == 0, result.stderr
    wrong = {}
    for case in EXPECTED:
        results = json.loads((out / case["name"] / "results.json").read_text())
        reasons = {t["name"]: t["tags"] for t in results["tests"] if t["status"] != "passed"}
        if results["score"] != case["score"] or reasons != {test: [why] for test, why in case["reasons"].items()}:
            wrong[case["name"]] = (results["score"], reasons, [t["output"] for t in results["tests"]])
        feedback = (out / case["name"] / "feedback.md").read_text()
        if case["note"] and case["note"] not in feedback:
            wrong[case["name"]] = ("note missing", case["note"], feedback)
    assert not wrong, wrong
    assert _tracked_files() == tracked and _git_status() == status, "a graded kernel changed the course"
    assert {path.name: path.read_bytes() for path in submitted.iterdir()} == submissions

    results_of = lambda name: json.loads((out / name / "results.json").read_text())
    for test in results_of("answer_key_reader")["tests"]:  # the answers found no key, so they defined nothing
        assert test["tags"] == ["error"] and "is not defined" in test["output"], test
    for name in ("reference_rerun", "reference_copier", "reference_subprocess"):
        failed = next(t for t in results_of(name)["tests"] if t["status"] != "passed")
        if name != "reference_subprocess":  # the child's error stays in the child; the answer's read fails
            assert "not available while lab01_gemm is graded" in failed["output"], (name, failed)
    assert results_of("honest_full")["extra_data"]["protections"]["view"].startswith("bubblewrap")
    assert "bubblewrap" in (out / "answer_key_reader" / "feedback.md").read_text()

    import csv

    from course_tools.gradebook import build_gradebook

    with open(out / "scores.csv", newline="", encoding="utf-8") as f:
        rows = {row["learner"]: row for row in csv.DictReader(f)}
    wrong_rows = {
        case["name"]: (problems, rows[case["name"]]["flags"][:400])
        for case in EXPECTED
        if (problems := _flag_problems(rows[case["name"]], case["class"]))
    }
    assert not wrong_rows, wrong_rows
    _, (book_path, _) = build_gradebook(tmp_path / "grades")
    with open(book_path, newline="", encoding="utf-8") as f:
        book = {row["learner"]: row for row in csv.DictReader(f)}
    assert {name: (row["status"], row["flags"]) for name, row in book.items()} == {
        name: (row["status"], row["flags"]) for name, row in rows.items()
    }
    assert "blocked" in result.stdout and "flags to look at" in result.stdout


def test_what_the_sandbox_takes_away(tmp_path):
    """The same class graded with `--no-sandbox` (as a learner grading their own work is): the
    answers that read a classmate's submission find it and score full marks, and the report says
    that nothing was sandboxed. (The answer key and the reference routes are graded without the
    sandbox in tests/test_adversarial.py: full marks there too.)"""
    submitted = tmp_path / "submitted"
    _submit(submitted, ["honest_full", "classmate_reader"])
    # The grader starts its own kernel template, as an instructor's run does (not this test worker's):
    # the kernels are then the grader's descendants, and /proc shows them its command line.
    from grading.run import warm

    env = {name: value for name, value in os.environ.items() if name not in (warm.SOCKET_ENV, warm.TOKEN_ENV)}
    result = _grade_class(submitted, tmp_path / "grades", "--no-sandbox", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "grades" / "classmate_reader" / "results.json").read_text())
    assert report["score"] == 10, [t["output"] for t in report["tests"]]
    assert report["extra_data"]["protections"]["view"].startswith("no sandbox")


def test_submissions_refuse_without_bubblewrap_unless_told(tmp_path):
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no bwrap on the PATH
    run = lambda *extra: subprocess.run(
        [sys.executable, "-m", "course_tools.cli", "grade", "--submissions", str(tmp_path), "--lab", "lab99", *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    refused = run()
    assert refused.returncode == 1 and "bwrap (bubblewrap) is not installed" in refused.stderr
    assert "apt-get install bubblewrap" in refused.stderr and "--no-sandbox" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    unsandboxed = run("--no-sandbox")  # past the sandbox: refused for the unknown lab instead
    assert unsandboxed.returncode == 2 and "no lab named 'lab99'" in unsandboxed.stderr


REFERENCE_PROBE = """
import json, subprocess, sys
from pathlib import Path
import infra_lib.timing as timing
import infra_lib.kernels.profiling as profiling

found = {}
try:
    timing.time_op(lambda: None)
    found["call"] = "ran"
except RuntimeError as exc:
    found["call"] = str(exc)
source = Path(timing.__file__).read_text()
found["body in the source"] = "statistics.median" in source
found["lines"] = len(source.splitlines())
found["cached bytecode"] = [p.stat().st_size for p in (Path(timing.__file__).parent / "__pycache__").glob("timing.*")]
child = subprocess.run([sys.executable, "-c", "import infra_lib.timing as t; t.time_op(lambda: None)"],
                       capture_output=True, text=True)
found["another process"] = (child.stderr.strip().splitlines() or [""])[-1]
found["rest of the module"] = profiling.profile_op.__name__  # not a reference: unchanged
print("PROBE " + json.dumps(found))
"""


def test_the_labs_reference_is_a_stub_in_the_sandbox(tmp_path):
    """While lab 01 is graded in bubblewrap its reference functions are stubs by every route (a call,
    the source file, the cached bytecode, another process); the rest of their modules, and the real
    files outside the sandbox, are unchanged."""
    from grading.hidden_reference import hidden_files

    real = REPO / "infra_lib" / "timing.py"
    before = real.read_bytes()
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(REFERENCE_PROBE))
    work = tmp_path / "work"
    work.mkdir()
    run = execute(
        nb,
        work,
        parameters={},
        env={},
        limits=Limits(bwrap=True),
        budget=120,
        hidden=hidden_files("lab01_gemm", tmp_path / "hidden"),
    )
    assert run.complete, run.reason
    text = "".join(o.get("text", "") for o in run.notebook.cells[0].outputs)
    found = json.loads(text.split("PROBE ", 1)[1])
    assert found["call"] == (
        "infra_lib.timing.time_op is the reference for lab01_gemm: it is not available while lab01_gemm is graded"
    ), found
    assert not found["body in the source"] and found["lines"] == len(before.decode().splitlines())
    assert set(found["cached bytecode"]) <= {0}, found
    assert "RuntimeError: infra_lib.timing.time_op is the reference for lab01_gemm" in found["another process"]
    assert found["rest of the module"] == "profile_op"
    assert real.read_bytes() == before


@pytest.mark.parametrize("lab", ["lab10_serving_metrics", "lab13_agents"])
def test_a_lab_whose_inputs_run_its_reference_grades_in_the_sandbox(lab):
    """Lab 10's inputs are runs of the simulated engine, lab 13's count a graph's steps with the course's
    runner: both use the lab's reference, which the sandboxed kernel sees as stubs. The grader makes the
    inputs and hands them over, so the instructor's answers still get full marks there."""
    from grading.grader import grade_notebook

    report = grade_notebook(REPO / "solutions" / lab / f"{lab}.ipynb", lab_id=lab, limits=Limits(bwrap=True))
    assert report.score == report.max_score > 0, [c.message for t in report.tests for c in t.checks if not c.passed]
    assert report.sandbox["reference"].startswith("absent"), report.sandbox
