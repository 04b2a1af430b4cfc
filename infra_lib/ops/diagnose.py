"""Why did P99 latency jump? Name the fault from metrics, starting with busy versus idle.

The first split is the one a step timeline gives at a glance: was the engine **busy** (time
inside steps: the model's kernels and the host work around them, scheduling, Python, sampling,
launches) or **idle** (gaps between steps, nothing to run) while the latency grew? This is busy
at step level; a profiler's kernel timeline is finer and can show a host-bound GPU step busy at
step level while the device waits between its kernels.

    idle, and clients wait for a first token far longer than the engine takes to give one
        -> the time is spent outside the engine: a slow dependency in front of it (gateway,
           retrieval, a tool call)                                              L5/L6
    busy, with preemptions and a full KV cache
        -> requests lose their KV blocks and recompute: memory pressure          L1 (HBM / KV)
    busy, with rare very long steps that carry a huge prefill
        -> one long prompt stalls every decode in its step: head-of-line blocking L4 (scheduling)
    busy almost all the time, with requests queueing
        -> more load than one replica can carry: add replicas or shed load       L4 / capacity
    otherwise healthy

``window_stats`` turns an engine's event log (and, when there is one, the client's timings) into
the numbers the rules read; ``diagnose`` applies the rules and says which evidence decided.
``run_scenario`` injects each fault into a simulated engine (a calibrated step-cost model, no
model weights), deterministically, to practise on.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from infra_lib.ops.latency import RequestTiming, e2el, percentile, summarize
from infra_lib.serving.events import EventLog
from infra_lib.serving.scheduler_output import SchedulerConfig
from infra_lib.serving.sim_clock import SimulatedRunner, StepCostModel
from infra_lib.serving.workload import WorkloadRequest, replay

RATE, DELAY = 0.5, 0.4  # the scenarios' request rate (1/s) and the slow dependency's mean delay (s)
FAULTS = ("healthy", "slow_dependency", "kv_pressure", "head_of_line", "overload")
LAYERS = {
    "healthy": "-",
    "slow_dependency": "L5/L6: outside the engine (gateway, retrieval, tools)",
    "kv_pressure": "L1: memory (the KV cache does not hold the batch)",
    "head_of_line": "L4: scheduling (a long prefill blocks the decodes)",
    "overload": "L4: capacity (more requests than one replica serves)",
}
ADVICE = {
    "healthy": "nothing to fix; keep watching P99 against the SLO",
    "slow_dependency": "trace the request path before the engine: the dependency's own latency and timeouts",
    "kv_pressure": "give the KV cache more blocks (memory, a smaller dtype) or lower max_num_seqs",
    "head_of_line": "enable chunked prefill or lower max_num_batched_tokens so long prompts run in pieces",
    "overload": "add replicas (see ops.cost.plan_capacity) or shed load with a smaller queue (429s)",
}

# Roughly SmolLM2-135M on two CPU cores (chapter 08's calibration): seconds per step.
CPU_STEP_COST = StepCostModel(
    fixed_s=0.04, per_prefill_token_s=0.0011, per_decode_seq_s=0.0017, kv_read_per_token_s=2e-6
)


def window_stats(events: EventLog | list, timings: list[RequestTiming] | None = None) -> dict[str, float]:
    """The numbers ``diagnose`` reads, over everything in ``events`` (one run or one window).

    Keys: duration_s, busy_fraction, steps, preemptions, kv_usage_peak, max_prefill_tokens,
    median_step_ms, p99_step_ms, max_step_ms, p99_queue_ms, engine_p99_ttft_ms, engine_p99_e2el_ms, and with
    client ``timings``
    also p99_ttft_ms, p99_tpot_ms, p99_itl_ms, p99_e2el_ms (else these come from the engine).
    """
    events = events.events() if isinstance(events, EventLog) else list(events)
    steps = [e for e in events if e.kind == "step"]
    if not steps:
        raise ValueError("the event log has no steps: run some requests through the engine first")
    start = (
        min(e.time for e in events if e.kind == "arrived")
        if any(e.kind == "arrived" for e in events)
        else steps[0].data["start"]
    )
    end = max(e.time for e in events)
    durations = [(e.time - e.data["start"]) * 1000 for e in steps]
    busy = sum(durations) / 1000
    arrived, admitted, finished, tokens = {}, {}, {}, {}
    for e in events:
        if e.kind == "arrived":
            arrived[e.request_id] = e.time
        elif e.kind == "admitted" and e.request_id not in admitted:
            admitted[e.request_id] = e.time
        elif e.kind == "finished":
            finished[e.request_id] = e.time
        elif e.kind == "token":
            tokens.setdefault(e.request_id, []).append(e.time)
    span = max(end - start, 1e-9)
    stats = {
        "duration_s": span,
        "busy_fraction": min(1.0, busy / span),
        "steps": len(steps),
        "preemptions": sum(e.kind == "preempted" for e in events),
        "kv_usage_peak": max(e.data.get("kv_usage", 0.0) for e in steps),
        "max_prefill_tokens": max(e.data.get("prefill_tokens", 0) for e in steps),
        "median_step_ms": percentile(durations, 50),
        "p99_step_ms": percentile(durations, 99),
        "max_step_ms": max(durations),
        "p99_queue_ms": percentile([(admitted[r] - arrived[r]) * 1000 for r in admitted if r in arrived], 99),
        "engine_p99_e2el_ms": percentile([(finished[r] - arrived[r]) * 1000 for r in finished if r in arrived], 99),
        "engine_p99_ttft_ms": percentile([(tokens[r][0] - arrived[r]) * 1000 for r in tokens if r in arrived], 99),
    }
    if timings is None:  # the engine's own view of each request, as if the client sat at its door
        timings = [
            RequestTiming(arrived[r], tokens.get(r, []), finished[r], output_tokens=len(tokens.get(r, [])))
            for r in finished
            if r in arrived
        ]
    summary = summarize(timings, span)
    for key in ("p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms"):
        stats[key] = summary[key]
    return stats


@dataclass
class Diagnosis:
    """The fault named, the layer it lives in, the evidence that decided, and what to do."""

    fault: str
    layer: str
    evidence: list[str] = field(default_factory=list)
    advice: str = ""

    def __str__(self) -> str:
        return f"{self.fault} ({self.layer}): " + "; ".join(self.evidence) + f" -> {self.advice}"


def diagnose(stats: dict[str, float]) -> Diagnosis:
    """Name the fault behind a window's latency from ``window_stats``' numbers (rules above)."""
    missing = {
        "busy_fraction",
        "preemptions",
        "kv_usage_peak",
        "max_step_ms",
        "median_step_ms",
        "max_prefill_tokens",
        "p99_ttft_ms",
        "engine_p99_ttft_ms",
        "p99_queue_ms",
    } - set(stats)
    if missing:
        raise ValueError(f"stats lacks {sorted(missing)}: build it with window_stats(events, timings)")
    busy = stats["busy_fraction"]
    outside = stats["p99_ttft_ms"] - stats["engine_p99_ttft_ms"]  # waiting before the engine saw the request

    def found(fault, *evidence):
        return Diagnosis(fault, LAYERS[fault], [f"engine busy {busy:.0%} of the time", *evidence], ADVICE[fault])

    if busy < 0.9 and outside > max(100.0, stats["engine_p99_ttft_ms"]):
        return found(
            "slow_dependency",
            f"clients' P99 TTFT {stats['p99_ttft_ms']:.0f} ms but only "
            f"{stats['engine_p99_ttft_ms']:.0f} ms inside the engine",
        )
    if stats["preemptions"] > 0 and stats["kv_usage_peak"] >= 0.9:
        return found(
            "kv_pressure",
            f"{stats['preemptions']:.0f} preemptions",
            f"KV cache {stats['kv_usage_peak']:.0%} full at its peak",
        )
    if stats["max_step_ms"] > 10 * stats["median_step_ms"] and stats["max_prefill_tokens"] >= 1024:
        return found(
            "head_of_line",
            f"the longest step took {stats['max_step_ms']:.0f} ms against a median of {stats['median_step_ms']:.0f} ms",
            f"one step prefilled {stats['max_prefill_tokens']:.0f} tokens",
        )
    if busy >= 0.9 and stats["p99_queue_ms"] > stats["median_step_ms"] * 10:
        return found("overload", f"P99 queue time {stats['p99_queue_ms']:.0f} ms")
    return found("healthy", f"P99 E2EL {stats['p99_e2el_ms']:.0f} ms")


def scenario_workload(
    name: str, seed: int = 0, num_requests: int = 60
) -> tuple[list[WorkloadRequest], SchedulerConfig, float]:
    """The requests, the engine's limits and the delay in front of the engine for one scenario."""
    if name not in FAULTS:
        raise ValueError(f"unknown scenario {name!r}; choose one of {FAULTS}")
    rng = random.Random(seed)
    rate = {"overload": 12.0}.get(name, RATE)
    t, requests = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        prompt = tuple(rng.randrange(1000) for _ in range(rng.randint(32, 96)))
        out = rng.randint(96, 160) if name == "kv_pressure" else rng.randint(16, 48)
        requests.append(WorkloadRequest(t, prompt, out))
    if name == "head_of_line":  # a few documents pasted into the chat, among short questions
        for k in range(3):
            at = requests[len(requests) * (k + 1) // 4].arrival_time
            requests.append(WorkloadRequest(at, tuple(rng.randrange(1000) for _ in range(1500)), 8))
        requests.sort(key=lambda r: r.arrival_time)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=2048 if name == "head_of_line" else 256,
        block_size=16,
        num_blocks=40 if name == "kv_pressure" else 512,
        enable_chunked_prefill=name != "head_of_line",
    )
    delay = DELAY if name == "slow_dependency" else 0.0
    return requests, config, delay


def run_scenario(name: str, seed: int = 0, cost_model: StepCostModel = CPU_STEP_COST, num_requests: int = 60) -> dict:
    """Run one scenario on a simulated engine; returns its events, client timings, stats and diagnosis.

    The client of ``slow_dependency`` sends each request 0.2-0.6 s before the engine
    sees it, as if a retrieval step sat in front of the server.
    """
    from infra_lib.serving.engine import LLMEngine

    requests, config, delay = scenario_workload(name, seed, num_requests)
    rng = random.Random(seed + 1)
    delays = [delay * (0.5 + rng.random()) for _ in requests]
    shifted = [WorkloadRequest(r.arrival_time + d, r.prompt_ids, r.output_len) for r, d in zip(requests, delays)]
    engine = LLMEngine(SimulatedRunner(cost_model), config)
    outputs = replay(engine, shifted)
    timings = [
        RequestTiming(
            o.metrics.arrival_time - d,
            list(o.metrics.token_times),
            o.metrics.finish_time,
            len(o.prompt_ids),
            len(o.token_ids),
        )
        for o, d in zip(outputs, delays)
    ]
    stats = window_stats(engine.events, timings)
    return {
        "name": name,
        "events": engine.events,
        "timings": timings,
        "stats": stats,
        "diagnosis": diagnose(stats),
        "config": config,
        "engine": engine,
    }


def p99_latency_ms(timings: list[RequestTiming]) -> float:
    """P99 end-to-end latency of the successful requests, in ms (nan for none)."""
    values = [e2el(t) * 1000 for t in timings if t.success and not math.isnan(e2el(t))]
    return percentile(values, 99)
