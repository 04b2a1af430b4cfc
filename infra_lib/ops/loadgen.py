"""An open-loop load generator for an OpenAI-compatible server, measuring like vLLM's benchmark.

Open loop: requests are sent at their arrival times whether or not earlier ones finished (a
closed loop, where each client waits for its answer, hides queueing: the load drops exactly when
the server slows down). Arrival gaps are drawn from a gamma distribution with shape
``burstiness`` and mean ``1 / rate``: burstiness 1 is a Poisson process, below 1 burstier, above
1 more regular; ``rate=inf`` sends everything at once. ``max_concurrency`` caps the requests in
flight: the rest wait in the client, and, as in vLLM's benchmark, a request's clock starts when
it leaves the client, after that wait.

Each request streams; the client stamps every chunk and reads the usage from the final chunk.
``disconnect_after`` makes chosen requests hang up after some tokens, to test that the server
aborts them and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import platform
import random
import threading
import time
from dataclasses import dataclass, field

from infra_lib.ops.latency import RequestTiming, summarize


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the start) of ``num_requests`` at mean ``rate`` per second."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be positive (inf: all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


@dataclass
class LoadResult:
    """Timings of every request, the run's duration, its vLLM summary and how it was run."""

    timings: list[RequestTiming]
    duration_s: float
    summary: dict
    config: dict
    status_counts: dict[str, int] = field(default_factory=dict)
    disconnected: int = 0

    def to_json(self, path=None) -> dict:
        """Everything as JSON-ready data (written to ``path`` when given), with the machine."""
        data = {
            "config": self.config,
            "summary": self.summary,
            "status_counts": self.status_counts,
            "disconnected": self.disconnected,
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "requests": [t.as_dict() for t in self.timings],
        }
        if path is not None:
            with open(path, "w") as f:
                json.dump(data, f, indent=1, default=float)
        return data


async def _one(client, url: str, body: dict, timing: RequestTiming, hang_up_after: int | None) -> str:
    """Stream one request into ``timing``; returns "ok", "disconnected" or the HTTP status."""
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            timing.success, timing.end_time = False, time.perf_counter()
            try:
                timing.error = f"{response.status_code}: {json.loads(text)['error']['message']}"
            except (ValueError, KeyError, TypeError):
                timing.error = f"{response.status_code}: {text[:200]}"
            return str(response.status_code)
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            now = time.perf_counter()
            if payload == "[DONE]":
                break
            data = json.loads(payload)
            if "error" in data:
                timing.success, timing.error = False, f"stream error: {data['error'].get('message')}"
                break
            for choice in data.get("choices") or ():
                carries = (
                    "content" in (choice.get("delta") or {})
                    if "delta" in choice
                    else choice.get("finish_reason") is None
                )
                if carries:
                    timing.chunk_times.append(now)
                    chunks += 1
            if data.get("usage"):
                timing.prompt_tokens = data["usage"]["prompt_tokens"]
                timing.output_tokens = data["usage"]["completion_tokens"]
            if hang_up_after is not None and chunks >= hang_up_after:
                timing.success, timing.error, timing.end_time = False, "disconnected by the client", now
                return "disconnected"
        timing.end_time = time.perf_counter()
        if timing.success and not timing.output_tokens:
            timing.output_tokens = len(timing.chunk_times)
        return "200" if timing.success else "stream_error"


async def run_load_async(
    base_url: str,
    prompts: list,
    *,
    model: str,
    rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    max_tokens: int = 32,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    endpoint: str = "chat",
    disconnect_after: dict[int, int] | None = None,
    seed: int = 0,
    progress: bool = True,
    timeout_s: float = 600.0,
    slo_ms: dict[str, float] | None = None,
) -> LoadResult:
    """Send ``prompts`` (str each) to ``base_url`` open-loop and measure every request.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        rate / burstiness: arrivals (see ``arrival_times``).
        max_concurrency: most requests in flight (None: no cap).
        max_tokens / ignore_eos: output length (ignore_eos makes every request produce max_tokens).
        endpoint: "chat" (``/v1/chat/completions``) or "completions".
        disconnect_after: request index -> hang up after this many token chunks.
        slo_ms: SLOs for goodput, e.g. ``{"ttft": 500, "tpot": 100}``.
    """
    import httpx
    from tqdm.auto import tqdm

    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be 'chat' or 'completions', got {endpoint!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be positive, got {max_concurrency}")
    url = f"{base_url.rstrip('/')}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    sends = arrival_times(len(prompts), rate, burstiness, seed)
    disconnect_after = disconnect_after or {}
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timings: list[RequestTiming] = [None] * len(prompts)  # type: ignore[list-item]
    statuses: dict[str, int] = {}
    bar = tqdm(total=len(prompts), desc="requests", disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def fire(i: int, prompt) -> None:
            await asyncio.sleep(max(0.0, start + sends[i] - time.perf_counter()))
            body = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": ignore_eos,
            }
            if endpoint == "chat":
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            timing, held = None, False
            try:
                if gate is not None:
                    await gate.acquire()
                    held = True
                timing = timings[i] = RequestTiming(send_time=time.perf_counter())  # after the cap, as vLLM's
                status = await _one(client, url, body, timing, disconnect_after.get(i))
            except (httpx.HTTPError, OSError, ValueError) as exc:
                timing = timing or timings[i] or RequestTiming(send_time=time.perf_counter())
                timings[i] = timing
                timing.success, timing.error, timing.end_time = (
                    False,
                    f"{type(exc).__name__}: {exc}",
                    time.perf_counter(),
                )
                status = type(exc).__name__
            finally:
                if held:
                    gate.release()
            statuses[status] = statuses.get(status, 0) + 1
            bar.update()

        await asyncio.gather(*(fire(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - start
    bar.close()
    counted = [t for i, t in enumerate(timings) if i not in disconnect_after]
    config = {
        "base_url": base_url,
        "model": model,
        "num_requests": len(prompts),
        "rate": rate,
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "temperature": temperature,
        "endpoint": endpoint,
        "seed": seed,
        "disconnecting": len(disconnect_after),
        "slo_ms": slo_ms,
    }
    return LoadResult(
        timings, duration, summarize(counted, duration, slo_ms), config, statuses, statuses.get("disconnected", 0)
    )


def run_load(base_url: str, prompts: list, **kwargs) -> LoadResult:
    """``run_load_async`` from synchronous code, also inside a notebook's running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_load_async(base_url, prompts, **kwargs))
    box: dict = {}

    def target():
        try:
            box["result"] = asyncio.run(run_load_async(base_url, prompts, **kwargs))
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
