"""Tensor-parallel decode of SmolLM2-135M-Instruct over two gloo processes: a decode step's time, the share of it
spent inside ``dist.all_reduce``, the all-reduce's own latency, and the same step unsplit, in one run.

Each rank decodes the same prompts greedily (fp32, one torch thread per rank) with its KV-head groups
(6 + 3 query heads) and half the MLP; per step it does 2 all-reduces per layer, 60 in all. The tokens are
checked against one process's ``greedy_decode``. The unsplit step runs the same code with one rank and no
all-reduce, on rank 0 while rank 1 waits. α is the median of single all-reduces of one hidden vector
(576 floats) over loopback. The last table applies ``tp_decode_estimate`` to SmolLM2 in bf16 on H100s with
α = 6 µs (NVLink; see ``infra_lib.serving.tensor_parallel_decode``).

Usage:
    python benchmarks/tp_decode.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import statistics

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info
from infra_lib.hardware.specs import get_accelerator
from infra_lib.model import load_default
from infra_lib.model.generation import greedy_decode
from infra_lib.serving.tensor_parallel_decode import tp_decode_estimate, tp_decode_worker
from infra_lib.training import run_workers

SEED = 0  # greedy decode draws nothing at random; recorded for the shared format
WORLD = 2
PROMPTS = ("What is the capital of France?", "What is Python?", "Name three planets.")
NVLINK_ALL_REDUCE_S = 6e-6


def plan(quick: bool) -> dict:
    if quick:
        return {"prompts": list(PROMPTS[:1]), "max_new_tokens": 4, "latency_iters": 20}
    return {"prompts": list(PROMPTS), "max_new_tokens": 24, "latency_iters": 300}


def run_tp_decode(device: torch.device, quick: bool) -> dict:
    p = plan(quick)
    loaded = load_default()
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in p["prompts"]]
    expected = [greedy_decode(loaded.model, prompt, p["max_new_tokens"], tokenizer.eos_id) for prompt in prompts]
    load_before = load_average()
    args = (prompts, p["max_new_tokens"], tokenizer.eos_id, True, p["latency_iters"])
    ranks = run_workers(tp_decode_worker, WORLD, args, timeout_s=600)
    per_rank = [
        {
            "rank": r["rank"],
            "query_heads": r["query_heads"],
            "kv_heads": r["kv_heads"],
            "weight_bytes": r["weight_bytes"],
            "step_ms_median": statistics.median(r["step_s"]) * 1e3,
            "all_reduce_ms_median": statistics.median(r["all_reduce_s"]) * 1e3,
            "all_reduce_share": sum(r["all_reduce_s"]) / sum(r["step_s"]),
            "all_reduce_latency_us": r["all_reduce_latency_s"] * 1e6,
        }
        for r in ranks
    ]
    # a step ends when its slowest rank ends: rank by rank the steps are the same steps
    step_s = [max(pair) for pair in zip(*(r["step_s"] for r in ranks))]
    single_ms = statistics.median(ranks[0]["single_step_s"]) * 1e3
    h100 = get_accelerator("H100 SXM")
    return {
        "benchmark": "tp_decode",
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
        "same_tokens_as_one_process": all(r["tokens"] == expected for r in ranks)
        and ranks[0]["single_tokens"] == expected,
        "decode_steps": len(step_s),
        "all_reduces_per_step": ranks[0]["all_reduces_per_step"],
        "tp_step_ms_median": statistics.median(step_s) * 1e3,
        "single_step_ms_median": single_ms,
        "tp_over_single": statistics.median(step_s) * 1e3 / single_ms,
        "per_rank": per_rank,
        "h100_estimate": {
            "all_reduce_latency_s": NVLINK_ALL_REDUCE_S,
            "bytes_per_param": 2,
            **tp_decode_estimate(loaded.model.config, WORLD, h100.bandwidth_bytes_per_s, NVLINK_ALL_REDUCE_S),
        },
        "note": "two processes on one machine over loopback; --device is recorded only",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
    }


def format_table(result: dict) -> str:
    lines = [
        f"same greedy tokens as one process: {result['same_tokens_as_one_process']} "
        f"({result['decode_steps']} decode steps, {result['all_reduces_per_step']} all-reduces each)",
        f"step: TP=2 {result['tp_step_ms_median']:.1f} ms, one process {result['single_step_ms_median']:.1f} ms "
        f"(TP/one = {result['tp_over_single']:.2f})",
        f"{'rank':4} {'heads q/kv':>10} {'weights MB':>10} {'step ms':>8} {'in all-reduce ms':>16} {'share':>6} "
        f"{'α µs':>6}",
    ]
    for r in result["per_rank"]:
        lines.append(
            f"{r['rank']:4} {r['query_heads']:>6}/{r['kv_heads']:<3} {r['weight_bytes'] / 1e6:>10.0f} "
            f"{r['step_ms_median']:>8.1f} {r['all_reduce_ms_median']:>16.1f} {r['all_reduce_share']:>6.0%} "
            f"{r['all_reduce_latency_us']:>6.0f}"
        )
    e = result["h100_estimate"]
    lines.append(
        f"H100 bf16 estimate: one GPU {e['one_gpu_s'] * 1e6:.0f} µs/token; TP=2 {e['tp_memory_s'] * 1e6:.0f} µs of "
        f"weights + {e['tp_all_reduce_s'] * 1e6:.0f} µs of all-reduces = {e['tp_s'] * 1e6:.0f} µs "
        f"(speed-up {e['tp_speedup']:.2f}); TP pays above {e['break_even_layer_bytes'] / 1e6:.0f} MB per layer, "
        f"SmolLM2's is {e['layer_bytes'] / 1e6:.1f} MB"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "tp_decode", run_tp_decode, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
