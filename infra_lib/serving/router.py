"""A router in front of N replicas of the OpenAI-compatible server, and the policies that pick one.

Each replica is the course's server in its own process, with its own paged KV pool and prefix
cache. The router speaks the same API (``/v1/chat/completions`` and ``/v1/completions``, streamed
or whole, ``/v1/models``, ``/health``), forwards every request to one replica and relays the answer
unchanged, so a replica's own errors (a 400 for a bad body, a 404 for an unknown model) reach the
client as the replica wrote them.

Which replica is a ``RoutingPolicy``'s decision, a pure object with no HTTP in it:

    round-robin     the replicas in turn
    least-loaded    the fewest outstanding requests (sent, not yet finished)
    prefix          the replica that most likely holds the longest cached prefix of the prompt:
                    the router hashes the prompt's full KV blocks exactly as a replica's prefix
                    cache keys them and remembers (LRU, bounded) where it sent each hash; a replica
                    loaded past (1 + slack) x the mean is skipped, so a hot prefix cannot pin one

Failure: a replica that refuses a connection, breaks one, or answers 503 from a dead engine leaves
the rotation at once (a health probe brings it back when it answers again). A request that had
nothing delivered to its client yet is retried once on another replica; one whose client already
received tokens ends with an error event naming the replica. With no replica up, a request gets
a 503 that says so.

Start it with ``infra-lab serve --replicas N --router prefix`` (``router_main``), or in a test with
``ReplicaSet`` (replicas.py), ``Router`` and ``server.ServerThread(create_router_app(router))``.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from infra_lib.serving.prefix_cache import chained_block_hashes

POLICIES = ("round-robin", "least-loaded", "prefix")
PROBE_INTERVAL_S = 0.5
REPLICA_HEADER = "x-infra-lab-replica"  # on every forwarded answer: the index of the replica that served it
PROBE_FAILURES_TO_DOWN = 3  # slow or failed probes in a row (a refused connection counts at once)


class NoReplicaAvailable(RuntimeError):
    """Every replica is out of rotation."""


# --- the policies (pure: no I/O, no clock) -------------------------------------------------------


class RoutingPolicy:
    """Which replica serves a request. The router's one decision, and its whole contract:

    For every request the router calls ``choose(request_hashes, replica_loads)``, sends the request
    to the replica it returns, then calls ``observe(request_hashes, replica)``. When a replica
    leaves the rotation (its process died, and its prefix cache with it) it calls
    ``forget(replica)``.

    ``choose(request_hashes, replica_loads) -> int``
        request_hashes: the chained hashes (``bytes``) of the prompt's full KV blocks, in order,
            exactly as a replica's prefix cache keys them (``chained_block_hashes`` of the prompt's
            token ids, at most the blocks ``PrefixCache.match`` could hit). Equal leading hashes
            mean an equal prefix. Empty for a prompt shorter than one block, or one the router could
            not tokenize.
        replica_loads: one entry per replica, the index being the replica's id: its outstanding
            requests (sent by the router, not yet finished), or ``None`` for a replica out of
            rotation, which must never be chosen.
        Returns the index of a replica whose load is not ``None``. Raises ``NoReplicaAvailable``
        when every entry is ``None``. It never modifies its arguments; it may update the policy's
        own state (a round-robin cursor).

    ``observe(request_hashes, replica)``: the request was sent to ``replica``.
    ``forget(replica)``: whatever the policy remembers of ``replica`` is gone.
    """

    name = "policy"

    def choose(self, request_hashes: Sequence[bytes], replica_loads: Sequence[int | None]) -> int:
        raise NotImplementedError

    def observe(self, request_hashes: Sequence[bytes], replica: int) -> None:
        """The request was sent to ``replica`` (default: nothing to remember)."""

    def forget(self, replica: int) -> None:
        """``replica`` left the rotation (default: nothing to forget)."""


def live_replicas(replica_loads: Sequence[int | None]) -> list[int]:
    """Indices of the replicas in rotation; ``NoReplicaAvailable`` when there is none."""
    live = [i for i, load in enumerate(replica_loads) if load is not None]
    if not live:
        raise NoReplicaAvailable(f"all {len(replica_loads)} replicas are out of rotation")
    return live


class RoundRobinPolicy(RoutingPolicy):
    """The replicas in turn, skipping those out of rotation."""

    name = "round-robin"

    def __init__(self):
        self._next = 0

    def _in_turn(self, candidates: Sequence[int], replica_loads: Sequence[int | None], key=lambda i: 0) -> int:
        """The candidate with the smallest ``key``, ties going to the first at or after the cursor."""
        n = len(replica_loads)
        chosen = min(candidates, key=lambda i: (key(i), (i - self._next) % n))
        self._next = (chosen + 1) % n
        return chosen

    def choose(self, request_hashes, replica_loads):
        return self._in_turn(live_replicas(replica_loads), replica_loads)


class LeastLoadedPolicy(RoundRobinPolicy):
    """The fewest outstanding requests; ties in turn (so an idle pool still spreads its requests)."""

    name = "least-loaded"

    def choose(self, request_hashes, replica_loads):
        return self._in_turn(live_replicas(replica_loads), replica_loads, key=lambda i: replica_loads[i])


class PrefixAwarePolicy(RoundRobinPolicy):
    """The replica that was sent the longest run of the request's leading block hashes, within a load bound.

    A replica is over the bound when its load exceeds ``(1 + slack)`` times the mean load of the
    replicas in rotation, or reaches ``max_outstanding``; such replicas are skipped (all of them
    over the cap: the least loaded of all serves). Among the rest the longest match wins, ties to the
    least loaded, then in turn; with no match anywhere it is least-loaded.

    Args:
        slack: how far above the mean load a replica may be and still be chosen for its cache.
        max_outstanding: an absolute cap on a replica's outstanding requests (None: none).
        max_hashes: how many block hashes the policy remembers (least recently sent forgotten first).
    """

    name = "prefix"

    def __init__(self, slack: float = 0.5, max_outstanding: int | None = None, max_hashes: int = 65536):
        super().__init__()
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        if max_outstanding is not None and max_outstanding < 1:
            raise ValueError(f"max_outstanding must be a positive integer or None, got {max_outstanding}")
        if max_hashes < 1:
            raise ValueError(f"max_hashes must be positive, got {max_hashes}")
        self.slack, self.max_outstanding, self.max_hashes = slack, max_outstanding, max_hashes
        self._sent_to: OrderedDict[bytes, set[int]] = OrderedDict()  # hash -> replicas sent it, LRU order

    def match_length(self, request_hashes: Sequence[bytes], replica: int) -> int:
        """How many leading hashes of the request were sent to ``replica`` (stops at the first not sent)."""
        length = 0
        for h in request_hashes:
            if replica not in self._sent_to.get(h, ()):
                break
            length += 1
        return length

    def within_bound(self, replica_loads: Sequence[int | None]) -> list[int]:
        """The replicas in rotation that are not over the load bound."""
        live = live_replicas(replica_loads)
        mean = sum(replica_loads[i] for i in live) / len(live)
        return [
            i
            for i in live
            if replica_loads[i] <= (1 + self.slack) * mean
            and (self.max_outstanding is None or replica_loads[i] < self.max_outstanding)
        ]

    def choose(self, request_hashes, replica_loads):
        candidates = self.within_bound(replica_loads)
        if not candidates:  # every replica at the absolute cap: the cache gives way to the load
            return self._in_turn(live_replicas(replica_loads), replica_loads, key=lambda i: replica_loads[i])
        matched = {i: self.match_length(request_hashes, i) for i in candidates}
        return self._in_turn(candidates, replica_loads, key=lambda i: (-matched[i], replica_loads[i]))

    def observe(self, request_hashes, replica):
        for h in request_hashes:
            self._sent_to.setdefault(h, set()).add(replica)
            self._sent_to.move_to_end(h)
        while len(self._sent_to) > self.max_hashes:
            self._sent_to.popitem(last=False)

    def forget(self, replica):
        for h in [h for h, sent in self._sent_to.items() if replica in sent]:
            self._sent_to[h].discard(replica)
            if not self._sent_to[h]:
                del self._sent_to[h]

    def __len__(self) -> int:
        return len(self._sent_to)


def make_policy(name: str, **options) -> RoutingPolicy:
    """The policy called ``name`` (one of ``POLICIES``); ``options`` go to ``PrefixAwarePolicy``."""
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-loaded":
        return LeastLoadedPolicy()
    if name == "prefix":
        return PrefixAwarePolicy(**options)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The prompt's block hashes as a replica's prefix cache looks them up: full blocks only, and
    never the block that holds the last prompt token when the prompt fills it (``PrefixCache.match``)."""
    return chained_block_hashes(token_ids, block_size, max(0, (len(token_ids) - 1) // block_size))


def load_tokenizer(model_path: str | None = None):
    """The tokenizer a replica serving ``model_path`` uses (default: the course's SmolLM2), without its weights."""
    from infra_lib.model.loaders import default_gguf_path, gguf_fields
    from infra_lib.model.tokenizer import Tokenizer

    path = Path(model_path) if model_path else default_gguf_path()
    if path.suffix == ".gguf":
        import gguf

        return Tokenizer.from_gguf_fields(gguf_fields(gguf.GGUFReader(str(path))))
    if (path / "tokenizer.json").exists():
        return Tokenizer.from_tokenizer_json(path / "tokenizer.json")
    return None  # the replicas take token ids only: prompts given as ids are still hashed


# --- the HTTP router -----------------------------------------------------------------------------


class ReplicaFailed(Exception):
    """A replica broke a request (refused or dropped the connection, or its engine is dead)."""


@dataclass
class Replica:
    """One replica as the router sees it."""

    url: str
    up: bool = True
    outstanding: int = 0
    routed: int = 0
    failed_probes: int = 0
    last_error: str = ""

    def as_dict(self, index: int) -> dict:
        return {
            "replica": index,
            "url": self.url,
            "up": self.up,
            "outstanding": self.outstanding,
            "routed": self.routed,
            "last_error": self.last_error,
        }


def _error(status: int, message: str, code: str, type: str = "server_error"):
    return JSONResponse({"error": {"message": message, "type": type, "param": None, "code": code}}, status_code=status)


def _error_event(message: str, code: str) -> str:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n"


def _role_only(event: str) -> bool:
    """Whether an SSE event is a chat stream's opening chunk (the role, no content): holding it back
    until the first token arrives lets a request whose replica fails before then be retried unseen."""
    try:
        choices = json.loads(event[len("data: ") :])["choices"]
    except (ValueError, KeyError, TypeError):
        return False
    return len(choices) == 1 and choices[0].get("delta") == {"role": "assistant"}


def _engine_dead(status: int, content: bytes) -> bool:
    if status != 503:
        return False
    try:
        return json.loads(content)["error"]["code"] == "engine_dead"
    except (ValueError, KeyError, TypeError):
        return False


class RelayResponse(StreamingResponse):
    """A relayed SSE stream that releases its replica even if the client left before it began."""

    def __init__(self, content, release, replica: int):
        headers = {"Cache-Control": "no-cache", REPLICA_HEADER: str(replica)}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()


class Router:
    """The replicas, the policy and the tokenizer; ``create_router_app`` serves it over HTTP.

    Args:
        replica_urls: each replica's base URL (``http://127.0.0.1:PORT``).
        policy: a ``RoutingPolicy`` (or a name from ``POLICIES``).
        tokenizer: the replicas' tokenizer (``load_tokenizer``); None hashes only token-id prompts.
        block_size: the replicas' KV block size (their prefix cache's block).
        probe_interval_s: how often each replica's ``/health`` is asked.
    """

    def __init__(
        self,
        replica_urls: Sequence[str],
        policy: RoutingPolicy | str = "prefix",
        tokenizer=None,
        *,
        block_size: int = 16,
        probe_interval_s: float = PROBE_INTERVAL_S,
    ):
        if not replica_urls:
            raise ValueError("a router needs at least one replica URL")
        self.replicas = [Replica(url.rstrip("/")) for url in replica_urls]
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.tokenizer, self.block_size, self.probe_interval_s = tokenizer, block_size, probe_interval_s
        self.retried = 0
        self.failed_mid_stream = 0
        self.client = None

    def describe(self, index: int) -> str:
        return f"replica {index} ({self.replicas[index].url})"

    # --- rotation ---

    def mark_down(self, index: int, reason: str) -> None:
        replica = self.replicas[index]
        replica.last_error = reason
        if replica.up:
            replica.up = False
            self.policy.forget(index)

    async def probe(self, index: int) -> None:
        replica = self.replicas[index]
        try:
            response = await self.client.get(replica.url + "/health", timeout=2.0)
        except httpx.ConnectError as exc:
            replica.failed_probes = PROBE_FAILURES_TO_DOWN
            reason = f"connection refused ({exc})"
        except httpx.HTTPError as exc:
            replica.failed_probes += 1
            reason = f"health probe failed: {type(exc).__name__}"
        else:
            if response.status_code == 200:
                replica.up, replica.failed_probes = True, 0
                return
            replica.failed_probes = PROBE_FAILURES_TO_DOWN
            reason = f"/health answered {response.status_code}"
        if replica.failed_probes >= PROBE_FAILURES_TO_DOWN:
            self.mark_down(index, reason)

    async def probe_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(i) for i in range(len(self.replicas))))
            await asyncio.sleep(self.probe_interval_s)

    # --- one request ---

    def request_hashes(self, body, chat: bool) -> list[bytes]:
        """The prompt's block hashes, tokenized as a replica tokenizes it ([] if it cannot be)."""
        from pydantic import ValidationError

        from infra_lib.serving.server import ChatRequest, CompletionRequest

        try:
            request = (ChatRequest if chat else CompletionRequest).model_validate_json(body)
        except ValidationError:
            return []  # the replica will answer its 400
        if chat:
            if self.tokenizer is None:
                return []
            ids = self.tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in request.messages])
        elif isinstance(request.prompt, str):
            if self.tokenizer is None:
                return []
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = request.prompt
        return prompt_block_hashes(ids, self.block_size)

    async def handle(self, request, path: str, chat: bool):
        """Route one completion request: choose, forward, relay; retry once if nothing was delivered."""
        body = await request.body()
        try:
            stream = json.loads(body).get("stream") is True
        except (ValueError, AttributeError):
            stream = False
        hashes = await asyncio.to_thread(self.request_hashes, body, chat)
        tried: list[int] = []
        failures: list[str] = []
        while len(tried) < 2:
            loads = [r.outstanding if r.up and i not in tried else None for i, r in enumerate(self.replicas)]
            try:
                index = self.policy.choose(hashes, loads)
            except NoReplicaAvailable:
                break
            if loads[index] is None:
                raise RuntimeError(
                    f"the {self.policy.name} policy chose {self.describe(index)}, which is out of rotation"
                )
            self.policy.observe(hashes, index)
            tried.append(index)
            try:
                return await (self.forward_stream if stream else self.forward_whole)(request, index, path, body)
            except ReplicaFailed as exc:
                self.mark_down(index, str(exc))
                failures.append(f"{self.describe(index)}: {exc}")
                if len(tried) < 2:
                    self.retried += 1
        if failures:
            return _error(
                503, "the request failed on " + "; then on ".join(failures) + "; retry later", "replica_failed"
            )
        down = "; ".join(f"{self.describe(i)}: {r.last_error or 'down'}" for i, r in enumerate(self.replicas))
        return _error(503, f"no replica is up ({down}); retry later", "no_replica_available")

    async def forward_whole(self, request, index: int, path: str, body: bytes):
        replica = self.replicas[index]
        replica.outstanding += 1
        replica.routed += 1
        send = asyncio.ensure_future(
            self.client.post(replica.url + path, content=body, headers={"content-type": "application/json"})
        )
        try:
            while not send.done():  # a client that hangs up cancels the replica's request too
                await asyncio.wait({send}, timeout=0.25)
                if not send.done() and await request.is_disconnected():
                    send.cancel()
                    return _error(499, "the client closed the connection", "client_closed", "invalid_request_error")
            response = send.result()
        except httpx.TransportError as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
        finally:
            replica.outstanding -= 1
        if _engine_dead(response.status_code, response.content):
            raise ReplicaFailed(json.loads(response.content)["error"]["message"])
        return Response(
            response.content, response.status_code, {REPLICA_HEADER: str(index)}, media_type="application/json"
        )

    async def forward_stream(self, request, index: int, path: str, body: bytes):
        replica = self.replicas[index]
        replica.outstanding += 1
        replica.routed += 1
        upstream, relaying = None, False
        try:
            upstream = await self.client.send(
                self.client.build_request(
                    "POST", replica.url + path, content=body, headers={"content-type": "application/json"}
                ),
                stream=True,
            )
            if upstream.status_code != 200:
                content = await upstream.aread()
                if _engine_dead(upstream.status_code, content):
                    raise ReplicaFailed(json.loads(content)["error"]["message"])
                return Response(
                    content, upstream.status_code, {REPLICA_HEADER: str(index)}, media_type="application/json"
                )
            events = (f"{line}\n\n" async for line in upstream.aiter_lines() if line)
            held = []
            async for event in events:  # nothing reaches the client before its first token: until then, retry
                held.append(event)
                if not _role_only(event):
                    break
            else:
                raise ReplicaFailed("the stream ended before its first token")
            relaying = True
        except httpx.TransportError as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
        finally:
            if not relaying:
                replica.outstanding -= 1
                if upstream is not None:
                    await upstream.aclose()

        released = False

        async def release():
            nonlocal released
            if not released:
                released = True
                replica.outstanding -= 1
                await upstream.aclose()

        async def relay():
            done = held[-1] == "data: [DONE]\n\n"
            try:
                for event in held:
                    yield event
                async for event in events:
                    done = event == "data: [DONE]\n\n"
                    yield event
                if not done:
                    raise ReplicaFailed("the stream ended without [DONE]")
            except (httpx.TransportError, ReplicaFailed) as exc:
                self.failed_mid_stream += 1
                self.mark_down(index, f"{type(exc).__name__}: {exc}")
                yield _error_event(
                    f"{self.describe(index)} failed mid-stream ({type(exc).__name__}: {exc}); the answer so far "
                    "is incomplete: send the request again",
                    "replica_failed",
                )
            finally:
                await release()

        return RelayResponse(relay(), release, index)

    async def models(self):
        for index, replica in enumerate(self.replicas):
            if not replica.up:
                continue
            try:
                response = await self.client.get(replica.url + "/v1/models", timeout=10.0)
            except httpx.TransportError as exc:
                self.mark_down(index, f"{type(exc).__name__}: {exc}")
                continue
            return Response(response.content, response.status_code, media_type="application/json")
        return _error(503, "no replica is up to list the models; retry later", "no_replica_available")


def create_router_app(router: Router):
    """A FastAPI app serving ``router`` (its HTTP client and health probe live as long as the app)."""

    @asynccontextmanager
    async def lifespan(app):
        router.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=5.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128),
        )
        await asyncio.gather(*(router.probe(i) for i in range(len(router.replicas))))
        prober = asyncio.create_task(router.probe_forever())
        yield
        prober.cancel()
        await router.client.aclose()

    app = FastAPI(title="infra-lab router", lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health():
        replicas = [r.as_dict(i) for i, r in enumerate(router.replicas)]
        up = sum(r.up for r in router.replicas)
        body = {"status": "ok" if up else "no replica up", "policy": router.policy.name, "replicas": replicas}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/router/stats")
    async def stats():
        return {
            "policy": router.policy.name,
            "retried": router.retried,
            "failed_mid_stream": router.failed_mid_stream,
            "replicas": [r.as_dict(i) for i, r in enumerate(router.replicas)],
        }

    @app.get("/v1/models")
    async def models():
        return await router.models()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.handle(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle(request, "/v1/completions", chat=False)

    return app


def router_main(args, replica_command: Sequence[str], block_size: int = 16) -> int:
    """``infra-lab serve --replicas N --router POLICY``: start N replicas, serve the router in front.

    ``args``: the serve options (``replicas``, ``router``, ``host``, ``port``, ``model_path``);
    ``replica_command``: one replica's command line without host and port. Ctrl-C or SIGTERM stops
    the router and every replica."""
    import signal

    import uvicorn

    from infra_lib.serving.replicas import ReplicaSet, ReplicaStartError
    from infra_lib.serving.server import KEEP_ALIVE_S, listen_problem

    if args.replicas < 1:
        raise SystemExit(f"--replicas must be a positive integer, got {args.replicas}")
    if args.model_path and not Path(args.model_path).exists():
        raise SystemExit(f"--model {args.model_path}: no such file or folder")
    policy = make_policy(args.router or "prefix")
    problem = listen_problem(args.host, args.port)
    if problem:
        raise SystemExit(problem)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # while the replicas start; uvicorn takes it over while serving
    replicas = ReplicaSet(replica_command, args.replicas)
    try:
        print(f"starting {args.replicas} replicas (logs in {replicas.log_dir}) ...", flush=True)
        with ThreadPoolExecutor(1) as pool:  # read the tokenizer while the replicas load the model
            tokenizer = pool.submit(load_tokenizer, args.model_path)
            replicas.start()
        router = Router(replicas.urls, policy, tokenizer.result(), block_size=block_size)
        base = f"http://{args.host}:{args.port}/v1"
        print(
            f"routing with the {policy.name} policy at {base} over "
            + ", ".join(f"replica {i} at {url}" for i, url in enumerate(replicas.urls))
            + f"\n  from openai import OpenAI\n  client = OpenAI(base_url={base!r}, api_key='unused')",
            flush=True,
        )
        uvicorn.run(
            create_router_app(router),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    except KeyboardInterrupt:
        pass
    except ReplicaStartError as exc:
        raise SystemExit(str(exc)) from None
    finally:
        replicas.stop()
        print("stopped the router and its replicas", flush=True)
    return 0
