"""The kernel sandbox launcher: memory, file size and network limits hold in the process it starts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from grading.sandbox import Limits

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
            [sys.executable, "-m", "grading.sandbox", "--status", str(status), "--memory-mb", "512",
             "--file-size-mb", "1", "--no-network", "--", sys.executable, "-c", PROBE, str(tmp_path / "big"),
             str(port)],
            capture_output=True, text=True, timeout=60, check=True)
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
    subprocess.run([sys.executable, "-m", "grading.sandbox", "--status", str(status), "--memory-mb", "2048",
                    "--file-size-mb", "8", "--", sys.executable, "-c", "pass"], check=True, timeout=60)
    assert json.loads(status.read_text())["network"] == "not requested"


@pytest.mark.parametrize("field", ["cell_timeout", "memory_mb", "max_processes", "output_kb"])
def test_limits_reject_non_positive_values(field):
    with pytest.raises(ValueError, match=field):
        Limits(**{field: 0})
