"""Routing policies side by side: two replicas of the server behind the router, the same chat workload
replayed once per policy, with each replica's own prefix-cache counters.

For each policy (round-robin, least-loaded, prefix) the script starts two fresh replicas (empty
prefix caches: ``infra-lab serve`` in their own processes, the machine's cores shared out), puts the
router in front (in this process, uvicorn on a thread), and replays the seeded workload of
``infra_lib.ops.router_workload``: a few system prompts, conversations whose turns each resend
the whole history, ``concurrency`` users sending one turn at a time. Every request is greedy and
produces the same number of tokens, so the policies differ only in where the prompts land.

Reported per policy: the prefix-cache hit rate (prompt tokens found cached over prompt tokens looked
up, summed over the replicas' ``/metrics`` counters ``vllm:prefix_cache_hits`` and
``vllm:prefix_cache_queries``), TTFT P50/P99 as the client saw it, output tokens per second over the
run, and the requests each replica served.

Usage:
    python benchmarks/router.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import asyncio
import sys

import httpx
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info
from infra_lib.ops.latency import summarize
from infra_lib.ops.router_workload import chat_workload, replay
from infra_lib.serving.observability import parse_metrics
from infra_lib.serving.prefix_cache import chained_block_hashes
from infra_lib.serving.replicas import ReplicaSet
from infra_lib.serving.router import POLICIES, Router, create_router_app, load_tokenizer, prompt_block_hashes
from infra_lib.serving.server import DEFAULT_MODEL_NAME, ServerThread

SEED = 0
NUM_REPLICAS = 2


def plan(quick: bool) -> dict:
    if quick:
        return {"conversations": 4, "turns": 3, "system_prompts": 2, "concurrency": 2, "max_tokens": 4}
    # three users on two replicas: round-robin does not send a user back to the same replica by accident
    return {"conversations": 12, "turns": 6, "system_prompts": 3, "concurrency": 3, "max_tokens": 16}


def replica_command(kv_blocks: int, max_num_seqs: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "course_tools.cli",
        "serve",
        "--kv-blocks",
        str(kv_blocks),
        "--max-num-seqs",
        str(max_num_seqs),
    ]


def prefix_counters(urls: list[str]) -> dict[str, float]:
    """Prompt tokens looked up in and found in the prefix caches of ``urls``, summed."""
    hits = queries = 0.0
    for url in urls:
        metrics = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
        hits += metrics["vllm:prefix_cache_hits_total"]
        queries += metrics["vllm:prefix_cache_queries_total"]
    return {"hits": hits, "queries": queries}


def run_policy(policy: str, p: dict, tokenizer, kv_blocks: int, max_num_seqs: int) -> dict:
    conversations = chat_workload(p["conversations"], p["turns"], SEED, p["system_prompts"])
    with ReplicaSet(replica_command(kv_blocks, max_num_seqs), NUM_REPLICAS) as replicas:
        for url in replicas.urls:  # the first step of a fresh process is slow: take it before the clock runs
            body = {"model": DEFAULT_MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 2}
            httpx.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()
        before = prefix_counters(replicas.urls)
        router = Router(replicas.urls, policy, tokenizer)
        with ServerThread(create_router_app(router)) as thread:
            timings, duration = asyncio.run(
                replay(
                    thread.url,
                    conversations,
                    model=DEFAULT_MODEL_NAME,
                    concurrency=p["concurrency"],
                    max_tokens=p["max_tokens"],
                )
            )
            after = prefix_counters(replicas.urls)
            counters = {key: after[key] - before[key] for key in after}
            routed = [r.routed for r in router.replicas]
    summary = summarize(timings, duration)
    return {
        "policy": policy,
        "prefix_cache_hit_rate": counters["hits"] / counters["queries"] if counters["queries"] else 0.0,
        "prefix_cache_hit_tokens": counters["hits"],
        "prefix_cache_query_tokens": counters["queries"],
        "p50_ttft_ms": summary["median_ttft_ms"],
        "p99_ttft_ms": summary["p99_ttft_ms"],
        "output_throughput": summary["output_throughput"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "duration_s": duration,
        "routed_per_replica": routed,
        "errors": sorted({t.error for t in timings if not t.success})[:5],
    }


def ideal_hit_rate(conversations, tokenizer) -> float:
    """The hit rate of one shared prefix cache that never evicts, the conversations sent one after another:
    what no routing can beat."""
    seen: set[bytes] = set()
    hits = total = 0
    for conversation in conversations:
        for turn in range(len(conversation.turns)):
            ids = tokenizer.encode_chat(conversation.messages(turn))
            hashes = prompt_block_hashes(ids, 16)
            hits += 16 * next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
            total += len(ids)
            seen.update(chained_block_hashes(ids, 16))  # a replica caches every full block of the prompt
    return hits / total


def run_router(device, quick: bool) -> dict:
    p = plan(quick)
    kv_blocks, max_num_seqs = 256, 8
    tokenizer = load_tokenizer()
    load_before = load_average()
    runs = {policy: run_policy(policy, p, tokenizer, kv_blocks, max_num_seqs) for policy in POLICIES}
    conversations = chat_workload(p["conversations"], p["turns"], SEED, p["system_prompts"])
    base = runs["round-robin"]
    return {
        "benchmark": "router",
        "seed": SEED,
        "plan": p,
        "flags": {"quick": quick, "device": "cpu", "replicas": NUM_REPLICAS, "stream": True, "greedy": True},
        "engine": {"kv_blocks": kv_blocks, "max_num_seqs": max_num_seqs, "block_size": 16},
        "runs": runs,
        "ideal_hit_rate": ideal_hit_rate(conversations, tokenizer),
        "prefix_over_round_robin": {
            "hit_rate": runs["prefix"]["prefix_cache_hit_rate"] - base["prefix_cache_hit_rate"],
            "p50_ttft": runs["prefix"]["p50_ttft_ms"] / base["p50_ttft_ms"],
            "throughput": runs["prefix"]["output_throughput"] / base["output_throughput"],
        },
        "note": "each replica is a CPU process; the replicas and the router share this machine's cores",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
    }


def format_table(result: dict) -> str:
    lines = [f"{'policy':<13} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>7} {'done':>5} {'routed':>9}"]
    for name, r in result["runs"].items():
        lines.append(
            f"{name:<13} {r['prefix_cache_hit_rate']:>8.1%} {r['p50_ttft_ms']:>9.0f} {r['p99_ttft_ms']:>9.0f} "
            f"{r['output_throughput']:>7.1f} {r['completed']:>5} {'/'.join(map(str, r['routed_per_replica'])):>9}"
        )
    lines.append(f"one shared cache that never evicts would hit {result['ideal_hit_rate']:.1%}")
    gain = result["prefix_over_round_robin"]
    lines.append(
        f"prefix over round-robin: hit rate {gain['hit_rate']:+.1%}, TTFT p50 x{gain['p50_ttft']:.2f}, "
        f"throughput x{gain['throughput']:.2f}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "router", run_router, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
