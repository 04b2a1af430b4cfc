"""Lab 05 task 3: ring_all_reduce over point-to-point ``comm.exchange``, run on a ``ThreadGroup`` (every rank
a thread, exchanging tensors through queues): the sum in every rank's tensor, in place, and the bytes each
rank sent. A rank that raises, or waits for a message no rank sent, stops the case with a time-out that
names the ranks; the remaining cases are skipped so that a check stays short."""

from __future__ import annotations

import math
import random
import threading

from grading.checks.common import reference, unwrap
from grading.registry import Check, Mismatch, register

TASK = "lab05 task 3: ring_all_reduce"
RANK_TIMEOUT_S = 2.0  # per rank: the ring on these small tensors takes milliseconds


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _ring_case(
    rng: random.Random, world: int, shape: list[int], dtype: str = "float32", layout: str = "contiguous"
) -> dict:
    return {"world": world, "shape": shape, "dtype": dtype, "layout": layout, "seed": rng.randrange(10**6)}


def _divisible_shape(rng: random.Random, world: int, two_d: bool = False, large: bool = False) -> list[int]:
    if two_d:
        return [world * rng.randint(1, 4), rng.randint(2, 9)]
    return [world * rng.randint(200, 1200) if large else world * rng.randint(2, 40)]


def _ring_sum_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 2, _divisible_shape(rng, 2)),
        _ring_case(rng, 3, _divisible_shape(rng, 3)),
        _ring_case(rng, 4, _divisible_shape(rng, 4)),
        _ring_case(rng, 4, _divisible_shape(rng, 4, two_d=True)),
    ]


def _ring_sum_more_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 5, _divisible_shape(rng, 5)),
        _ring_case(rng, 6, _divisible_shape(rng, 6, large=True)),
        _ring_case(rng, 8, _divisible_shape(rng, 8)),
        _ring_case(rng, 3, _divisible_shape(rng, 3, two_d=True)),
        _ring_case(rng, 2, _divisible_shape(rng, 2, large=True)),
    ]


def _ring_traffic_cases(rng: random.Random) -> list[dict]:
    return [_ring_case(rng, w, [w * rng.randint(16, 64)]) for w in (2, 3, 4)]


def _ring_traffic_more_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 5, _divisible_shape(rng, 5, large=True)),
        _ring_case(rng, 8, _divisible_shape(rng, 8)),
        _ring_case(rng, 4, [4 * rng.randint(8, 32)], dtype="float64"),
        _ring_case(rng, 6, _divisible_shape(rng, 6, two_d=True)),
    ]


def _uneven(rng: random.Random, world: int) -> int:
    n = rng.randint(world + 1, 12 * world)
    return n + 1 if n % world == 0 else n


def _ring_any_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 3, [_uneven(rng, 3)]),  # not divisible: chunks differ by one element
        _ring_case(rng, 4, [_uneven(rng, 4)]),
        _ring_case(rng, 3, [2]),  # fewer elements than ranks: one chunk is empty
        _ring_case(rng, 4, [1]),
        _ring_case(rng, 4, [3, 5]),  # 2-D, 15 elements on 4 ranks
        _ring_case(rng, 3, [rng.randint(4, 7), rng.randint(2, 5)], layout="transposed"),  # non-contiguous
        _ring_case(rng, 2, [rng.randint(5, 30)], dtype="float64"),
        _ring_case(rng, 3, [_uneven(rng, 3)], dtype="float64"),
    ]


def _ring_edge_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 1, [rng.randint(3, 9)]),  # one rank: nothing to send
        _ring_case(rng, 5, [3]),
        _ring_case(rng, 5, [_uneven(rng, 5)]),
        _ring_case(rng, 3, [0]),  # empty
        _ring_case(rng, 3, [_uneven(rng, 3)], dtype="int64"),
        _ring_case(rng, 4, [3, rng.randint(3, 6)], layout="strided"),
        _ring_case(rng, 2, [2, 3, 4], layout="permuted"),
        _ring_case(rng, 5, [rng.randint(3, 6), 7], dtype="float64", layout="transposed"),
    ]


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


def _describe_ring(case: dict) -> str:
    shape, layout = case["shape"], case["layout"]
    made = {
        "contiguous": "",
        "transposed": f", non-contiguous: x.t() of a {shape[::-1]} tensor",
        "strided": f", non-contiguous: x[:, ::2] of a {shape[:1] + [2 * n for n in shape[1:]]} tensor",
        "permuted": f", non-contiguous: x.permute(2, 1, 0) of a {shape[::-1]} tensor",
    }[layout]
    numel = math.prod(shape)
    return (
        f"world size {case['world']}, each rank a torch.{case['dtype']} tensor of shape {shape} "
        f"({_count(numel, 'element')}{made})"
    )


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


_SENDS = "\n  elements each rank sent/received, exchange by exchange: "


def _numel(tensor) -> int:
    try:
        return int(tensor.numel())
    except Exception:  # not a tensor: the exchange itself reports it
        return -1


def _sends_line(comms: dict) -> str:
    """Every rank's exchanges so far, as the sizes it sent and received into: the comparison reads the order."""
    return _SENDS + "; ".join(f"rank {r} [{' '.join(c.sizes[:16])}]" for r, c in sorted(comms.items()))


def _ring_order(numel: int, world: int, rank: int) -> list[str]:
    """ "sent/received" elements at each of a ring rank's 2 (W - 1) exchanges (chunks from an even split)."""
    sizes = [numel // world + (c < numel % world) for c in range(world)]
    scatter = [(sizes[(rank - step) % world], sizes[(rank - step - 1) % world]) for step in range(world - 1)]
    gather = [(sizes[(rank + 1 - step) % world], sizes[(rank - step) % world]) for step in range(world - 1)]
    return [f"{a}/{b}" for a, b in scatter + gather]


def _skipped_empty(done: list[str], order: list[str]) -> bool:
    """Whether ``done`` follows the ring's ``order`` with some exchanges of an empty chunk left out."""
    i, skipped = 0, False
    for exchange in done:
        while i < len(order) and order[i] != exchange and "0" in order[i].split("/"):
            i, skipped = i + 1, True
        if i == len(order) or order[i] != exchange:
            return False
        i += 1
    return skipped


def _skipped_note(text: str, case: dict) -> str:
    """The note for a rank that left out the exchange of an empty chunk: the count of exchanges is wrong."""
    import re

    if _SENDS not in text:
        return ""
    numel, world = math.prod(case["shape"]), case["world"]
    for rank, listed in re.findall(r"rank (\d+) \[([-\d/ ]*)\]", text.split(_SENDS, 1)[1]):
        done = listed.split()
        order = _ring_order(numel, world, int(rank))
        if _skipped_empty(done, order):
            return (
                f"\n  rank {rank} left out the exchange of an empty chunk: its exchanges sent/received "
                f"[{' '.join(done)}] elements where the ring's are [{' '.join(order)}]. The chunk indices are "
                "right; the number of exchanges is not. "
                f"Every rank calls exchange exactly 2 (W - 1) = {2 * (world - 1)} times, also when the chunk it "
                "sends or receives is empty: an empty tensor is still a message, its neighbour's receive is "
                "waiting for it, and one left out shifts every later message by one"
            )
    return ""


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


def _tolerance(dtype: str) -> tuple[float, float]:
    """(rtol, atol) between sums added in different orders."""
    return {"float64": (1e-10, 1e-12), "int64": (0.0, 0.0)}.get(dtype, (1e-5, 1e-5))


def _raised_note(text: str, case: dict) -> str:
    numel, world = math.prod(case["shape"]), case["world"]
    skipped = _skipped_note(text, case)
    if skipped:
        return skipped
    if "waiting in exchange" in text:
        return (
            "\n  a rank waits in exchange for a message that no rank sent it. Every rank must call exchange the "
            "same number of times (2 (W - 1)), each time sending to its right neighbour (rank + 1) % W and "
            "receiving from its left neighbour (rank - 1) % W"
        )
    if "view size is not compatible" in text:
        return (
            "\n  tensor.view(-1) needs a contiguous tensor: use tensor.reshape(-1) (a copy when the tensor is not "
            "contiguous) and copy the result back into the tensor at the end"
        )
    if "into a buffer of shape" in text:
        return (
            "\n  the chunk a rank receives into must have the size of the chunk its neighbour sends in the same "
            "step: check which chunk index each rank sends and receives at each step"
        )
    if "is not a rank of a group" in text:
        return "\n  peers are 0 .. W - 1: take the neighbours modulo W, (rank + 1) % W and (rank - 1) % W"
    if "IndexError" in text and numel % world:
        return (
            "\n  with fewer elements than ranks, or a size W does not divide, torch.chunk and ceil-sized chunks "
            "give fewer than W chunks: torch.tensor_split(flat, W) (or your shard_bounds) always gives W, some "
            "empty"
        )
    if "can't be cast to the desired output type" in text:
        return "\n  make receive buffers with the tensor's dtype, torch.empty_like(chunk): torch.empty(n) is float32"
    return ""


def _element_note(got: float, want: float, values: list[float]) -> str:
    """What one wrong element holds, when it is the sum over some of the ranks, or the sum plus some again."""
    world = len(values)
    scale = max(1.0, sum(abs(v) for v in values))
    for mask in range(1, 2**world):
        ranks = [r for r in range(world) if mask >> r & 1]
        part = sum(values[r] for r in ranks)
        which = f"rank {ranks[0]}'s value" if len(ranks) == 1 else f"the values of ranks {ranks}"
        if abs(want + part - got) <= 1e-4 * scale:
            return (
                f"; that element holds the sum plus {which} again: added twice. The all-gather copies the "
                "finished chunks over yours (receive straight into the chunk); only the reduce-scatter adds"
            )
        if mask == 2**world - 1 or abs(part - got) > 1e-4 * scale:
            continue
        if len(ranks) == 1:
            return (
                f"; that element holds only {which}: nothing was added into it. Either the reduce-scatter "
                "replaced chunks instead of adding to them (receiving straight into a chunk replaces it) or ran "
                f"fewer than W - 1 = {world - 1} steps, or the all-gather passed on chunks that were not "
                "finished yet (at every all-gather step a rank sends the finished chunk it holds or has just "
                "received): check which chunk each step sends and receives, in both phases"
            )
        return (
            f"; that element holds the sum over ranks {ranks} only, of {world}: each chunk needs W - 1 = "
            f"{world - 1} reduce-scatter steps, each adding what the left neighbour sent into the chunk it sends "
            "on at the next step"
        )
    return ""


def _values_problem(case: dict, got_ranks: list, want_ranks: list) -> Mismatch | None:
    """The first rank whose tensor does not hold the sum, with the mistake named where it can be."""
    import numpy as np

    from infra_lib.training.zero import shard_bounds  # the grader's side: not the learner's code

    world, where = case["world"], _describe_ring(case)
    rtol, atol = _tolerance(case["dtype"])
    want = np.asarray(want_ranks[0]["values"], dtype=np.float64)
    originals = [rank_tensor(case, r).double().numpy() for r in range(world)]
    copied = (
        (
            "; it is not contiguous, so reshape(-1) gave you a copy: copy the result back with "
            "tensor.copy_(flat.view_as(tensor))"
        )
        if case["layout"] != "contiguous"
        else ""
    )
    for rank, rank_data in enumerate(got_ranks):
        try:
            got = np.asarray(rank_data["values"], dtype=np.float64)
        except (TypeError, ValueError):
            return Mismatch("the check recorded a malformed tensor", f"on {where}: rank {rank}")
        if got.shape == want.shape and np.allclose(got, want, rtol=rtol, atol=atol):
            continue
        returned = rank_data["returned"]
        if type(returned) is dict:
            back = np.asarray(returned["values"], dtype=np.float64)
            if back.shape == want.shape and np.allclose(back, want, rtol=rtol, atol=atol):
                return Mismatch(
                    "ring_all_reduce returned the sum but left the input tensor unchanged: all-reduce "
                    "works in place, like dist.all_reduce",
                    f"on {where}: rank {rank}'s input tensor does not hold the sum{copied}",
                )
        if np.array_equal(got, originals[rank]) and want.size:
            return Mismatch(
                "the input tensor still holds its own values after ring_all_reduce",
                f"on {where}: rank {rank}'s tensor is unchanged"
                + (copied or "; write the sum into it (work on a view of it, or copy the result back)"),
            )
        if got.shape != want.shape:
            return Mismatch(
                "the tensor changed shape",
                f"on {where}: rank {rank}: expected shape {list(want.shape)}, got {list(got.shape)}",
            )
        if world > 1 and want.size and np.allclose(got, want / world, rtol=1e-5, atol=1e-6):
            return Mismatch(
                "ring_all_reduce averaged instead of summing",
                f"on {where}: rank {rank} holds the sum divided by {world}; all-reduce sums (data "
                "parallelism divides by W afterwards, outside the collective)",
            )
        flat_got, flat_want = got.reshape(-1), want.reshape(-1)
        bad = ~np.isclose(flat_got, flat_want, rtol=rtol, atol=atol)
        first = int(np.argmax(bad))
        index = [int(i) for i in np.unravel_index(first, want.shape)]
        note, digits = "", 12 if case["dtype"] == "float64" else 6
        chunks = [shard_bounds(want.size, world, c) for c in range(world)]
        finished = [(s, e) for s, e in chunks if e > s and (~bad)[s:e].all() and (~bad).sum() == e - s]
        values = [float(o.reshape(-1)[first]) for o in originals]
        element = _element_note(float(flat_got[first]), float(flat_want[first]), values) if world > 1 else ""
        if case["dtype"] == "float64" and np.allclose(got, want, rtol=1e-5, atol=1e-5):
            note = (
                "; the values are right to float32 precision only: make receive buffers with the tensor's "
                "dtype, torch.empty_like(chunk) (torch.empty(n) is float32)"
            )
        elif finished and "added twice" not in element:
            start, end = finished[0]
            note = (
                f"; rank {rank} holds the sum only in elements {start}..{end - 1}, one chunk: that is where the "
                f"reduce-scatter ends. The all-gather must then pass the finished chunks around the ring "
                f"(W - 1 = {world - 1} more steps) so that every rank has all of them"
            )
        else:
            note = element
        own = ", ".join(f"{o.reshape(-1)[first]:.4g}" for o in originals)
        return Mismatch(
            "ring_all_reduce did not leave the sum over the ranks in every rank's tensor",
            f"on {where}: rank {rank}: {int(bad.sum())} of {bad.size} elements differ; at index {index} "
            f"expected {flat_want[first]:.{digits}g}, got {flat_got[first]:.{digits}g} (the ranks' own "
            f"values there: {own}){note}",
        )
    for rank, rank_data in enumerate(got_ranks):
        returned = rank_data["returned"]
        if returned == "the input tensor":
            continue
        if type(returned) is not dict:
            return Mismatch(
                "ring_all_reduce must return the tensor it reduced",
                f"on {where}: rank {rank} returned {returned} (end with `return tensor`)",
            )
        back = np.asarray(returned["values"], dtype=np.float64)
        dtype = f"torch.{case['dtype']}"
        if returned["dtype"] != dtype or back.shape != want.shape or not np.allclose(back, want, rtol=rtol, atol=atol):
            return Mismatch(
                "ring_all_reduce returned a tensor other than the sum",
                f"on {where}: rank {rank}'s tensor holds the sum, but it returned a {returned['dtype']} "
                f"tensor of shape {returned['shape']} with other values (expected {dtype}, "
                f"{list(want.shape)}): end with `return tensor`",
            )
    return None


def _ring_results(got, expected, cases):
    """Per case: (case, the learner's per-rank data, the reference's) or a Mismatch for what went wrong first."""
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    rows = []
    for case, g, e in zip(cases, got, expected):
        kind, value = unwrap(g)
        where = _describe_ring(case)
        if kind == "raised":
            if "outside exchange" in str(value):
                return Mismatch(
                    "ring_all_reduce did not finish: a rank kept running its own code", f"on {where}: {value}"
                )
            if "waiting in exchange" in str(value):
                return Mismatch(
                    "ring_all_reduce did not finish: a rank waited for a message that never came",
                    f"on {where}: {value}{_raised_note(str(value), case)}",
                )
            return Mismatch(
                "ring_all_reduce raised an exception", f"on {where}: {value}{_raised_note(str(value), case)}"
            )
        if kind != "value" or type(value) is not list or len(value) != case["world"]:
            return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
        rows.append((case, value, e[1]))
    return rows


def _compare_ring_sum(got, expected, cases) -> Mismatch | None:
    rows = _ring_results(got, expected, cases)
    if isinstance(rows, Mismatch):
        return rows
    for case, got_ranks, want_ranks in rows:
        problem = _values_problem(case, got_ranks, want_ranks)
        if problem:
            return problem
    return None


def _compare_ring_traffic(got, expected, cases) -> Mismatch | None:
    rows = _ring_results(got, expected, cases)
    if isinstance(rows, Mismatch):
        return rows
    for case, got_ranks, want_ranks in rows:
        problem = _values_problem(case, got_ranks, want_ranks)
        if problem:
            return Mismatch("the traffic is measured on a correct all-reduce: " + problem.what, problem.detail)
        world, where = case["world"], _describe_ring(case)
        itemsize = 8 if case["dtype"] in ("float64", "int64") else 4
        tensor_bytes = math.prod(case["shape"]) * itemsize
        for rank, (g, e) in enumerate(zip(got_ranks, want_ranks)):
            if g["bytes"] == e["bytes"]:
                continue
            sent, share = g["bytes"], 2 * (world - 1) / world
            chunk = tensor_bytes // world
            note = ""
            if sent == 0:
                note = (
                    "; you sent nothing: the ranks shared memory instead of messages, which only threads can do. "
                    "In a process group every rank is its own process (on its own GPU): only exchange moves data"
                )
            elif sent == (world - 1) * tensor_bytes:
                note = (
                    "; that is the whole tensor in each of W - 1 steps: send one chunk (1 / W of the tensor) per "
                    "step, in a reduce-scatter and then an all-gather"
                )
            elif sent % tensor_bytes == 0:
                note = "; you sent whole tensors: a ring sends one chunk (1 / W of the tensor) per message"
            elif sent == (world - 1) * chunk:
                note = "; that is only the reduce-scatter: the all-gather sends W - 1 chunks more"
            peers = g.get("peers") or []
            if any(pair != [(rank + 1) % world, (rank - 1) % world] for pair in peers):
                note += (
                    f"; rank {rank} exchanged with (to, from) {[tuple(p) for p in peers]}: in a ring it sends to "
                    f"{(rank + 1) % world} and receives from {(rank - 1) % world} only"
                )
            return Mismatch(
                "a rank sent a different number of bytes than a ring all-reduce does",
                f"on {where}: rank {rank} sent {sent} bytes in {_count(g['messages'], 'message')} "
                f"({sent / tensor_bytes:.3g} x the tensor's {tensor_bytes} bytes); a ring sends "
                f"2 (W - 1) / W = {share:.3g} x the tensor: {e['bytes']} bytes in 2 (W - 1) = "
                f"{2 * (world - 1)} messages of one {chunk}-byte chunk each{note}",
            )
    return None


_RING_HINT = (
    "a ring all-reduce is a reduce-scatter, in which each chunk travels the ring collecting one more "
    "rank's contribution per step (received partial sums are added to the rank's own copy), then an "
    "all-gather, in which the finished chunks travel the ring once more and replace the stale copies "
    "(nothing is added). The sum belongs in the tensor itself, in place, which is also what is returned; "
    "see chapter 05, section “4 · Collectives: all-reduce, reduce-scatter, all-gather”."
)


def ring_parts() -> dict:
    """The fields every ring check shares: the task, the reference ring and the driver."""
    return {
        "task": TASK,
        "reference": reference("infra_lib.training.collectives", "ring_all_reduce"),
        "drive": drive_ring,
    }


register(
    Check(
        check_id="lab05.ring_sum",
        make_inputs=_ring_sum_cases,
        compare=_compare_ring_sum,
        hint=_RING_HINT,
        **ring_parts(),
    )
)

register(
    Check(
        check_id="lab05.ring_sum_more",
        make_inputs=_ring_sum_more_cases,
        compare=_compare_ring_sum,
        hint=_RING_HINT + " Up to 8 ranks, tens of thousands of elements.",
        **ring_parts(),
    )
)

register(
    Check(
        check_id="lab05.ring_traffic",
        make_inputs=_ring_traffic_cases,
        compare=_compare_ring_traffic,
        hint="every message in a ring carries one chunk, 1 / W of the tensor, so each rank sends 2 (W - 1) / W of the "
        "tensor in all, whatever W is; ranks share nothing but what exchange carries. Passing the whole tensor around "
        "the ring also gives the sum, at W - 1 times the traffic (chapter 05, section “4 · Collectives: all-reduce, "
        "reduce-scatter, all-gather”).",
        **ring_parts(),
    )
)

register(
    Check(
        check_id="lab05.ring_traffic_more",
        make_inputs=_ring_traffic_more_cases,
        compare=_compare_ring_traffic,
        hint="every message carries one chunk (1 / W of the tensor), never the whole tensor, so each rank sends "
        "2 (W - 1) / W of the tensor's bytes whatever W is. Up to 8 ranks, float64 tensors.",
        **ring_parts(),
    )
)

register(
    Check(
        check_id="lab05.ring_any_tensor",
        make_inputs=_ring_any_cases,
        compare=_compare_ring_sum,
        hint=_RING_HINT + " Sizes W does not divide (chunks differ by one element), fewer elements than ranks (empty "
        "chunks, still exchanged: every rank makes 2 (W - 1) exchanges whatever the sizes), 2-D, non-contiguous "
        "(flattening one gives a copy, not a view: the sum must still reach the tensor) and float64 tensors (received "
        "data keeps the tensor's dtype).",
        **ring_parts(),
    )
)

register(
    Check(
        check_id="lab05.ring_edges",
        make_inputs=_ring_edge_cases,
        compare=_compare_ring_sum,
        hint=_RING_HINT + " One rank, empty tensors, fewer elements than ranks (an empty chunk is exchanged like any "
        "other: 2 (W - 1) exchanges per rank), int64, strided and permuted views, 5 ranks.",
        **ring_parts(),
    )
)
