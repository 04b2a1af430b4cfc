"""Load test of the OpenAI-compatible server on SmolLM2-135M-Instruct: open-loop streams against
the same requests sent one at a time, measured in one run with vLLM's definitions.

The server runs on 127.0.0.1 in this process (uvicorn on a thread, the engine on another). The
client streams every request and stamps each chunk:

* **sequential** (the baseline): the requests one after another (concurrency 1), so the engine
  never batches;
* **open loop**: the same requests arriving as a Poisson process at ``rate`` per second (or all
  at once), at most ``max_num_seqs`` running in the engine, the rest queued; a tenth of the
  streams hang up after two tokens, to check that their KV blocks come back.

Reported per run: TTFT and TPOT (P50/P99), ITL P99, output tokens per second, goodput at the
SLOs below, HTTP statuses, and the KV blocks still held once the server is idle (must be 0).

Usage:
    python benchmarks/serve_load.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import time

import torch

from benchmark_cli import benchmark_main, load_average
from infra_lib.hardware.probes import machine_info
from infra_lib.model import load_default
from infra_lib.ops import run_load
from infra_lib.serving.server import DEFAULT_MODEL_NAME, ServerThread, build_engine, create_app

SEED = 0
SLO_MS = {"ttft": 2000, "tpot": 200}
KEYS = ("completed", "failed", "request_throughput", "output_throughput", "request_goodput", "p50_ttft_ms",
        "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms")


def plan(quick: bool) -> dict:
    if quick:
        return {"num_requests": 6, "max_tokens": 6, "rate": float("inf"), "max_num_seqs": 4,
                "sequential_requests": 2, "kv_blocks": 64}
    return {"num_requests": 200, "max_tokens": 24, "rate": 8.0, "max_num_seqs": 32, "sequential_requests": 16}


def leaked_blocks(engine, timeout_s: float = 60.0) -> int:
    """KV blocks still held once every request has finished or been aborted."""
    deadline = time.monotonic() + timeout_s
    while (engine.num_outstanding or engine.engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    return engine.engine.config.num_blocks - engine.engine.scheduler.pool.num_free


def run_serve_load(device: torch.device, quick: bool) -> dict:
    p = plan(quick)
    load_before = load_average()
    loaded = load_default()
    kv_blocks = p.get("kv_blocks", 512)  # a smaller pool in --quick: allocating it (zeroed) takes time too
    engine = build_engine(loaded.model, loaded.tokenizer, max_num_seqs=p["max_num_seqs"], kv_blocks=kv_blocks)
    prompts = [f"In one sentence, why is the number {i} interesting?" for i in range(p["num_requests"])]
    hang_ups = {i: 2 for i in range(0, p["num_requests"], 10)}
    runs = {}
    with ServerThread(create_app(engine, DEFAULT_MODEL_NAME)) as server:
        common = {"model": DEFAULT_MODEL_NAME, "max_tokens": p["max_tokens"], "slo_ms": SLO_MS, "seed": SEED}
        sequential = run_load(server.url, prompts[:p["sequential_requests"]], max_concurrency=1, **common)
        runs["sequential"] = {**{k: sequential.summary.get(k) for k in KEYS},
                              "status_counts": sequential.status_counts, "leaked_blocks": leaked_blocks(engine)}
        loaded_run = run_load(server.url, prompts, rate=p["rate"], disconnect_after=hang_ups, **common)
        runs["open_loop"] = {**{k: loaded_run.summary.get(k) for k in KEYS},
                             "status_counts": loaded_run.status_counts, "disconnected": loaded_run.disconnected,
                             "leaked_blocks": leaked_blocks(engine)}
        alive = engine.is_alive
    return {
        "benchmark": "serve_load", "seed": SEED, "plan": p, "slo_ms": SLO_MS,
        "flags": {"quick": quick, "device": str(device), "dtype": "float32", "endpoint": "chat", "stream": True},
        "engine": {"max_num_seqs": p["max_num_seqs"], "kv_blocks": kv_blocks, "block_size": 16},
        "runs": runs,
        "throughput_vs_sequential": runs["open_loop"]["output_throughput"] / runs["sequential"]["output_throughput"],
        "engine_alive_after": alive,
        "device": str(device), "note": "the engine and its KV pool run on the CPU",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
    }


def format_table(result: dict) -> str:
    lines = [f"{'run':<11} {'done':>5} {'fail':>4} {'tok/s':>7} {'good/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'TPOT p50':>9} {'TPOT p99':>9} {'ITL p99':>8} {'leaked':>6}"]
    for name, r in result["runs"].items():
        lines.append(f"{name:<11} {r['completed']:>5} {r['failed']:>4} {r['output_throughput']:>7.1f} "
                     f"{r['request_goodput']:>7.2f} {r['p50_ttft_ms']:>9.0f} {r['p99_ttft_ms']:>9.0f} "
                     f"{r['p50_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f} {r['p99_itl_ms']:>8.1f} "
                     f"{r['leaked_blocks']:>6}")
    lines.append(f"open-loop throughput / sequential: {result['throughput_vs_sequential']:.2f}x  "
                 f"statuses: {result['runs']['open_loop']['status_counts']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "serve_load", run_serve_load, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
