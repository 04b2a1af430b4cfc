"""Probes that measure this machine rather than quote a datasheet."""

from __future__ import annotations

import glob
import os
import platform
from collections.abc import Iterable

import torch

from infra_lib.device import describe, synchronizer
from infra_lib.hardware.flops import gemm_flops
from infra_lib.hardware.roofline import arithmetic_intensity, attainable_flops, bound, elementwise_intensity
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


BF16_MATRIX_FLAGS = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX", "bf16": "Arm BF16"}


def bf16_matrix_instructions(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's instructions that multiply bf16 matrices natively, from the flags Linux lists (x86:
    AVX512-BF16, AMX; Arm: BF16); empty where it has none or the OS does not say. Without them a
    CPU converts bf16 to fp32 around every product, and bf16 is often slower than fp32 there."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        line = ""
    flags = set(line.partition(":")[2].split())
    return [name for flag, name in BF16_MATRIX_FLAGS.items() if flag in flags]


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
    rows = []
    for n in sizes:
        if n < 1:
            raise ValueError(f"GEMM sizes must be >= 1, got {n}")
        point = measure_gemm_point(f"n={n}", n, n, n, device, dtype, warmup=warmup, iters=iters, seed=seed + n)
        rows.append({"n": n, "seconds": point["seconds"], "gflops": point["achieved_gflops"]})
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


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest cache as Linux reports it (sysfs), or None where it does not say."""
    best_level, best_size = 0, None
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "level"), encoding="utf-8") as f:
                level = int(f.read())
            with open(os.path.join(index, "size"), encoding="utf-8") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
        if level > best_level:
            best_level, best_size = level, size
    return best_size


def measure_memory_bandwidth(
    size_mb: float | None = None,
    iters: int = 5,
    quick: bool = False,
    *,
    device: torch.device | str = "cpu",
) -> dict:
    """Main-memory bandwidth, STREAM style: a copy and a triad over float32 arrays.

    Byte counting follows STREAM: an operation is charged the bytes it asks for, each array
    read or written once. copy (``a = b``) moves 2 arrays, triad (``a = b + s * c``) moves 3.
    A CPU that must read a cache line before overwriting it (write-allocate) really moves one
    array more, so these figures are what a program sees, not the raw DRAM traffic. Arrays
    must be far larger than the last-level cache, or the cache's bandwidth is measured
    instead. The ops write into preallocated tensors, so nothing is allocated while timing.

    Args:
        size_mb: size of each of the three arrays, decimal MB (default 256, or 64 with quick).
        iters: timed repetitions per kernel; the median is reported.
        quick: smaller arrays (64 MB, for CI), still larger than most CPUs' last-level cache.
        device: where the arrays live ("cpu", or a GPU to measure its memory).

    Returns:
        ``copy_gbps``, ``triad_gbps`` (decimal GB/s), ``bandwidth_gbps`` (the larger of the two:
        the memory roof to use), ``array_mb``, ``llc_mb`` (None where unknown), ``iters``,
        ``torch_threads``.
    """
    if size_mb is None:
        size_mb = 64 if quick else 256
    if not size_mb > 0:
        raise ValueError(f"size_mb must be > 0, got {size_mb!r}")
    device = torch.device(device)
    n = int(size_mb * 1e6) // 4  # float32 elements per array
    array_bytes = 4 * n
    a = torch.zeros(n, dtype=torch.float32, device=device)  # writing every page maps it now
    b = torch.full((n,), 1.0, dtype=torch.float32, device=device)
    c = torch.full((n,), 2.0, dtype=torch.float32, device=device)
    sync = synchronizer(device)
    copy_seconds = time_op(lambda: a.copy_(b), warmup=2, iters=iters, sync=sync)
    triad_seconds = time_op(lambda: torch.add(b, c, alpha=3.0, out=a), warmup=2, iters=iters, sync=sync)
    copy_gbps = 2 * array_bytes / copy_seconds / 1e9
    triad_gbps = 3 * array_bytes / triad_seconds / 1e9
    llc = last_level_cache_bytes() if device.type == "cpu" else None
    return {
        "copy_gbps": copy_gbps,
        "triad_gbps": triad_gbps,
        "bandwidth_gbps": max(copy_gbps, triad_gbps),
        "array_mb": array_bytes / 1e6,
        "llc_mb": None if llc is None else llc / 1e6,
        "iters": iters,
        "torch_threads": torch.get_num_threads(),
    }


def measure_gemm_point(
    name: str,
    m: int,
    n: int,
    k: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    warmup: int = 2,
    iters: int = 5,
    seed: int = 0,
) -> dict:
    """Time one (m, k) @ (k, n) GEMM into a preallocated output, for a roofline plot.

    Returns:
        ``name``, ``kind`` ("gemm"), ``m``, ``n``, ``k``, ``seconds`` (median), ``flops``,
        ``intensity`` (FLOP/byte with A and B read and C written once) and ``achieved_gflops``.
    """
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=generator).to(device=device, dtype=dtype)
    c = torch.empty(m, n, device=device, dtype=dtype)
    seconds = time_op(lambda: torch.mm(a, b, out=c), warmup=warmup, iters=iters, sync=synchronizer(device))
    flops = gemm_flops(m, n, k)
    return {
        "name": name,
        "kind": "gemm",
        "m": m,
        "n": n,
        "k": k,
        "seconds": seconds,
        "flops": flops,
        "intensity": arithmetic_intensity(m, n, k, bytes_per_element=a.element_size()),
        "achieved_gflops": flops / seconds / 1e9,
    }


def measure_add_point(
    name: str,
    size_mb: float,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    warmup: int = 2,
    iters: int = 5,
) -> dict:
    """Time an elementwise ``c = a + b`` over arrays of ``size_mb`` decimal MB each, for a roofline plot.

    Returns:
        ``name``, ``kind`` ("elementwise"), ``elements``, ``seconds`` (median), ``flops`` (one per
        element), ``intensity`` (FLOP/byte: two arrays read, one written) and ``achieved_gflops``.
    """
    device = torch.device(device)
    element_size = torch.empty(0, dtype=dtype).element_size()
    elements = int(size_mb * 1e6) // element_size
    if elements < 1:
        raise ValueError(f"size_mb must hold at least one element, got {size_mb!r}")
    a = torch.full((elements,), 1.0, device=device, dtype=dtype)
    b = torch.full((elements,), 2.0, device=device, dtype=dtype)
    c = torch.zeros(elements, device=device, dtype=dtype)
    seconds = time_op(lambda: torch.add(a, b, out=c), warmup=warmup, iters=iters, sync=synchronizer(device))
    return {
        "name": name,
        "kind": "elementwise",
        "elements": elements,
        "seconds": seconds,
        "flops": elements,
        "intensity": elementwise_intensity(1, inputs=2, outputs=1, bytes_per_element=element_size),
        "achieved_gflops": elements / seconds / 1e9,
    }


def place_on_roofline(point: dict, peak_gflops: float, bandwidth_gbps: float) -> dict:
    """A measured point with its roof: ``attainable_gflops``, ``fraction_of_roof`` (achieved /
    attainable; above 1 means the op beat the roof, e.g. because its data sat in a cache) and
    ``bound`` ("memory-bound" or "compute-bound")."""
    peak, bandwidth = peak_gflops * 1e9, bandwidth_gbps * 1e9
    attainable = attainable_flops(point["intensity"], peak, bandwidth) / 1e9
    return {
        **point,
        "attainable_gflops": attainable,
        "fraction_of_roof": point["achieved_gflops"] / attainable,
        "bound": bound(point["intensity"], peak, bandwidth),
    }
