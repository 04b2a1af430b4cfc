"""The engine on its own thread, fed from asyncio: what an HTTP server talks to.

    HTTP handler --submit()--> inbox --engine thread: add_request, step(), ...--> per-request asyncio.Queue

``LLMEngine`` is not thread-safe, so only the engine thread touches it: handlers put commands
(add, abort) in an inbox and await the answer; the thread drains the inbox between steps, runs
a step whenever a request is unfinished, and hands each ``RequestOutput`` to its request's queue
on the handler's event loop. When nothing is unfinished the thread sleeps until a command comes.

Back-pressure: at most ``max_num_seqs + max_queue_len`` requests may be outstanding; one more
raises ``QueueFull`` (the server answers 429) instead of growing latency without bound.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from collections.abc import AsyncIterator

from infra_lib.model.sampling import SamplingParams
from infra_lib.serving.engine import LLMEngine, RequestOutput


class QueueFull(RuntimeError):
    """Too many requests are outstanding; try again later (HTTP 429)."""


class EngineDead(RuntimeError):
    """The engine thread stopped after an error; the server answers 503 from then on."""


class AsyncLLMEngine:
    """Runs ``engine`` on a background thread; ``generate`` streams one request's outputs.

    Args:
        engine: the engine (only this object's thread touches it once ``start`` ran).
        max_queue_len: requests that may wait beyond the running batch's ``max_num_seqs``.
        idle_wait_s: how long the idle thread sleeps between looks at its inbox.
    """

    def __init__(self, engine: LLMEngine, max_queue_len: int = 256, idle_wait_s: float = 0.05):
        if max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        self.engine, self.max_queue_len, self.idle_wait_s = engine, max_queue_len, idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._accepted: dict[asyncio.Future, int] = {}  # a submit's future -> request id, for cancelled submits
        self._future_of: dict[int, asyncio.Future] = {}
        self._outstanding = 0
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> AsyncLLMEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def capacity(self) -> int:
        return self.engine.config.max_num_seqs + self.max_queue_len

    @property
    def num_outstanding(self) -> int:
        """Requests submitted and not finished (waiting or running)."""
        return self._outstanding

    # --- requests --------------------------------------------------------------------------------

    async def submit(
        self, prompt, params: SamplingParams, stop: tuple[str, ...] = (), arrival_time: float | None = None
    ) -> tuple[int, asyncio.Queue]:
        """Queue a request; returns its id and the queue its ``RequestOutput``s arrive on.

        ``arrival_time``: when the request arrived, on the engine's clock (default: now; a server
        that tokenizes the prompt itself stamps it before, so its latencies include tokenizing).
        Raises ``QueueFull``, ``EngineDead``, or the engine's ``ValueError`` for a request it
        cannot take (prompt longer than the context, more KV than the pool holds).
        """
        if not self.is_alive:
            raise EngineDead(f"the engine loop is not running{': ' + repr(self.error) if self.error else ''}")
        with self._lock:
            if self._outstanding >= self.capacity:
                raise QueueFull(
                    f"{self._outstanding} requests outstanding, the limit is {self.capacity} "
                    f"(max_num_seqs {self.engine.config.max_num_seqs} + queue {self.max_queue_len})"
                )
            self._outstanding += 1
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        outputs: asyncio.Queue = asyncio.Queue()
        # now, not when the engine thread next looks (after its step)
        arrival = self.engine.clock.now() if arrival_time is None else arrival_time
        self._inbox.put(("add", (prompt, params, tuple(stop), arrival), loop, accepted, outputs))
        self._wake.set()
        try:
            request_id = await accepted
        except asyncio.CancelledError:  # the client left before the engine took the request
            self._inbox.put(("abort_pending", accepted))  # after the add in the FIFO inbox
            self._wake.set()
            raise
        return request_id, outputs

    def abort(self, request_id: int) -> None:
        """Ask the engine to stop ``request_id`` (thread-safe; its KV blocks return to the pool)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    async def generate(
        self, prompt, params: SamplingParams, stop: tuple[str, ...] = ()
    ) -> AsyncIterator[RequestOutput]:
        """Submit and yield the request's outputs until it finishes; leaving early aborts it."""
        request_id, outputs = await self.submit(prompt, params, stop)
        finished = False
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    # --- the engine thread -----------------------------------------------------------------------

    def _deliver(self, loop, target: asyncio.Queue, item) -> None:
        try:
            loop.call_soon_threadsafe(target.put_nowait, item)
        except RuntimeError:  # the handler's loop is closed: nobody is listening
            pass

    def _finished(self, request_id: int) -> None:
        self._accepted.pop(self._future_of.pop(request_id, None), None)
        if self._streams.pop(request_id, None) is not None:
            with self._lock:
                self._outstanding -= 1

    def _drain(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, (prompt, params, stop, arrival), loop, accepted, outputs = command
                try:
                    request_id = self.engine.add_request(prompt, params, stop=stop, arrival_time=arrival)
                except Exception as exc:  # a request the engine refuses: the handler answers 400
                    with self._lock:
                        self._outstanding -= 1
                    loop.call_soon_threadsafe(_settle, accepted, None, exc)
                    continue
                self._streams[request_id] = (loop, outputs)
                self._accepted[accepted], self._future_of[request_id] = request_id, accepted
                loop.call_soon_threadsafe(_settle, accepted, request_id, None)
            elif command[0] in ("abort", "abort_pending"):
                request_id = command[1] if command[0] == "abort" else self._accepted.get(command[1])
                if request_id is not None and self.engine.abort(request_id) is not None:
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        self._deliver(*stream, self.engine.output(request_id))
                    self._finished(request_id)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain()
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        stream = self._streams.get(out.request_id)
                        if stream is not None:
                            self._deliver(*stream, out)
                        if out.finished:
                            self._finished(out.request_id)
                else:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # a bug in a step: fail every open request loudly, never hang them
            self.error = exc
            traceback.print_exc()
            failure = EngineDead(f"the engine loop stopped: {exc!r}")
            for loop, outputs in list(self._streams.values()):
                self._deliver(loop, outputs, failure)
            self._streams.clear()


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
