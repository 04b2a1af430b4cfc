"""Lab 05 task 9: ZeRO stage 1 over ``comm.exchange``, on a ``ThreadGroup`` with counted bytes.

``lab05.zero_halves`` runs the learner's ``reduce_scatter`` and ``all_gather`` through the ring checks' driver
(every rank a thread, a hang stopped with the ranks named): after ``reduce_scatter`` each rank's own shard,
``shard_bounds(numel, W, rank)``, must hold the sum over the ranks; after ``all_gather`` every rank must hold every
owner's shard; on sizes W divides each half sends (W - 1) / W of the tensor per rank.

``lab05.zero_step`` builds the learner's ``ZeroAdamW`` on seeded float64 parameters on every rank, gives each rank
its own gradients for three steps, and compares the parameters after each step with ``torch.optim.AdamW``
(``foreach=False``) stepped on the mean of the ranks' gradients, the state's size with the rank's shard, and the
bytes each step sends with 2 (W - 1) / W of the flat parameters. It first runs the learner's halves,
``adamw_update`` and ``shard_bounds`` on one small input each, so that a wrong step names the piece behind it.
"""

from __future__ import annotations

import math
import random

from grading.checks.lab05.ring_diagnosis import describe_ring
from grading.checks.lab05.ring_threads import drive_ring, rank_tensor
from grading.registry import Check, Mismatch, register

HALVES_TASK = "lab05 task 9: reduce_scatter and all_gather"
STEP_TASK = "lab05 task 9: ZeroAdamW"
HALVES = ("reduce_scatter", "all_gather")
PIECES = ("reduce_scatter", "all_gather", "ZeroAdamW", "adamw_update", "shard_bounds")
RANK_TIMEOUT_S = 10.0
PARAM_TOLERANCE = 1e-10  # float64, relative to the parameter's size: rounding of sums taken in another order


def _halves_case(rng: random.Random, world: int, numel: int, dtype: str = "float32") -> dict:
    return {"world": world, "shape": [numel], "dtype": dtype, "layout": "contiguous", "seed": rng.randrange(10**6)}


def _uneven(rng: random.Random, world: int) -> int:
    n = rng.randint(world + 1, 9 * world)
    return n + 1 if n % world == 0 else n


def _halves_cases(rng: random.Random) -> list[dict]:
    return [
        _halves_case(rng, 2, 2 * rng.randint(3, 20)),
        _halves_case(rng, 3, 3 * rng.randint(3, 20)),
        _halves_case(rng, 4, 4 * rng.randint(3, 20)),
        _halves_case(rng, 3, _uneven(rng, 3)),
        _halves_case(rng, 4, _uneven(rng, 4)),
    ]


def _halves_edge_cases(rng: random.Random) -> list[dict]:
    return [
        _halves_case(rng, 1, rng.randint(2, 9)),  # one rank: nothing to send
        _halves_case(rng, 4, 3),  # fewer elements than ranks: an empty shard
        _halves_case(rng, 3, 0),
        _halves_case(rng, 5, _uneven(rng, 5)),
        _halves_case(rng, 4, 4 * rng.randint(20, 60), dtype="float64"),
        _halves_case(rng, 3, _uneven(rng, 3), dtype="int64"),
        _halves_case(rng, 2, 1),
    ]


def _check_pieces(pieces, needed: tuple, check_id: str) -> None:
    if type(pieces) is not dict or not set(needed) <= set(pieces) or not set(pieces) <= set(PIECES):
        raise TypeError(f"check({check_id!r}, pieces) takes a dict of your {', '.join(needed)}")
    for name, fn in pieces.items():
        if not callable(fn):
            raise TypeError(f"pieces[{name!r}] must be your {name}, got a {type(fn).__name__}")


def drive_halves(pieces, cases: list[dict]) -> dict:
    _check_pieces(pieces, HALVES, "lab05.zero_halves")
    return {name: drive_ring(pieces[name], cases) for name in HALVES}


def _tolerance(dtype: str) -> tuple[float, float]:
    return {"float64": (1e-10, 1e-12), "int64": (0.0, 0.0)}.get(dtype, (1e-5, 1e-5))


def _shards(numel: int, world: int) -> list[tuple[int, int]]:
    from infra_lib.training.zero import shard_bounds  # the grader's side: not the learner's code

    return [shard_bounds(numel, world, r) for r in range(world)]


_HALVES_HINT = (
    "the ring's two halves with the own-shard convention: in the reduce-scatter each shard travels the ring "
    "gathering one more rank's contribution per step (W - 1 steps, partial sums added), timed so that the full sum "
    "of shard r ends on rank r; in the all-gather each owner's shard travels W - 1 hops, replacing the stale copies "
    "it passes. Shard r is shard_bounds(numel, W, r) (chapter 05, section “6 · ZeRO: sharding the training state”)."
)
_RING_END_HINT = (
    "your reduce-scatter ends as the all-reduce ring's first half does, with shard (r + 1) % W finished on rank r. "
    "ZeRO needs the sum of rank r's OWN shard on rank r (the shard whose optimizer state it keeps): shift which "
    "shard each rank sends at each step so that the last partial sum to arrive is its own."
)
_BOUNDARY_HINT = (
    "only elements at a shard's edge are wrong: a shard is exactly tensor[start:end] with (start, end) = "
    "shard_bounds(numel, W, r), end excluded, the same split on every rank."
)
_TRAFFIC_HINT = (
    "each half moves one shard per exchange, W - 1 exchanges: (W - 1) / W of the tensor per rank. A whole "
    "all-reduce for the reduce-scatter sends twice that."
)


def _rank_values(data: dict) -> list[float] | None:
    import numpy as np

    try:
        return np.asarray(data["values"], dtype=np.float64).reshape(-1)
    except (TypeError, ValueError, KeyError):
        return None


def _scatter_problem(case: dict, got_ranks: list, want_ranks: list, where: str) -> Mismatch | None:
    import numpy as np

    world, numel = case["world"], case["shape"][0]
    rtol, atol = _tolerance(case["dtype"])
    shards = _shards(numel, world)
    total = sum(rank_tensor(case, r).double().numpy() for r in range(world))
    for rank, (g, w) in enumerate(zip(got_ranks, want_ranks)):
        got, want = _rank_values(g), _rank_values(w)
        start, end = shards[rank]
        at = f"{where}, rank {rank} (its shard is elements {start}..{end - 1})"
        if got is None or got.shape != want.shape:
            return Mismatch("reduce_scatter changed the tensor's shape or type", f"on {at}")
        bad = ~np.isclose(got[start:end], want[start:end], rtol=rtol, atol=atol)
        if not bad.any():
            if g["returned"] != "the input tensor":
                return Mismatch(
                    "reduce_scatter must return the tensor it was given (it works in place)",
                    f"on {at}: it returned {g['returned'] if type(g['returned']) is str else 'another tensor'}",
                )
            continue
        first = start + int(np.argmax(bad))
        detail = (
            f"on {at}: {int(bad.sum())} of {end - start} elements of its own shard differ; at index {first} "
            f"expected the sum {want[first]:.8g}, got {got[first]:.8g}"
        )
        nxt = (rank + 1) % world
        s2, e2 = shards[nxt]
        if world > 1 and e2 > s2 and np.allclose(got[s2:e2], total[s2:e2], rtol=rtol, atol=atol):
            return Mismatch(
                "after reduce_scatter rank r holds the sum of shard (r + 1) % W, not of its own shard",
                f"{detail}; its elements {s2}..{e2 - 1}, rank {nxt}'s shard, hold the sum",
                hint=_RING_END_HINT,
            )
        wrong = np.flatnonzero(bad) + start
        if set(wrong.tolist()) <= {start, end - 1}:
            return Mismatch("reduce_scatter is wrong at the edge of a shard", detail, hint=_BOUNDARY_HINT)
        if world > 1 and np.allclose(got[start:end], want[start:end] / world, rtol=1e-5, atol=1e-6):
            return Mismatch(
                "reduce_scatter averaged instead of summing", f"{detail}: the sum divided by {world}", hint=_HALVES_HINT
            )
        return Mismatch("after reduce_scatter a rank's own shard does not hold the sum over the ranks", detail)
    return None


def _gather_problem(case: dict, got_ranks: list, want_ranks: list, where: str) -> Mismatch | None:
    import numpy as np

    world, numel = case["world"], case["shape"][0]
    shards = _shards(numel, world)
    for rank, (g, w) in enumerate(zip(got_ranks, want_ranks)):
        got, want = _rank_values(g), _rank_values(w)
        if got is None or got.shape != want.shape:
            return Mismatch("all_gather changed the tensor's shape or type", f"on {where}, rank {rank}")
        if np.array_equal(got, want):
            if g["returned"] != "the input tensor":
                return Mismatch(
                    "all_gather must return the tensor it was given (it works in place)",
                    f"on {where}, rank {rank}: it returned another object",
                )
            continue
        owner = next(o for o, (s, e) in enumerate(shards) if not np.array_equal(got[s:e], want[s:e]))
        s, e = shards[owner]
        original = rank_tensor(case, rank).double().numpy().reshape(-1)
        note = ""
        if np.array_equal(got[s:e], original[s:e]):
            note = ": it still holds what the rank had there before, owner's shard never arrived"
        elif np.allclose(got[s:e], want[s:e] + original[s:e]):
            note = ": it holds the owner's shard plus the rank's stale copy; the all-gather replaces, it never adds"
        return Mismatch(
            "after all_gather a rank does not hold every owner's shard",
            f"on {where}, rank {rank}: its copy of rank {owner}'s shard (elements {s}..{e - 1}) differs{note}",
        )
    return None


def _traffic_problem(name: str, case: dict, got_ranks: list, where: str) -> Mismatch | None:
    world, numel = case["world"], case["shape"][0]
    if numel % world:
        return None
    itemsize = 8 if case["dtype"] in ("float64", "int64") else 4
    want = (world - 1) * numel // world * itemsize
    for rank, g in enumerate(got_ranks):
        if g["bytes"] != want:
            return Mismatch(
                f"{name} sent a different number of bytes than one half of a ring does",
                f"on {where}, rank {rank}: sent {g['bytes']} bytes in {g['messages']} exchanges; (W - 1) / W of the "
                f"{numel * itemsize}-byte tensor is {want} bytes in {world - 1} exchanges",
                hint=_TRAFFIC_HINT,
                reason="excess traffic",
            )
    return None


def compare_halves(got, expected, cases: list[dict]) -> Mismatch | None:
    from grading.checks.common import unwrap

    if type(got) is not dict or set(got) != set(HALVES):
        return Mismatch(f"the check recorded a malformed result: {got!r:.80}")
    for name, problem_of in (("reduce_scatter", _scatter_problem), ("all_gather", _gather_problem)):
        for case, g, e in zip(cases, got[name], expected[name]):
            where = f"{name} on {describe_ring(case)}"
            kind, value = unwrap(g)
            if kind == "skipped":
                continue  # an earlier case of this half failed: that case is reported
            if kind == "raised":
                return Mismatch(f"{name} raised an exception or did not finish", f"on {where}: {value}")
            if kind != "value" or type(value) is not list or len(value) != case["world"]:
                return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
            problem = problem_of(case, value, e[1], where) or _traffic_problem(name, case, value, where)
            if problem:
                return problem
    return None


def halves_parts() -> dict:
    return {
        "task": HALVES_TASK,
        "reference": lambda: {name: _reference(name) for name in HALVES},
        "drive": drive_halves,
        "compare": compare_halves,
    }


def _reference(name: str):
    import importlib

    module = "infra_lib.training.scratch_train" if name == "adamw_update" else "infra_lib.training.zero"
    return getattr(importlib.import_module(module), name)


register(
    Check(
        check_id="lab05.zero_halves",
        make_inputs=_halves_cases,
        hint=_HALVES_HINT,
        **halves_parts(),
    )
)

register(
    Check(
        check_id="lab05.zero_halves_edges",
        make_inputs=_halves_edge_cases,
        hint=_HALVES_HINT + " One rank, fewer elements than ranks (an empty shard is still exchanged), an empty "
        "tensor, 5 ranks, float64 and int64 tensors (received data keeps the tensor's dtype).",
        **halves_parts(),
    )
)


# --- the step -----------------------------------------------------------------------------------------------


def _step_case(
    rng: random.Random, world: int, shapes: list, weight_decay: float = 0.01, grad_scale: float = 1.0, eps=1e-8
) -> dict:
    return {
        "world": world,
        "shapes": shapes,
        "steps": 3,
        "lr": rng.choice([1e-2, 3e-3]),
        "betas": [0.9, rng.choice([0.99, 0.999])],
        "eps": eps,
        "weight_decay": weight_decay,
        "grad_scale": grad_scale,
        "seed": rng.randrange(10**6),
    }


def _step_cases(rng: random.Random) -> list[dict]:
    return [
        _step_case(rng, 2, [[4, 3], [6], [2]]),  # 20 elements
        _step_case(rng, 3, [[5, 3], [6]], weight_decay=0.1),  # 21
        _step_case(rng, 4, [[3, 3], [4]]),  # 13: W does not divide
        _step_case(rng, 1, [[3, 2], [2]]),
    ]


def _step_edge_cases(rng: random.Random) -> list[dict]:
    return [
        _step_case(rng, 3, [[4, 2], [3], [1]], weight_decay=0.0),  # 12
        _step_case(rng, 4, [[2], [1]]),  # fewer elements than ranks
        _step_case(rng, 2, [[7, 2], [5]], grad_scale=1e-7, eps=1e-8),  # gradients small against eps: the mean matters
        _step_case(rng, 4, [[6, 4], [8], [1], [3]]),  # 36
        _step_case(rng, 3, [[rng.randint(5, 9)], [rng.randint(2, 6), 3]], weight_decay=0.2),
    ]


def step_tensors(case: dict) -> tuple[list, list]:
    """(initial parameters, per step per rank per parameter gradients), float64, seeded."""
    import torch

    gen = torch.Generator().manual_seed(case["seed"])
    init = [torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in case["shapes"]]
    grads = [
        [
            [torch.randn(*shape, generator=gen, dtype=torch.float64) * case["grad_scale"] for shape in case["shapes"]]
            for _ in range(case["world"])
        ]
        for _ in range(case["steps"])
    ]
    return init, grads


def torch_adamw(case: dict, mean: bool = True) -> list[list[float]]:
    """The flat parameters after each step of ``torch.optim.AdamW(foreach=False)`` on the ranks' mean gradient
    (or, ``mean=False``, their sum: the mistake a comparison names)."""
    import torch

    init, grads = step_tensors(case)
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = torch.optim.AdamW(
        params,
        lr=case["lr"],
        betas=tuple(case["betas"]),
        eps=case["eps"],
        weight_decay=case["weight_decay"],
        foreach=False,
    )
    out = []
    for step_grads in grads:
        for i, p in enumerate(params):
            total = sum(rank_grads[i] for rank_grads in step_grads)
            p.grad = total / case["world"] if mean else total
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in params]).tolist())
    return out


class _Comm:
    """A rank's communicator as the learner's ZeroAdamW sees it: it notes when the rank waits in exchange."""

    def __init__(self, comm):
        self._comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.waiting = False

    @property
    def bytes_sent(self) -> int:
        return self._comm.bytes_sent

    def exchange(self, send, to, recv, source) -> None:
        """Send ``send`` to rank ``to`` and receive into ``recv`` from rank ``source``, both at once."""
        self.waiting = True
        self._comm.exchange(send, to, recv, source)
        self.waiting = False


def _state_numel(opt, name: str):
    import torch

    value = getattr(opt, name, None)
    return value.numel() if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


def _run_step_case(ZeroAdamW, case: dict) -> dict:  # noqa: N803 - the learner's class
    import threading

    import torch

    from grading.checks.lab05.ddp import stop_rank_threads
    from grading.checks.lab05.pieces import NoTorchAdam
    from infra_lib.training.collectives import ThreadGroup

    init, grads = step_tensors(case)
    world = case["world"]
    recs = [{"params": [], "bytes": [], "state": None, "error": None} for _ in range(world)]
    comms, threads, stops = {}, {}, []

    def on_rank(comm):
        rec, comm = recs[comm.rank], _Comm(comm)
        comms[comm.rank], threads[comm.rank] = comm, threading.current_thread()
        params = [torch.nn.Parameter(t.clone()) for t in init]
        method = "ZeroAdamW(...)"
        try:
            opt = ZeroAdamW(
                params,
                comm,
                lr=case["lr"],
                betas=tuple(case["betas"]),
                eps=case["eps"],
                weight_decay=case["weight_decay"],
            )
            rec["state"] = [_state_numel(opt, "exp_avg"), _state_numel(opt, "exp_avg_sq")]
            for step, step_grads in enumerate(grads):
                for p, g in zip(params, step_grads[comm.rank]):
                    p.grad = g.clone()
                before, method = comm.bytes_sent, f"step() number {step + 1}"
                opt.step()
                rec["bytes"].append(comm.bytes_sent - before)
                rec["params"].append(torch.cat([p.detach().reshape(-1) for p in params]).tolist())
        except (NotImplementedError, MemoryError) as exc:
            stops.append(exc)
        except Exception as exc:  # the learner's code may raise anything
            rec["error"] = f"in {method}: {type(exc).__name__}: {exc}"[:400]
        rec["done"] = True

    hang = None
    with NoTorchAdam():
        try:
            ThreadGroup(world).run(on_rank, timeout_s=RANK_TIMEOUT_S)
        except TimeoutError:
            waiting = [r for r, c in sorted(comms.items()) if not recs[r].get("done") and c.waiting]
            running = [r for r in sorted(comms) if not recs[r].get("done") and r not in waiting]
            hang = f"after {RANK_TIMEOUT_S:g} s ranks {waiting} were waiting in exchange for a message no rank sent"
            if running:
                hang += f" and ranks {running} were running your code (a loop that never ends?)"
            stop_rank_threads([threads[r] for r in running])
    if stops:
        raise stops[0]
    for rec in recs:
        rec.pop("done", None)
    return {"ranks": recs, "hang": hang, "torch": torch_adamw(case), "torch_sum": torch_adamw(case, mean=False)}


def _probes(pieces: dict) -> dict:
    """Each of the learner's other pieces on one small input: the step's failure can name the piece behind it."""
    import torch

    from grading.checks.common import outcome

    probe_case = {"world": 3, "shape": [10], "dtype": "float64", "layout": "contiguous", "seed": 7}
    out = {name: drive_ring(pieces[name], [probe_case]) for name in HALVES}
    if "shard_bounds" in pieces:
        out["shard_bounds"] = [outcome(pieces["shard_bounds"], n, w, r) for n, w in ((10, 4), (2, 3)) for r in range(w)]
    if "adamw_update" in pieces:
        tensors = [torch.linspace(-1, 1, 5, dtype=torch.float64) * k for k in (1.0, 0.5, 0.0, 0.0)]
        kind = outcome(pieces["adamw_update"], *tensors, 1, 0.01, 0.9, 0.999, 1e-8, 0.1)
        out["adamw_update"] = kind if kind[0] == "raised" else ["value", tensors[0].tolist()]
    return out


def drive_zero_step(pieces, cases: list[dict]) -> dict:
    from grading.checks.common import one_thread

    _check_pieces(pieces, ("ZeroAdamW", *HALVES), "lab05.zero_step")
    if not callable(pieces["ZeroAdamW"]):  # a class, or anything that builds one when called
        raise TypeError(f"pieces['ZeroAdamW'] must be your ZeroAdamW class, got a {type(pieces['ZeroAdamW']).__name__}")
    with one_thread():
        probes, results = _probes(pieces), []
        for case in cases:
            if results and (
                results[-1] is None or results[-1]["hang"] or any(r["error"] for r in results[-1]["ranks"])
            ):
                results.append(None)  # skipped: a hang costs seconds, and the failed case is what is reported
                continue
            results.append(_run_step_case(pieces["ZeroAdamW"], case))
        return {"probes": probes, "cases": results}


_STEP_HINT = (
    "ZeroAdamW.step: reduce-scatter the flat local gradients (your own shard then holds their sum), divide by W "
    "for the mean, AdamW (your adamw_update) on your shard of the flat parameters with the state of that shard "
    "only, then all-gather the flat parameters and copy them back into the parameters (chapter 05, section "
    "“6 · ZeRO: sharding the training state”)."
)
_STATE_HINT = (
    "stage 1 shards the optimizer state: each rank keeps exp_avg and exp_avg_sq for its own shard of the "
    "flattened parameters only, shard_bounds(total numel, W, rank), 1 / W of the memory."
)
_GATHER_STEP_HINT = (
    "after the update each rank has new values for its own shard only: an all-gather of the flat parameters gives "
    "every rank every shard, then copy them back into the parameters."
)
_MEAN_STEP_HINT = (
    "the reduce-scatter leaves the SUM of the ranks' gradients on your shard; AdamW steps on their mean, the "
    "global batch's gradient: divide by W (with gradients small next to eps the difference shows)."
)


def describe_step(case: dict) -> str:
    numel = sum(math.prod(s) for s in case["shapes"])
    return (
        f"world size {case['world']}, float64 parameters of shapes {case['shapes']} ({numel} elements), lr "
        f"{case['lr']:g}, betas {tuple(case['betas'])}, eps {case['eps']:g}, weight_decay {case['weight_decay']:g}"
        + (f", gradients of the order of {case['grad_scale']:g}" if case["grad_scale"] != 1 else "")
    )


def _probe_problem(got: dict, want: dict) -> Mismatch | None:
    import numpy as np

    for name in HALVES:
        g, w = got[name][0], want[name][0]
        if g[0] != "value" or not all(
            np.allclose(_rank_values(a)[slice(*s)], _rank_values(b)[slice(*s)], rtol=1e-10, atol=1e-12)
            for a, b, s in zip(g[1], w[1], _shards(10, 3) if name == "reduce_scatter" else [(0, 10)] * 3)
        ):
            return Mismatch(
                f"your {name} does not do its part (its own check, lab05.zero_halves, fails), and ZeroAdamW.step "
                "calls it",
                f"on {name} of a float64 tensor of 10 elements on 3 ranks: "
                + (str(g[1]) if g[0] == "raised" else "a rank's result differs"),
                hint=_HALVES_HINT,
            )
    if "shard_bounds" in got and got["shard_bounds"] != want["shard_bounds"]:
        return Mismatch(
            "your shard_bounds (task 6) does not split as its checks require, and ZeroAdamW's shards come from it",
            "on numel 10 over 4 ranks and 2 over 3",
            hint="fix task 6 first",
        )
    if "adamw_update" in got and not (
        got["adamw_update"][0] == "value" and np.allclose(got["adamw_update"][1], want["adamw_update"][1], rtol=1e-12)
    ):
        return Mismatch(
            "your adamw_update (task 5) does not give torch's AdamW step, and ZeroAdamW.step calls it",
            "on one step of a 5-element float64 tensor",
            hint="fix task 5 first",
        )
    return None


def _params_problem(case: dict, got: dict, want: dict, where: str) -> Mismatch | None:
    import numpy as np

    from infra_lib.training.zero import shard_bounds

    world = case["world"]
    numel = sum(math.prod(s) for s in case["shapes"])
    target = np.asarray(want["torch"])
    init = np.concatenate([t.reshape(-1).numpy() for t in step_tensors(case)[0]])
    for step in range(case["steps"]):
        previous = init if step == 0 else target[step - 1]
        for rank, rec in enumerate(got["ranks"]):
            if step >= len(rec["params"]):
                continue
            params = np.asarray(rec["params"][step], dtype=np.float64)
            at = f"{where}, rank {rank}, after step() number {step + 1}"
            if params.shape != target[step].shape:
                return Mismatch("ZeroAdamW.step changed the parameters' sizes", f"on {at}")
            tol = PARAM_TOLERANCE * np.maximum(1.0, np.abs(target[step]))
            bad = np.abs(params - target[step]) > tol
            if not bad.any():
                continue
            start, end = shard_bounds(numel, world, rank)
            first = int(np.argmax(bad))
            detail = (
                f"on {at}: {int(bad.sum())} of {numel} parameter elements differ from torch.optim.AdamW(foreach=False) "
                f"on the mean gradient; at flat index {first} expected {target[step][first]:.12g}, got "
                f"{params[first]:.12g} (this rank's shard is {start}..{end - 1}; tolerance {PARAM_TOLERANCE:g} "
                "relative)"
            )
            outside = np.r_[0:start, end:numel]
            if not bad[start:end].any() and np.allclose(params[outside], previous[outside], rtol=0, atol=0):
                return Mismatch(
                    "after ZeroAdamW.step only the rank's own shard is updated", detail, hint=_GATHER_STEP_HINT
                )
            if np.allclose(params, np.asarray(want["torch_sum"][step]), rtol=1e-9, atol=1e-12):
                return Mismatch("ZeroAdamW.step took AdamW on the sum of the gradients", detail, hint=_MEAN_STEP_HINT)
            return Mismatch("ZeroAdamW.step did not give AdamW's parameters", detail)
    return None


def _step_case_problem(case: dict, got: dict, want: dict) -> Mismatch | None:
    from infra_lib.training.zero import shard_bounds

    where = describe_step(case)
    world = case["world"]
    if type(got) is not dict or type(got.get("ranks")) is not list or len(got["ranks"]) != world:
        return Mismatch("the check recorded a malformed result", f"on {where}: {got!r:.80}")
    numel = sum(math.prod(s) for s in case["shapes"])
    for rank, rec in enumerate(got["ranks"]):
        start, end = shard_bounds(numel, world, rank)
        if rec["state"] is not None and rec["state"] != [end - start] * 2:
            return Mismatch(
                "ZeroAdamW's exp_avg and exp_avg_sq are not the size of the rank's shard",
                f"on {where}, rank {rank}: they hold {rec['state'][0]} and {rec['state'][1]} elements; its shard of "
                f"the {numel} flat parameters is elements {start}..{end - 1}, {end - start} elements",
                hint=_STATE_HINT,
            )
    if got["hang"]:
        return Mismatch("ZeroAdamW did not finish", f"on {where}: {got['hang']}", hint=_STEP_HINT)
    problem = _params_problem(case, got, want, where)
    if problem:
        return problem
    for rank, rec in enumerate(got["ranks"]):
        if rec["error"]:
            return Mismatch("ZeroAdamW raised an exception", f"on {where}, rank {rank}: {rec['error']}")
    if numel % world == 0:
        want_bytes = 2 * (world - 1) * numel // world * 8
        for rank, rec in enumerate(got["ranks"]):
            if any(b != want_bytes for b in rec["bytes"]):
                half = (
                    "; that is one half: the other half of the ring is missing"
                    if rec["bytes"][0] * 2 == want_bytes
                    else ""
                )
                return Mismatch(
                    "a ZeroAdamW step sent a different number of bytes than a reduce-scatter and an all-gather do",
                    f"on {where}, rank {rank}: its steps sent {rec['bytes']} bytes; 2 (W - 1) / W of the "
                    f"{numel * 8}-byte flat parameters is {want_bytes}{half}",
                    hint=_TRAFFIC_HINT,
                    reason="excess traffic",
                )
    return None


def compare_zero_step(got, expected, cases: list[dict]) -> Mismatch | None:
    if type(got) is not dict or set(got) != {"probes", "cases"} or len(got["cases"]) != len(cases):
        return Mismatch(f"the check recorded a malformed result: {got!r:.80}")
    for case, g, e in zip(cases, got["cases"], expected["cases"]):
        if g is None:
            return Mismatch("the check recorded a malformed result", f"on {describe_step(case)}: skipped")
        problem = _step_case_problem(case, g, e)
        if problem:
            return _probe_problem(got["probes"], expected["probes"]) or problem
    return None


def step_parts() -> dict:
    return {
        "task": STEP_TASK,
        "reference": lambda: {name: _reference(name) for name in PIECES},
        "drive": drive_zero_step,
        "compare": compare_zero_step,
    }


register(
    Check(
        check_id="lab05.zero_step",
        make_inputs=_step_cases,
        hint=_STEP_HINT,
        **step_parts(),
    )
)

register(
    Check(
        check_id="lab05.zero_step_edges",
        make_inputs=_step_edge_cases,
        hint=_STEP_HINT + " No weight decay, fewer elements than ranks (an empty shard: an empty state), gradients "
        "small next to eps, 4 ranks with four parameters.",
        **step_parts(),
    )
)
