"""All-reduce by hand: the ring algorithm over point-to-point send and receive.

Every rank holds a tensor; afterwards every rank holds the element-wise sum. The ring splits
the tensor into W chunks and runs two phases of W - 1 steps, each rank sending one chunk to its
right neighbour and receiving one from its left:

    reduce-scatter: after step s, rank r holds the sum over s + 2 ranks of chunk (r - s - 1) mod W;
                    at the end rank r owns the full sum of chunk (r + 1) mod W
    all-gather:     the finished chunks travel once more around the ring

Each rank sends 2 (W - 1) / W of the tensor in total, whatever W is: the bandwidth term of the
ring does not grow with the number of ranks, which is why NCCL, gloo and MPI use it for large
tensors (its latency term, 2 (W - 1) messages, does grow).

``BackgroundAllReduce`` runs any of these all-reduces on a thread of its own, one tensor after the
other in the order given, so that a caller (``ddp.DDP``'s gradient hooks) starts one and goes on
computing while it travels: the overlap of communication with the backward pass.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist


class DistComm:
    """Point-to-point messages over the default ``torch.distributed`` group (gloo, NCCL, ...)."""

    def __init__(self):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.bytes_sent = 0

    def exchange(self, send: torch.Tensor, to: int, recv: torch.Tensor, source: int) -> None:
        """Send ``send`` to rank ``to`` and receive into ``recv`` from ``source``, both at once (non-blocking),
        so no rank waits for a neighbour that is waiting for it."""
        requests = [dist.isend(send.contiguous(), to), dist.irecv(recv, source)]
        for request in requests:
            request.wait()
        self.bytes_sent += send.nbytes


class ThreadGroup:
    """``world_size`` ranks simulated by threads of one process, exchanging tensors through queues:
    the same ``exchange`` as ``DistComm``, without processes (fast checks, byte counting)."""

    def __init__(self, world_size: int):
        import queue

        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        self.world_size = world_size
        self._queues = {(a, b): queue.Queue() for a in range(world_size) for b in range(world_size)}

    def comm(self, rank: int) -> "ThreadComm":
        return ThreadComm(self, rank)

    def run(self, fn, args_per_rank: list | None = None, timeout_s: float = 30.0) -> list:
        """``fn(comm, *args)`` on every rank in its own thread; results by rank. A rank that raises
        or does not finish in ``timeout_s`` (a missing send) raises here."""
        import threading

        args_per_rank = args_per_rank or [()] * self.world_size
        results, errors = [None] * self.world_size, {}

        def target(rank):
            try:
                results[rank] = fn(self.comm(rank), *args_per_rank[rank])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors[rank] = exc

        threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(self.world_size)]
        import time

        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s  # one deadline for the whole group
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if errors:
            rank = min(errors)
            raise RuntimeError(f"rank {rank} raised {type(errors[rank]).__name__}: {errors[rank]}") from errors[rank]
        if any(t.is_alive() for t in threads):
            raise TimeoutError(
                f"ranks {[r for r, t in enumerate(threads) if t.is_alive()]} did not finish in "
                f"{timeout_s} s: a receive is waiting for a message no rank sent"
            )
        return results


class ThreadComm:
    """One simulated rank of a ``ThreadGroup``."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.bytes_sent = 0

    def exchange(self, send: torch.Tensor, to: int, recv: torch.Tensor, source: int) -> None:
        import operator

        try:
            to, source = operator.index(to), operator.index(source)  # numpy and torch integers too
        except TypeError:
            raise TypeError(f"rank {self.rank}: peers must be integers, got {to!r} and {source!r}") from None
        for peer in (to, source):
            if not 0 <= peer < self.world_size:
                raise ValueError(
                    f"rank {self.rank}: peer {peer} is not a rank of a group of {self.world_size} "
                    f"(ranks 0..{self.world_size - 1})"
                )
        self.group._queues[(self.rank, to)].put(send.detach().clone())
        message = self.group._queues[(source, self.rank)].get(timeout=20)
        if message.shape != recv.shape:
            raise ValueError(
                f"rank {self.rank} received {list(message.shape)} from rank {source} into a buffer of "
                f"shape {list(recv.shape)}: both sides must use the same chunk"
            )
        recv.copy_(message)
        self.bytes_sent += send.nbytes


def ring_all_reduce(tensor: torch.Tensor, comm=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, with a ring; returns it.

    Args:
        tensor: this rank's tensor (any shape and size, also not divisible by the world size:
            chunks differ by one element, and some are empty when it has fewer elements than ranks).
        comm: ``DistComm()`` (the default: the ``torch.distributed`` group) or a ``ThreadComm``;
            anything with ``rank``, ``world_size`` and ``exchange(send, to, recv, source)``.
    """
    comm = comm if comm is not None else DistComm()
    world, rank = comm.world_size, comm.rank
    if world == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    chunks = list(torch.tensor_split(flat, world))
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):  # reduce-scatter
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv_i])
        comm.exchange(chunks[send_i], right, incoming, left)
        chunks[recv_i] += incoming
    for step in range(world - 1):  # all-gather
        send_i, recv_i = (rank + 1 - step) % world, (rank - step) % world
        comm.exchange(chunks[send_i], right, chunks[recv_i], left)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def ring_bytes_sent(tensor_bytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of a ``tensor_bytes`` tensor: 2 (W - 1) / W of it."""
    return 2 * (world_size - 1) / world_size * tensor_bytes


def all_reduce_worker(rank: int, world_size: int, shapes: list, seed: int, use_ring: bool = True) -> list:
    """A worker for ``run_workers``: all-reduce seeded tensors of ``shapes``; returns them as lists."""
    out = []
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(seed * 1000 + i * 10 + rank)
        t = torch.randn(*shape, generator=g)
        if use_ring:
            ring_all_reduce(t)
        else:
            dist.all_reduce(t)
        out.append(t.tolist())
    return out


def bandwidth_worker(rank: int, world_size: int, numels: list[int], repeats: int = 3) -> list[dict]:
    """A worker timing ring and ``dist.all_reduce`` on float32 tensors; returns per-size seconds (best of)."""
    import time

    rows = []
    for numel in numels:
        t = torch.ones(numel)
        row = {"numel": numel, "bytes": numel * 4}
        for name, fn in (("ring", ring_all_reduce), ("dist.all_reduce", dist.all_reduce)):
            best = float("inf")
            for _ in range(repeats):
                t.fill_(1.0)
                dist.barrier()
                start = time.perf_counter()
                fn(t)
                best = min(best, time.perf_counter() - start)
            row[name] = best
        rows.append(row)
    return rows


class AllReduceHandle:
    """One all-reduce started by ``BackgroundAllReduce``: ``wait()`` blocks until it is done."""

    def __init__(self, tensor: torch.Tensor, index: int):
        self.tensor, self.index = tensor, index
        self.error: BaseException | None = None
        self._done = threading.Event()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The reduced tensor, once the background thread has finished it; re-raises its error.

        Raises:
            TimeoutError: not done within ``timeout`` seconds (a rank that never started the same all-reduce).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"all-reduce number {self.index} ({self.tensor.numel()} elements) did not finish within {timeout} s: "
                "every rank must start the same all-reduces in the same order"
            )
        if self.error is not None:
            raise RuntimeError(
                f"all-reduce number {self.index} ({self.tensor.numel()} elements) failed: "
                f"{type(self.error).__name__}: {self.error}"
            ) from self.error
        return self.tensor


class BackgroundAllReduce:
    """An ``all_reduce_async`` for ``DDP``: a background thread of this rank runs ``all_reduce(tensor)``
    on each tensor it is given, first in, first out, while the caller goes on.

        run = BackgroundAllReduce(lambda t: ring_all_reduce(t, comm))
        handle = run(flat)   # returns at once
        ...                  # more backward
        handle.wait()        # flat now holds the sum over the ranks
        run.close()

    One thread per rank and a FIFO keep every rank's all-reduces in the same order, which a
    collective needs (rank 0's third all-reduce meets rank 1's third). ``log``, when given, gets one
    dict per event, ``{"event": "launch" | "done", "index", "numel", "t"}`` with ``t`` from ``clock``:
    the timeline that shows how much of the communication the backward pass hid.
    """

    def __init__(
        self,
        all_reduce: Callable[[torch.Tensor], object],
        log: list | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not callable(all_reduce):
            raise TypeError(f"all_reduce must be callable (tensor -> None), got a {type(all_reduce).__name__}")
        self.all_reduce, self.log, self.clock = all_reduce, log, clock
        self.launched = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="background-all-reduce", daemon=True)
        self._thread.start()

    def __call__(self, tensor: torch.Tensor) -> AllReduceHandle:
        """Queue ``tensor`` for an all-reduce in place; returns its handle at once."""
        if self._thread is None:
            raise RuntimeError("this BackgroundAllReduce was closed")
        handle = AllReduceHandle(tensor, self.launched)
        self.launched += 1
        self._note("launch", handle)
        self._queue.put(handle)
        return handle

    def _note(self, event: str, handle: AllReduceHandle) -> None:
        if self.log is not None:
            self.log.append({"event": event, "index": handle.index, "numel": handle.tensor.numel(), "t": self.clock()})

    def _serve(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            try:
                self.all_reduce(handle.tensor)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on this handle
                handle.error = exc
            self._note("done", handle)
            handle._done.set()

    def close(self, timeout: float = 10.0) -> None:
        """Finish what was queued, then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> "BackgroundAllReduce":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dist_all_reduce_async(tensor: torch.Tensor):
    """gloo's (or NCCL's) own all-reduce, started in the background: the work handle has ``wait()``."""
    return dist.all_reduce(tensor, async_op=True)
