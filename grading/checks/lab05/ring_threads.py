"""A learner's ``ring_all_reduce`` run on a ``ThreadGroup``: every rank a thread exchanging tensors through queues,
its tensor, what it returned and the bytes and messages it sent recorded. A rank that raises, or waits for a
message no rank sent, stops the case with a time-out that names the ranks; after a case that failed the rest are
skipped, so that a check stays short."""

from __future__ import annotations

import threading

RANK_TIMEOUT_S = 2.0  # per rank: the ring on these small tensors takes milliseconds
SENDS = "\n  elements each rank sent/received, exchange by exchange: "  # heads the sizes a failed case lists


def rank_tensor(case: dict, rank: int):
    """The tensor ``rank`` starts with in a ring case: seeded values in the case's dtype and layout."""
    import torch

    shape, layout = list(case["shape"]), case["layout"]
    base_shape = [shape[0], 2 * shape[1]] if layout == "strided" else shape[::-1] if layout != "contiguous" else shape
    gen = torch.Generator().manual_seed(case["seed"] * 16 + rank)
    if case["dtype"] == "int64":
        base = torch.randint(-50, 50, base_shape, generator=gen, dtype=torch.int64)
    else:
        base = torch.randn(base_shape, generator=gen, dtype=getattr(torch, case["dtype"]))
    if layout == "transposed":
        return base.t()
    if layout == "strided":
        return base[:, ::2]
    if layout == "permuted":
        return base.permute(2, 1, 0)
    return base


class _CountingComm:
    """A rank's communicator as the learner sees it, counting the messages it sends."""

    def __init__(self, comm):
        self._comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.messages = 0
        self.peers: set[tuple] = set()
        self.waiting = False  # inside exchange, for a message
        self.last: tuple | None = None  # (to, source) of the latest exchange
        self.done = False
        self.thread: threading.Thread | None = None
        self.sizes: list[str] = []  # "sent/received" elements, exchange by exchange

    @property
    def bytes_sent(self) -> int:
        return self._comm.bytes_sent

    def exchange(self, send, to, recv, source) -> None:
        """Send ``send`` to rank ``to`` and receive into ``recv`` from rank ``source``, both at once."""
        self.messages += 1
        self.sizes.append(f"{_numel(send)}/{_numel(recv)}")
        self.peers.add((to, source))
        self.waiting, self.last = True, (to, source)
        self._comm.exchange(send, to, recv, source)
        self.waiting = False


def _numel(tensor) -> int:
    try:
        return int(tensor.numel())
    except Exception:  # not a tensor: the exchange itself reports it
        return -1


def _sends_line(comms: dict) -> str:
    """Every rank's exchanges so far, as the sizes it sent and received into: the comparison reads the order."""
    return SENDS + "; ".join(f"rank {r} [{' '.join(c.sizes[:16])}]" for r, c in sorted(comms.items()))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]} was" if len(ranks) == 1 else f"ranks {ranks} were"


class RankStopped(BaseException):
    """Raised inside a rank's thread that is still running after its group gave up on it."""


def _stop_threads(threads: list) -> None:
    """Stop rank threads a failed case left running their own code (a loop that never ends would take the
    CPU from every later check): an exception is raised in each at its next Python instruction.

    Only for threads that run Python code: an exception pending for a thread blocked in a C call (a
    receive) slows every other thread of the process down while a profiler, such as the grader's call
    monitor, is active, until that thread wakes up.
    """
    import ctypes

    stopping = [t for t in threads if t.is_alive() and t.ident is not None]
    for thread in stopping:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RankStopped))
    for thread in stopping:
        thread.join(1.0)


def _run_ring_case(ring, case: dict) -> list:
    """One case on a ThreadGroup: per rank, the input tensor's values afterwards, what came back, the traffic."""
    import torch

    from infra_lib.training.collectives import ThreadGroup

    comms = {}

    def on_rank(comm, tensor):
        counting = comms[comm.rank] = _CountingComm(comm)
        counting.thread = threading.current_thread()
        out = ring(tensor, counting)
        counting.done = True
        if out is tensor:
            returned = "the input tensor"
        elif isinstance(out, torch.Tensor):
            returned = {"values": out.detach().tolist(), "dtype": str(out.dtype), "shape": list(out.shape)}
        else:
            returned = f"a {type(out).__name__}"
        peers = sorted([to, source] for to, source in counting.peers if type(to) is int and type(source) is int)
        return {
            "values": tensor.tolist(),
            "returned": returned,
            "bytes": int(comm.bytes_sent),
            "messages": counting.messages,
            "peers": peers,
        }

    tensors = [rank_tensor(case, rank) for rank in range(case["world"])]
    try:
        return ["value", ThreadGroup(case["world"]).run(on_rank, [(t,) for t in tensors], timeout_s=RANK_TIMEOUT_S)]
    except TimeoutError:
        waiting = [r for r, c in sorted(comms.items()) if not c.done and c.waiting]
        running = [r for r, c in sorted(comms.items()) if not c.done and not c.waiting]
        if running:
            text = (
                f"TimeoutError: {_ranks(running)} still running your code after {RANK_TIMEOUT_S:g} s, outside "
                "exchange (a loop that never ends?)"
            )
            return ["raised", text]
        calls = "; ".join(
            f"rank {r} sent to {comms[r].last[0]!r} and waits for {comms[r].last[1]!r} "
            f"(its exchange number {comms[r].messages})"
            for r in waiting
        )
        text = (
            f"TimeoutError: {_ranks(waiting)} waiting in exchange after {RANK_TIMEOUT_S:g} s for a message no "
            f"rank sent: {calls}"
        )
        return ["raised", text[:400] + _sends_line(comms)]
    except RuntimeError as exc:  # a rank raised: the group names it
        if isinstance(exc.__cause__, (NotImplementedError, MemoryError)):
            raise exc.__cause__ from None
        return ["raised", f"{exc}"[:400] + _sends_line(comms)]
    finally:  # a rank waiting in exchange ends with its receive's own time-out; one running its own code may not
        _stop_threads([c.thread for c in comms.values() if not c.done and not c.waiting])


def drive_ring(ring, cases: list[dict]) -> list:
    """Each case on a ThreadGroup, in turn; after a case that raised, the rest are skipped."""
    if not callable(ring):
        raise TypeError(f"check(...) needs your ring_all_reduce function, got a {type(ring).__name__}")
    results = []
    for case in cases:
        if results and results[-1][0] in ("raised", "skipped"):
            results.append(["skipped", "an earlier case failed"])  # a hung ring costs seconds: stop at the first
            continue
        results.append(_run_ring_case(ring, case))
    return results
