"""Probes that measure this machine rather than quote a datasheet."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable

import torch

from infra_lib.device import describe, synchronizer
from infra_lib.hardware.flops import gemm_flops
from infra_lib.timing import time_op


def cpu_model() -> str:
    """The processor's marketing name, or the architecture where the OS does not say."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device | str = "cpu") -> dict:
    """Facts a benchmark result must carry to be comparable with another run."""
    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "mkl": torch.backends.mkl.is_available(),
        "device": describe(device),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def measure_gemm_rates(
    sizes: Iterable[int],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    warmup: int = 2,
    iters: int = 5,
    seed: int = 0,
) -> list[dict]:
    """Time a square n x n @ n x n GEMM for each n.

    Returns:
        One dict per size: ``n``, ``seconds`` (median), ``gflops`` (achieved GFLOP/s).
    """
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for n in sizes:
        if n < 1:
            raise ValueError(f"GEMM sizes must be >= 1, got {n}")
        a = torch.randn(n, n, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
        seconds = time_op(lambda: a @ b, warmup=warmup, iters=iters, sync=synchronizer(device))
        rows.append({"n": n, "seconds": seconds, "gflops": gemm_flops(n, n, n) / seconds / 1e9})
    return rows


def measure_peak_gemm_flops(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    sizes: Iterable[int] = (512, 1024, 1536, 2048),
    *,
    iters: int = 5,
) -> dict:
    """This machine's practical GEMM peak: the best achieved rate over a few large sizes.

    A datasheet peak assumes every core issues fused multiply-adds every cycle; the
    practical peak is what a tuned BLAS reaches here, and is the ceiling a course
    measurement can honestly be compared with.

    Returns:
        ``peak_gflops``, ``best_n``, ``per_size`` (as from measure_gemm_rates), ``dtype``,
        ``torch_threads``.
    """
    rows = measure_gemm_rates(sizes, device, dtype, warmup=2, iters=iters)
    best = max(rows, key=lambda row: row["gflops"])
    return {
        "peak_gflops": best["gflops"],
        "best_n": best["n"],
        "per_size": rows,
        "dtype": str(dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
    }
