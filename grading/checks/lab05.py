"""Checks for lab 05 (training from scratch, then parallelism): the learner writes the ZeRO memory
calculator ``zero_memory_per_device``, ``shard_bounds`` (which part of a tensor a rank owns),
``ring_all_reduce(tensor, comm)`` over point-to-point ``comm.exchange``, and the pieces under one
training step: ``softmax_backward``, ``rms_norm_backward`` and ``adamw_update``, which a last check
plugs into the course's autograd to train a tiny Llama next to the reference pieces.

The ring is run on a ``ThreadGroup``: every rank a thread of the learner's kernel, exchanging
tensors through queues, so a check needs no process (the grader's kernel limits them, and a
function defined in a notebook cannot be sent to a spawned one) and counts the bytes each rank
sent. Each case runs the learner's function on seeded tensors of 1 to 8 ranks; every rank's
tensor must then hold the sum over the ranks (in place, what ``dist.all_reduce`` gives), and on
sizes the world size divides every rank must have sent 2 (W - 1) / W of the tensor. A rank that
raises, or waits for a message no rank sent, stops the case with a time-out that names the
ranks; the remaining cases are skipped so that a check stays short.

``run_on_process_group`` runs the learner's answer cells on a real gloo process group, for the
lab's last cell: the answers travel as source text and each worker executes them.
"""

from __future__ import annotations

import math
import random
import threading

from grading.checks.common import array_mismatch, is_number, outcome, reference, unwrap
from grading.registry import Check, Mismatch, register, register_shortcuts

_ZERO = "infra_lib.training.zero"
_COLLECTIVES = "infra_lib.training.collectives"
_AUTOGRAD = "infra_lib.training.autograd"
_SCRATCH = "infra_lib.training.scratch_train"

# The autograd's ops and ``train_tiny`` are the stack the last check runs the learner's pieces in: they
# are no reference, and stay whole in the graded kernel; only the three formulas are stubbed there.
register_shortcuts("lab05", [f"{_ZERO}:zero_memory_per_device", f"{_ZERO}:zero_table", f"{_ZERO}:shard_bounds",
                             f"{_COLLECTIVES}:ring_all_reduce", f"{_AUTOGRAD}:softmax_backward",
                             f"{_AUTOGRAD}:rms_norm_backward", f"{_SCRATCH}:adamw_update"])

_TASKS = {1: "lab05 task 1: zero_memory_per_device", 2: "lab05 task 2: shard_bounds",
          3: "lab05 task 3: ring_all_reduce", 4: "lab05 task 4: softmax_backward",
          5: "lab05 task 5: rms_norm_backward", 6: "lab05 task 6: adamw_update"}
RANK_TIMEOUT_S = 2.0  # per rank: the ring on these small tensors takes milliseconds


# --- calling the implementation -------------------------------------------------------------------

def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# --- task 1: zero_memory_per_device --------------------------------------------------------------

_DEFAULT_BYTES = {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}


def _zero_case(num_params, num_devices, stage, **bytes_per) -> dict:
    case = {"num_params": num_params, "num_devices": num_devices, "stage": stage}
    if bytes_per:
        case["bytes"] = bytes_per
    return case


def _zero_cases(rng: random.Random) -> list[dict]:
    """The paper's figure, seeded model and cluster sizes, fp32 training, and one device."""
    cases = [_zero_case(7.5e9, 64, stage) for stage in range(4)]  # ZeRO, figure 1
    for stage in range(4):
        params = rng.choice([1.3e9, 6.7e9, 13e9, 70e9, 175e9])
        cases.append(_zero_case(params, rng.choice([8, 16, 128, 1024]), stage))
    fp32 = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}  # fp32 weights and grads, Adam's m and v
    params = rng.choice([124_000_000, 350_000_000, 774_000_000])
    cases += [_zero_case(params, rng.choice([2, 4, 8]), stage, **fp32) for stage in (0, 1, 2, 3)]
    cases += [_zero_case(rng.choice([1.5e9, 3e9]), 1, stage) for stage in (0, 2, 3)]
    return cases


def _zero_edge_cases(rng: random.Random) -> list[dict]:
    """Other byte counts, no parameters, many devices, and invalid arguments (ValueError)."""
    return [
        _zero_case(rng.choice([7e9, 8e9]), 8, 2, param_bytes=2, grad_bytes=4, optimizer_bytes=12),  # fp32 grads
        _zero_case(rng.choice([1e9, 2e9]), 4, 1, param_bytes=4, grad_bytes=4, optimizer_bytes=0),  # plain SGD
        _zero_case(rng.choice([1e9, 2e9]), 4, 3, param_bytes=4, grad_bytes=4, optimizer_bytes=0),
        _zero_case(rng.randrange(10**6, 10**8), rng.randint(3, 7), 2, optimizer_bytes=16),
        _zero_case(0, 16, 3),
        _zero_case(1e12, 4096, rng.choice([1, 2])),
        _zero_case(rng.choice([175e9, 530e9]), 1, 1),
        _zero_case(1e9, 8, 4), _zero_case(1e9, 8, -1), _zero_case(1e9, 0, 1), _zero_case(1e9, -4, 2),
        _zero_case(1e9, 2.5, 1), _zero_case(1e9, 8.0, 1), _zero_case(-1, 8, 1),
        # A stage is compared by value, as Python compares numbers: 1.0 and True are stage 1, False stage 0;
        # 1.5 and nan are no stage. A num_params of nan is not a count.
        _zero_case(rng.choice([1e9, 2e9]), 8, 1.0), _zero_case(rng.choice([1e9, 2e9]), 8, True),
        _zero_case(rng.choice([1e9, 2e9]), 4, False), _zero_case(1e9, 8, 1.5), _zero_case(1e9, 8, math.nan),
        _zero_case(math.nan, 8, 1),
    ]


def _describe_zero(case: dict) -> str:
    extra = "".join(f", {k}={v:g}" for k, v in case.get("bytes", {}).items())
    return (f"zero_memory_per_device(num_params={case['num_params']:g}, num_devices={case['num_devices']!r}, "
            f"stage={case['stage']!r}{extra})")


def _drive_zero(fn, cases: list[dict]) -> list:
    return [outcome(fn, c["num_params"], c["num_devices"], c["stage"], **c.get("bytes", {})) for c in cases]


def _stage_bytes(stage: int, p: float, g: float, k: float, n: float) -> float:
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]


def _zero_note(case: dict, got: float, want: float) -> str:
    """Name the mistake behind a wrong memory figure, when it is a recognisable one."""
    per = {**_DEFAULT_BYTES, **case.get("bytes", {})}
    psi, n, stage = case["num_params"], case["num_devices"], case["stage"]
    p, g, k = (per[name] * psi for name in ("param_bytes", "grad_bytes", "optimizer_bytes"))
    def same(value: float) -> bool:
        return _close(got, value) and not _close(want, value)

    if same(want / 1e9) or same(want / 2**30):
        return "; return bytes, not GB: the table at the end divides by 1e9"
    if case.get("bytes") and same(_stage_bytes(stage, *(_DEFAULT_BYTES[name] * psi for name in _DEFAULT_BYTES), n)):
        return "; that uses the default 2/2/12 bytes: use the param_bytes, grad_bytes and optimizer_bytes passed in"
    if stage == 2 and same((p + g + k) / n):
        return ("; at stage 2 the parameters stay whole on every device: only the gradients and the optimizer "
                "state are divided by num_devices (dividing the parameters too is stage 3)")
    if stage == 1 and same(p + (g + k) / n):
        return "; stage 1 shards only the optimizer state: the gradients are sharded from stage 2 on"
    if stage == 1 and same((p + g + k) / n):
        return ("; at stage 1 only the optimizer state (optimizer_bytes per parameter) is divided by num_devices: "
                "the parameters and gradients stay whole")
    if stage in (1, 2) and same(_stage_bytes(stage, p, g, p + g + k, n)):
        whole = per["param_bytes"] + per["grad_bytes"] + per["optimizer_bytes"]
        return (f"; the optimizer state is optimizer_bytes = {per['optimizer_bytes']:g} bytes per parameter (fp32 "
                f"master weights, momentum, variance); {whole:g} is the whole per-parameter state")
    if same(_stage_bytes(stage, p, 0, k, n)):
        return "; you left out the gradients (grad_bytes per parameter): every stage keeps them, whole or sharded"
    if same(_stage_bytes(stage, 0, g, k, n)):
        return "; you left out the parameters themselves (param_bytes per parameter)"
    if stage > 0 and same(p + g + k):
        return f"; that is stage 0 (nothing sharded): stage {stage} divides part of the state by num_devices"
    for other in range(4):
        if other != stage and same(_stage_bytes(other, p, g, k, n)):
            return (f"; that is stage {other}'s figure: stage 0 shards nothing, 1 the optimizer state, 2 the "
                    "gradients too, 3 the parameters too")
    if stage > 0 and same(_stage_bytes(stage, p, g, k, 1 / n)):
        return "; you multiplied by num_devices: each device holds 1 / num_devices of a sharded part"
    return ""


def _compare_zero(got, expected, cases: list[dict]) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from zero_memory_per_device, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        (got_kind, value), (want_kind, want) = unwrap(g), unwrap(e)
        where = _describe_zero(case)
        if want_kind == "raised":
            error = str(want).split(":")[0]
            if got_kind == "raised" and str(value).split(":")[0] == error:
                continue
            got_text = f"it raised {value}" if got_kind == "raised" else f"it returned {value!r}"
            return Mismatch(f"zero_memory_per_device should raise {error} on an invalid input",
                            f"on {where}: {got_text}; raise ValueError for a stage that is not 0, 1, 2 or 3 by "
                            "value (1.5 and nan are none of them), num_devices that is not a positive int, or a "
                            "num_params that is negative or nan")
        if got_kind == "raised":
            note = ("; a stage is compared by value, as `stage in (0, 1, 2, 3)` compares it: 1.0 and True are "
                    "stage 1, False stage 0" if type(case["stage"]) is not int else "")
            return Mismatch("zero_memory_per_device raised an exception on a valid input",
                            f"on {where}: expected {want:g} bytes, your code raised {value}{note}")
        if got_kind != "value" or not is_number(value):
            return Mismatch("zero_memory_per_device must return a number of bytes (an int or a float)",
                            f"on {where}: got {value!r:.80}")
        if not _close(value, want):
            return Mismatch("zero_memory_per_device returned the wrong number of bytes",
                            f"on {where}: expected {want:.6g} bytes ({want / 1e9:.4g} GB), got {value:.6g}"
                            + _zero_note(case, value, want))
    return None


_ZERO_HINT = ("each ZeRO stage shards one more part of the training state across the devices: stage 0 nothing, "
              "stage 1 the optimizer state, stage 2 the gradients as well, stage 3 the parameters as well; a sharded "
              "part is split among the devices, an unsharded one stays whole on every device. Count each part with "
              "the byte counts passed in and return bytes, not GB (chapter 05, section “6 · ZeRO: sharding the "
              "training state”).")

register(Check(check_id="lab05.zero_memory", task=_TASKS[1], reference=reference(_ZERO, "zero_memory_per_device"),
               make_inputs=_zero_cases, drive=_drive_zero, compare=_compare_zero, hint=_ZERO_HINT))
register(Check(check_id="lab05.zero_memory_edges", task=_TASKS[1],
               reference=reference(_ZERO, "zero_memory_per_device"), make_inputs=_zero_edge_cases,
               drive=_drive_zero, compare=_compare_zero,
               hint=_ZERO_HINT + " Other byte counts (optimizer_bytes=0 for plain SGD), no parameters, one device, "
                                 "stages given as 1.0, True or False (compared by value: stages 1, 1 and 0), and "
                                 "invalid arguments (a stage that is none of 0 to 3, 1.5 and nan included, a "
                                 "num_devices that is not a positive int, a num_params that is negative or nan), "
                                 "which raise ValueError."))


# --- task 2: shard_bounds ------------------------------------------------------------------------

def _shard_cases(rng: random.Random) -> list[list[int]]:
    return [[10, 4], [12, 4], [3, 5], [7, 3], [1, 1], [rng.randint(20, 200), rng.randint(2, 8)],
            [rng.randint(20, 200), rng.randint(2, 8)]]


def _shard_edge_cases(rng: random.Random) -> list[list[int]]:
    return [[0, 4], [5, 5], [4, 5], [rng.randint(10, 99), 1], [10**9 + rng.randint(1, 63), 64],
            [rng.randint(1000, 9999), rng.randint(9, 17)], [rng.randint(2, 6), 8]]


def _drive_shards(fn, cases: list[list[int]]) -> list:
    return [[outcome(fn, numel, world, rank) for rank in range(world)] for numel, world in cases]


def _shard_note(numel: int, world: int, got: list) -> str:
    """Name the splitting rule behind wrong bounds, when it is a recognisable one."""
    base, extra = divmod(numel, world)
    ceil = -(-numel // world)
    rules = {
        "ceil": [[min(r * ceil, numel), min((r + 1) * ceil, numel)] for r in range(world)],
        "last": [[r * base, numel if r == world - 1 else (r + 1) * base] for r in range(world)],
        "extra_last": [[r * base + max(0, r - (world - extra)), (r + 1) * base + max(0, r + 1 - (world - extra))]
                       for r in range(world)],
        "inclusive": [[r * base + min(r, extra), r * base + min(r, extra) + base + (r < extra) - 1]
                      for r in range(world)],
    }
    notes = {
        "ceil": ("; you gave every rank ceil(numel / world_size) elements and the last ones what was left (as "
                 "torch.chunk does): split as evenly as possible, shards differ by at most one element"),
        "last": "; the last rank took all the leftover elements: give one extra element to each of the first "
                "numel % world_size ranks",
        "extra_last": "; the extra elements go to the FIRST numel % world_size ranks (as torch.tensor_split does)",
        "inclusive": "; end is exclusive: the shard is [start, end), so end - start is its size",
    }
    for name, bounds in rules.items():
        if got == bounds:
            return notes[name]
    return ""


def _compare_shards(got, expected, cases: list[list[int]]) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected results for {len(expected)} splits, got {got!r:.80}")
    for (numel, world), ranks, want_ranks in zip(cases, got, expected):
        if type(ranks) is not list or len(ranks) != world:
            return Mismatch("the check recorded a malformed result", f"on numel={numel}, world_size={world}")
        values = []
        for rank, (g, e) in enumerate(zip(ranks, want_ranks)):
            where = f"shard_bounds(numel={numel}, world_size={world}, rank={rank})"
            kind, value = unwrap(g)
            if kind == "raised":
                return Mismatch("shard_bounds raised an exception", f"on {where}: your code raised {value}")
            if (kind != "value" or type(value) is not list or len(value) != 2
                    or not all(type(x) is int for x in value)):
                note = ("; use integer arithmetic (divmod, //): a float cannot index a tensor"
                        if type(value) is list and any(type(x) is float for x in value) else "")
                return Mismatch("shard_bounds must return (start, end): two ints",
                                f"on {where}: got {value!r:.80}{note}")
            values.append(value)
        want = [e[1] for e in want_ranks]
        if values != want:
            rank = next(r for r, (v, w) in enumerate(zip(values, want)) if v != w)
            return Mismatch("shard_bounds returned the wrong shard",
                            f"on numel={numel}, world_size={world}: rank {rank} expected {tuple(want[rank])}, got "
                            f"{tuple(values[rank])}; all ranks: expected {[tuple(w) for w in want]}, got "
                            f"{[tuple(v) for v in values]}" + _shard_note(numel, world, values))
    return None


_SHARD_HINT = ("split as evenly as possible: shard sizes differ by at most one element, and the larger shards go "
               "to the first ranks (torch.tensor_split's split, not torch.chunk's). Return (start, end), two ints: "
               "the half-open range [start, end); the shards are contiguous, in rank order, and cover [0, numel) "
               "exactly.")

register(Check(check_id="lab05.shard_bounds", task=_TASKS[2], reference=reference(_ZERO, "shard_bounds"),
               make_inputs=_shard_cases, drive=_drive_shards, compare=_compare_shards, hint=_SHARD_HINT))
register(Check(check_id="lab05.shard_bounds_more", task=_TASKS[2], reference=reference(_ZERO, "shard_bounds"),
               make_inputs=_shard_edge_cases, drive=_drive_shards, compare=_compare_shards,
               hint=_SHARD_HINT + " Empty tensors, fewer elements than ranks, one rank, a billion elements."))


# --- task 3: ring_all_reduce ---------------------------------------------------------------------

def _ring_case(rng: random.Random, world: int, shape: list[int], dtype: str = "float32",
               layout: str = "contiguous") -> dict:
    return {"world": world, "shape": shape, "dtype": dtype, "layout": layout, "seed": rng.randrange(10**6)}


def _divisible_shape(rng: random.Random, world: int, two_d: bool = False, large: bool = False) -> list[int]:
    if two_d:
        return [world * rng.randint(1, 4), rng.randint(2, 9)]
    return [world * rng.randint(200, 1200) if large else world * rng.randint(2, 40)]


def _ring_sum_cases(rng: random.Random) -> list[dict]:
    return [_ring_case(rng, 2, _divisible_shape(rng, 2)), _ring_case(rng, 3, _divisible_shape(rng, 3)),
            _ring_case(rng, 4, _divisible_shape(rng, 4)), _ring_case(rng, 4, _divisible_shape(rng, 4, two_d=True))]


def _ring_sum_more_cases(rng: random.Random) -> list[dict]:
    return [_ring_case(rng, 5, _divisible_shape(rng, 5)), _ring_case(rng, 6, _divisible_shape(rng, 6, large=True)),
            _ring_case(rng, 8, _divisible_shape(rng, 8)), _ring_case(rng, 3, _divisible_shape(rng, 3, two_d=True)),
            _ring_case(rng, 2, _divisible_shape(rng, 2, large=True))]


def _ring_traffic_cases(rng: random.Random) -> list[dict]:
    return [_ring_case(rng, w, [w * rng.randint(16, 64)]) for w in (2, 3, 4)]


def _ring_traffic_more_cases(rng: random.Random) -> list[dict]:
    return [_ring_case(rng, 5, _divisible_shape(rng, 5, large=True)), _ring_case(rng, 8, _divisible_shape(rng, 8)),
            _ring_case(rng, 4, [4 * rng.randint(8, 32)], dtype="float64"),
            _ring_case(rng, 6, _divisible_shape(rng, 6, two_d=True))]


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
    made = {"contiguous": "", "transposed": f", non-contiguous: x.t() of a {shape[::-1]} tensor",
            "strided": f", non-contiguous: x[:, ::2] of a {shape[:1] + [2 * n for n in shape[1:]]} tensor",
            "permuted": f", non-contiguous: x.permute(2, 1, 0) of a {shape[::-1]} tensor"}[layout]
    numel = math.prod(shape)
    return (f"world size {case['world']}, each rank a torch.{case['dtype']} tensor of shape {shape} "
            f"({_count(numel, 'element')}{made})")


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
        return {"values": tensor.tolist(), "returned": returned, "bytes": int(comm.bytes_sent),
                "messages": counting.messages, "peers": peers}

    tensors = [rank_tensor(case, rank) for rank in range(case["world"])]
    try:
        return ["value", ThreadGroup(case["world"]).run(on_rank, [(t,) for t in tensors], timeout_s=RANK_TIMEOUT_S)]
    except TimeoutError:
        waiting = [r for r, c in sorted(comms.items()) if not c.done and c.waiting]
        running = [r for r, c in sorted(comms.items()) if not c.done and not c.waiting]
        if running:
            text = (f"TimeoutError: {_ranks(running)} still running your code after {RANK_TIMEOUT_S:g} s, outside "
                    "exchange (a loop that never ends?)")
            return ["raised", text]
        calls = "; ".join(f"rank {r} sent to {comms[r].last[0]!r} and waits for {comms[r].last[1]!r} "
                          f"(its exchange number {comms[r].messages})" for r in waiting)
        text = (f"TimeoutError: {_ranks(waiting)} waiting in exchange after {RANK_TIMEOUT_S:g} s for a message no "
                f"rank sent: {calls}")
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
    """"sent/received" elements at each of a ring rank's 2 (W - 1) exchanges (chunks from an even split)."""
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
            return (f"\n  rank {rank} left out the exchange of an empty chunk: its exchanges sent/received "
                    f"[{' '.join(done)}] elements where the ring's are [{' '.join(order)}]. The chunk indices are "
                    "right; the number of exchanges is not. "
                    f"Every rank calls exchange exactly 2 (W - 1) = {2 * (world - 1)} times, also when the chunk it "
                    "sends or receives is empty: an empty tensor is still a message, its neighbour's receive is "
                    "waiting for it, and one left out shifts every later message by one")
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


def _drive_ring(ring, cases: list[dict]) -> list:
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
        return ("\n  a rank waits in exchange for a message that no rank sent it. Every rank must call exchange the "
                "same number of times (2 (W - 1)), each time sending to its right neighbour (rank + 1) % W and "
                "receiving from its left neighbour (rank - 1) % W")
    if "view size is not compatible" in text:
        return ("\n  tensor.view(-1) needs a contiguous tensor: use tensor.reshape(-1) (a copy when the tensor is not "
                "contiguous) and copy the result back into the tensor at the end")
    if "into a buffer of shape" in text:
        return ("\n  the chunk a rank receives into must have the size of the chunk its neighbour sends in the same "
                "step: check which chunk index each rank sends and receives at each step")
    if "is not a rank of a group" in text:
        return "\n  peers are 0 .. W - 1: take the neighbours modulo W, (rank + 1) % W and (rank - 1) % W"
    if "IndexError" in text and numel % world:
        return ("\n  with fewer elements than ranks, or a size W does not divide, torch.chunk and ceil-sized chunks "
                "give fewer than W chunks: torch.tensor_split(flat, W) (or your shard_bounds) always gives W, some "
                "empty")
    if "can't be cast to the desired output type" in text:
        return ("\n  make receive buffers with the tensor's dtype, torch.empty_like(chunk): torch.empty(n) is float32")
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
            return (f"; that element holds the sum plus {which} again: added twice. The all-gather copies the "
                    "finished chunks over yours (receive straight into the chunk); only the reduce-scatter adds")
        if mask == 2**world - 1 or abs(part - got) > 1e-4 * scale:
            continue
        if len(ranks) == 1:
            return (f"; that element holds only {which}: nothing was added into it. Either the reduce-scatter "
                    "replaced chunks instead of adding to them (receiving straight into a chunk replaces it) or ran "
                    f"fewer than W - 1 = {world - 1} steps, or the all-gather passed on chunks that were not "
                    "finished yet (at every all-gather step a rank sends the finished chunk it holds or has just "
                    "received): check which chunk each step sends and receives, in both phases")
        return (f"; that element holds the sum over ranks {ranks} only, of {world}: each chunk needs W - 1 = "
                f"{world - 1} reduce-scatter steps, each adding what the left neighbour sent into the chunk it sends "
                "on at the next step")
    return ""


def _values_problem(case: dict, got_ranks: list, want_ranks: list) -> Mismatch | None:
    """The first rank whose tensor does not hold the sum, with the mistake named where it can be."""
    import numpy as np

    from infra_lib.training.zero import shard_bounds  # the grader's side: not the learner's code

    world, where = case["world"], _describe_ring(case)
    rtol, atol = _tolerance(case["dtype"])
    want = np.asarray(want_ranks[0]["values"], dtype=np.float64)
    originals = [rank_tensor(case, r).double().numpy() for r in range(world)]
    copied = ("; it is not contiguous, so reshape(-1) gave you a copy: copy the result back with "
              "tensor.copy_(flat.view_as(tensor))") if case["layout"] != "contiguous" else ""
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
                return Mismatch("ring_all_reduce returned the sum but left the input tensor unchanged: all-reduce "
                                "works in place, like dist.all_reduce",
                                f"on {where}: rank {rank}'s input tensor does not hold the sum{copied}")
        if np.array_equal(got, originals[rank]) and want.size:
            return Mismatch("the input tensor still holds its own values after ring_all_reduce",
                            f"on {where}: rank {rank}'s tensor is unchanged"
                            + (copied or "; write the sum into it (work on a view of it, or copy the result back)"))
        if got.shape != want.shape:
            return Mismatch("the tensor changed shape",
                            f"on {where}: rank {rank}: expected shape {list(want.shape)}, got {list(got.shape)}")
        if world > 1 and want.size and np.allclose(got, want / world, rtol=1e-5, atol=1e-6):
            return Mismatch("ring_all_reduce averaged instead of summing",
                            f"on {where}: rank {rank} holds the sum divided by {world}; all-reduce sums (data "
                            "parallelism divides by W afterwards, outside the collective)")
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
            note = ("; the values are right to float32 precision only: make receive buffers with the tensor's "
                    "dtype, torch.empty_like(chunk) (torch.empty(n) is float32)")
        elif finished and "added twice" not in element:
            start, end = finished[0]
            note = (f"; rank {rank} holds the sum only in elements {start}..{end - 1}, one chunk: that is where the "
                    f"reduce-scatter ends. The all-gather must then pass the finished chunks around the ring "
                    f"(W - 1 = {world - 1} more steps) so that every rank has all of them")
        else:
            note = element
        own = ", ".join(f"{o.reshape(-1)[first]:.4g}" for o in originals)
        return Mismatch("ring_all_reduce did not leave the sum over the ranks in every rank's tensor",
                        f"on {where}: rank {rank}: {int(bad.sum())} of {bad.size} elements differ; at index {index} "
                        f"expected {flat_want[first]:.{digits}g}, got {flat_got[first]:.{digits}g} (the ranks' own "
                        f"values there: {own}){note}")
    for rank, rank_data in enumerate(got_ranks):
        returned = rank_data["returned"]
        if returned == "the input tensor":
            continue
        if type(returned) is not dict:
            return Mismatch("ring_all_reduce must return the tensor it reduced",
                            f"on {where}: rank {rank} returned {returned} (end with `return tensor`)")
        back = np.asarray(returned["values"], dtype=np.float64)
        dtype = f"torch.{case['dtype']}"
        if returned["dtype"] != dtype or back.shape != want.shape or not np.allclose(back, want, rtol=rtol, atol=atol):
            return Mismatch("ring_all_reduce returned a tensor other than the sum",
                            f"on {where}: rank {rank}'s tensor holds the sum, but it returned a {returned['dtype']} "
                            f"tensor of shape {returned['shape']} with other values (expected {dtype}, "
                            f"{list(want.shape)}): end with `return tensor`")
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
                return Mismatch("ring_all_reduce did not finish: a rank kept running its own code",
                                f"on {where}: {value}")
            if "waiting in exchange" in str(value):
                return Mismatch("ring_all_reduce did not finish: a rank waited for a message that never came",
                                f"on {where}: {value}{_raised_note(str(value), case)}")
            return Mismatch("ring_all_reduce raised an exception",
                            f"on {where}: {value}{_raised_note(str(value), case)}")
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
                note = ("; you sent nothing: the ranks shared memory instead of messages, which only threads can do. "
                        "In a process group every rank is its own process (on its own GPU): only exchange moves data")
            elif sent == (world - 1) * tensor_bytes:
                note = ("; that is the whole tensor in each of W - 1 steps: send one chunk (1 / W of the tensor) per "
                        "step, in a reduce-scatter and then an all-gather")
            elif sent % tensor_bytes == 0:
                note = "; you sent whole tensors: a ring sends one chunk (1 / W of the tensor) per message"
            elif sent == (world - 1) * chunk:
                note = "; that is only the reduce-scatter: the all-gather sends W - 1 chunks more"
            peers = g.get("peers") or []
            if any(pair != [(rank + 1) % world, (rank - 1) % world] for pair in peers):
                note += (f"; rank {rank} exchanged with (to, from) {[tuple(p) for p in peers]}: in a ring it sends to "
                         f"{(rank + 1) % world} and receives from {(rank - 1) % world} only")
            return Mismatch("a rank sent a different number of bytes than a ring all-reduce does",
                            f"on {where}: rank {rank} sent {sent} bytes in {_count(g['messages'], 'message')} "
                            f"({sent / tensor_bytes:.3g} x the tensor's {tensor_bytes} bytes); a ring sends "
                            f"2 (W - 1) / W = {share:.3g} x the tensor: {e['bytes']} bytes in 2 (W - 1) = "
                            f"{2 * (world - 1)} messages of one {chunk}-byte chunk each{note}")
    return None


_RING_HINT = ("a ring all-reduce is a reduce-scatter, in which each chunk travels the ring collecting one more "
              "rank's contribution per step (received partial sums are added to the rank's own copy), then an "
              "all-gather, in which the finished chunks travel the ring once more and replace the stale copies "
              "(nothing is added). The sum belongs in the tensor itself, in place, which is also what is returned; "
              "see chapter 05, section “4 · Collectives: all-reduce, reduce-scatter, all-gather”.")

_RING_CHECKS = (
    ("lab05.ring_sum", _ring_sum_cases, _compare_ring_sum, _RING_HINT),
    ("lab05.ring_sum_more", _ring_sum_more_cases, _compare_ring_sum,
     _RING_HINT + " Up to 8 ranks, tens of thousands of elements."),
    ("lab05.ring_traffic", _ring_traffic_cases, _compare_ring_traffic,
     ("every message in a ring carries one chunk, 1 / W of the tensor, so each rank sends 2 (W - 1) / W of the "
      "tensor in all, whatever W is; ranks share nothing but what exchange carries. Passing the whole tensor around "
      "the ring also gives the sum, at W - 1 times the traffic (chapter 05, section “4 · Collectives: all-reduce, "
      "reduce-scatter, all-gather”).")),
    ("lab05.ring_traffic_more", _ring_traffic_more_cases, _compare_ring_traffic,
     ("every message carries one chunk (1 / W of the tensor), never the whole tensor, so each rank sends "
      "2 (W - 1) / W of the tensor's bytes whatever W is. Up to 8 ranks, float64 tensors.")),
    ("lab05.ring_any_tensor", _ring_any_cases, _compare_ring_sum,
     _RING_HINT + " Sizes W does not divide (chunks differ by one element), fewer elements than ranks (empty "
                  "chunks, still exchanged: every rank makes 2 (W - 1) exchanges whatever the sizes), 2-D, non-contiguous (flattening one gives a copy, not a view: the sum must still reach "
                  "the tensor) and float64 tensors (received data keeps the tensor's dtype)."),
    ("lab05.ring_edges", _ring_edge_cases, _compare_ring_sum,
     _RING_HINT + " One rank, empty tensors, fewer elements than ranks (an empty chunk is exchanged like any "
                  "other: 2 (W - 1) exchanges per rank), int64, strided and permuted views, 5 ranks."),
)
for _check_id, _make, _compare, _hint in _RING_CHECKS:
    register(Check(check_id=_check_id, task=_TASKS[3], reference=reference(_COLLECTIVES, "ring_all_reduce"),
                   make_inputs=_make, drive=_drive_ring, compare=_compare, hint=_hint))


# --- the lab's last cell: the learner's ring on a real process group ----------------------------

def answer_source(fn) -> str:
    """The source of the notebook cell (or file) that defined ``fn``: with it go the helpers and imports
    the answer cell holds."""
    import inspect
    import linecache

    lines = linecache.getlines(fn.__code__.co_filename)
    return "".join(lines) if lines else inspect.getsource(fn)


def run_on_process_group(sources: list[str], name: str = "ring_all_reduce", world_size: int = 2,
                         shapes: tuple = ((4096,), (1000, 3), (7,)), seed: int = 0, repeats: int = 3,
                         timeout_s: float = 60.0) -> list[list[dict]]:
    """Run the function ``name`` defined by ``sources`` (answer cells) on a gloo group of ``world_size``
    processes, against ``dist.all_reduce`` on the same seeded tensors; per rank, one row per shape.

    A function defined in a notebook cannot be sent to a spawned process, so its cell's source is:
    every worker executes the sources in a fresh namespace (with ``torch`` and ``math``), then calls
    ``name(tensor, DistComm())``. Raises ``WorkerError`` naming the rank if a worker fails or hangs.
    """
    from infra_lib.training.launcher import run_workers

    return run_workers(_answer_worker, world_size, (list(sources), name, [list(s) for s in shapes], seed, repeats),
                       timeout_s=timeout_s)


def _answer_worker(rank: int, world_size: int, sources: list[str], name: str, shapes: list, seed: int,
                   repeats: int) -> list[dict]:
    import time

    import torch
    import torch.distributed as dist

    from infra_lib.training.collectives import DistComm

    namespace = {"__name__": "lab05_answers", "torch": torch, "math": math}
    for source in sources:
        exec(compile(source, "<answer cell>", "exec"), namespace)  # noqa: S102 - the learner's own answers
    ring = namespace[name]
    rows = []
    for i, shape in enumerate(shapes):
        tensor = torch.randn(*shape, generator=torch.Generator().manual_seed(seed * 1000 + i * 16 + rank))
        expected = tensor.clone()
        dist.all_reduce(expected)
        comm = DistComm()
        ring(tensor, comm)

        def best_of(all_reduce, shape: list) -> float:  # the first call pays for warm-up
            best = float("inf")
            for _ in range(repeats):
                scratch = torch.randn(*shape)
                dist.barrier()
                start = time.perf_counter()
                all_reduce(scratch)
                best = min(best, time.perf_counter() - start)
            return best

        ring_s = best_of(lambda t: ring(t, DistComm()), shape)
        dist_s = best_of(dist.all_reduce, shape)
        rows.append({"shape": list(shape), "bytes": tensor.nbytes, "bytes_sent": comm.bytes_sent,
                     "max_abs_error": float((tensor - expected).abs().max()) if tensor.numel() else 0.0,
                     "ring_s": ring_s, "all_reduce_s": dist_s})
    return rows


# --- tasks 4 to 6: the pieces under one training step --------------------------------------------
# Cases are plain data (a seed, a shape, a dtype); the tensors are made from them on each side, the
# same way, by ``_randn``. A result is recorded as its values, dtype and shape (``_record``).

def _randn(seed: int, shape: list[int], dtype: str, scale: float = 1.0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(getattr(torch, dtype))


def _record(value) -> dict:
    import torch

    if isinstance(value, torch.Tensor):
        return {"values": value.detach().double().tolist(), "dtype": str(value.dtype).replace("torch.", ""),
                "shape": list(value.shape)}
    return {"type": type(value).__name__}


def _tolerance_for(dtype: str, expected, tight: bool = False) -> tuple[float, float]:
    """(atol, rtol): rounding of float32 or float64, scaled to the largest expected value. ``tight``
    for values that a step changes only a little (a weight after an update): no relative part."""
    import numpy as np

    top = float(np.abs(np.asarray(expected, dtype=np.float64)).max()) if np.size(expected) else 1.0
    if tight:
        return (4e-6 if dtype == "float32" else 1e-12) * max(top, 1e-300), 0.0
    return ((2e-6 * max(top, 1e-30), 1e-4) if dtype == "float32" else (1e-12 * max(top, 1e-300), 1e-9))


def _tensor_problem(name: str, got: dict, want: dict, where: str, variants, what: str,
                    tight: bool = False, noun: str = "the returned tensor") -> Mismatch | None:
    """Shape, dtype, then values of one recorded tensor (``noun``); a value mismatch (``what``) names the
    first variant (a classic mistake, computed in float64 on the same inputs) that the result matches."""
    import numpy as np

    pairs = list(variants.items()) if isinstance(variants, dict) else variants
    if "values" not in got:
        return Mismatch(f"{name} must return a torch tensor", f"on {where}: got a {got.get('type')}")
    if got["shape"] != want["shape"]:
        note = next((why for why, value in pairs if list(np.shape(value)) == got["shape"]), "")
        return Mismatch(f"{noun} from {name} has the wrong shape", f"on {where}: expected shape {want['shape']}, got "
                                                        f"{got['shape']}" + (f"; {note}" if note else ""))
    if got["dtype"] != want["dtype"]:
        return Mismatch(f"{noun} from {name} has the wrong dtype",
                        f"on {where}: expected {want['dtype']} (the inputs' dtype), got {got['dtype']}; make new "
                        "tensors with the inputs' dtype (torch.zeros_like, or dtype=x.dtype)")
    atol, rtol = _tolerance_for(want["dtype"], want["values"], tight)
    problem = array_mismatch(got["values"], want["values"], what, where, atol=atol, rtol=rtol)
    if problem is None:
        return None
    for why, value in pairs:
        if np.shape(value) == tuple(got["shape"]) and np.allclose(got["values"], value, atol=atol, rtol=rtol):
            return Mismatch(problem.what, f"{problem.detail}; {why}")
    return problem


def _raised_or_none(name: str, kind: str, value, where: str) -> Mismatch | None:
    if kind == "raised":
        return Mismatch(f"{name} raised an exception", f"on {where}: your code raised {value}")
    if kind != "value" or type(value) is not dict:
        return Mismatch("the check recorded a malformed result", f"on {where}: {value!r:.80}")
    return None


# --- task 4: softmax_backward ----------------------------------------------------------------------

def _softmax_case(rng: random.Random, label: str, shape: list[int], dtype: str = "float32", mask: str = "none",
                  scale: float = 1.0, layout: str = "contiguous") -> dict:
    return {"label": label, "shape": shape, "dtype": dtype, "mask": mask, "scale": scale, "layout": layout,
            "seed": rng.randrange(10**6)}


def _softmax_cases(rng: random.Random) -> list[dict]:
    return [_softmax_case(rng, "attention weights", [2, 2, 5, 5], mask="causal"),
            _softmax_case(rng, "one row", [rng.randint(3, 9)]),
            _softmax_case(rng, "a batch of rows", [rng.randint(2, 5), rng.randint(4, 12)]),
            _softmax_case(rng, "a float64 batch", [3, rng.randint(2, 4), 7], dtype="float64")]


def _softmax_edges(rng: random.Random) -> list[dict]:
    t = rng.randint(2, 4)
    return [_softmax_case(rng, "single-element rows", [4, 1]),
            _softmax_case(rng, "a one-element tensor", [1]),
            _softmax_case(rng, "a causal mask with fewer queries than keys", [2, t, t + 3], mask="causal"),
            _softmax_case(rng, "rows masked everywhere but the diagonal", [3, 6, 6], mask="diagonal"),
            _softmax_case(rng, "fully masked (padding) rows, all-zero probabilities, among causal rows", [2, 6, 6],
                          mask="padded"),
            _softmax_case(rng, "probabilities from logits of the order of 1e4", [5, 9], scale=1e4),
            _softmax_case(rng, "causal float64 attention weights", [1, 3, 6, 6], dtype="float64", mask="causal"),
            _softmax_case(rng, "a transposed (non-contiguous) tensor", [7, 4], layout="transposed"),
            _softmax_case(rng, "odd sizes", [3, 1, 5, 7], dtype="float64")]


def _softmax_inputs(case: dict):
    """(probs, grad_probs) as the case describes them; grad_probs is random at masked entries too."""
    import torch

    scores = _randn(case["seed"], case["shape"], "float64", case["scale"])
    if case["layout"] == "transposed":
        scores = scores.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, strided
    if case["mask"] != "none":
        t, s = case["shape"][-2:]
        keep = torch.eye(t, s) > 0 if case["mask"] == "diagonal" else torch.ones(t, s, dtype=torch.bool).tril(s - t)
        if case["mask"] == "padded":
            keep[::3] = False  # every third query row masked everywhere: padding
        scores = scores.masked_fill(~keep, float("-inf"))
    # A fully masked row has no probabilities (softmax gives nan): like attention kernels, it holds zeros.
    probs = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0).to(getattr(torch, case["dtype"]))
    grad = _randn(case["seed"] + 1, case["shape"], case["dtype"])
    if case["layout"] == "transposed":
        grad = grad.transpose(-1, -2).contiguous().transpose(-1, -2)
    return probs, grad


def _describe_softmax(case: dict) -> str:
    return f"{case['label']}: probs of shape {case['shape']}, {case['dtype']}"


def _drive_softmax(fn, cases: list[dict]) -> list:
    def run(case):
        probs, grad = _softmax_inputs(case)
        before = (probs.clone(), grad.clone())
        result = fn(probs, grad)
        return {"result": _record(result),
                "changed": not (torch_equal(probs, before[0]) and torch_equal(grad, before[1]))}

    with _NoTorchAutograd():
        return [outcome(run, case) for case in cases]


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _softmax_variants(case: dict) -> list:
    """Classic mistakes on the case's inputs, in float64: (message, result) pairs."""
    probs, grad = (t.double() for t in _softmax_inputs(case))
    weighted = (grad * probs).sum(-1, keepdim=True)
    variants = {
        "that is probs * grad_probs: every score moves every probability through the normalisation, so the "
        "gradient also has the term - p_i Σ_j g_j p_j": probs * grad,
        "that is only the diagonal of the Jacobian, p_i (1 - p_i) g_i: d p_i / d x_j = - p_i p_j for j ≠ i too":
            grad * probs * (1 - probs),
        "the sum over j is weighted by the probabilities: Σ_j g_j p_j, not Σ_j g_j": probs * (grad - grad.sum(-1,
                                                                                                             True)),
        "the sign is flipped: the gradient is p_i (g_i - Σ_j g_j p_j)": -probs * (grad - weighted),
        "the gradient is p_i times (g_i - Σ_j g_j p_j): without the factor p_i a masked entry (p = 0) gets a "
        "gradient": grad - weighted,
    }
    pairs = [(why, value.numpy()) for why, value in variants.items()]
    for dim in range(probs.dim() - 1):
        pairs.append(("the sum runs over the wrong dim: the softmax normalises over the last dim, so Σ_j is over "
                      "the last dim (keepdim=True, so that it broadcasts)",
                      (probs * (grad - (grad * probs).sum(dim, True))).numpy()))
    return pairs


def _compare_softmax(got, expected, cases: list[dict]) -> Mismatch | None:
    import numpy as np

    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from softmax_backward, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        (kind, value), (_, want) = unwrap(g), unwrap(e)
        where = _describe_softmax(case)
        problem = _raised_or_none("softmax_backward", kind, value, where)
        if problem:
            return problem
        variants = _softmax_variants(case)
        result = value["result"]
        if "values" in result and result["shape"] == want["result"]["shape"]:
            probs = _softmax_inputs(case)[0].double().numpy()
            zero = probs == 0
            got_values = np.asarray(result["values"], dtype=np.float64)
            if (got_values[zero] != 0).any():
                index = [int(i) for i in np.argwhere(zero & (got_values != 0))[0]]
                note = next((f"; {why}" for why, v in variants if np.allclose(got_values, v, rtol=1e-4,
                                                                                     atol=1e-5)), "")
                return Mismatch("softmax_backward gave a nonzero gradient where the probability is exactly 0 (a "
                                "masked entry)",
                                f"on {where}: at index {index} probs is 0 and your gradient is "
                                f"{got_values[tuple(index)]:.6g}; it must be exactly 0 whatever grad_probs holds "
                                f"there{note}")
        problem = _tensor_problem("softmax_backward", result, want["result"], where, variants,
                                  "softmax_backward returned the wrong gradient", noun="the returned gradient")
        if problem:
            return problem
        if value["changed"]:
            return Mismatch("softmax_backward changed its inputs",
                            f"on {where}: probs or grad_probs holds other values after the call; compute into new "
                            "tensors (the autograd reuses probs for every gradient that passes through)")
    return None


_SOFTMAX_HINT = ("every score moves every probability of its row through the normalisation: d p_i / d x_j = "
                 "p_i (δ_ij - p_j), over the last dim only; contract that Jacobian with grad_probs without "
                 "building it. A masked entry has p exactly 0, and its gradient must come out exactly 0 "
                 "(chapter 05, section “1 · The chain rule as a graph”).")

register(Check(check_id="lab05.softmax_backward", task=_TASKS[4], reference=reference(_AUTOGRAD, "softmax_backward"),
               make_inputs=_softmax_cases, drive=_drive_softmax, compare=_compare_softmax, hint=_SOFTMAX_HINT))
register(Check(check_id="lab05.softmax_backward_edges", task=_TASKS[4],
               reference=reference(_AUTOGRAD, "softmax_backward"), make_inputs=_softmax_edges, drive=_drive_softmax,
               compare=_compare_softmax,
               hint=_SOFTMAX_HINT + " Single-element rows, rectangular causal masks, rows masked everywhere but the "
                                    "diagonal (probability 1), fully masked rows (all probabilities 0, so the whole "
                                    "row's gradient is 0), probabilities from logits of the order of 1e4, float64 "
                                    "and non-contiguous tensors."))


# --- task 5: rms_norm_backward ---------------------------------------------------------------------

def _rms_case(rng: random.Random, label: str, shape: list[int], dtype: str = "float32", eps: float = 1e-5,
              scale: float = 1.0, weight: str = "random") -> dict:
    return {"label": label, "shape": shape, "dtype": dtype, "eps": eps, "scale": scale, "weight": weight,
            "seed": rng.randrange(10**6)}


def _rms_cases(rng: random.Random) -> list[dict]:
    return [_rms_case(rng, "a batch of rows", [rng.randint(2, 5), 8]),
            _rms_case(rng, "activations [batch, t, d]", [2, rng.randint(2, 5), 16], eps=1e-6),
            _rms_case(rng, "small activations, where eps matters", [4, 6], dtype="float64", eps=1e-3, scale=0.02),
            _rms_case(rng, "one vector", [rng.randint(3, 12)], dtype="float64")]


def _rms_edges(rng: random.Random) -> list[dict]:
    return [_rms_case(rng, "d = 1", [5, 1], dtype="float64"),
            _rms_case(rng, "four leading dims", [2, 3, 2, 4, 6]),
            _rms_case(rng, "tiny activations, eps of the same order as mean(x^2)", [3, 10], dtype="float64",
                      eps=1e-6, scale=1e-3),
            _rms_case(rng, "large activations", [4, 8], scale=1e3),
            _rms_case(rng, "a weight with zeros", [3, 2, 9], dtype="float64", weight="zeros"),
            _rms_case(rng, "a large eps", [6, 5], dtype="float64", eps=0.5)]


def _rms_inputs(case: dict):
    """(x, weight, grad_out, eps) as the case describes them."""
    dtype, d = case["dtype"], case["shape"][-1]
    x = _randn(case["seed"], case["shape"], dtype, case["scale"])
    weight = 1 + 0.5 * _randn(case["seed"] + 1, [d], dtype)
    if case["weight"] == "zeros":
        weight[::2] = 0
    grad = _randn(case["seed"] + 2, case["shape"], dtype)
    return x, weight, grad, case["eps"]


def _describe_rms(case: dict) -> str:
    return f"{case['label']}: x of shape {case['shape']}, {case['dtype']}, eps={case['eps']:g}"


class _Refused:
    """For the length of a drive, some of torch's functions refuse to run (``targets``: (module, name) pairs),
    raising ``MESSAGE``; they are restored afterwards."""

    MESSAGE = ""

    def targets(self) -> list[tuple]:
        raise NotImplementedError

    def __enter__(self):
        def refuse(*args, **kwargs):
            raise RuntimeError(self.MESSAGE)

        self.saved = [(module, name, getattr(module, name)) for module, name in self.targets() if hasattr(module, name)]
        for owner, name, _ in self.saved:
            setattr(owner, name, refuse)
        return self

    def __exit__(self, *exc):
        for owner, name, original in self.saved:
            setattr(owner, name, original)
        return False


class _NoTorchAutograd(_Refused):
    """Tasks 4 and 5 ask for the formulas themselves: ``Tensor.backward``, ``torch.autograd.backward`` and
    ``torch.autograd.grad`` all reach the engine through one function, replaced here (also where an answer
    imported ``grad`` by name)."""

    MESSAGE = ("lab05 tasks 4 and 5 ask for the backward formula itself, in tensor ops: torch.autograd "
               "(requires_grad, .backward(), torch.autograd.grad) is not part of an answer")

    def targets(self) -> list[tuple]:
        import torch.autograd
        import torch.autograd.graph

        return [(torch.autograd, "_engine_run_backward"), (torch.autograd.graph, "_engine_run_backward")]


def _drive_rms(fn, cases: list[dict]) -> list:
    def run(case):
        x, weight, grad, eps = _rms_inputs(case)
        before = [t.clone() for t in (x, weight, grad)]
        result = fn(x, weight, grad, eps)
        changed = not all(torch_equal(a, b) for a, b in zip((x, weight, grad), before))
        if type(result) not in (tuple, list) or len(result) != 2:
            return {"pair": False, "type": type(result).__name__, "changed": changed}
        return {"pair": True, "grad_x": _record(result[0]), "grad_weight": _record(result[1]), "changed": changed}

    with _NoTorchAutograd():
        return [outcome(run, case) for case in cases]


def _rms_variants(case: dict) -> tuple[dict, dict]:
    """Classic mistakes on the case's inputs, in float64: (for grad_x, for grad_weight), message -> result."""
    x, weight, grad, eps = (t.double() if hasattr(t, "double") else t for t in _rms_inputs(case))
    mean_square = x.pow(2).mean(-1, keepdim=True)
    inv_rms = (mean_square + eps).rsqrt()
    normed, grad_normed = x * inv_rms, grad * weight
    # eps outside the root, 1 / (sqrt(mean(x^2)) + eps), is the reference's rsqrt(mean(x^2) + eps) with this
    # per-row eps in place of the scalar (the checks compare with the library's backward, never a copy of it)
    from infra_lib.training.autograd import rms_norm_backward

    outside = rms_norm_backward(x, weight, grad, (mean_square.sqrt() + eps) ** 2 - mean_square)
    for_x = {
        "that treats the rms as a constant: it depends on every x_j of the row, so the gradient also has the "
        "term through the mean, - x̂_i · mean_j(g_j w_j x̂_j) / rms": inv_rms * grad_normed,
        "the mean's 1/d is missing from the term through the rms": inv_rms * (grad_normed - normed * (
            grad_normed * normed).sum(-1, keepdim=True)),
        "eps belongs inside the square root: rms = sqrt(mean(x^2) + eps)": outside[0],
        "the gradient reaches x̂ through the weight first: use grad_out * weight, not grad_out": inv_rms * (
            grad - normed * (grad * normed).mean(-1, keepdim=True)),
    }
    lead = x.dim() - 1
    for_weight = {
        "grad_weight must be summed over every leading dim (the weight is shared by every row): it is [d]":
            grad * normed,
        "eps belongs inside the square root: rms = sqrt(mean(x^2) + eps)": outside[1],
        "grad_weight is Σ grad_out · x̂ (the normalised x), not Σ grad_out": grad.reshape(-1, x.shape[-1]).sum(0),
    }
    if lead > 1:
        for_weight["grad_weight must be summed over every leading dim, not only the first: it is [d]"] = (
            grad * normed).sum(0)
    return ({why: v.numpy() for why, v in for_x.items()}, {why: v.numpy() for why, v in for_weight.items()})


def _compare_rms(got, expected, cases: list[dict]) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from rms_norm_backward, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        (kind, value), (_, want) = unwrap(g), unwrap(e)
        where = _describe_rms(case)
        problem = _raised_or_none("rms_norm_backward", kind, value, where)
        if problem:
            return problem
        if not value.get("pair"):
            return Mismatch("rms_norm_backward must return (grad_x, grad_weight): two tensors",
                            f"on {where}: got a {value.get('type')}")
        for_x, for_weight = _rms_variants(case)
        problem = (_tensor_problem("rms_norm_backward", value["grad_x"], want["grad_x"], where, for_x,
                                   "rms_norm_backward returned the wrong grad_x", noun="grad_x")
                   or _tensor_problem("rms_norm_backward", value["grad_weight"], want["grad_weight"], where,
                                      for_weight, "rms_norm_backward returned the wrong grad_weight",
                                      noun="grad_weight"))
        if problem:
            return problem
        if value["changed"]:
            return Mismatch("rms_norm_backward changed its inputs",
                            f"on {where}: x, weight or grad_out holds other values after the call; compute into "
                            "new tensors")
    return None


_RMS_HINT = ("y = x̂ · weight with x̂ = x / rms and rms = sqrt(mean(x^2) + eps) over the last dim: the rms depends on "
             "every element of its row, so each x_j reaches each y_i twice, directly and through the rms. The "
             "weight is shared by every row: its gradient sums over all the leading dims "
             "(chapter 05, section “1 · The chain rule as a graph”).")

register(Check(check_id="lab05.rms_norm_backward", task=_TASKS[5],
               reference=reference(_AUTOGRAD, "rms_norm_backward"), make_inputs=_rms_cases, drive=_drive_rms,
               compare=_compare_rms, hint=_RMS_HINT))
register(Check(check_id="lab05.rms_norm_backward_edges", task=_TASKS[5],
               reference=reference(_AUTOGRAD, "rms_norm_backward"), make_inputs=_rms_edges, drive=_drive_rms,
               compare=_compare_rms,
               hint=_RMS_HINT + " d = 1, four leading dims, tiny activations where eps dominates, large ones, a "
                                "weight with zeros, a large eps."))


# --- task 6: adamw_update --------------------------------------------------------------------------

def _adamw_case(rng: random.Random, label: str, shape: list[int], *, dtype: str = "float32", steps: int = 4,
                start: int = 1, lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.01, grad_scale: float = 1.0) -> dict:
    return {"label": label, "shape": shape, "dtype": dtype, "steps": steps, "start": start, "lr": lr,
            "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay, "grad_scale": grad_scale,
            "seed": rng.randrange(10**6)}


def _adamw_cases(rng: random.Random) -> list[dict]:
    return [_adamw_case(rng, "a weight matrix", [rng.randint(2, 5), rng.randint(3, 6)], weight_decay=0.1),
            _adamw_case(rng, "small gradients, as a network's are", [rng.randint(5, 20)], lr=1e-3, beta2=0.95,
                        grad_scale=1e-4),
            _adamw_case(rng, "a float64 tensor over 6 steps", [3, 4], dtype="float64", steps=6, lr=3e-2,
                        weight_decay=0.05)]


def _adamw_edges(rng: random.Random) -> list[dict]:
    return [_adamw_case(rng, "no weight decay", [4, 3], weight_decay=0.0),
            _adamw_case(rng, "one step (step 1)", [6], steps=1, weight_decay=0.1),
            _adamw_case(rng, "a large eps", [5], dtype="float64", eps=1e-3, grad_scale=1e-2),
            _adamw_case(rng, "zero gradients", [2, 3], grad_scale=0.0, weight_decay=0.1),
            _adamw_case(rng, "beta1 = 0", [7], dtype="float64", beta1=0.0),
            _adamw_case(rng, "resuming at step 1000 with moments already there", [3, 3], dtype="float64",
                        start=1000, steps=3),
            _adamw_case(rng, "odd shape, 12 steps", [3, 1, 2], steps=12, beta2=0.9, weight_decay=0.3)]


def _adamw_state(case: dict):
    """(param, exp_avg, exp_avg_sq) before the first step: zero moments at step 1, else seeded ones."""
    import torch

    dtype = case["dtype"]
    param = _randn(case["seed"], case["shape"], dtype)
    if case["start"] == 1:
        return param, torch.zeros_like(param), torch.zeros_like(param)
    scale = case["grad_scale"]
    return param, 0.3 * scale * _randn(case["seed"] + 1, case["shape"], dtype), (
        scale * _randn(case["seed"] + 2, case["shape"], dtype)) ** 2


def _adamw_grads(case: dict):
    return [_randn(case["seed"] + 10 + i, case["shape"], case["dtype"], case["grad_scale"])
            for i in range(case["steps"])]


class _NoTorchAdam(_Refused):
    """For the length of a drive, torch's own Adam and AdamW refuse to run: the task is the update itself."""

    MESSAGE = ("lab05 task 6 asks for the update itself: torch.optim.AdamW is what it is compared with, not part "
               "of an answer")

    def targets(self) -> list[tuple]:
        import importlib

        adam, adamw = (importlib.import_module(f"torch.optim.{name}") for name in ("adam", "adamw"))
        # The module-level functions that Adam.step and AdamW.step call (the classes' own step is
        # re-wrapped by torch when an optimizer is made, so it is left alone).
        return [(adam, name) for name in ("adam", "_single_tensor_adam", "_multi_tensor_adam", "_fused_adam")] + \
            [(adamw, "adamw")]


def _drive_adamw(fn, cases: list[dict]) -> list:
    def run(case):
        param, exp_avg, exp_avg_sq = _adamw_state(case)
        rows = []
        for i, grad in enumerate(_adamw_grads(case)):
            before = grad.clone()
            returned = fn(param, grad, exp_avg, exp_avg_sq, case["start"] + i, case["lr"], case["beta1"],
                          case["beta2"], case["eps"], case["weight_decay"])
            rows.append({"param": _record(param), "exp_avg": _record(exp_avg), "exp_avg_sq": _record(exp_avg_sq),
                         "grad_changed": not torch_equal(grad, before),
                         "returned": None if returned is None else type(returned).__name__})
        return rows

    with _NoTorchAdam():
        return [outcome(run, case) for case in cases]


def _adamw_variant(case: dict, *, bias_correction=True, l2=False, eps_inside=False, from_zero=False,
                   decay_lr=True) -> list:
    """The parameter after each step with one classic mistake, in float64."""
    import torch

    param, m, v = (t.double() for t in _adamw_state(case))
    lr, b1, b2, eps, wd = (case[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    out = []
    for i, grad in enumerate(_adamw_grads(case)):
        grad, step = grad.double(), case["start"] + i + (1 if from_zero else 0)
        if l2:
            grad = grad + wd * param
        else:
            param = param * (1 - (lr * wd if decay_lr else wd))
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad * grad
        c1, c2 = (1 - b1 ** step, 1 - b2 ** step) if bias_correction else (1.0, 1.0)
        denom = (v / c2 + eps).sqrt() if eps_inside else (v / c2).sqrt() + eps
        param = param - lr * (m / c1) / denom
        out.append(param.numpy() if torch.isfinite(param).all() else None)
    return out


_ADAMW_MISTAKES = {
    "the moments start at zero, so early steps need the bias corrections: m / (1 - beta1^step) and "
    "v / (1 - beta2^step)": {"bias_correction": False},
    "that is Adam's L2 penalty (weight_decay * param added to the gradient, so it enters the moments): AdamW "
    "decouples it, shrinking the weight itself by lr * weight_decay": {"l2": True},
    "eps goes outside the square root: sqrt(v_hat) + eps": {"eps_inside": True},
    "step is 1 on the first update (the step being taken now): do not add 1 to it": {"from_zero": True},
    "the decoupled decay is scaled by the learning rate: param *= 1 - lr * weight_decay": {"decay_lr": False},
}


def _describe_adamw(case: dict) -> str:
    steps = f"steps {case['start']}..{case['start'] + case['steps'] - 1}"
    return (f"{case['label']}: param of shape {case['shape']}, {case['dtype']}, {steps}, lr={case['lr']:g}, "
            f"beta1={case['beta1']:g}, beta2={case['beta2']:g}, eps={case['eps']:g}, "
            f"weight_decay={case['weight_decay']:g}")


def _compare_adamw(got, expected, cases: list[dict]) -> Mismatch | None:
    import numpy as np

    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from adamw_update, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        (kind, rows), (_, want_rows) = unwrap(g), unwrap(e)
        where = _describe_adamw(case)
        if kind == "raised":
            return Mismatch("adamw_update raised an exception", f"on {where}: your code raised {rows}")
        if kind != "value" or type(rows) is not list or len(rows) != len(want_rows):
            return Mismatch("the check recorded a malformed result", f"on {where}: {rows!r:.80}")
        initial = _adamw_state(case)[0].double().numpy()
        for i, (row, want) in enumerate(zip(rows, want_rows)):
            at = f"{where}, after step {case['start'] + i}"
            param = row["param"]
            if i == 0 and param.get("values") is not None and np.array_equal(param["values"], initial) and (
                    not np.array_equal(want["param"]["values"], initial)):
                return Mismatch("adamw_update left param unchanged: it updates param, exp_avg and exp_avg_sq in "
                                "place", f"on {at}: param still holds its starting values; a new tensor made by "
                                "`param = param - ...` is lost when the function returns: write into the tensor "
                                "(mul_, add_, addcdiv_, or param.copy_(...))")
            variants = {why: steps_[i] for why, flags in _ADAMW_MISTAKES.items()
                        if (steps_ := _adamw_variant(case, **flags))[i] is not None}
            problem = _tensor_problem("adamw_update", param, want["param"], at, variants,
                                      "adamw_update left the wrong values in param", tight=True, noun="param")
            if problem:
                return problem
            for name in ("exp_avg", "exp_avg_sq"):
                problem = _tensor_problem("adamw_update", row[name], want[name], at, {},
                                          f"adamw_update left the wrong values in {name}", noun=name)
                if problem:
                    return Mismatch(problem.what, problem.detail + "; the moments are updated in place too: the "
                                    "next step starts from them (they are not bias-corrected in place)")
            if row["grad_changed"]:
                return Mismatch("adamw_update changed grad", f"on {at}: grad holds other values after the call; "
                                "it is read only")
            if row.get("returned") is not None:
                return Mismatch("adamw_update returned a value: it works in place and returns None",
                                f"on {at}: it returned a {row['returned']}; the caller reads param, exp_avg and "
                                "exp_avg_sq themselves, as torch.optim's step leaves them")
    return None


_ADAMW_HINT = ("AdamW's step: shrink the weight by lr * weight_decay (decoupled: the decay never enters the "
               "moments), move the two moments towards grad and grad² with beta1 and beta2, correct their bias "
               "from starting at zero with 1 - beta^step (step is 1 on the first update), and move the weight by "
               "lr * m_hat / (sqrt(v_hat) + eps). All three tensors are updated in place "
               "(chapter 05, section “2 · One training step, measured: memory, mixed precision, checkpointing”).")

register(Check(check_id="lab05.adamw_update", task=_TASKS[6], reference=reference(_SCRATCH, "adamw_update"),
               make_inputs=_adamw_cases, drive=_drive_adamw, compare=_compare_adamw, hint=_ADAMW_HINT))
register(Check(check_id="lab05.adamw_edges", task=_TASKS[6], reference=reference(_SCRATCH, "adamw_update"),
               make_inputs=_adamw_edges, drive=_drive_adamw, compare=_compare_adamw,
               hint=_ADAMW_HINT + " No weight decay, a single step, a large eps, zero gradients, beta1 = 0, resuming "
                                  "at step 1000 with moments already there, 12 steps."))


# --- the three pieces in one training run ------------------------------------------------------------

TRAIN_STEPS = 20
PIECES = ("softmax_backward", "rms_norm_backward", "adamw_update")


def reference_pieces() -> dict:
    from infra_lib.training.autograd import rms_norm_backward, softmax_backward
    from infra_lib.training.scratch_train import adamw_update

    return {"softmax_backward": softmax_backward, "rms_norm_backward": rms_norm_backward,
            "adamw_update": adamw_update}


def _training_inputs(rng: random.Random) -> dict:
    return {"steps": TRAIN_STEPS, "seed": rng.randrange(10**6)}


def _checked(name: str, fn, shapes):
    """``fn`` with its error named, and the shapes of what it returns checked against its inputs'."""

    def call(*args):
        try:
            result = fn(*args)
        except (NotImplementedError, MemoryError):
            raise
        except Exception as exc:  # the learner's code may raise anything
            raise RuntimeError(f"your {name} raised {type(exc).__name__}: {exc}") from None
        shapes(result, *args)
        return result

    return call


def _softmax_shapes(result, probs, grad):
    if getattr(result, "shape", None) != probs.shape:
        raise ValueError(f"your softmax_backward returned {getattr(result, 'shape', type(result).__name__)} for "
                         f"probs of shape {tuple(probs.shape)}")


def _rms_shapes(result, x, weight, grad, eps):
    if (type(result) not in (tuple, list) or len(result) != 2 or getattr(result[0], "shape", None) != x.shape
            or getattr(result[1], "shape", None) != weight.shape):
        shapes = ([tuple(getattr(r, "shape", ())) for r in result] if type(result) in (tuple, list)
                  else type(result).__name__)
        raise ValueError(f"your rms_norm_backward must return (grad_x {tuple(x.shape)}, grad_weight "
                         f"{tuple(weight.shape)}); it returned {shapes}")


def _drive_training(pieces, case: dict) -> dict:
    from infra_lib.training.autograd import using_backward
    from infra_lib.training.scratch_train import train_tiny

    if type(pieces) is not dict or set(pieces) != set(PIECES):
        raise TypeError(f"check('lab05.train_tiny', pieces) takes a dict of your {', '.join(PIECES)}")
    grad_norms: list = []
    with _NoTorchAdam(), using_backward(softmax=_checked("softmax_backward", pieces["softmax_backward"],
                                                         _softmax_shapes),
                                        rms_norm=_checked("rms_norm_backward", pieces["rms_norm_backward"],
                                                          _rms_shapes)):
        losses = train_tiny(case["steps"], adamw=_checked("adamw_update", pieces["adamw_update"],
                                                          lambda *args: None),
                            seed=case["seed"], grad_norms=grad_norms)
    return {"losses": losses, "first_grad_norms": grad_norms[0] if grad_norms else {}}


def _first_gradient_note(got: dict, want: dict) -> str:
    """Which piece the first step's gradients point at (the weights are the same before it)."""
    differ = [name for name, value in want.items()
              if not (is_number(got.get(name)) and math.isclose(got[name], value, rel_tol=1e-5, abs_tol=1e-12))]
    if not differ:
        return ("; the first step's gradients agree with the reference's, so the update differs: your adamw_update "
                "(task 6)")
    if "norm.weight" in differ:
        return "; already the final RMSNorm's weight gradient differs: your rms_norm_backward (task 5)"
    top = max((int(name.split(".")[1]) for name in want if name.startswith("layers.")), default=0)
    if f"layers.{top}.mlp.down_proj.weight" in differ:
        return ("; already the last MLP's gradients differ, which no softmax lies behind (only the final RMSNorm): "
                "your rms_norm_backward (task 5)")
    return (f"; the last layer's MLP gradients agree, its query and key projections' do not ({len(differ)} of "
            f"{len(want)} parameters differ, e.g. {differ[0]}): the attention scores' gradient, your softmax_backward "
            "(task 4)")


def _compare_training(got, expected, case: dict) -> Mismatch | None:
    if type(got) is not dict or type(got.get("losses")) is not list:
        return Mismatch("the check recorded a malformed result", f"got {got!r:.80}")
    losses, want = got["losses"], expected["losses"]
    where = f"train_tiny({case['steps']} steps, seed={case['seed']})"
    for step, (g, e) in enumerate(zip(losses, want), start=1):
        if not (is_number(g) and math.isclose(g, e, rel_tol=1e-5)):
            shown = ", ".join(f"{x:.6f}" if is_number(x) else repr(x) for x in losses[:step])
            return Mismatch(f"training with your pieces left the reference's loss curve at step {step}",
                            f"on {where}: the first {step - 1} losses agree, then step {step}'s loss is "
                            f"{g!r:.12} instead of {e:.10g} (relative tolerance 1e-5); your losses so far: "
                            f"[{shown}]" + _first_gradient_note(got.get("first_grad_norms") or {},
                                                                expected["first_grad_norms"]))
    if len(losses) != len(want):
        return Mismatch("training with your pieces ran a different number of steps",
                        f"on {where}: expected {len(want)} losses, got {len(losses)}")
    return None


register(Check(check_id="lab05.train_tiny", task=_TASKS[6], reference=lambda: reference_pieces(),
               make_inputs=_training_inputs, drive=_drive_training, compare=_compare_training,
               hint=("every step of the tiny model's training runs your softmax_backward in each attention, your "
                     "rms_norm_backward in each RMSNorm and your adamw_update on each parameter (step counted from "
                     "1); their losses must follow the reference pieces' at every step. A piece whose own checks "
                     "fail shows here first: fix that task (chapter 05, sections “1 · The chain rule as a graph” "
                     "and “2 · One training step, measured: memory, mixed precision, checkpointing”).")))
