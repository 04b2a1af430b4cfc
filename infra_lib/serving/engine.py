"""The engine loop: requests in, one scheduled step at a time, tokens out.

    add_request -> Scheduler.waiting
    step():  Scheduler.schedule() -> runner.run(batch) -> Scheduler.commit() -> append tokens, check stops

The runner is either a ``ModelRunner`` (the real model on the paged KV store) or a
``SimulatedRunner`` (no model: dummy tokens, a simulated clock advanced by a step-cost model),
so the same scheduler and the same loop serve text and run scheduling experiments. ``LLM``
(``llm.py``) wraps the engine in vLLM's offline API.

One step is a function of the engine, ``engine_step(engine) -> list[RequestOutput]`` (lab 08 writes its
own; ``engine_class(engine_step)`` is the engine that runs it). It uses only this surface:

    engine.scheduler.schedule() / .commit(out)   plan the step; book the computed positions after the run
    engine.begin_step(out) -> batch              the course's check and books of the plan; [] for an empty one
    engine.runner.run(batch) -> {seq_id: token}  run the model on the batch and sample each sampling sequence
    engine.sequences[seq_id]                     the ``Sequence``: ``append_token``, ``text``, ``stop_ids``,
                                                 ``stop_strings``, ``num_tokens``, ``max_tokens``
    engine.record_token(seq)                     once per appended token: its time, the token event
    engine.decoder(seq_id)                       the request's stream decoder: ``push(token) -> str``, ``flush()``
    engine.finish(seq, reason)                   finish for good ("stop", "length"): blocks freed, event, time
    engine.output(seq_id, new_ids, new_text)     a ``RequestOutput``; its ``text`` is what may be shown so far

The rest (the step's record in ``engine.steps``, the step event) is booked around the step by
``LLMEngine.step``, which runs the course's ``engine_step`` through the same surface.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from infra_lib.model.generation import prompt_ids
from infra_lib.model.model import Llama
from infra_lib.model.sampling import SamplingParams
from infra_lib.serving.block_table import blocks_needed
from infra_lib.serving.events import EventLog
from infra_lib.serving.kv_store import PagedKVStore
from infra_lib.serving.model_runner import ModelRunner
from infra_lib.serving.scheduler import Scheduler
from infra_lib.serving.scheduler_output import SchedulerConfig, SchedulerOutput
from infra_lib.serving.sequence import FINISH_REASONS, RequestMetrics, Sequence, SequenceStatus

_ENDINGS = ("stop", "length")  # the reasons a step finishes a request for (an abort is the caller's)


class WallClock:
    """Seconds since the engine started, on the wall."""

    def __init__(self):
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start

    def advance_to(self, t: float) -> None:
        """Wait until ``t`` (a simulated clock jumps instead)."""
        time.sleep(max(0.0, t - self.now()))


@dataclass
class RequestOutput:
    """A request's state after a step: everything so far, and what this step added (for streaming).

    ``text`` is the text that may be shown so far: while the request runs, its last characters are held
    back as long as a stop string could still begin in them (the longest stop string's length minus one),
    so that the ``new_text`` deltas always join to ``text``, and to the final text once it finished."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""


@dataclass(frozen=True)
class StepRecord:
    """One engine step on the engine's clock, for timelines: when it ran and what it scheduled."""

    start: float
    end: float
    output: SchedulerOutput


class PlanRefused(RuntimeError):
    """The engine will not run the scheduler's plan: it is empty while sequences are unfinished (no
    progress), or it schedules a sequence it preempts. ``output`` is the plan."""

    def __init__(self, message: str, output):
        super().__init__(message)
        self.output = output


class LLMEngine:
    """Continuous batching: a scheduler, a runner and the requests' bookkeeping.

    Args:
        runner: ``ModelRunner`` or ``SimulatedRunner`` (anything with ``run(batch) -> {seq_id: token}``
            and ``max_position``).
        config: the scheduler's limits and pool size (ignored when ``scheduler`` is given).
        tokenizer: turns text prompts into ids and tokens into text (None: token ids only).
        scheduler: a ready scheduler (a lab's own); its pool must match the runner's store.
        clock: the engine's time (default: the runner's simulated clock if it has one, else the wall).
        events: the log the engine writes request lifecycle events to (default: a new unbounded one).
    """

    def __init__(
        self,
        runner,
        config: SchedulerConfig = SchedulerConfig(),
        tokenizer=None,
        scheduler: Scheduler | None = None,
        clock=None,
        events: EventLog | None = None,
    ):
        self.runner, self.tokenizer = runner, tokenizer
        self.scheduler = scheduler if scheduler is not None else Scheduler(config)
        self.config = self.scheduler.config
        self.clock = clock or getattr(runner, "clock", None) or WallClock()
        self.sequences: dict[int, Sequence] = {}
        self.steps: list[StepRecord] = []
        self._decoders: dict[int, object] = {}
        self.events = events if events is not None else EventLog()
        self._open: tuple[float, SchedulerOutput] | None = None  # the step in progress: its start and plan
        self._ran_at: float | None = None  # when its run ended (taken at its first token or finish)
        self._begun = False

    @classmethod
    def from_model(
        cls,
        model: Llama,
        tokenizer=None,
        config: SchedulerConfig = SchedulerConfig(),
        attention_backend: str = "torch",
        native: str | None = None,
        **kwargs,
    ) -> LLMEngine:
        """An engine on ``model`` with a paged KV store of ``config.num_blocks`` blocks; its attention
        runs in PyTorch (``"torch"``) or in the course's Triton kernels (``"triton"``). ``native``, a
        weight format (``"fp32"``, ``"bf16"``, ``"int8"``), runs the engine's small steps in C
        (``NativeModelRunner``; ``model`` must then be as loaded, on the CPU)."""
        weight = model.embed_tokens.weight
        store = PagedKVStore.for_model(model.config, config.num_blocks, config.block_size, weight.dtype, weight.device)
        if native is not None:
            from infra_lib.serving.native_runner import NativeModelRunner

            return cls(
                NativeModelRunner(model, store, native, attention_backend=attention_backend),
                config,
                tokenizer,
                **kwargs,
            )
        return cls(ModelRunner(model, store, attention_backend), config, tokenizer, **kwargs)

    # --- requests ----------------------------------------------------------------------------------

    def add_request(
        self,
        prompt,
        params: SamplingParams = SamplingParams(),
        *,
        stop: tuple[str, ...] = (),
        arrival_time: float | None = None,
    ) -> int:
        """Queue a request; returns its id.

        Args:
            prompt: token ids, or (with a tokenizer) a str or a list of chat messages.
            params: sampling and stopping; ``stop_ids`` None means the tokenizer's end-of-turn.
            stop: strings that end the output (the text is cut before the match).
            arrival_time: on the engine's clock (default: now).
        """
        if self.tokenizer is None and not (
            isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt)
        ):
            raise ValueError("without a tokenizer the engine takes prompts as lists of token ids")
        ids = prompt_ids(self.tokenizer, list(prompt) if isinstance(prompt, tuple) else prompt)
        seq_id = len(self.sequences)
        at = self.clock.now() if arrival_time is None else arrival_time
        seq = Sequence(seq_id, ids, params, self.config.block_size, arrival_index=seq_id, arrival_time=at)
        context = self.runner.max_position
        if len(ids) >= context:
            raise ValueError(f"request {seq_id}'s prompt has {len(ids)} tokens; the model's context is {context}")
        seq.max_tokens = min(seq.max_tokens, context)
        most_positions = seq.max_tokens - 1  # the last token is sampled, never computed
        if blocks_needed(most_positions, self.config.block_size) > self.config.num_blocks:
            raise ValueError(
                f"request {seq_id} may need {most_positions} KV positions, more than the pool's "
                f"{self.config.num_blocks} blocks of {self.config.block_size} hold: lower "
                "max_new_tokens or give the pool more blocks"
            )
        if not self.config.enable_chunked_prefill and most_positions > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {seq_id} may need to (re)compute {most_positions} tokens in one step but the "
                f"budget is {self.config.max_num_batched_tokens}: enable chunked prefill or raise it"
            )
        if params.stop_ids is None and self.tokenizer is not None:
            seq.stop_ids = frozenset((self.tokenizer.eos_id,))
        seq.stop_strings = tuple(stop)
        if self.tokenizer is not None:
            self._decoders[seq_id] = self.tokenizer.stream_decoder(skip_special=True)
        self.sequences[seq_id] = seq
        self.scheduler.add(seq)
        self.events.emit("arrived", at, seq_id, prompt_tokens=len(ids))
        return seq_id

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request now (its blocks are freed); None if it is unknown or already finished."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.is_finished:
            return None
        shown = self._shown(seq)
        self._finish(seq, "abort", self.clock.now())
        return self.output(request_id, [], seq.text[len(shown) :])  # the text held back is released

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def output(self, request_id: int, new_token_ids=(), new_text: str = "") -> RequestOutput:
        """Request ``request_id`` as a ``RequestOutput``, with ``new_token_ids`` and ``new_text`` as what the
        step added; its ``text`` is what may be shown so far (see ``RequestOutput``)."""
        seq = self.sequences.get(request_id)
        if seq is None:
            raise KeyError(f"no request {request_id}; the engine has {len(self.sequences)} (ids from 0)")
        return RequestOutput(
            seq.seq_id,
            list(seq.prompt_ids),
            list(seq.output_ids),
            self._shown(seq),
            seq.is_finished,
            seq.finish_reason,
            seq.metrics,
            [int(t) for t in new_token_ids],
            new_text,
        )

    @staticmethod
    def _shown(seq: Sequence) -> str:
        """The text of ``seq`` that may be shown: all of it once finished; before that, all but the last
        characters a stop string could still begin in."""
        if seq.is_finished or not seq.stop_strings:
            return seq.text
        held = max(len(stop) for stop in seq.stop_strings) - 1
        return seq.text[: max(0, len(seq.text) - held)]

    # --- the loop: the step, and the course's books around it ----------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and book one step; the outputs of requests that got a token (or finished).
        The course's ``engine_step``, with the step's record and event booked around it."""
        return self._booked(engine_step)

    def _booked(self, step) -> list[RequestOutput]:
        """Run ``step(self)``; then record the step it ran (``steps``) and emit its step event."""
        self._open, self._ran_at, self._begun = None, None, False
        planned = getattr(self.scheduler, "num_steps", None)
        outputs = step(self)
        if type(outputs) is not list or not all(isinstance(o, RequestOutput) for o in outputs):
            raise TypeError(
                f"the engine step must return a list of RequestOutput, got {type(outputs).__name__}"
                + (f" holding a {type(outputs[0]).__name__}" if isinstance(outputs, list) and outputs else "")
            )
        if not self._begun and getattr(self.scheduler, "num_steps", None) != planned:
            raise RuntimeError(
                "the engine step planned a step (scheduler.schedule()) but never handed the plan to "
                "engine.begin_step(out): the course could not check it or book its events"
            )
        if self._open is not None:
            start, out = self._open
            end = self._run_end()
            self._open = None
            self.steps.append(StepRecord(start, end, out))
            self.events.emit(
                "step",
                end,
                start=start,
                **self._queues(),
                batched_tokens=out.num_batched_tokens,
                prefill_tokens=out.num_prefill_tokens,
                decode_seqs=out.num_decode_seqs,
            )
        return outputs

    def begin_step(self, out: SchedulerOutput) -> list[tuple[Sequence, object]]:
        """The plan ``out`` is about to run: check it, book it, and return its batch.

        Returns ``[(Sequence, ScheduledSeq), ...]`` in plan order, for ``runner.run``; ``[]`` when the plan
        is empty (there is nothing to run). Books the preempted and admitted events and each sequence's
        first scheduled time, and notes the step's start.

        Raises:
            PlanRefused: the plan is empty while sequences are unfinished (no progress), or it schedules a
                sequence it also preempts (its blocks are gone).
        """
        self._begun = True
        if out.is_empty:
            if self.scheduler.has_unfinished():
                raise PlanRefused(
                    f"step {out.step} scheduled nothing with {len(self.scheduler.waiting)} waiting and "
                    f"{len(self.scheduler.running)} running: the scheduler made no progress "
                    f"({'; '.join(out.reasons) or 'no reason given'})",
                    out,
                )
            return []
        both = [s.seq_id for s in out.scheduled if s.seq_id in out.preempted]
        if both:  # a preempted sequence gave its blocks back: running it would write to blocks it lost
            raise PlanRefused(
                f"step {out.step} scheduled seq {both} and preempted it in the same step: the scheduler "
                "gave a plan that cannot run (the plan was not run)",
                out,
            )
        start = self.clock.now()
        self._open, self._ran_at = (start, out), None
        batch = [(self.sequences[s.seq_id], s) for s in out.scheduled]
        for seq_id in out.preempted:
            self.events.emit("preempted", start, seq_id)
        for seq_id in out.admitted:
            seq = self.sequences[seq_id]
            self.events.emit(
                "admitted",
                start,
                seq_id,
                cached_tokens=out.num_cached_tokens.get(seq_id, 0),
                prompt_tokens=seq.num_prompt_tokens,
                first=seq.metrics.first_scheduled_time is None,
            )
        for seq, _ in batch:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = start
        return batch

    def _run_end(self) -> float:
        """When the step in progress finished running: the clock at the first call after the run."""
        if self._ran_at is None:
            self._ran_at = self.clock.now()
        return self._ran_at

    def record_token(self, seq: Sequence) -> None:
        """Book the token just appended to ``seq`` (``seq.append_token``) in the step in progress: its time,
        the request's first-token time, the token event. Once per appended token."""
        if self._open is None:
            raise RuntimeError("record_token books a token of the step in progress: call begin_step(out) first")
        if len(seq.metrics.token_times) >= len(seq.output_ids):
            raise RuntimeError(
                f"seq {seq.seq_id} has {len(seq.output_ids)} output tokens and as many booked: record_token(seq) "
                "books a token appended with seq.append_token(token), once"
            )
        now = self._run_end()
        seq.metrics.token_times.append(now)
        self.events.emit("token", now, seq.seq_id, first=seq.metrics.first_token_time is None)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now

    def decoder(self, request_id: int):
        """The stream decoder of an unfinished request: ``push(token) -> str`` gives the text the token
        completes (nothing while a character's bytes are incomplete, nor for a special token), ``flush() -> str``
        the bytes held back, as text. Without a tokenizer, one that gives no text."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.is_finished:
            raise ValueError(f"request {request_id} is {'unknown' if seq is None else 'finished'}: it has no decoder")
        return self._decoders.get(request_id, _NO_TEXT)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish ``seq`` for good with ``reason`` ("stop" or "length"): out of its queue, its blocks back in
        the pool, its finish time and event. ``abort`` is the caller's way to stop a request."""
        if reason not in _ENDINGS:
            raise ValueError(f"a step finishes a request with reason 'stop' or 'length', got {reason!r}")
        if seq.is_finished:
            raise ValueError(f"seq {seq.seq_id} has already finished ({seq.finish_reason})")
        self._finish(seq, reason, self._run_end() if self._open is not None else self.clock.now())

    def _queues(self) -> dict:
        """The queues and the KV pool now (what the running, waiting and KV-usage gauges show)."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": 1 - self.scheduler.pool.num_free / self.config.num_blocks,
        }

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self.scheduler.finish(seq, reason)
        seq.metrics.finish_time = now
        self._decoders.pop(seq.seq_id, None)
        # the queues after the release: an abort between steps is followed by no step event, so the
        # gauges must not wait for one
        self.events.emit(
            "finished",
            now,
            seq.seq_id,
            reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            output_tokens=len(seq.output_ids),
            **self._queues(),
        )

    def check_invariants(self) -> None:
        """The scheduler's invariants, finished requests hold nothing, outputs within their limits."""
        self.scheduler.check_invariants()
        queued = {s.seq_id for s in self.scheduler.running} | {s.seq_id for s in self.scheduler.waiting}
        for seq in self.sequences.values():
            if seq.is_finished == (seq.seq_id in queued):
                raise AssertionError(f"{seq} is {'finished but queued' if seq.is_finished else 'in neither queue'}")
            if seq.is_finished and (seq.block_table.blocks or seq.finish_reason not in FINISH_REASONS):
                raise AssertionError(f"finished {seq} holds blocks or has finish reason {seq.finish_reason!r}")
            if seq.num_tokens > seq.max_tokens:
                raise AssertionError(f"{seq} outgrew its limit of {seq.max_tokens} tokens")
            if (seq.status is SequenceStatus.RUNNING) != (seq in self.scheduler.running):
                raise AssertionError(f"{seq} has status {seq.status.value} but the running queue says otherwise")


class _NoText:
    """The stream decoder of an engine without a tokenizer: no text."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


_NO_TEXT = _NoText()


def first_stop(text: str, stops, searched: int) -> int | None:
    """Where the earliest stop string in ``text`` begins, among those that end past ``searched`` (the
    length of the text already searched); None if none does."""
    found = [text.find(stop, max(0, searched - len(stop) + 1)) for stop in stops]
    found = [at for at in found if at >= 0]
    return min(found) if found else None


def engine_step(engine: LLMEngine) -> list[RequestOutput]:
    """One step of the engine (``LLMEngine.step``'s body): schedule, run the plan, append each sampled
    token, finish the requests that stop (a stop token, a stop string in the text, the length), and
    return the output of every request that got a token, with what the step added."""
    out = engine.scheduler.schedule()
    batch = engine.begin_step(out)
    if not batch:
        return []
    sampled = engine.runner.run(batch)
    engine.scheduler.commit(out)
    outputs = []
    for seq_id, token in sampled.items():
        seq = engine.sequences[seq_id]
        shown = engine.output(seq_id).text
        seq.append_token(token)
        engine.record_token(seq)
        decoder = engine.decoder(seq_id)
        searched = len(seq.text)
        seq.text += decoder.push(token)
        reason = "stop" if token in seq.stop_ids else "length" if seq.num_tokens >= seq.max_tokens else None
        if reason is not None:
            seq.text += decoder.flush()
        at = first_stop(seq.text, seq.stop_strings, searched)
        if at is not None:  # the text ends before the stop string
            seq.text, reason = seq.text[:at], "stop"
        if reason is not None:
            engine.finish(seq, reason)
        outputs.append(engine.output(seq_id, [token], engine.output(seq_id).text[len(shown) :]))
    return outputs


def engine_class(step) -> type[LLMEngine]:
    """``LLMEngine`` whose step is ``step(engine) -> list[RequestOutput]`` (lab 08's ``engine_step``), with
    the course's books around it as ``LLMEngine.step`` has them."""
    if not callable(step):
        raise TypeError(f"the engine step must be a function engine_step(engine), got a {type(step).__name__}")

    class StepEngine(LLMEngine):
        def step(self) -> list[RequestOutput]:
            return self._booked(step)

    StepEngine.__doc__ = f"LLMEngine whose step is {getattr(step, '__qualname__', step)!r}."
    return StepEngine
