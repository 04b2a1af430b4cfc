"""`python -m course_tools.gpu.check`: without a GPU it runs nothing and says so; the step runner records
each step's outcome and keeps going after a failure, a time-out or a spent budget.

The GPU steps themselves run only where there is a GPU (`make gpu-check`); here every command is
started with CUDA hidden, so these tests behave the same on a machine that has one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

from course_tools.gpu.check import RUN_BUDGET_S, STEPS, run_here, run_in_child, run_steps, table_row, write_json
from course_tools.gpu.steps import Step, StepFailed, StepSkipped

NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
GPU_BRANCHES = {
    "profiling.timing",
    "profiling.kernels",  # chapter 01: CUDA timing, kernel names in a profile
    "triton.vector_add",
    "triton.softmax",
    "triton.matmul",
    "triton.rmsnorm",  # chapter 03, compiled
    "triton.flash_attention",
    "triton.paged_decode",
    "triton.gemv_q4",  # the serving kernels, compiled
    "model.greedy_cuda",
    "serving.engine_cuda",  # SmolLM2 and the engine on cuda, torch and triton attention
    "training.nccl_all_reduce",  # a collective over NCCL
}


def test_without_a_gpu_it_runs_nothing_says_so_and_exits_0(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "course_tools.gpu.check", "--out", str(out)],
        cwd=REPO,
        env=NO_GPU,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "no GPU is present" in lines[0] and "nothing was run" in lines[0], result.stdout
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["gpu"] is None
    assert [s["name"] for s in report["steps"]] == [s.name for s in STEPS]
    assert all(s["status"] == "skipped" and s["error"].startswith("no GPU") for s in report["steps"])
    assert report["summary"] == {"passed": 0, "failed": 0, "skipped": len(STEPS)}
    assert {"torch", "triton", "cuda", "nccl"} <= set(report["versions"])
    assert {"cpu", "logical_cores", "torch", "device"} <= set(report["machine_info"])


def test_the_steps_cover_every_gpu_branch_within_the_run_budget():
    assert {s.name for s in STEPS} == GPU_BRANCHES
    assert len({s.run for s in STEPS}) == len(STEPS), "each step runs its own function"
    assert all(s.covers and 0 < s.limit_s <= RUN_BUDGET_S for s in STEPS)
    assert RUN_BUDGET_S <= 7.5 * 60, "the whole run, with its start-up, must end inside 8 minutes"


def _passes(facts, quick):
    facts["quick"] = quick
    facts["summary"] = "all good"


def _raises_half_way(facts, quick):
    facts["measured_before"] = 1.5
    raise RuntimeError("boom: the kernel faulted")


def _fails_a_check(facts, quick):
    raise StepFailed("max |diff| 3.0 over tolerance 0.02")


def _skips(facts, quick):
    raise StepSkipped("infra_lib/kernels/gemv_q4.py is not there yet")


def test_a_failing_step_is_recorded_and_the_steps_after_it_still_run():
    steps = [
        Step("first", "passes", _passes, 5),
        Step("second", "raises", _raises_half_way, 5),
        Step("third", "fails a check", _fails_a_check, 5),
        Step("fourth", "skips", _skips, 5),
        Step("fifth", "passes", _passes, 5),
    ]
    seen = []
    records = run_steps(steps, quick=True, run_one=run_here, on_record=seen.append)
    assert seen == records
    assert [r["status"] for r in records] == ["passed", "failed", "failed", "skipped", "passed"]
    first, second, third, fourth, fifth = records
    assert first["error"] is None and first["facts"] == {"quick": True, "summary": "all good"}
    assert second["error"].startswith("RuntimeError: boom: the kernel faulted (at test_gpu_check.py:")
    assert second["facts"] == {"measured_before": 1.5}, "what was measured before the failure is kept"
    assert third["error"].startswith("StepFailed: max |diff| 3.0 over tolerance 0.02")
    assert fourth["error"] == "infra_lib/kernels/gemv_q4.py is not there yet"
    assert fifth["status"] == "passed"
    assert all(r["seconds"] >= 0 and r["limit_s"] == 5 for r in records)
    assert "RuntimeError" in table_row(second) and "all good" in table_row(first)


def test_a_long_error_is_cut_short():
    def long_failure(facts, quick):
        raise ValueError("x" * 5000)

    record = run_here(Step("long", "a long message", long_failure, 5), quick=True)
    assert record["status"] == "failed" and len(record["error"]) < 500 and "..." in record["error"]


def test_a_nan_measured_by_a_step_is_written_as_strict_json(tmp_path):
    write_json(tmp_path / "r.json", {"facts": {"cases": {"a": {"max_abs_diff": float("nan")}}, "x": [float("inf")]}})
    report = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"), parse_constant=lambda c: 1 / 0)
    assert report == {"facts": {"cases": {"a": {"max_abs_diff": "nan"}}, "x": ["inf"]}}


def test_steps_reached_after_the_budget_is_spent_are_failed_not_run():
    records = run_steps([Step("late", "never runs", _passes, 5)], quick=True, run_one=run_here, budget_s=0)
    assert records[0]["status"] == "failed" and records[0]["error"].startswith("not run")
    assert records[0]["facts"] == {}


def test_a_step_runs_in_its_own_process_and_reports_back(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    record = run_in_child(STEPS[2], quick=True, limit_s=120)
    assert record["name"] == STEPS[2].name and record["status"] == "skipped", record
    assert record["error"].startswith("no GPU") and record["wall_s"] >= record["seconds"]


def test_a_step_past_its_limit_is_stopped_and_recorded_as_failed(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    record = run_in_child(STEPS[0], quick=True, limit_s=0.2)  # stopped before it could even import torch
    assert record["status"] == "failed" and "ran past its limit" in record["error"], record
    assert record["wall_s"] < 30


def test_a_tile_sweep_keeps_the_fastest_config_that_is_right(monkeypatch):
    """gpu-check tunes FlashAttention's and the GEMV's tiles by measurement: a config whose result is
    wrong is a failed case (the step then fails naming it), never the one kept, however fast."""
    import pytest
    import torch

    from course_tools.gpu.kernel_steps import sweep_tiles
    from course_tools.gpu.steps import require_cases_close

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # the check's timing waits for a GPU
    want = torch.arange(6.0)
    speed = {16: 3.0, 32: 1.0, 64: 0.5, 128: 2.0}  # 64 is fastest but wrong

    launched = []

    def run(block):
        launched.append(block)
        return want + (1.0 if block == 64 else 0.0)

    def bench(fn):  # the "milliseconds" of whichever config fn launches
        fn()
        return speed[launched[-1]]

    facts: dict = {}
    best = sweep_tiles(facts, "demo", [{"block": b} for b in speed], run, want, 1e-6, bench=bench)
    assert best == {"block": 32}
    sweep = facts["tile_sweep"]["demo"]
    assert sweep["best"] == "demo.tiles(block=32)" and set(sweep["ms"]) == {
        "demo.tiles(block=16)",
        "demo.tiles(block=32)",
        "demo.tiles(block=128)",
    }
    assert not facts["cases"]["demo.tiles(block=64)"]["ok"]
    with pytest.raises(StepFailed, match=r"demo.tiles\(block=64\)"):
        require_cases_close(facts)
