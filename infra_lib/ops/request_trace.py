"""One chat request through the course's own stack, with the wall time of every layer.

The request goes out over HTTP to the OpenAI-compatible server (``infra_lib.serving.server``) and
comes back whole. The engine behind the server is assembled here from public parts, each
wrapped so it keeps a stopwatch (``stage_timers.py``): the tokenizer, the scheduler, the model
runner (forward pass and sampling). Kernel time comes from ``torch.profiler``, started and
stopped on the engine's own thread by a subscriber to the engine's event log, as the ATen
operators' self time inside the forward passes. The client's wall time then splits into:

    http_in     client sends -> the handler hands the request to the engine (stamped by the server)
    tokenize | scheduler | model_python | kernels | sampling | detokenize    (inside the engine)
    engine_other  the rest of the engine's window: the loop, thread hand-offs, the event log
    profiler    starting and stopping the profiler (measurement cost, shown rather than hidden)
    http_out    the engine's last event -> the client holds the parsed JSON answer

The intervals are cut on one clock (``time.perf_counter``), so they add up to the client's total
up to ``SUM_TOLERANCE_S``; ``engine_other`` is a remainder and is reported, never dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from infra_lib.ops.stage_timers import KernelProfiler, Stopwatch, TimedModelRunner, TimedScheduler, TimedTokenizer

SUM_TOLERANCE_S = 0.002  # the layers' sum may differ from the client's total by this much (clock reads)

# layer -> (what it is, the runtime layer it belongs to)
LAYERS = {
    "http_in": ("HTTP in: client, socket, FastAPI validation, hand-off to the engine", "L5a serving"),
    "tokenize": ("tokenizer: chat template and BPE", "L5a serving"),
    "scheduler": ("scheduler: admission, token budget, KV blocks", "L5a/L5b serving"),
    "model_python": ("model forward, Python side: modules, paged-attention bookkeeping", "L4 framework"),
    "kernels": ("kernels: ATen operators inside the forward passes", "L2/L3 kernels"),
    "sampling": ("sampling the next token from the logits", "L4 framework"),
    "detokenize": ("detokenizer: token ids back to text", "L5a serving"),
    "engine_other": ("engine loop, thread hand-offs, event log (remainder)", "L5a serving"),
    "profiler": ("starting and stopping torch.profiler (measurement)", "measurement"),
    "http_out": ("HTTP out: response to the handler, JSON, socket, client parse", "L5a serving"),
}


@dataclass
class RequestTrace:
    """One traced request.

    Attributes:
        layers: seconds per layer, in ``LAYERS`` order; they add up to ``total_s`` within
            ``SUM_TOLERANCE_S``.
        total_s: the client's wall time from sending the request to holding the parsed answer.
        kernel_ops: ATen operator -> self seconds inside the forward passes (empty without profiling).
        forward_passes: forward passes the engine ran for this request (prefill + decodes).
        token_ids / text: what the engine generated; ``prompt_ids`` what it read.
    """

    layers: dict[str, float]
    total_s: float
    kernel_ops: dict[str, float]
    forward_passes: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    profiled: bool
    notes: list[str] = field(default_factory=list)

    @property
    def sum_s(self) -> float:
        return sum(self.layers.values())

    def fractions(self) -> dict[str, float]:
        """Each layer's share of the client's total."""
        return {name: seconds / self.total_s for name, seconds in self.layers.items()}

    def by_runtime_layer(self) -> dict[str, float]:
        """Seconds per runtime layer (``LAYERS``' second column), in the order they first appear."""
        out: dict[str, float] = {}
        for name, seconds in self.layers.items():
            out[LAYERS[name][1]] = out.get(LAYERS[name][1], 0.0) + seconds
        return out

    def check(self) -> None:
        """Raise ``AssertionError`` unless every layer is >= 0 and the layers add up to the total."""
        negative = {k: v for k, v in self.layers.items() if v < 0}
        if negative:
            raise AssertionError(f"layers with negative time (counted twice somewhere): {negative}")
        if abs(self.sum_s - self.total_s) > SUM_TOLERANCE_S:
            raise AssertionError(f"layers add up to {self.sum_s:.6f} s, the client measured {self.total_s:.6f} s")


class TracedServer:
    """The course's server on ``model``, with every stage timed: ``with TracedServer(lm) as s: s.trace(messages)``.

    Args:
        model / tokenizer: the model to serve (e.g. ``load_default()``'s).
        kv_blocks: KV-cache blocks of 16 tokens in the engine's pool.
    """

    def __init__(self, model, tokenizer, kv_blocks: int = 128, model_name: str | None = None):
        from infra_lib.serving import LLMEngine, PagedKVStore, SchedulerConfig
        from infra_lib.serving.async_engine import AsyncLLMEngine
        from infra_lib.serving.events import EventLog
        from infra_lib.serving.server import DEFAULT_MODEL_NAME, ServerThread, create_app

        self.watch = Stopwatch()
        config = SchedulerConfig(max_num_seqs=4, num_blocks=kv_blocks)
        weight = model.embed_tokens.weight
        store = PagedKVStore.for_model(model.config, config.num_blocks, config.block_size, weight.dtype, weight.device)
        self.runner = TimedModelRunner(model, store, self.watch)
        self.tokenizer = TimedTokenizer(tokenizer, self.watch)
        self.engine = LLMEngine(
            self.runner,
            config,
            self.tokenizer,
            scheduler=TimedScheduler(config, self.watch),
            events=EventLog(maxlen=20_000),
        )
        self.profiler = KernelProfiler()
        self.engine.events.subscribe(self.profiler.on_event)
        self.model_name = model_name or DEFAULT_MODEL_NAME
        self.server = ServerThread(create_app(AsyncLLMEngine(self.engine), self.model_name))

    def __enter__(self) -> TracedServer:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def _post(self, client, messages, max_tokens: int) -> dict:
        response = client.post(
            f"{self.server.url}/v1/chat/completions",
            json={"model": self.model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
        )
        if response.status_code != 200:
            raise RuntimeError(f"the server answered {response.status_code}: {response.text[:300]}")
        return response.json()

    def trace(
        self, messages: list[dict], max_tokens: int = 16, profile_kernels: bool = True, warmup: bool = True
    ) -> RequestTrace:
        """Send one greedy chat request and return where its time went.

        Args:
            messages: the conversation, ``[{"role": "user", "content": ...}]``.
            max_tokens: the answer's limit (it may stop earlier at the end-of-turn token).
            profile_kernels: run ``torch.profiler`` on the engine thread to split the forward pass
                into kernels and Python (it slows the forward pass a little and costs start/stop time).
            warmup: send a one-token request first, so one-off costs (first forward, connection
                set-up) stay out of the trace.

        Raises:
            ValueError: ``max_tokens`` < 1.
            RuntimeError: the server refused the request, or the engine's record disagrees with the answer.
        """
        import httpx

        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        with httpx.Client(timeout=120.0) as client:
            if warmup:
                self._post(client, messages, 1)
            self.watch.reset()
            self.profiler.arm(profile_kernels)
            clock_offset = time.perf_counter() - self.engine.clock.now()  # engine clock -> perf_counter
            sent = time.perf_counter()
            body = self._post(client, messages, max_tokens)
            received = time.perf_counter()
        capture = self.profiler.capture
        if capture is None or capture.finished_at is None:
            raise RuntimeError("the engine's event log never reported the traced request finishing")
        arrival = self.engine.events.events("arrived", capture.request_id)[0].time + clock_offset
        inside = {
            name: self.watch.seconds(name) for name in ("tokenize", "scheduler", "forward", "sampling", "detokenize")
        }
        kernels = sum(capture.kernel_ops.values())
        window = capture.finished_at - arrival
        layers = {
            "http_in": arrival - sent,
            "tokenize": inside["tokenize"],
            "scheduler": inside["scheduler"],
            "model_python": inside["forward"] - kernels,
            "kernels": kernels,
            "sampling": inside["sampling"],
            "detokenize": inside["detokenize"],
            "engine_other": window - sum(inside.values()) - capture.start_s,
            "profiler": capture.start_s + capture.stop_s,
            "http_out": received - capture.finished_at - capture.stop_s,
        }
        output = self.engine.output(capture.request_id)
        notes = [] if profile_kernels else ["kernels not separated from model_python (profile_kernels=False)"]
        if body["choices"][0]["message"]["content"] != output.text:
            raise RuntimeError("the HTTP answer differs from the engine's record of the traced request")
        return RequestTrace(
            layers,
            received - sent,
            dict(capture.kernel_ops),
            self.watch.count("forward"),
            list(output.prompt_ids),
            list(output.token_ids),
            output.text,
            profile_kernels,
            notes,
        )


def trace_request(
    model, tokenizer, messages: list[dict], max_tokens: int = 16, profile_kernels: bool = True, warmup: bool = True
) -> RequestTrace:
    """Start a traced server on ``model``, trace one request (see ``TracedServer.trace``), stop it."""
    with TracedServer(model, tokenizer) as server:
        return server.trace(messages, max_tokens, profile_kernels, warmup)
