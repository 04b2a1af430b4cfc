"""DDP's overlap on this machine: the step time of ``ddp.DDP`` (each bucket's all-reduce started by a gradient hook,
in the background, while backward goes on) against the same buckets all-reduced after the whole backward, on
two gloo processes, measured side by side in one run.

Each rank trains two copies of the tiny Llama on its half of each global batch, one step of each variant in
turn (which goes first alternates), after a barrier; the step time of a variant is the slowest rank's. Reported
per transport (the course's ring over ``DistComm`` on a ``BackgroundAllReduce`` thread, and gloo's own
``dist.all_reduce``): median step time, backward time and the communication left after the backward (what
overlap can hide), and ``after / overlap``, the speed-up. Both variants compute the same sums: their parameters
stay bit-for-bit equal (checked, reported). Each rank computes on one torch thread; the communication of the
overlapped variant needs a core of its own to hide anything, so on a busy machine the ratio falls towards 1.

Usage:
    python benchmarks/ddp_overlap.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import statistics

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info
from infra_lib.training import run_workers
from infra_lib.training.ddp import overlap_worker

SEED = 0
WORLD = 2
VARIANTS = ("overlap", "after")


def plan(quick: bool) -> dict:
    if quick:
        return {
            "steps": 3,
            "batch_per_rank": 1,
            "seq_len": 32,
            "bucket_bytes": 1 << 16,
            "transports": ["ring"],
            "model_size": {
                "hidden_size": 64,
                "n_layers": 2,
                "n_heads": 2,
                "n_kv_heads": 1,
                "head_dim": 32,
                "intermediate_size": 192,
            },
        }
    return {
        "steps": 20,
        "batch_per_rank": 2,
        "seq_len": 64,
        "bucket_bytes": 1 << 18,
        "transports": ["ring", "gloo"],
        "model_size": {},
    }


def _median(per_rank: list[dict], variant: str, key: str) -> float:
    """The median over steps of the slowest rank's time."""
    steps = zip(*(rank["rows"][variant] for rank in per_rank))
    return statistics.median(max(row[key] for row in rows) for rows in steps)


def run_overlap(device: torch.device, quick: bool) -> dict:
    p = plan(quick)
    load_before = load_average()
    results = []
    for transport in p["transports"]:
        args = (p["steps"], p["batch_per_rank"], p["seq_len"], p["bucket_bytes"], transport, p["model_size"], SEED)
        per_rank = run_workers(overlap_worker, WORLD, args, timeout_s=600)
        row = {
            "transport": transport,
            "buckets": per_rank[0]["buckets"],
            "grad_bytes": per_rank[0]["grad_bytes"],
            "same_parameters": all(r["same_parameters"] for r in per_rank),
        }
        for variant in VARIANTS:
            for key in ("step_s", "backward_s", "exposed_comm_s"):
                row[f"{variant}_{key}"] = _median(per_rank, variant, key)
        row["after_over_overlap"] = row["after_step_s"] / row["overlap_step_s"]
        row["comm_hidden_fraction"] = 1 - row["overlap_exposed_comm_s"] / max(row["after_exposed_comm_s"], 1e-12)
        results.append(row)
    return {
        "benchmark": "ddp_overlap",
        "seed": SEED,
        "plan": p,
        "flags": {
            "quick": quick,
            "device": "cpu",
            "backend": "gloo",
            "world_size": WORLD,
            "dtype": "float32",
            "torch_threads_per_rank": 1,
        },
        "results": results,
        "note": "two processes on one machine over loopback; --device is recorded only",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
    }


def format_table(result: dict) -> str:
    lines = [
        f"{'transport':9} {'overlap ms':>10} {'after ms':>9} {'after/overlap':>13} {'backward ms':>11} "
        f"{'comm left: overlap / after ms':>30}"
    ]
    for r in result["results"]:
        lines.append(
            f"{r['transport']:9} {r['overlap_step_s'] * 1e3:>10.1f} {r['after_step_s'] * 1e3:>9.1f} "
            f"{r['after_over_overlap']:>13.2f} {r['overlap_backward_s'] * 1e3:>11.1f} "
            f"{r['overlap_exposed_comm_s'] * 1e3:>14.1f} / {r['after_exposed_comm_s'] * 1e3:.1f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "ddp_overlap", run_overlap, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
