"""Workloads for scheduling experiments: requests with arrival times, replayed through an engine.

A ``WorkloadRequest`` fixes when a request arrives, its prompt and how many tokens it will
produce. ``random_workload`` draws them from a seed (Poisson arrivals, uniform lengths);
``replay`` feeds them to an ``LLMEngine`` as its clock passes their arrival times and runs it
until every request finishes. On a ``SimulatedRunner`` the whole run is deterministic and takes
no model time; on a ``ModelRunner`` the wall clock waits for arrivals.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from infra_lib.model.sampling import SamplingParams


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: arrival time (s), prompt token ids, output length."""

    arrival_time: float
    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def random_workload(
    num_requests: int,
    seed: int = 0,
    *,
    rate: float = float("inf"),
    prompt_len: tuple[int, int] = (16, 128),
    output_len: tuple[int, int] = (8, 64),
    shared_prefix_len: int = 0,
    vocab_size: int = 1000,
) -> list[WorkloadRequest]:
    """Requests with Poisson arrivals at ``rate`` per second (inf: all at time 0) and lengths drawn
    uniformly from the inclusive ranges; the first ``shared_prefix_len`` prompt tokens are common to
    all (a system prompt, for prefix caching)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(shared_prefix_len)]
    t, requests = 0.0, []
    for _ in range(num_requests):
        if rate != float("inf"):
            t += rng.expovariate(rate)
        n = max(1, rng.randint(*prompt_len) - shared_prefix_len)
        prompt = prefix + [rng.randrange(vocab_size) for _ in range(n)]
        requests.append(WorkloadRequest(t, tuple(prompt), rng.randint(*output_len)))
    return requests


def replay(engine, workload: list[WorkloadRequest], on_step=None, max_steps: int = 1_000_000) -> list:
    """Run ``workload`` through ``engine`` (greedy, exactly ``output_len`` tokens each unless a stop id
    comes first); returns each request's final ``RequestOutput`` in workload order.

    ``on_step(engine)`` runs after every step (tests check invariants there).
    """
    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
    ids: dict[int, int] = {}
    finals: dict[int, object] = {}
    for _ in range(max_steps):
        while pending and workload[pending[0]].arrival_time <= engine.clock.now():
            i = pending.pop(0)
            request = workload[i]
            params = SamplingParams(max_new_tokens=request.output_len, stop_ids=())
            ids[engine.add_request(list(request.prompt_ids), params, arrival_time=request.arrival_time)] = i
        if not engine.has_unfinished():
            if not pending:
                break
            engine.clock.advance_to(workload[pending[0]].arrival_time)  # idle until the next arrival
            continue
        for output in engine.step():
            if output.finished:
                finals[ids[output.request_id]] = output
        if on_step is not None:
            on_step(engine)
    else:
        raise RuntimeError(f"the workload did not finish within {max_steps} steps")
    return [finals[i] for i in range(len(workload))]


def summarize(outputs: list, duration: float | None = None) -> dict[str, float]:
    """Mean TTFT, mean TPOT, output tokens per second and preemptions of finished ``RequestOutput``s."""
    ttft = [o.metrics.ttft for o in outputs]
    tpot = [o.metrics.tpot for o in outputs if len(o.token_ids) > 1]
    start = min(o.metrics.arrival_time for o in outputs)
    end = max(o.metrics.finish_time for o in outputs)
    tokens = sum(len(o.token_ids) for o in outputs)
    span = duration if duration is not None else end - start
    return {
        "requests": len(outputs),
        "mean_ttft_s": statistics.fmean(ttft),
        "mean_tpot_s": statistics.fmean(tpot) if tpot else float("nan"),
        "output_tokens_per_s": tokens / span if span > 0 else float("inf"),
        "makespan_s": end - start,
        "preemptions": sum(o.metrics.num_preemptions for o in outputs),
    }
