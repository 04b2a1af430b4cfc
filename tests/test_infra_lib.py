"""Unit tests of the library pieces chapter 01 stands on."""

from __future__ import annotations

import time

import pytest
import torch

from infra_lib.device import available_devices, pick_device, synchronizer
from infra_lib.hardware.flops import achieved_tflops, gemm_flops
from infra_lib.hardware.probes import machine_info, measure_gemm_rates, measure_peak_gemm_flops
from infra_lib.kernels.profiling import dominant_op, profile_op, self_times
from infra_lib.timing import time_op


def test_gemm_flops_counts_multiply_and_add():
    assert gemm_flops(2, 3, 4) == 48
    assert gemm_flops(1, 4096, 4096) == 2 * 4096 * 4096
    assert gemm_flops(0, 5, 5) == 0
    assert gemm_flops(8192, 8192, 8192) == 2 * 8192**3  # beyond 32 bits


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_gemm_flops_rejects_bad_dimensions(bad):
    with pytest.raises(ValueError, match="non-negative int"):
        gemm_flops(bad, 2, 2)


def test_achieved_tflops():
    assert achieved_tflops(1000, 1000, 1000, 0.002) == pytest.approx(1.0)
    for bad in (0, 0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="seconds must be > 0"):
            achieved_tflops(10, 10, 10, bad)


def test_time_op_excludes_warmup_and_takes_the_median():
    costs = iter([0.1, 0.1, 0.004, 0.004, 0.2, 0.004, 0.004])  # two cold calls, one outlier
    calls = []

    def fn():
        calls.append(1)
        time.sleep(next(costs))

    seconds = time_op(fn, warmup=2, iters=5)
    assert len(calls) == 7
    # The median is ~4 ms; a mean would be >= 43 ms, a timer that kept the cold calls >= 100 ms.
    assert 0.004 <= seconds < 0.03, f"median of timed calls should be ~4 ms, got {seconds * 1e3:.1f} ms"


def test_time_op_synchronises_queued_work():
    queued = []

    def launch():
        queued.append(0.005)  # returns at once, like a GPU launch

    def sync():
        time.sleep(sum(queued))
        queued.clear()

    assert time_op(launch, warmup=1, iters=3) < 0.001  # what forgetting sync measures
    assert time_op(launch, warmup=1, iters=3, sync=sync) >= 0.005


@pytest.mark.parametrize("kwargs", [{"warmup": -1}, {"iters": 0}])
def test_time_op_rejects_bad_counts(kwargs):
    with pytest.raises(ValueError):
        time_op(lambda: None, **kwargs)


def test_pick_device():
    assert pick_device("auto").type == available_devices()[0]
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            pick_device("cuda")
    assert synchronizer("cpu") is None


def test_profile_names_mm_not_matmul():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    prof = profile_op(lambda: torch.matmul(a, b))
    clock, times = self_times(prof)
    assert clock == "cpu"
    assert "aten::matmul" in times and "aten::mm" in times
    assert dominant_op(prof) == "aten::mm"
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    assert totals["aten::matmul"] >= totals["aten::mm"], "matmul's total includes mm"


def test_first_profile_in_a_process_is_not_skewed(tmp_path):
    """The profiler's start-up cost must not be charged to the op under study, and starting it
    does not import torch's compiler (seconds) in a process that never compiled."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from infra_lib.kernels.profiling import profile_op, self_times\n"
        "a = torch.randn(256, 256)\n"
        "_, t = self_times(profile_op(lambda: a @ a))\n"
        "assert 'torch._inductor' not in sys.modules, 'starting the profiler imported torch._inductor'\n"
        "print(t['aten::matmul'] / t['aten::mm'])\n"
    )
    ratios = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
        for _ in range(2)
    ]
    assert max(ratios) < 0.5, f"aten::matmul self time should be tiny next to aten::mm, ratios {ratios}"


def test_dominant_op_rejects_empty_profile():
    class Empty:
        def key_averages(self):
            return []

    with pytest.raises(ValueError, match="no events"):
        dominant_op(Empty())


def test_gemm_rates_and_peak():
    rows = measure_gemm_rates([32, 128], iters=2)
    assert [r["n"] for r in rows] == [32, 128]
    assert all(r["seconds"] > 0 and r["gflops"] > 0 for r in rows)
    peak = measure_peak_gemm_flops(sizes=(64, 128), iters=2)
    assert peak["peak_gflops"] == max(r["gflops"] for r in peak["per_size"])
    assert peak["best_n"] in (64, 128)
    assert peak["torch_threads"] == torch.get_num_threads()
    with pytest.raises(ValueError):
        measure_gemm_rates([0])


def test_machine_info_fields():
    info = machine_info()
    for key in ("cpu", "logical_cores", "torch_threads", "torch", "device"):
        assert info[key] not in (None, "")
