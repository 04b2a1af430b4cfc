"""An OpenAI-compatible HTTP server on the continuous-batching engine.

    POST /v1/chat/completions   chat messages in, an answer out (streamed over SSE or whole)
    POST /v1/completions        a text prompt (or token ids) in, its continuation out
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs, 503 after it died
    GET  /metrics               Prometheus text with vLLM's metric names (observability.py)

Every request is validated before it reaches the engine: malformed JSON, wrong types, values
out of range, an unknown model, a prompt that fills the context, or a ``max_tokens`` that with
the prompt overruns it get an OpenAI-style error body (``{"error": {"message", "type", "param",
"code"}}``) with status 400 (404 for an unknown model), and the engine never sees them. A request
without ``max_tokens`` gets ``max_tokens_default``, lowered to what the context leaves. A full
queue answers 429. A client that disconnects, mid-stream or while waiting for a whole answer,
aborts its request: the engine thread frees its KV blocks before its next step, and the
``/metrics`` gauges show the freed blocks at once, with no other request needed.

Start it with ``infra-lab serve`` (``serve_main``), or in a notebook or test with
``ServerThread``, which runs uvicorn on a background thread on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra_lib.model.native_decode import NativeUnavailable, native_decode_available
from infra_lib.model.sampling import SamplingParams
from infra_lib.serving.async_engine import AsyncLLMEngine, EngineDead, QueueFull
from infra_lib.serving.engine import LLMEngine
from infra_lib.serving.events import EventLog
from infra_lib.serving.observability import CONTENT_TYPE, ServingMetrics
from infra_lib.serving.scheduler_output import SchedulerConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DISCONNECT_POLL_S = 0.25  # how often a handler waiting for tokens looks whether its client is still there
MAX_BODY_BYTES = 1 << 20


# --- the request bodies (only what this server implements; unknown fields are ignored) ----------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # an extension, as in vLLM
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    ignore_eos: bool = False  # an extension, as in vLLM: generate exactly max_tokens (load tests)


class ChatRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]


# --- errors --------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class _ClientGone(Exception):
    """The client closed its connection; its request is aborted."""


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    if errors[0].get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {errors[0].get('msg')}", code="invalid_json")
    # Of a union's alternatives, the one whose type matched says the most ("at most 4 items")
    first = next((e for e in errors if not e.get("type", "").endswith("_type")), errors[0])
    path = [
        str(p)
        for p in first.get("loc", ())
        if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS or p[:1].isupper()))
    ]
    where = ".".join(path)
    got = first.get("input")
    shown = json.dumps(got)[:80] if isinstance(got, (str, int, float, bool, type(None))) else type(got).__name__
    return APIError(400, f"{where or 'body'}: {first.get('msg')}; got {shown}", param=path[0] if path else None)


# --- the app -------------------------------------------------------------------------------------


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_name: str
    metrics: ServingMetrics
    max_tokens_default: int
    downstream_delay_s: float
    started: int


def create_app(
    engine: AsyncLLMEngine,
    model_name: str = DEFAULT_MODEL_NAME,
    *,
    metrics: ServingMetrics | None = None,
    max_tokens_default: int = 256,
    downstream_delay_s: float = 0.0,
):
    """A FastAPI app serving ``engine`` (started with the app, stopped with it).

    Args:
        model_name: the id clients must send as ``model``.
        metrics: the collectors ``/metrics`` exposes (default: new ones on the engine's event log).
        max_tokens_default: output limit when a request gives no ``max_tokens`` (lowered to what the
            context leaves after the prompt).
        downstream_delay_s: a fault to inject: every request first waits this long in the handler,
            like a slow retrieval or gateway in front of the engine (chapter 11's drill).
    """
    if metrics is None:
        metrics = ServingMetrics(model_name, engine.engine.events, engine.engine.config.enable_prefix_caching)
    state = ServerState(engine, model_name, metrics, max_tokens_default, downstream_delay_s, int(time.time()))

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="infra-lab OpenAI-compatible server", lifespan=lifespan)
    app.state.serving = state

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return JSONResponse({"status": "dead", "error": repr(engine.error)}, status_code=503)
        return {"status": "ok", "outstanding": engine.num_outstanding}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": state.started,
                    "owned_by": "infra-lab",
                    "max_model_len": engine.engine.runner.max_position,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _parse(request, ChatRequest)
        arrival = await _arrive()
        tokenizer = engine.engine.tokenizer
        if tokenizer is None:
            raise APIError(
                400,
                "this model has no tokenizer (no chat template): use /v1/completions with the "
                "prompt as a list of token ids",
                param="messages",
            )
        ids = tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        return await _complete(request, body, ids, arrival, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        arrival = await _arrive()
        tokenizer = engine.engine.tokenizer
        if isinstance(body.prompt, str):
            if tokenizer is None:
                raise APIError(
                    400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt"
                )
            ids = tokenizer.encode(body.prompt)
        else:
            vocab = engine.engine.runner.model.config.vocab_size if hasattr(engine.engine.runner, "model") else None
            if vocab is not None and any(not 0 <= t < vocab for t in body.prompt):
                raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
            ids = list(body.prompt)
        return await _complete(request, body, ids, arrival, chat=False)

    async def _arrive() -> float:
        """The request's arrival on the engine's clock, after the injected downstream delay (which lies
        in front of the engine) and before tokenizing (which the engine's latencies include)."""
        if downstream_delay_s:
            await asyncio.sleep(downstream_delay_s)
        return engine.engine.clock.now()

    async def _parse(request, model_cls):
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the body has {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", code="body_too_large")
        try:
            body = model_cls.model_validate_json(raw)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        if body.model != model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return body

    def _output_limit(body: _SamplingRequest, num_prompt: int, chat: bool) -> int:
        """The request's max_tokens, refused (400) where the prompt and it overrun the model's context;
        without one, ``max_tokens_default`` lowered to what the context leaves after the prompt."""
        context = engine.engine.runner.max_position
        if num_prompt >= context:
            raise APIError(
                400,
                f"the prompt has {num_prompt} tokens; the model's context length is {context} "
                f"tokens, and at least one of them must be left for the output: shorten the prompt",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        asked, field = (
            (body.max_completion_tokens, "max_completion_tokens")
            if body.max_completion_tokens
            else (body.max_tokens, "max_tokens")
        )
        if asked is None:
            return min(max_tokens_default, context - num_prompt)
        if num_prompt + asked > context:
            raise APIError(
                400,
                f"{field} is {asked}, but the model's context length is {context} tokens and the "
                f"prompt takes {num_prompt} of them ({num_prompt} + {asked} = {num_prompt + asked} "
                f"> {context}): ask for at most {context - num_prompt} tokens or shorten the prompt",
                param=field,
                code="context_length_exceeded",
            )
        return asked

    async def _complete(request, body: _SamplingRequest, prompt: list[int], arrival: float, chat: bool):
        max_tokens = _output_limit(body, len(prompt), chat)
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            max_new_tokens=max_tokens,
            stop_ids=() if body.ignore_eos else None,
        )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if any(not s for s in stop):
            raise APIError(400, "stop strings must not be empty", param="stop")
        try:
            request_id, outputs = await engine.submit(prompt, params, stop, arrival_time=arrival)
        except QueueFull as exc:
            raise APIError(
                429, f"the server is busy: {exc}; retry later", type="rate_limit_error", code="queue_full"
            ) from None
        except EngineDead as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_dead") from None
        except ValueError as exc:
            code = "context_length_exceeded" if "context" in str(exc) or "KV positions" in str(exc) else None
            raise APIError(400, str(exc), param="messages" if chat else "prompt", code=code) from None
        kind = "chatcmpl" if chat else "cmpl"
        response_id = f"{kind}-{request_id:08x}{state.started:x}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(request, request_id, outputs, response_id, chat, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _whole(request, request_id, outputs, response_id, chat)

    async def _next(request, outputs):
        """The request's next output; raises ``_ClientGone`` as soon as its client hangs up (uvicorn
        drops writes to a closed connection silently, so nothing else would notice)."""
        getter = asyncio.ensure_future(outputs.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    raise _ClientGone
        finally:
            if not getter.done():
                getter.cancel()
        out = getter.result()
        if isinstance(out, BaseException):
            raise APIError(503, str(out), type="server_error", code="engine_dead")
        if await request.is_disconnected():
            raise _ClientGone
        return out

    async def _whole(request, request_id, outputs, response_id, chat):
        out = None
        try:
            while out is None or not out.finished:
                out = await _next(request, outputs)
        except _ClientGone:
            raise APIError(499, "the client closed the connection", code="client_closed") from None
        finally:
            if out is None or not out.finished:
                engine.abort(request_id)
        usage = _usage(out)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "finish_reason": out.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [choice],
            "usage": usage,
        }

    async def _stream(request, request_id, outputs, response_id, chat, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(choices, usage=None):
            data = {"id": response_id, "object": obj, "created": created, "model": model_name, "choices": choices}
            if include_usage:
                data["usage"] = usage
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None, "logprobs": None}])
            while not finished:
                try:
                    out = await _next(request, outputs)
                except APIError as exc:
                    yield f"data: {json.dumps(exc.body())}\n\n"
                    return
                except _ClientGone:
                    return
                finished = out.finished
                if out.new_token_ids:  # one chunk per token (its text may be empty: half a UTF-8 character)
                    delta = {"content": out.new_text} if chat else None
                    choice = (
                        {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
                        if chat
                        else {"index": 0, "text": out.new_text, "finish_reason": None, "logprobs": None}
                    )
                    yield chunk([choice])
            final = (
                {"index": 0, "delta": {}, "finish_reason": out.finish_reason, "logprobs": None}
                if chat
                else {"index": 0, "text": "", "finish_reason": out.finish_reason, "logprobs": None}
            )
            yield chunk([final])
            if include_usage:
                yield chunk([], _usage(out))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (the response task was cancelled)
                engine.abort(request_id)

    return app


def _usage(out) -> dict:
    return {
        "prompt_tokens": len(out.prompt_ids),
        "completion_tokens": len(out.token_ids),
        "total_tokens": len(out.prompt_ids) + len(out.token_ids),
    }


# --- building and running ------------------------------------------------------------------------


def build_engine(
    model=None,
    tokenizer=None,
    *,
    model_path: str | None = None,
    max_num_seqs: int = 16,
    kv_blocks: int = 512,
    block_size: int = 16,
    max_num_batched_tokens: int = 512,
    enable_prefix_caching: bool = True,
    max_queue_len: int = 256,
    event_log_len: int | None = 200_000,
    pieces: dict | None = None,
    native: str | None = None,
) -> AsyncLLMEngine:
    """An ``AsyncLLMEngine`` on ``model`` (default: ``model_path``, else the course's SmolLM2).

    ``pieces``: a learner's engine pieces (``infra_lib.serving.pieces``); with a learner's block
    pool, prefix caching is off (the lab's pool has no prefix cache). ``native``: a weight format
    (``"fp32"``, ``"bf16"``, ``"int8"``) for the course's engine to run its steps in C
    (``NativeModelRunner``), or None for PyTorch."""
    if pieces and native is not None:
        raise ValueError("a learner's engine runs its own pieces in PyTorch: serve it without --native")
    if model is None:
        from infra_lib.model.loaders import load_default, load_gguf, load_hf_dir

        if model_path is None:
            loaded = load_default()
        elif str(model_path).endswith(".gguf"):
            loaded = load_gguf(model_path)
        else:
            loaded = load_hf_dir(model_path)
        model, tokenizer = loaded.model, loaded.tokenizer if tokenizer is None else tokenizer
    if pieces and pieces.get("BlockPool") is not None:
        enable_prefix_caching = False
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_blocks=kv_blocks,
        enable_prefix_caching=enable_prefix_caching,
    )
    if pieces:
        from infra_lib.serving.pieces import assemble

        engine = assemble(model, tokenizer, config, pieces, events=EventLog(maxlen=event_log_len))
    else:
        engine = LLMEngine.from_model(model, tokenizer, config, events=EventLog(maxlen=event_log_len), native=native)
    return AsyncLLMEngine(engine, max_queue_len=max_queue_len)


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` (in use, no such address), or None when it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            return None
    except (OSError, OverflowError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return (
            f"cannot listen on {host}:{port} ({reason}); pass --port with a free port, "
            f"or --host with an address of this machine"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long an idle keep-alive connection stays open on the server's side. Longer than the clients' own idle
# expiry (httpx: 5 s, the same as uvicorn's default): with equal timeouts, a client under load can send a
# request on a connection the server is closing at that instant, and get a transport error with no response
# (a router or canary in front then takes a healthy upstream for a failed one). The server closing last
# removes that race; 75 s is nginx's default for the same reason.
KEEP_ALIVE_S = 75


class ServerThread:
    """Serve an app with uvicorn on a background thread (notebooks, tests): ``with ServerThread(app) as s: s.url``.

    Args:
        app: the ASGI app (``create_app``).
        port: the port on 127.0.0.1 (default: a free one).
        startup_timeout_s: how long to wait for the server to answer.
    """

    def __init__(self, app, port: int | None = None, startup_timeout_s: float = 30.0):
        import uvicorn

        self.app, self.port = app, port or free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=2,
                timeout_keep_alive=KEEP_ALIVE_S,
            )
        )
        self._thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.startup_timeout_s = startup_timeout_s

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on port {self.port} stopped while starting (is the port taken?)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server on port {self.port} did not start in {self.startup_timeout_s} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def choose_step(native: str | None, pytorch: bool, learner: bool) -> tuple[str | None, str]:
    """Where ``infra-lab serve``'s engine runs its steps: ``(weight format of the C step, or None for
    PyTorch; the sentence printed at start)``.

    By default the course's engine runs its steps in C with the model's fp32 weights (the same answers
    as in PyTorch, in about half the time a step), where the C step builds here; where it does not, in
    PyTorch, saying why. ``--native FORMAT`` asks for the C step in that format (and fails where it
    cannot be built), ``--pytorch`` for PyTorch; a learner's engine runs its own pieces in PyTorch."""
    if native and pytorch:
        raise SystemExit("--native runs the engine's steps in C, --pytorch in PyTorch: give one or the other")
    if learner:
        return None, ""
    if pytorch:
        return None, "engine steps in PyTorch (--pytorch)"
    if native:
        return native, f"engine steps in C, {native} weights (--native {native})"
    ok, why = native_decode_available()
    if not ok:
        return None, f"engine steps in PyTorch: the C step cannot be built here ({why.splitlines()[0]})"
    return (
        "fp32",
        "engine steps in C, the model's fp32 weights (the PyTorch engine's answers); --pytorch runs them in PyTorch",
    )


def serve_main(args: argparse.Namespace, pieces: dict | None = None) -> int:
    """``infra-lab serve``: load the model, print where to point a client, serve until Ctrl-C.
    ``pieces``: a learner's engine pieces (``--engine learner``), None for the course's engine."""
    from pathlib import Path

    import uvicorn

    for name in ("port", "max_num_seqs", "kv_blocks", "max_num_batched_tokens", "max_tokens_default"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.model_path and not Path(args.model_path).exists():
        raise SystemExit(f"--model {args.model_path}: no such file or folder")
    problem = listen_problem(args.host, args.port)
    if problem:  # found before the model loads, not after
        raise SystemExit(problem)
    native = getattr(args, "native", None)
    if pieces and native:
        raise SystemExit(
            "--native runs the course's engine in C; a learner's engine (--engine learner) runs its "
            "own pieces: leave --native out"
        )
    chosen, note = choose_step(native, getattr(args, "pytorch", False), bool(pieces))
    print("loading the model ...", flush=True)

    def engine_on(step: str | None) -> AsyncLLMEngine:
        return build_engine(
            model_path=args.model_path,
            max_num_seqs=args.max_num_seqs,
            kv_blocks=args.kv_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_queue_len=args.max_queue_len,
            pieces=pieces,
            native=step,
        )

    try:
        engine = engine_on(chosen)
    except (NativeUnavailable, TypeError, ValueError) as exc:
        if native:
            raise SystemExit(
                f"--native {native}: the engine's step in C is unavailable here: {exc}\n"
                "serve without --native (the same engine in PyTorch)"
            ) from None
        if chosen is None:
            raise
        # the default, on a model the C step does not read: the same engine in PyTorch
        note = f"engine steps in PyTorch: the C step cannot run this model ({str(exc).splitlines()[0]})"
        engine = engine_on(None)
    if note:
        print(note, flush=True)
    name = args.served_model_name or (Path(args.model_path).stem if args.model_path else DEFAULT_MODEL_NAME)
    app = create_app(engine, name, max_tokens_default=args.max_tokens_default)
    base = f"http://{args.host}:{args.port}/v1"
    print(
        f"serving {name!r} at {base}\n"
        f"  from openai import OpenAI\n"
        f"  client = OpenAI(base_url={base!r}, api_key='unused')\n"
        f"  client.chat.completions.create(model={name!r}, messages=[{{'role': 'user', 'content': 'Hi'}}])",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
    return 0
