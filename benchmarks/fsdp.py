"""FSDP2 and distributed checkpoints on this machine: one SmolLM2-135M step sharded over 2 gloo ranks, and a
blocking against an async checkpoint of a sharded Llama over 4, side by side in one run.

SmolLM2 (fp32, AdamW at 1e-5): each rank's bytes held (parameters, gradients, AdamW's moments) against
``zero_memory_per_device``'s stage 3, each rank's peak resident memory, the time of each step (the first includes
FSDP2's set-up), and the bytes each rank sent in the last step's all-gathers and reduce-scatters against
``fsdp.expected_traffic``.

Checkpoints (``checkpointing.save_worker``, 4 ranks): the loop's stall in a blocking ``dcp.save`` and in
``dcp.async_save`` of the same state, the steps trained while the async write ran against the steps after a
second blocking save, and whether the two checkpoints of one state hold the same numbers; ``stall_ratio`` is
the async stall over the blocking one (the slowest rank's each). 4 ranks share this machine's cores with the
write thread: read ``load_average_1m``.

Usage:
    python benchmarks/fsdp.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info
from infra_lib.training import checkpointing, fsdp
from infra_lib.training.launcher import run_workers
from infra_lib.training.train_step import tiny_config, tiny_model
from infra_lib.training.zero import zero_memory_per_device

FP32_ADAMW = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}


def plan(quick: bool) -> dict:
    return {
        "smollm2": {"world_size": 2, "seq_len": 16 if quick else 32, "batch_per_rank": 1, "steps": 2},
        "checkpoint": {
            "world_size": 4,
            "config": [256, 128, 4, 4, 2, 32, 384, 32] if quick else [256, 512, 8, 8, 4, 64, 1536, 64],
            "steps": 4 if quick else 11,
            "save_at": 2 if quick else 3,
        },
    }


def smollm2_step(p: dict) -> dict:
    ranks = run_workers(
        fsdp.smollm2_step_worker, p["world_size"], (p["seq_len"], p["batch_per_rank"], p["steps"]), timeout_s=600
    )
    num_params = ranks[0]["num_params"]
    return {
        "num_params": num_params,
        "stage3_bytes_per_rank": zero_memory_per_device(num_params, p["world_size"], 3, **FP32_ADAMW),
        "ranks": ranks,
    }


def checkpoint_stalls(p: dict) -> dict:
    config = tiny_config(*p["config"])
    batches = fsdp.global_batches(p["steps"], 4, 32)
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as folder:
        ranks = run_workers(
            checkpointing.save_worker, p["world_size"], (config, batches, p["save_at"], folder), timeout_s=600
        )
        blocking = checkpointing.checkpoint_contents(Path(folder) / "blocking")
        written_late = checkpointing.checkpoint_contents(Path(folder) / "async")
        files = checkpointing.shard_files(Path(folder) / "blocking")
    same = blocking.keys() == written_late.keys() and all(
        (v == written_late[k]).all() for k, v in blocking.items() if hasattr(v, "shape")
    )
    slowest = {k: max(r[k] for r in ranks) for k in ("blocking_s", "async_s", "async_wait_s", "blocking_later_s")}
    k, m = ranks[0]["saved_step"], ranks[0]["overlap_steps"]
    steps = [max(r["step_seconds"][i] for r in ranks) for i in range(p["steps"])]
    return {
        "num_params": sum(t.numel() for t in tiny_model(config).parameters()),
        "checkpoint_bytes": sum(files.values()),
        "slowest_rank": slowest,
        "stall_ratio": slowest["async_s"] / slowest["blocking_s"],
        "steps_during_async_write_s": sum(steps[k : k + m]),
        "steps_after_blocking_save_s": sum(steps[k + m : k + 2 * m]),
        "loop_with_async_s": slowest["async_s"] + sum(steps[k : k + m]) + slowest["async_wait_s"],
        "loop_with_blocking_s": slowest["blocking_later_s"] + sum(steps[k + m : k + 2 * m]),
        "same_numbers": bool(same),
        "ranks": [{key: r[key] for key in ("step_seconds", *slowest)} for r in ranks],
    }


def run(device, quick: bool) -> dict:
    p = plan(quick)
    load_before = load_average()
    return {
        "benchmark": "fsdp",
        "plan": p,
        "flags": {"quick": quick, "device": "cpu", "backend": "gloo", "dtype": "float32"},
        "smollm2": smollm2_step(p["smollm2"]),
        "checkpoint": checkpoint_stalls(p["checkpoint"]),
        "note": "every rank a CPU process on gloo; --device is recorded only",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
    }


def sent(traffic: dict) -> int:
    """Bytes of all-gathers and reduce-scatters in a traffic dict (which may also count the calls)."""
    return traffic["all_gather"] + traffic["reduce_scatter"]


def format_table(result: dict) -> str:
    smol, ckpt = result["smollm2"], result["checkpoint"]
    lines = [
        f"SmolLM2-135M, {smol['num_params']:,} parameters, stage 3: {smol['stage3_bytes_per_rank'] / 1e9:.3f} GB a rank"
    ]
    for r, rank in enumerate(smol["ranks"]):
        peak = "n/a" if rank["peak_rss_bytes"] is None else f"{rank['peak_rss_bytes'] / 1e9:.2f} GB"
        lines.append(
            f"  rank {r}: held {sum(rank['held'].values()) / 1e9:.3f} GB, peak resident {peak}, steps "
            f"{', '.join(f'{t:.2f}' for t in rank['seconds'])} s, sent {sent(rank['traffic']) / 1e6:.0f} MB "
            f"(expected {sent(rank['expected_traffic']) / 1e6:.0f} MB)"
        )
    s = ckpt["slowest_rank"]
    lines.append(
        f"checkpoint of {ckpt['num_params']:,} parameters ({ckpt['checkpoint_bytes'] / 1e6:.0f} MB) on 4 ranks: stall "
        f"blocking {s['blocking_s'] * 1e3:.0f} ms / {s['blocking_later_s'] * 1e3:.0f} ms, "
        f"async {s['async_s'] * 1e3:.0f} ms "
        f"(ratio {ckpt['stall_ratio']:.2f}); save + steps: async {ckpt['loop_with_async_s']:.2f} s, blocking "
        f"{ckpt['loop_with_blocking_s']:.2f} s; same numbers: {ckpt['same_numbers']}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "fsdp", run, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
