"""The kernel sandbox launcher: memory, file size and network limits hold in the process it starts, and a
kernel run as another user keeps out of root's files."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from grading.run.sandbox import Limits

PROBE = textwrap.dedent("""
    import json, socket, sys
    result = {}
    try:
        hoard = b"x" * (1 << 30)
        result["memory"] = "allocated"
    except MemoryError:
        result["memory"] = "refused"
    try:
        with open(sys.argv[1], "wb") as f:
            f.write(b"x" * (3 << 20))
        result["file"] = "written"
    except OSError as exc:
        result["file"] = f"refused: {exc.strerror}"
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=3).close()
        result["network"] = "connected"
    except OSError as exc:
        result["network"] = f"refused: {exc}"
    print(json.dumps(result))
""")


def test_limits_hold_in_the_launched_process(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    status = tmp_path / "status.json"
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "grading.run.sandbox",
                "--status",
                str(status),
                "--memory-mb",
                "512",
                "--file-size-mb",
                "1",
                "--no-network",
                "--",
                sys.executable,
                "-c",
                PROBE,
                str(tmp_path / "big"),
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        server.close()
    probe = json.loads(result.stdout)
    applied = json.loads(status.read_text())
    assert probe["memory"] == "refused" and "512 MiB" in applied["memory"]
    assert probe["file"].startswith("refused") and (tmp_path / "big").stat().st_size <= 1 << 20
    if applied["network"].startswith("isolated"):
        assert probe["network"].startswith("refused"), probe
    else:  # the OS did not allow it: the status must say so, and say what to do
        assert "NOT isolated" in applied["network"] and "container" in applied["network"]


def test_without_network_isolation_the_status_says_so(tmp_path):
    status = tmp_path / "status.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grading.run.sandbox",
            "--status",
            str(status),
            "--memory-mb",
            "2048",
            "--file-size-mb",
            "8",
            "--",
            sys.executable,
            "-c",
            "pass",
        ],
        check=True,
        timeout=60,
    )
    assert json.loads(status.read_text())["network"] == "not requested"


@pytest.mark.parametrize("field", ["cell_timeout", "memory_mb", "max_processes", "output_kb"])
def test_limits_reject_non_positive_values(field):
    with pytest.raises(ValueError, match=field):
        Limits(**{field: 0})


def test_limits_refuse_a_kernel_user_inside_bubblewrap():
    with pytest.raises(ValueError, match="kernel_user is for a kernel without bubblewrap"):
        Limits(bwrap=True, kernel_user="nobody")


def test_a_kernel_for_another_user_starts_cold_through_the_launcher(tmp_path):
    """A kernel forked from the grader's template would keep the template's user: with a kernel user
    the kernelspec names no warm provisioner, and its launcher carries the user."""
    from grading.run.sandbox import parse_launcher, write_kernelspec

    name = write_kernelspec(tmp_path, Limits(kernel_user="nobody"), tmp_path / "status.json", warm=True)
    spec = json.loads((tmp_path / "kernels" / name / "kernel.json").read_text())
    assert "metadata" not in spec, spec
    launcher = parse_launcher(spec["argv"][3:])
    assert launcher.user == "nobody" and launcher.command[-2:] == ["-f", "{connection_file}"]
    warm = json.loads(
        (
            tmp_path / "kernels" / write_kernelspec(tmp_path, Limits(), tmp_path / "s.json", warm=True) / "kernel.json"
        ).read_text()
    )
    assert "kernel_provisioner" in warm["metadata"] and "--user" not in warm["argv"]


@pytest.fixture
def kernel_folder():
    """A grading folder as the grader makes one (root's alone, under /tmp), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="grade-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_kernel_run_as_another_user_keeps_out_of_roots_files(kernel_folder, tmp_path):
    """The launcher, as root, runs the command as nobody in the kernel's folder: it reads its own copy
    of the connection file, writes in the folder and in its home, and cannot read a file only root may
    read, remove the grader's files from the folder, list it, or gain privileges."""
    assert os.geteuid() == 0, "the grader runs as root where it drops the kernel's privileges"
    key = tmp_path / "key.ipynb"
    key.write_text("the answer key")
    key.chmod(0o600)
    connection = tmp_path / "kernel-1.json"
    connection.write_text('{"key": "k"}')
    connection.chmod(0o600)
    (kernel_folder / "graded.ipynb").write_text("the grader's")
    status = kernel_folder / "sandbox.json"
    script = (
        'id -un; echo "HOME=$HOME"; cat "$2"; echo; touch mine "$HOME/cache" && echo wrote; '
        f'cat "{key}" || echo key-refused; rm -f graded.ipynb || echo rm-refused; '
        "ls . >/dev/null 2>&1 || echo list-refused; grep NoNewPrivs /proc/self/status"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "grading.run.sandbox",
            "--status",
            str(status),
            "--memory-mb",
            "2048",
            "--file-size-mb",
            "8",
            "--user",
            "nobody",
            "--",
            "/bin/sh",
            "-c",
            script,
            "sh",
            "-f",
            str(connection),
        ],
        cwd=kernel_folder,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split("\n")
    assert lines[:4] == ["nobody", f"HOME={kernel_folder}/home-nobody", '{"key": "k"}', "wrote"], run.stdout
    assert lines[4:7] == ["key-refused", "rm-refused", "list-refused"], run.stdout
    assert lines[7].split() == ["NoNewPrivs:", "1"]
    assert "the answer key" not in run.stdout and (kernel_folder / "graded.ipynb").exists()
    assert (kernel_folder / "mine").stat().st_uid == pwd.getpwnam("nobody").pw_uid
    said = json.loads(status.read_text())
    assert said["user"].startswith("the kernel ran as nobody (uid ") and status.stat().st_uid == 0
