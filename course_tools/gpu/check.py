"""``python -m course_tools.gpu.check``: run every code path of the course that only a GPU takes.

The course is built and tested on a CPU, where Triton interprets its kernels and every
``device.type == "cuda"`` branch is dead code. On a machine with an NVIDIA GPU this command
runs those branches (the steps of ``course_tools.gpu.steps`` and ``course_tools.gpu.kernel_steps``), each
in a process of its own under its own time limit, so a kernel that faults or hangs takes down
its step and nothing else. It writes a JSON report (the machine, the versions, each step's
status, seconds, error and measured facts) and prints a table; the exit code is 1 when a step
failed.

Without a GPU nothing runs: one line says so, the report records ``"gpu": null`` and every step
as skipped, and the exit code is 0.

    python -m course_tools.gpu.check [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from course_tools.gpu.kernel_steps import (
    flash_attention_step,
    gemv_q4_step,
    matmul_step,
    paged_decode_step,
    rmsnorm_step,
    softmax_step,
    vector_add_step,
)
from course_tools.gpu.steps import (
    Step,
    StepSkipped,
    engine_step,
    model_step,
    nccl_step,
    nccl_version,
    profile_step,
    timing_step,
)
from grading.course import REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "gpu_check.json"
INTERPRET_ENV = "TRITON_INTERPRET"  # the variable infra_lib.kernels.triton_env reads
RUN_BUDGET_S = 420.0  # all steps together: the run, with the start-up, ends inside 8 minutes
ERROR_CHARS = 400

# Every branch of the course that only a GPU takes, in the order they run; limits in seconds.
STEPS = (
    Step("profiling.timing", "ch01: time_op synchronised vs CUDA events vs unsynchronised", timing_step, 60),
    Step("profiling.kernels", "ch01: kernel names in a CUDA profile (a GEMM, a Triton kernel)", profile_step, 90),
    Step("triton.vector_add", "ch03: vector_add compiled", vector_add_step, 90),
    Step("triton.softmax", "ch03: fused and three-pass softmax compiled (bfloat16 too)", softmax_step, 90),
    Step("triton.matmul", "ch03: tiled matmul compiled and autotuned", matmul_step, 150),
    Step("triton.rmsnorm", "ch03: fused RMSNorm compiled", rmsnorm_step, 90),
    Step(
        "triton.flash_attention",
        "FlashAttention forward and the naive baseline compiled, its tiles tuned",
        flash_attention_step,
        150,
    ),
    Step("triton.paged_decode", "paged decode attention compiled (split-K too)", paged_decode_step, 120),
    Step("triton.gemv_q4", "fused 4-bit GEMV compiled, its tiles tuned", gemv_q4_step, 120),
    Step(
        "model.greedy_cuda",
        "SmolLM2 greedy on cuda vs cpu, with the triton backend, and Q4_1 through the fused GEMV",
        model_step,
        180,
    ),
    Step("serving.engine_cuda", "LLMEngine.from_model on cuda, torch vs triton attention", engine_step, 180),
    Step("training.nccl_all_reduce", "all-reduce and the ring over the NCCL backend", nccl_step, 150),
)


def short_error(exc: BaseException) -> str:
    """The exception's type and message, cut to ``ERROR_CHARS``, and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = f"{type(exc).__name__}: {exc}".strip()
    return (text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "...") + where


def step_record(step: Step, status: str, seconds: float, error: str | None, facts: dict) -> dict:
    """One step's entry in the report; ``error`` says why it failed or was skipped (None when it passed)."""
    return {
        "name": step.name,
        "covers": step.covers,
        "status": status,
        "seconds": round(seconds, 3),
        "limit_s": step.limit_s,
        "error": error,
        "facts": facts,
    }


def run_here(step: Step, quick: bool, limit_s: float | None = None) -> dict:
    """Run ``step`` in this process; an exception is recorded, never raised (``limit_s`` is the caller's to enforce)."""
    facts: dict = {}
    start = time.perf_counter()
    try:
        step.run(facts, quick)
        status, error = "passed", None
    except StepSkipped as exc:
        status, error = "skipped", str(exc)
    except Exception as exc:  # noqa: BLE001 - recorded in the report; the next step still runs
        status, error = "failed", short_error(exc)
    return step_record(step, status, time.perf_counter() - start, error, facts)


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as strict JSON: a nan or inf (a kernel that produced one) becomes a string."""

    def strict(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [strict(v) for v in value]
        return value

    path.write_text(json.dumps(strict(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _tail(output: str, lines: int = 15) -> str:
    return "\n".join(output.strip().splitlines()[-lines:])


def _stop(child: subprocess.Popen) -> None:
    """Kill a step's process and everything it started (NCCL workers, a fork server)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)


def run_in_child(step: Step, quick: bool, limit_s: float) -> dict:
    """Run ``step`` in a new Python process, stopped (with all it started) after ``limit_s`` seconds.

    The child never sees ``TRITON_INTERPRET``: on a GPU, Triton must compile.
    """
    env = {k: v for k, v in os.environ.items() if k != INTERPRET_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "step.json"
        command = [sys.executable, "-m", "course_tools.gpu.check", "--step", step.name, "--out", str(out)]
        start = time.perf_counter()
        child = subprocess.Popen(
            command + (["--quick"] if quick else []),
            cwd=REPO_ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = child.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _stop(child)
            output, _ = child.communicate()
            record = step_record(
                step,
                "failed",
                time.perf_counter() - start,
                f"ran past its limit of {limit_s:.0f} s and was stopped",
                {},
            )
        except BaseException:  # Ctrl-C: the child has its own session, so it must be stopped here
            _stop(child)
            raise
        else:
            if out.is_file():
                record = json.loads(out.read_text(encoding="utf-8"))
            else:
                last = _tail(output, 1) or "no output"
                record = step_record(
                    step,
                    "failed",
                    time.perf_counter() - start,
                    f"its process exited with code {child.returncode} and no result: {last}",
                    {},
                )
    record["wall_s"] = round(time.perf_counter() - start, 3)
    if record["status"] == "failed":
        record["log_tail"] = _tail(output)
    return record


def run_steps(
    steps: tuple[Step, ...] | list[Step],
    quick: bool,
    run_one: Callable[..., dict] = run_in_child,
    budget_s: float = RUN_BUDGET_S,
    on_record: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Run every step in order with ``run_one(step, quick, limit_s)``; one step's failure never stops the next.

    Each step gets its own limit, cut to what is left of ``budget_s``; a step reached after the
    budget is spent is recorded as failed, not run, so an incomplete check never looks complete.
    """
    deadline = time.monotonic() + budget_s
    records = []
    for step in steps:
        left = deadline - time.monotonic()
        if left <= 1:
            record = step_record(step, "failed", 0.0, f"not run: the run's budget of {budget_s:.0f} s was spent", {})
        else:
            record = run_one(step, quick, min(step.limit_s, left))
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


# --- the report -----------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(gpu: bool) -> dict:
    """The machine and versions, as the benchmarks record them, and the GPU (None without one)."""
    import torch

    from infra_lib.hardware.probes import machine_info

    versions = {
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "cudnn": None,
        "nccl": None,
        "python": platform.python_version(),
    }
    info = None
    if gpu:
        versions["cudnn"] = torch.backends.cudnn.version()
        versions["nccl"] = nccl_version()
        props = torch.cuda.get_device_properties(0)
        info = {
            "name": props.name,
            "count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
        }
    return {"gpu": info, "versions": versions, "machine_info": machine_info("cuda" if gpu else "cpu")}


def load_average() -> float | None:
    """The 1-minute load average, as the benchmarks record it (a busy machine skews timings)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def summary(records: list[dict]) -> dict[str, int]:
    return {status: sum(r["status"] == status for r in records) for status in ("passed", "failed", "skipped")}


def table_row(record: dict) -> str:
    detail = record["error"] if record["status"] != "passed" else record["facts"].get("summary", "")
    detail = detail or ""
    return f"{record['name']:<26} {record['status']:<8} {record['seconds']:>7.1f}  {detail[:100]}"


TABLE_HEADER = f"{'step':<26} {'status':<8} {'seconds':>7}  facts or error"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run every code path of the course that only a GPU takes, "
        "each step in its own process; write a JSON report."
    )
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer tokens")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report (default: {DEFAULT_OUT})")
    parser.add_argument("--step", choices=[s.name for s in STEPS], help=argparse.SUPPRESS)  # one step, in a child
    args = parser.parse_args(argv)
    found_interpret = os.environ.pop(INTERPRET_ENV, None)  # Triton must compile, not interpret
    if args.step:
        record = run_here(next(s for s in STEPS if s.name == args.step), args.quick)
        write_json(args.out, record)
        return 0

    from infra_lib.backends import get_backend

    reason = get_backend("cuda").unavailable_reason()
    start = time.perf_counter()
    load_before = load_average()
    if reason is None:
        print(
            f"{len(STEPS)} steps, each in its own process (at most {RUN_BUDGET_S:.0f} s in all)\n{TABLE_HEADER}",
            flush=True,
        )
        records = run_steps(STEPS, args.quick, on_record=lambda r: print(table_row(r), flush=True))
    else:
        records = [step_record(step, "skipped", 0.0, f"no GPU: {reason}", {}) for step in STEPS]
    report = {
        "check": "gpu_check",
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **environment(reason is None),
        "flags": {"quick": args.quick},
        "triton_interpret_found": found_interpret,
        "load_average_1m": {"before": load_before, "after": load_average()},
        "seconds": round(time.perf_counter() - start, 1),
        "summary": summary(records),
        "steps": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report)
    if reason is not None:
        print(f"no GPU is present ({reason}); nothing was run, every step is recorded as skipped in {args.out}")
        return 0
    counts = report["summary"]
    print(
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped in "
        f"{report['seconds']:.0f} s on {report['gpu']['name']}; wrote {args.out}"
    )
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
