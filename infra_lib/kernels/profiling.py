"""Profiling one operation: what ran, for how long, and which kernel dominated.

The four functions of lab 01 live here (``gemm_flops``, ``time_op``, ``dominant_op``,
``achieved_tflops``), so the lab's reference and the library expose the same names.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from infra_lib.hardware.flops import achieved_tflops, gemm_flops
from infra_lib.timing import time_op

__all__ = ["achieved_tflops", "dominant_op", "gemm_flops", "profile_op", "self_times", "start_profiler", "time_op"]


_profiler_warmed = False


def profile_op(
    fn: Callable[[], Any],
    device: torch.device | str = "cpu",
    *,
    warmup: int = 1,
    record_shapes: bool = True,
) -> profile:
    """Run ``fn`` once under torch.profiler (after ``warmup`` unprofiled calls).

    CPU activity is always recorded; CUDA kernels too when ``device`` is a GPU. The first
    profiler session in a process charges its own start-up (hundreds of microseconds) to
    the first op it sees, so that session is run once, on ``fn``, and thrown away.
    """
    global _profiler_warmed
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    if not _profiler_warmed:
        _profiled(fn, device, profile(activities=activities))
        _profiler_warmed = True
    return _profiled(fn, device, profile(activities=activities, record_shapes=record_shapes))


def start_profiler(prof: profile) -> None:
    """``prof.start()``, without torch importing its compiler to answer a question about it.

    Starting a ``torch.profiler.profile`` asks ``hasattr(torch, "_inductor")`` only to read one
    CUDA-graphs flag of ``torch.compile``; in a process that never compiled anything, asking
    imports the whole compiler (about 3 s on two CPU cores). Until something else loads it,
    the question is answered "not loaded", which is the truth.
    """
    if "torch._inductor" in sys.modules:
        prof.start()
        return
    lazy = torch.__dict__.get("__getattr__")

    def without_inductor(name: str):
        if name == "_inductor":
            raise AttributeError(name)
        return lazy(name)

    torch.__getattr__ = without_inductor
    try:
        prof.start()
    finally:
        torch.__getattr__ = lazy


def _profiled(fn: Callable[[], Any], device: torch.device, prof: profile) -> profile:
    with _quiet_native_stderr():  # the profiler's back end logs each start and stop there
        start_profiler(prof)
    try:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        with _quiet_native_stderr():
            prof.stop()
    return prof


@contextlib.contextmanager
def _quiet_native_stderr():
    """Send file descriptor 2 to /dev/null for a moment (C++ logging ignores sys.stderr)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (some embedded interpreters)
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _device_self_time(event: Any) -> float:
    # torch >= 2.4 names it self_device_time_total; older releases self_cuda_time_total.
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def self_times(prof: Any) -> tuple[str, dict[str, float]]:
    """Self time per op or kernel name, in microseconds, from a profiler result.

    Device time is used when the profile recorded any (GPU kernels run there); otherwise
    CPU self time.

    Returns:
        ``(clock, times)``: clock is "device" or "cpu"; times maps each name to its self time.
    """
    events = list(prof.key_averages())
    if not events:
        raise ValueError("the profile recorded no events: run the operation inside the profiler")
    on_device = any(_device_self_time(e) > 0 for e in events)
    if on_device:
        return "device", {e.key: _device_self_time(e) for e in events}
    return "cpu", {e.key: float(e.self_cpu_time_total) for e in events}


def dominant_op(prof: Any) -> str:
    """Name of the op or kernel with the largest self time in a profiler result.

    Self time excludes children: ``aten::matmul`` spends almost all of its total time
    inside ``aten::mm``, so the dominant op by self time is ``aten::mm`` (on a GPU, the
    GEMM kernel that ``aten::mm`` launched).
    """
    _, times = self_times(prof)
    return max(times, key=times.__getitem__)
