"""Prometheus metrics with vLLM's names, computed from the engine's event log.

``ServingMetrics`` subscribes to an ``EventLog`` and keeps its own ``CollectorRegistry``, so two
servers in one process (a notebook, a test) never share counters. The names and meanings follow
vLLM's ``/metrics`` so dashboards and habits carry over:

    vllm:num_requests_running / _waiting      gauges, after the latest step or finished request
    vllm:kv_cache_usage_perc                  gauge, fraction of KV blocks in use (0..1), same times
    vllm:prefix_cache_queries / _hits         counters, prompt tokens looked up / found cached
    vllm:num_preemptions                      counter
    vllm:prompt_tokens / generation_tokens    counters
    vllm:request_success{finished_reason}     counter (stop, length, abort)
    vllm:time_to_first_token_seconds          histogram, arrival to first token
    vllm:inter_token_latency_seconds          histogram, each gap between successive tokens
    vllm:e2e_request_latency_seconds          histogram, arrival to finish
    vllm:request_queue_time_seconds           histogram, arrival to first admission
    infra_lab:engine_busy_seconds             counter, time spent inside steps (busy versus idle)
    infra_lab:engine_steps                    counter

Counters get Prometheus' ``_total`` suffix in the exposition text, as vLLM's do.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from infra_lib.serving.events import EngineEvent, EventLog

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServingMetrics:
    """vLLM-named Prometheus collectors fed by an engine's events.

    Args:
        model_name: the ``model_name`` label on every series.
        events: subscribe to this log now (or call ``observe`` yourself, e.g. to replay a log).
        prefix_caching: count prefix-cache queries (vLLM counts them only with the cache on).
    """

    def __init__(self, model_name: str = "model", events: EventLog | None = None, prefix_caching: bool = False):
        self.model_name, self.prefix_caching = model_name, prefix_caching
        self.registry = CollectorRegistry()
        label = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", label, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", label, registry=r)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", label, registry=r
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", label, registry=r
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", label, registry=r
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Preemptions (a request's KV blocks taken away).", label, registry=r
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens admitted.", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", label, registry=r)
        self.success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", label + ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival to first output token.",
            label,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Gap between successive output tokens.",
            label,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", label, buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Arrival to first admission.", label, buckets=LATENCY_BUCKETS, registry=r
        )
        self.busy = Counter(
            "infra_lab:engine_busy_seconds", "Seconds the engine spent inside steps.", label, registry=r
        )
        self.steps = Counter("infra_lab:engine_steps", "Engine steps run.", label, registry=r)
        for metric in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.busy,
            self.steps,
        ):
            self._l(metric)  # every series exists (at 0) from the start, as a scraper expects
        for reason in ("stop", "length", "abort"):
            self._l(self.success, finished_reason=reason)
        self._arrival: dict[int, float] = {}
        self._last_token: dict[int, float] = {}
        self._lock = threading.Lock()
        if events is not None:
            events.subscribe(self.observe)

    def _l(self, metric, **labels):
        return metric.labels(model_name=self.model_name, **labels)

    def observe(self, event: EngineEvent) -> None:
        """Update the collectors with one event."""
        kind, t, rid, data = event.kind, event.time, event.request_id, event.data
        with self._lock:
            if kind == "arrived":
                self._arrival[rid] = t
            elif kind == "admitted":
                if data.get("first", True):
                    self._l(self.prompt_tokens).inc(data.get("prompt_tokens", 0))
                    if rid in self._arrival:
                        self._l(self.queue_time).observe(t - self._arrival[rid])
                    if self.prefix_caching:
                        self._l(self.prefix_queries).inc(data.get("prompt_tokens", 0))
                        self._l(self.prefix_hits).inc(data.get("cached_tokens", 0))
            elif kind == "preempted":
                self._l(self.preemptions).inc()
            elif kind == "token":
                self._l(self.generation_tokens).inc()
                if rid in self._last_token:
                    self._l(self.itl).observe(t - self._last_token[rid])
                elif rid in self._arrival:
                    self._l(self.ttft).observe(t - self._arrival[rid])
                self._last_token[rid] = t
            elif kind == "finished":
                self._l(self.success, finished_reason=data.get("reason", "stop")).inc()
                if rid in self._arrival:
                    self._l(self.e2e).observe(t - self._arrival.pop(rid))
                self._last_token.pop(rid, None)
                if "running" in data:  # an abort frees its blocks between steps: no step event follows
                    self._set_queues(data)
            elif kind == "step":
                self._set_queues(data)
                self._l(self.busy).inc(max(0.0, t - data.get("start", t)))
                self._l(self.steps).inc()

    def _set_queues(self, data: dict) -> None:
        self._l(self.running).set(data.get("running", 0))
        self._l(self.waiting).set(data.get("waiting", 0))
        self._l(self.kv_usage).set(data.get("kv_usage", 0.0))

    def exposition(self) -> bytes:
        """The Prometheus text format, what ``GET /metrics`` answers."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, float]:
        """Every sample as ``{name{labels}: value}``, e.g. ``"vllm:prompt_tokens_total"``; labels other
        than model_name stay in the key (``vllm:request_success_total{finished_reason="stop"}``)."""
        return parse_metrics(self.exposition().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus exposition text into ``{sample name[{labels}]: value}`` (model_name dropped)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = sample.name
            if labels:
                key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
            out[key] = out.get(key, 0.0) + sample.value
    return out
