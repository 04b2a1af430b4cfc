"""All-reduce bandwidth on this machine: the course's ring (send/recv) against ``dist.all_reduce``
(gloo's own algorithm), on real process groups of 2 and 4 ranks, measured in one run.

For each float32 tensor size, each rank runs both collectives a few times after a barrier and the
best time is kept. Reported: seconds, and the bus bandwidth NCCL's tests define,
``2 (W - 1) / W x bytes / seconds``: the bytes each rank must send in any bandwidth-optimal
all-reduce, per second, so numbers for different W compare. The processes share this machine's
cores and talk over loopback, so this measures the algorithms' overheads, not a network.

Usage:
    python benchmarks/allreduce_bandwidth.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info
from infra_lib.training import ring_bytes_sent, run_workers
from infra_lib.training.collectives import bandwidth_worker

SEED = 0


def plan(quick: bool) -> dict:
    if quick:
        return {"world_sizes": [2], "numels": [1 << 10, 1 << 18], "repeats": 2}
    return {"world_sizes": [2, 4], "numels": [1 << 10, 1 << 14, 1 << 18, 1 << 22], "repeats": 5}


def run_allreduce(device: torch.device, quick: bool) -> dict:
    p = plan(quick)
    load_before = load_average()
    rows = []
    for world in p["world_sizes"]:
        per_rank = run_workers(bandwidth_worker, world, (p["numels"], p["repeats"]), timeout_s=300)
        for i, numel in enumerate(p["numels"]):
            times = {name: max(r[i][name] for r in per_rank) for name in ("ring", "dist.all_reduce")}  # slowest rank
            nbytes = numel * 4
            rows.append(
                {
                    "world_size": world,
                    "numel": numel,
                    "bytes": nbytes,
                    "ring_s": times["ring"],
                    "dist_s": times["dist.all_reduce"],
                    "ring_bus_gb_s": ring_bytes_sent(nbytes, world) / times["ring"] / 1e9,
                    "dist_bus_gb_s": ring_bytes_sent(nbytes, world) / times["dist.all_reduce"] / 1e9,
                    "ring_vs_dist": times["dist.all_reduce"] / times["ring"],
                }
            )
    return {
        "benchmark": "allreduce_bandwidth",
        "seed": SEED,
        "plan": p,
        "flags": {"quick": quick, "device": "cpu", "backend": "gloo", "dtype": "float32"},
        "results": rows,
        "note": "processes on one machine over loopback; --device is recorded only",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
    }


def format_table(result: dict) -> str:
    lines = [f"{'W':>2} {'bytes':>10} {'ring ms':>8} {'gloo ms':>8} {'ring GB/s':>9} {'gloo GB/s':>9} {'ring/gloo':>9}"]
    for r in result["results"]:
        lines.append(
            f"{r['world_size']:>2} {r['bytes']:>10} {r['ring_s'] * 1e3:>8.2f} {r['dist_s'] * 1e3:>8.2f} "
            f"{r['ring_bus_gb_s']:>9.3f} {r['dist_bus_gb_s']:>9.3f} {r['ring_vs_dist']:>9.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "allreduce_bandwidth", run_allreduce, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
