"""This machine's roofline: measured GEMM peak and memory bandwidth, and ops placed under it.

Chapter 02 draws the same roofline live; this script records it with the hardware, seed and
flags. Each point is an op timed here, at its arithmetic intensity, with the fraction of the
roof (achieved / attainable FLOP/s) it reached.

Usage:
    python benchmarks/roofline_probe.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import sys

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import (
    machine_info,
    measure_add_point,
    measure_gemm_point,
    measure_memory_bandwidth,
    measure_peak_gemm_flops,
    place_on_roofline,
)
from infra_lib.hardware.roofline import ridge_point

SEED = 0
DTYPE = torch.float32
WIDTH = 4096  # a 4096 x 4096 float32 weight is 64 MiB: larger than a laptop's last-level cache


def plan(quick: bool, device: torch.device) -> dict:
    """Sizes for the peak, the bandwidth arrays, and the (name, m, n, k) GEMMs to place."""
    prompt = 256 if quick else 512
    squares = (256, 512) if quick else (256, 1024, 2048)
    if quick:
        peak_sizes = (256, 512)
    elif device.type == "cuda":
        peak_sizes = (2048, 4096, 8192)
    else:
        peak_sizes = (512, 1024, 1536, 2048)
    gemms = [(f"square GEMM n={n}", n, n, n) for n in squares]
    gemms += [
        (f"prefill GEMM, {prompt} tokens", prompt, WIDTH, WIDTH),
        ("decode GEMM, batch 8", 8, WIDTH, WIDTH),
        ("decode GEMV, batch 1", 1, WIDTH, WIDTH),
    ]
    return {
        "peak_sizes": peak_sizes,
        "bandwidth_mb": 64 if quick else 256,
        "add_mb": 64 if quick else 256,
        "iters": 3 if quick else 5,
        "gemms": gemms,
    }


def run_probe(device: torch.device, quick: bool) -> dict:
    """Measure the two roofs, then each point; return the JSON-ready result."""
    torch.manual_seed(SEED)
    settings = plan(quick, device)
    load_before = load_average()
    peak = measure_peak_gemm_flops(device, DTYPE, sizes=settings["peak_sizes"], iters=settings["iters"])
    bandwidth = measure_memory_bandwidth(settings["bandwidth_mb"], iters=settings["iters"], device=device)
    peak_gflops, bandwidth_gbps = peak["peak_gflops"], bandwidth["bandwidth_gbps"]

    measured = [
        measure_gemm_point(name, m, n, k, device, DTYPE, iters=settings["iters"], seed=SEED)
        for name, m, n, k in settings["gemms"]
    ]
    measured.append(
        measure_add_point(
            f"elementwise add, {settings['add_mb']} MB arrays",
            settings["add_mb"],
            device,
            DTYPE,
            iters=settings["iters"],
        )
    )
    points = [place_on_roofline(point, peak_gflops, bandwidth_gbps) for point in measured]
    return {
        "benchmark": "roofline_probe",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
        "seed": SEED,
        "flags": {"quick": quick, "device": str(device), "dtype": str(DTYPE).replace("torch.", "")},
        "peak": peak,
        "bandwidth": bandwidth,
        "ridge_point_flop_per_byte": ridge_point(peak_gflops * 1e9, bandwidth_gbps * 1e9),
        "points": points,
    }


def format_table(result: dict) -> str:
    """A short human-readable summary of one probe result."""
    peak, bandwidth = result["peak"], result["bandwidth"]
    lines = [
        (
            f"{result['machine_info']['device']}, {result['flags']['dtype']}: peak {peak['peak_gflops']:,.1f} GFLOP/s "
            f"(n = {peak['best_n']}); bandwidth copy {bandwidth['copy_gbps']:.1f}, triad {bandwidth['triad_gbps']:.1f} "
            f"GB/s; ridge {result['ridge_point_flop_per_byte']:.1f} FLOP/byte"
        ),
        f"{'point':34s} {'FLOP/B':>8s} {'GFLOP/s':>9s} {'roof':>9s} {'of roof':>8s}  bound",
    ]
    for p in result["points"]:
        lines.append(
            f"{p['name']:34s} {p['intensity']:8.2f} {p['achieved_gflops']:9.1f} "
            f"{p['attainable_gflops']:9.1f} {p['fraction_of_roof']:8.0%}  {p['bound']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "roofline_probe", run_probe, format_table)


if __name__ == "__main__":
    sys.exit(main())
