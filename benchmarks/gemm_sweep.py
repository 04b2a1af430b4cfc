"""Square GEMM throughput against this machine's measured peak, written as JSON.

Chapter 01 plots the same sweep live; this script records it with the hardware, seed and
flags so that runs on different machines (or thread counts) can be compared.

Usage:
    python benchmarks/gemm_sweep.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import sys

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info, measure_gemm_rates, measure_peak_gemm_flops

SEED = 0
DTYPE = torch.float32

# (sweep sizes, sizes the peak is taken over, timed iterations per size)
QUICK_PLAN = ([64, 128, 256, 512], (256, 512), 3)
CPU_PLAN = ([32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048], (512, 1024, 1536, 2048), 5)
GPU_PLAN = ([64, 128, 256, 512, 1024, 2048, 4096, 8192], (2048, 4096, 8192), 5)


def run_sweep(device: torch.device, quick: bool) -> dict:
    """Measure the practical peak, then each square size; return the JSON-ready result."""
    if quick:
        sizes, peak_sizes, iters = QUICK_PLAN
    elif device.type == "cuda":
        sizes, peak_sizes, iters = GPU_PLAN
    else:
        sizes, peak_sizes, iters = CPU_PLAN
    torch.manual_seed(SEED)
    load_before = load_average()
    peak = measure_peak_gemm_flops(device, DTYPE, sizes=peak_sizes, iters=iters)
    rows = measure_gemm_rates(sizes, device, DTYPE, iters=iters, seed=SEED)
    for row in rows:
        row["fraction_of_peak"] = row["gflops"] / peak["peak_gflops"]
    return {
        "benchmark": "gemm_sweep",
        "machine_info": machine_info(device),
        "torch_threads": torch.get_num_threads(),
        # Other programs competing for the cores distort every number here; keep the evidence.
        "load_average_1m": {"before": load_before, "after": load_average()},
        "seed": SEED,
        "flags": {"quick": quick, "device": str(device), "dtype": str(DTYPE).replace("torch.", "")},
        "sizes": list(sizes),
        "results": rows,
        "peak": peak,
    }


def format_table(result: dict) -> str:
    """A short human-readable table of one sweep result."""
    peak = result["peak"]
    lines = [
        f"{result['machine_info']['device']}, {result['flags']['dtype']}: practical peak "
        f"{peak['peak_gflops']:,.1f} GFLOP/s at n = {peak['best_n']}",
        f"{'n':>6} {'ms per call':>12} {'GFLOP/s':>10} {'of peak':>8}",
    ]
    for row in result["results"]:
        lines.append(
            f"{row['n']:6d} {row['seconds'] * 1e3:12.4f} {row['gflops']:10,.1f} {row['fraction_of_peak']:8.0%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "gemm_sweep", run_sweep, format_table)


if __name__ == "__main__":
    sys.exit(main())
