"""The two processes of prefill/decode disaggregation, and the colocated engine they are measured against.

    run = serve_disaggregated(workload)              # rank 0 prefills, rank 1 decodes (run_workers, gloo)
    run = serve_colocated(model, workload)           # one engine does both, in this process
    run = serve_colocated_in_process(workload, 2)    # the same in a fresh process with 2 torch threads

Both replay the same ``WorkloadRequest`` trace (greedy, exactly ``output_len`` tokens each) on a clock whose
zero is the trace's start, and return a ``ServingRun``: each request's tokens and token times, the pools'
free counts at the end, and (disaggregated) what each KV transfer cost. The workers load the model
themselves (``load_default``: about a second from the cache of its weights) and warm it up before the
clock starts. The two workers share ``time.monotonic()``, one clock for the whole machine on Linux, so a
token's time on the decode worker and an arrival on the prefill worker are comparable.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from infra_lib.model.sampling import SamplingParams
from infra_lib.serving.disaggregated import (
    Handoff,
    adopt,
    install_kv,
    pack_kv,
    prefill_step,
    recv_handoff,
    send_done,
    send_handoff,
)
from infra_lib.serving.engine import LLMEngine, engine_class
from infra_lib.serving.scheduler_output import SchedulerConfig
from infra_lib.serving.workload import WorkloadRequest, replay
from infra_lib.training.launcher import run_workers

PREFILL_RANK, DECODE_RANK = 0, 1


class TraceClock:
    """Seconds since ``t0`` on ``time.monotonic()`` (negative before it): the engines' shared clock."""

    def __init__(self, t0: float):
        self.t0 = t0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def advance_to(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))


@dataclass
class ServedRequest:
    """One request of a run: its output tokens and when each existed (the run's clock, seconds)."""

    prompt_len: int
    token_ids: list[int]
    arrival_time: float
    token_times: list[float]
    finish_time: float

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_time

    @property
    def gaps(self) -> list[float]:
        """Inter-token latencies: the gaps between successive tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class ServingRun:
    """A run's requests (workload order), each pool's ``(free, total)`` blocks at the end, the most sequences
    one decode step ran, per request what its KV transfer cost (disaggregated runs only), and the ids of
    the processes that served it (none when it ran in the caller's)."""

    requests: list[ServedRequest]
    pools: dict[str, tuple[int, int]]
    max_decode_batch: int
    transfers: list[dict] = field(default_factory=list)
    worker_pids: list[int] = field(default_factory=list)


def warm_up(model) -> None:
    """One short request through a throwaway engine: the first forward's one-off costs happen here."""
    engine = LLMEngine.from_model(model, None, SchedulerConfig(num_blocks=8, block_size=16))
    engine.add_request(list(range(1, 20)), SamplingParams(max_new_tokens=3, stop_ids=()))
    while engine.has_unfinished():
        engine.step()


def _served(engine: LLMEngine, seq_id: int) -> ServedRequest:
    seq = engine.sequences[seq_id]
    m = seq.metrics
    return ServedRequest(
        seq.num_prompt_tokens, list(seq.output_ids), m.arrival_time, list(m.token_times), m.finish_time
    )


def _pool_end(engine: LLMEngine) -> tuple[int, int]:
    engine.check_invariants()
    return engine.scheduler.pool.num_free, engine.scheduler.pool.num_blocks


def _max_decode_batch(engine: LLMEngine) -> int:
    return max((step.output.num_decode_seqs for step in engine.steps), default=0)


# --- colocated: one engine does both phases ---------------------------------------------------------


def serve_colocated(model, workload: list[WorkloadRequest], config: SchedulerConfig = SchedulerConfig()) -> ServingRun:
    """Replay ``workload`` through one engine on ``model`` (continuous batching, chunked prefill)."""
    warm_up(model)
    engine = LLMEngine.from_model(model, None, config, clock=TraceClock(time.monotonic()))
    outputs = replay(engine, workload)
    requests = [_served(engine, o.request_id) for o in outputs]
    return ServingRun(requests, {"colocated": _pool_end(engine)}, _max_decode_batch(engine))


def _colocated_worker(rank: int, world_size: int, workload, config, threads: int) -> ServingRun:
    from infra_lib.model import load_default

    torch.set_num_threads(threads)
    run = serve_colocated(load_default().model, workload, config)
    run.worker_pids = [os.getpid()]
    return run


def serve_colocated_in_process(
    workload: list[WorkloadRequest], threads: int, config: SchedulerConfig = SchedulerConfig(), timeout_s: float = 600
) -> ServingRun:
    """``serve_colocated`` on the default model in a fresh process with ``threads`` torch threads."""
    return run_workers(_colocated_worker, 1, args=(workload, config, threads), timeout_s=timeout_s)[0]


# --- disaggregated: rank 0 prefills, rank 1 decodes --------------------------------------------------


def serve_disaggregated(
    workload: list[WorkloadRequest],
    prefill_config: SchedulerConfig = SchedulerConfig(),
    decode_config: SchedulerConfig = SchedulerConfig(),
    timeout_s: float = 600,
) -> ServingRun:
    """Replay ``workload`` on two processes (one torch thread each): rank 0 prefills each prompt and ships its
    KV, rank 1 installs it in its own pool and decodes. Both pools must have the same block size."""
    if prefill_config.block_size != decode_config.block_size:
        raise ValueError(
            f"the prefill pool's blocks hold {prefill_config.block_size} slots, the decode pool's "
            f"{decode_config.block_size}: a payload of whole blocks needs the same block size on both sides"
        )
    prefill, decode = run_workers(
        _disaggregated_worker, 2, args=(workload, prefill_config, decode_config), timeout_s=timeout_s
    )
    # the prefill engine numbered the requests in its order of arrival; map them back to the workload's
    order = prefill["request_ids"]
    requests = [decode["requests"][rid] for rid in order]
    transfers = [{**prefill["transfers"][rid], **decode["transfers"][rid]} for rid in order]
    pools = {"prefill": prefill["pool"], "decode": decode["pool"]}
    return ServingRun(requests, pools, decode["max_decode_batch"], transfers, [prefill["pid"], decode["pid"]])


def _disaggregated_worker(rank: int, world_size: int, workload, prefill_config, decode_config) -> dict:
    from infra_lib.model import load_default

    model = load_default().model
    warm_up(model)
    dist.barrier()  # both warm: start the trace's clock now, the same zero on both sides
    t0 = torch.tensor([time.monotonic() + 0.05], dtype=torch.float64)
    dist.broadcast(t0, PREFILL_RANK)
    clock = TraceClock(float(t0))
    if rank == PREFILL_RANK:
        return _prefill_worker(model, workload, prefill_config, clock)
    return _decode_worker(model, decode_config, clock)


def _prefill_worker(model, workload, config: SchedulerConfig, clock: TraceClock) -> dict:
    """Replay the trace through a prefill-only engine; ship each prompt's KV to the decode worker."""
    transfers: dict[int, dict] = {}

    def ship(engine: LLMEngine, seq) -> None:
        start = time.perf_counter()
        payload, metadata = pack_kv(engine.runner.store, seq.block_table.blocks, seq.num_computed_tokens)
        packed = time.perf_counter()
        handoff = Handoff(
            seq.seq_id,
            tuple(seq.prompt_ids),
            seq.output_ids[0],
            seq.params.max_new_tokens,
            seq.metrics.arrival_time,
            clock.now(),
        )
        send_handoff(handoff, payload, metadata, DECODE_RANK)
        transfers[seq.seq_id] = {
            "tokens": metadata.num_tokens,
            "blocks": metadata.num_blocks,
            "payload_bytes": payload.nbytes,
            "pack_s": packed - start,
            "send_s": time.perf_counter() - packed,
            "first_token_sampled": seq.metrics.first_token_time,
            "source_blocks": list(metadata.source_blocks),
        }

    engine = engine_class(partial(prefill_step, handoff=ship)).from_model(model, None, config, clock=clock)
    try:
        outputs = replay(engine, workload)
    finally:
        send_done(DECODE_RANK)
    request_ids = [o.request_id for o in outputs]
    return {"request_ids": request_ids, "transfers": transfers, "pool": _pool_end(engine), "pid": os.getpid()}


def _receive(inbox: queue.Queue, clock: TraceClock) -> None:
    """The decode worker's receiver thread: every handoff, with the time it arrived, into ``inbox``; then
    None (no more), or the exception that stopped it."""
    try:
        while (item := recv_handoff(PREFILL_RANK)) is not None:
            inbox.put((*item, clock.now()))
        inbox.put(None)
    except BaseException as exc:  # noqa: BLE001 - raised again by the decode loop
        inbox.put(exc)


def _decode_worker(model, config: SchedulerConfig, clock: TraceClock) -> dict:
    """Install each arriving request's KV in this worker's pool and decode them all with continuous batching.

    Transfers land on a receiver thread while the engine steps; between steps, every received request that
    fits (a free row of the batch, enough free blocks) is installed and joins the running batch."""
    engine = LLMEngine.from_model(model, None, config, clock=clock)
    pool, store = engine.scheduler.pool, engine.runner.store
    inbox: queue.Queue = queue.Queue()
    receiver = threading.Thread(target=_receive, args=(inbox, clock), daemon=True)
    receiver.start()
    pending: deque = deque()
    seq_ids: dict[int, int] = {}
    transfers: dict[int, dict] = {}
    receiving = True

    def take(item) -> None:
        nonlocal receiving
        if isinstance(item, BaseException):
            raise RuntimeError("the decode worker's receiver failed") from item
        if item is None:
            receiving = False
        else:
            pending.append(item)

    while True:
        while not inbox.empty():
            take(inbox.get())
        while (
            pending
            and len(engine.scheduler.running) < config.max_num_seqs
            and pool.can_allocate(pending[0][2].num_blocks)
        ):
            handoff, payload, metadata, received = pending.popleft()
            start = time.perf_counter()
            table = install_kv(store, pool, payload, metadata)
            installed = time.perf_counter()
            seq_ids[handoff.request_id] = adopt(engine, handoff, table)
            transfers[handoff.request_id] = {
                "wire_s": received - handoff.sent_time,
                "install_s": installed - start,
                "queued_s": clock.now() - received,
                "decode_blocks": table,
            }
        if engine.has_unfinished():
            engine.step()
        elif pending:
            handoff, _, metadata, _ = pending[0]
            raise RuntimeError(
                f"request {handoff.request_id} needs {metadata.num_blocks} blocks but the idle decode pool has "
                f"{pool.num_free}: give the decode worker more blocks"
            )
        elif not receiving:
            break
        else:
            take(inbox.get())  # idle: wait for the next transfer
    receiver.join()
    requests = {rid: _served(engine, seq_id) for rid, seq_id in seq_ids.items()}
    return {
        "requests": requests,
        "transfers": transfers,
        "pool": _pool_end(engine),
        "max_decode_batch": _max_decode_batch(engine),
        "pid": os.getpid(),
    }
