"""Load imbalance and dropped slots of a mixture-of-experts block as its capacity factor varies, and the
expert-parallel block (4 experts over 2 gloo processes) against the one-process block, in one run.

The block is built at SmolLM2's sizes (hidden 576, 1536 per expert), 4 experts, top-2, seeded weights and an
untrained router (SmolLM2 itself is dense). Two kinds of seeded token batches go through it: Gaussian
vectors, and rows of SmolLM2's embedding table for random token ids, each scaled to unit RMS as a norm
would (real embeddings share directions, so an untrained router already prefers some experts). Per capacity
factor: the slots per expert, the imbalance (the most-loaded expert's slots over the mean, before any drop),
the same ratio over the slots kept, and the fraction of (token, choice) slots dropped, each the mean over
the batches.

Usage:
    python benchmarks/moe.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import statistics

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info
from infra_lib.model import load_default
from infra_lib.serving.moe import MoEBlock, MoEConfig, moe_forward, moe_worker
from infra_lib.training import run_workers

SEED = 0
WORLD = 2
FACTORS = [0.5, 1.0, 1.25, 2.0]


def plan(quick: bool) -> dict:
    if quick:
        return {"batches": 2, "tokens": 64, "factors": FACTORS}
    return {"batches": 8, "tokens": 512, "factors": FACTORS}


def token_batches(kind: str, batches: int, tokens: int, hidden: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    if kind == "gaussian":
        return [torch.randn(tokens, hidden, generator=g) for _ in range(batches)]
    table = load_default().model.embed_tokens.weight.detach()
    rows = [table[torch.randint(17, table.shape[0], (tokens,), generator=g)] for _ in range(batches)]
    return [x / x.pow(2).mean(-1, keepdim=True).sqrt() for x in rows]


def run_moe(device: torch.device, quick: bool) -> dict:
    p = plan(quick)
    config = MoEConfig()
    block = MoEBlock(config, SEED)
    load_before = load_average()
    rows = []
    for kind in ("gaussian", "smollm2_embeddings"):
        batches = token_batches(kind, p["batches"], p["tokens"], config.hidden_size)
        for factor in p["factors"]:
            results = [moe_forward(block, x, factor) for x in batches]
            kept_loads = [
                torch.stack([(r.experts == e)[r.kept].sum() for e in range(config.n_experts)]).float() for r in results
            ]
            rows.append(
                {
                    "tokens": kind,
                    "capacity_factor": factor,
                    "capacity": results[0].capacity,
                    "imbalance": statistics.mean(r.imbalance() for r in results),
                    "kept_imbalance": statistics.mean(float(k.max() / k.mean()) for k in kept_loads),
                    "dropped_fraction": statistics.mean(r.dropped_fraction() for r in results),
                }
            )
    # the expert-parallel block on the first Gaussian batch at every factor, against one process
    x = token_batches("gaussian", 1, p["tokens"], config.hidden_size)[0]
    ranks = run_workers(moe_worker, WORLD, (config, SEED, x, p["factors"]), timeout_s=600)
    parallel = []
    for factor in p["factors"]:
        reference = moe_forward(block, x, factor)
        out = torch.cat([r["results"][factor]["out"] for r in ranks])
        kept = torch.cat([r["results"][factor]["kept"] for r in ranks])
        parallel.append(
            {
                "capacity_factor": factor,
                "same_kept_slots": bool(torch.equal(kept, reference.kept)),
                "max_abs_difference": float((out - reference.out).abs().max()),
            }
        )
    return {
        "benchmark": "moe",
        "seed": SEED,
        "plan": p,
        "flags": {
            "quick": quick,
            "device": "cpu",
            "backend": "gloo",
            "world_size": WORLD,
            "dtype": "float32",
            "n_experts": config.n_experts,
            "top_k": config.top_k,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
        },
        "results": rows,
        "expert_parallel": parallel,
        "note": "an untrained, seeded router; --device is recorded only",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
    }


def format_table(result: dict) -> str:
    lines = [f"{'tokens':18} {'C':>5} {'slots/expert':>12} {'imbalance':>9} {'kept imbalance':>14} {'dropped':>8}"]
    for r in result["results"]:
        lines.append(
            f"{r['tokens']:18} {r['capacity_factor']:>5.2f} {r['capacity']:>12} {r['imbalance']:>9.2f} "
            f"{r['kept_imbalance']:>14.2f} {r['dropped_fraction']:>8.1%}"
        )
    for r in result["expert_parallel"]:
        lines.append(
            f"expert-parallel (2 processes) at C={r['capacity_factor']}: same kept slots {r['same_kept_slots']}, "
            f"max |difference| {r['max_abs_difference']:.1e}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "moe", run_moe, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
