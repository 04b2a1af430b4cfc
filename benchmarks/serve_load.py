"""Load test of the OpenAI-compatible server on SmolLM2-135M-Instruct: open-loop streams against
the same requests sent one at a time, measured in one run with vLLM's definitions.

The server runs on 127.0.0.1 in this process (uvicorn on a thread, the engine on another). The
client streams every request and stamps each chunk:

* **sequential** (the baseline): the requests one after another (concurrency 1), so the engine
  never batches;
* **open loop**: the same requests arriving as a Poisson process at ``rate`` per second (or all
  at once), at most ``max_num_seqs`` running in the engine, the rest queued; a tenth of the
  streams hang up after two tokens, to check that their KV blocks come back.

The open loop runs twice on the same arrival trace (same seed, prompts and hang-ups): **before**,
the engine on the model as loaded (fp32, one product per projection), and **after**, the engine on
the decode layout with int8 weights (``infra_lib.model.decode_layout``: fused q/k/v and gate/up
products, a quarter of the bytes per step). Where the C step builds, it runs a third time,
**served**: the engine as ``infra-lab serve`` runs it by default, its steps in C
(``NativeModelRunner``) on the model's fp32 weights, the same answers as before.

Reported per run: TTFT and TPOT (P50/P99), ITL P99, output tokens per second, goodput at the
SLOs below (requests per second that met both), HTTP statuses, and the KV blocks still held once
the server is idle (must be 0). Then, for each engine, a sweep of arrival rates on the same traces:
the highest rate whose P99 TTFT and P99 TPOT stay within the SLOs, and the throughput there (the
throughput at a fixed SLO), before and after.

Usage:
    python benchmarks/serve_load.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import time

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info
from infra_lib.model import load_default
from infra_lib.model.decode_layout import bytes_per_step, decode_layout
from infra_lib.model.native_decode import native_decode_available
from infra_lib.ops import run_load
from infra_lib.serving.server import DEFAULT_MODEL_NAME, ServerThread, build_engine, create_app

SEED = 0
# SLOs this 2-core CPU can meet below saturation (a batch-32 decode step alone takes about 250 ms
# here; a GPU service would promise tens of milliseconds per token).
SLO_MS = {"ttft": 2000, "tpot": 300}
KEYS = (
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "request_goodput",
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "p99_itl_ms",
    "p99_e2el_ms",
)


def plan(quick: bool) -> dict:
    # slo_rates: arrival rates (requests/s) of the SLO sweep, slo_requests requests each: the highest
    # rate whose P99 TTFT and TPOT stay within the SLOs gives the throughput at the SLO
    if quick:
        return {
            "num_requests": 6,
            "max_tokens": 6,
            "rate": float("inf"),
            "max_num_seqs": 4,
            "sequential_requests": 2,
            "kv_blocks": 64,
            "slo_rates": [4.0],
            "slo_requests": 4,
        }
    return {
        "num_requests": 200,
        "max_tokens": 24,
        "rate": 8.0,
        "max_num_seqs": 32,
        "sequential_requests": 16,
        "slo_rates": [1.0, 1.5, 2.0, 3.0],
        "slo_requests": 40,
    }


def within_slo(summary: dict) -> bool:
    """Whether a run's P99 TTFT and P99 TPOT both stay within the SLOs."""
    ttft, tpot = summary.get("p99_ttft_ms"), summary.get("p99_tpot_ms")
    return ttft is not None and tpot is not None and ttft <= SLO_MS["ttft"] and tpot <= SLO_MS["tpot"]


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
    prompts = [f"In one sentence, why is the number {i} interesting?" for i in range(p["num_requests"])]
    hang_ups = {i: 2 for i in range(0, p["num_requests"], 10)}
    common = {"model": DEFAULT_MODEL_NAME, "max_tokens": p["max_tokens"], "slo_ms": SLO_MS, "seed": SEED}
    # before and after: the engine in PyTorch, on the model as loaded and on its int8 decode layout;
    # served: what `infra-lab serve` runs by default, its steps in C on the model's fp32 weights
    # (where the C step builds here; otherwise the row says why it is missing)
    native_ok, native_why = native_decode_available()
    models = {
        "before": ("fp32, as loaded", loaded.model, None),
        "after": ("int8, decode layout", decode_layout(loaded.model, "int8"), None),
    }
    if native_ok:
        models["served"] = ("fp32, steps in C (infra-lab serve's default)", loaded.model, "fp32")
    runs, alive, weights, slo_sweep = {}, {}, {}, {}
    for when, (label, model, native) in models.items():
        engine = build_engine(
            model, loaded.tokenizer, max_num_seqs=p["max_num_seqs"], kv_blocks=kv_blocks, native=native
        )
        weights[when] = {"weights": label, "bytes_per_step": bytes_per_step(model)}
        with ServerThread(create_app(engine, DEFAULT_MODEL_NAME)) as server:
            if when == "before":  # the baseline without batching, on the engine as loaded
                sequential = run_load(server.url, prompts[: p["sequential_requests"]], max_concurrency=1, **common)
                runs["sequential"] = {
                    **{k: sequential.summary.get(k) for k in KEYS},
                    "status_counts": sequential.status_counts,
                    "leaked_blocks": leaked_blocks(engine),
                }
            loaded_run = run_load(server.url, prompts, rate=p["rate"], disconnect_after=hang_ups, **common)
            name = {"before": "open_loop", "after": "open_loop_after", "served": "open_loop_served"}[when]
            runs[name] = {
                **{k: loaded_run.summary.get(k) for k in KEYS},
                "status_counts": loaded_run.status_counts,
                "disconnected": loaded_run.disconnected,
                "leaked_blocks": leaked_blocks(engine),
            }
            for rate in p["slo_rates"]:  # the same traces for both engines (same seed, prompts, rate)
                run = run_load(server.url, prompts[: p["slo_requests"]], rate=rate, **common)
                slo_sweep.setdefault(when, []).append(
                    {
                        "rate": rate,
                        **{k: run.summary.get(k) for k in KEYS},
                        "within_slo_at_p99": within_slo(run.summary),
                    }
                )
            alive[when] = engine.is_alive
    before, after = runs["open_loop"], runs["open_loop_after"]
    at_slo = {}
    for when, rows in slo_sweep.items():
        ok = [row for row in rows if row["within_slo_at_p99"]]
        best = max(ok, key=lambda row: row["rate"]) if ok else None
        at_slo[when] = {
            "highest_rate_within_slo": best["rate"] if best else None,
            "output_throughput": best["output_throughput"] if best else 0.0,
            "best_request_goodput": max(row["request_goodput"] or 0.0 for row in rows),
        }
    return {
        "benchmark": "serve_load",
        "seed": SEED,
        "plan": p,
        "slo_ms": SLO_MS,
        "flags": {"quick": quick, "device": str(device), "dtype": "float32", "endpoint": "chat", "stream": True},
        "engine": {"max_num_seqs": p["max_num_seqs"], "kv_blocks": kv_blocks, "block_size": 16},
        "weights": weights,
        "runs": runs,
        "throughput_vs_sequential": before["output_throughput"] / runs["sequential"]["output_throughput"],
        # the same trace, before and after: requests per second within both SLOs, and tokens per second
        "throughput_after_over_before": after["output_throughput"] / before["output_throughput"],
        "slo_sweep": slo_sweep,
        "at_slo": at_slo,
        "throughput_at_slo_after_over_before": (
            at_slo["after"]["output_throughput"] / at_slo["before"]["output_throughput"]
            if at_slo["before"]["output_throughput"]
            else None
        ),
        # the server's default against the same engine in PyTorch on the same weights, the same trace
        "served_over_before": (
            runs["open_loop_served"]["output_throughput"] / before["output_throughput"] if native_ok else None
        ),
        "served_missing": None if native_ok else f"the C step cannot be built here: {native_why.splitlines()[0]}",
        "engine_alive_after": all(alive.values()),
        "device": str(device),
        "note": "the engine and its KV pool run on the CPU",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
    }


def format_table(result: dict) -> str:
    lines = [
        f"{'run':<15} {'done':>5} {'fail':>4} {'tok/s':>7} {'good/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'ITL p99':>8} {'leaked':>6}"
    ]
    for name, r in result["runs"].items():
        lines.append(
            f"{name:<15} {r['completed']:>5} {r['failed']:>4} {r['output_throughput']:>7.1f} "
            f"{r['request_goodput']:>7.2f} {r['p50_ttft_ms']:>9.0f} {r['p99_ttft_ms']:>9.0f} "
            f"{r['p50_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f} {r['p99_itl_ms']:>8.1f} "
            f"{r['leaked_blocks']:>6}"
        )
    lines.append(
        f"open-loop throughput / sequential: {result['throughput_vs_sequential']:.2f}x  "
        f"statuses: {result['runs']['open_loop']['status_counts']}"
    )
    lines.append(
        f"same overload trace, {result['weights']['after']['weights']} over "
        f"{result['weights']['before']['weights']}: throughput {result['throughput_after_over_before']:.2f}x"
    )
    if result["served_over_before"] is not None:
        lines.append(
            f"same overload trace, {result['weights']['served']['weights']} over "
            f"{result['weights']['before']['weights']}: throughput {result['served_over_before']:.2f}x"
        )
    else:
        lines.append(f"infra-lab serve's default (steps in C) not measured: {result['served_missing']}")
    slo = result["slo_ms"]
    lines.append(f"SLO sweep (P99 TTFT <= {slo['ttft']} ms and P99 TPOT <= {slo['tpot']} ms):")
    lines.append(
        f"{'engine':<8} {'rate/s':>6} {'tok/s':>7} {'good/s':>7} {'TTFT p99':>9} {'TPOT p99':>9} {'in SLO':>6}"
    )
    for when, rows in result["slo_sweep"].items():
        for r in rows:
            lines.append(
                f"{when:<8} {r['rate']:>6.1f} {r['output_throughput']:>7.1f} {r['request_goodput'] or 0:>7.2f} "
                f"{r['p99_ttft_ms'] or 0:>9.0f} {r['p99_tpot_ms'] or 0:>9.1f} "
                f"{'yes' if r['within_slo_at_p99'] else 'no':>6}"
            )
    for when, a in result["at_slo"].items():
        lines.append(
            f"{when}: highest rate within the SLOs {a['highest_rate_within_slo']}, "
            f"{a['output_throughput']:.1f} tok/s there; best goodput {a['best_request_goodput']:.2f} req/s"
        )
    ratio = result["throughput_at_slo_after_over_before"]
    lines.append("throughput at the SLOs, after over before: " + (f"{ratio:.2f}x" if ratio else "n/a"))
    return "\n".join(lines)


def main(argv=None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "serve_load", run_serve_load, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
