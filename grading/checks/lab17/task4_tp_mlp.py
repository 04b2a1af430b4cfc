"""Lab 17 task 4: ``shard_mlp(mlp, rank, world_size)`` and ``tp_mlp_forward(x, shard, all_reduce)``, a SwiGLU MLP
split over ranks. Every rank is a thread of the kernel; they share ``all_reduce``, a real one: it waits until every
rank has called it, sums their tensors in rank order and hands each rank the sum, and counts the calls.

For each case the driver records, per rank, which rows of gate and up and which columns of down its shard holds
(found by value in the unsplit weights), what each rank's forward returned, and how often it called all_reduce.
The comparison checks the split first (every intermediate unit on exactly one rank, as ``shard_bounds`` splits
them), then the calls, then the outputs against the unsplit MLP. The driver also computes what the usual mistakes
would give (the SiLU after the all-reduce, a rank's partial returned unsummed); the comparison reads those from
the reference's side only and names the one the learner's output matches.
"""

from __future__ import annotations

import functools
import math
import random
import threading

from grading.checks.common import array_mismatch
from grading.checks.lab17.tasks import TASKS, TP_SECTION
from grading.registry import Check, Mismatch, register

RANK_TIMEOUT_S = 5.0
ATOL, RTOL = 1e-4, 1e-4

SPLIT_HINT = (
    "the intermediate units are split, not the hidden size: rank r holds units shard_bounds(intermediate, "
    "world_size, r), the rows of gate_proj.weight and of up_proj.weight for those units (column-parallel) and the "
    f"same columns of down_proj.weight (row-parallel), so every unit lives on exactly one rank ({TP_SECTION})"
)
DOWN_HINT = (
    "down_proj.weight is [hidden, intermediate]: its input is the intermediate dimension, along its columns, so a "
    "rank's share of down is a slice of columns (the units it owns), each rank's product then a partial sum of the "
    "whole hidden output"
)
UP_HINT = (
    "gate and up are both column-parallel: a rank needs the same units of up as of gate, to multiply them unit by unit"
)
CALLS_HINT = (
    "one forward calls all_reduce exactly once, with the rank's partial output [..., hidden]: gate, up, the SiLU "
    "and down all run on the rank's own units without communication, and only the partial outputs are summed"
)
SILU_HINT = (
    "the SiLU acts on each intermediate unit, inside a rank: silu of the rank's gate units times its up units, "
    "before down; the all-reduce sums partial outputs, and the SiLU of a sum is not the sum of the SiLUs"
)
RETURN_HINT = "tp_mlp_forward returns what all_reduce returned (the sum over the ranks), not the rank's own partial"
VALUES_HINT = (
    "each rank computes down_r(silu(gate_r x) * up_r x) over its own units, a partial of the unsplit output; the "
    "all-reduce adds the partials into the MLP's output, the same on every rank"
)


def _case(rng: random.Random, hidden: int, intermediate: int, world: int, lead: list[int]) -> dict:
    return {"hidden": hidden, "intermediate": intermediate, "world": world, "lead": lead, "seed": rng.randrange(10**6)}


def tp_cases(rng: random.Random) -> list[dict]:
    """SmolLM2's MLP (576 -> 1536) on 2 ranks, an odd MLP on 3 ranks and an uneven split on 4."""
    return [
        _case(rng, 576, 1536, 2, [rng.randint(1, 4)]),
        _case(rng, rng.choice([10, 11]), 7, 3, [2, rng.randint(2, 5)]),
        _case(rng, 24, rng.choice([30, 31]), 4, [rng.randint(2, 6)]),
    ]


def tp_edge_cases(rng: random.Random) -> list[dict]:
    """One rank, one unit per rank, SmolLM2's MLP on 3 ranks, 1537 units on 4, and an x without leading dims."""
    return [
        _case(rng, 16, 12, 1, [3]),
        _case(rng, 9, 4, 4, [2]),
        _case(rng, 576, 1536, 3, [2]),
        _case(rng, 32, 1537, 4, []),
        _case(rng, 13, 5, 2, [1, 2, 3]),
    ]


def build_mlp(case: dict):
    """The case's MLP (the course's SwiGLU module, seeded weights) and its input x [*lead, hidden]."""
    import torch

    from infra_lib.model.config import LlamaConfig
    from infra_lib.model.model import MLP

    hidden, intermediate = case["hidden"], case["intermediate"]
    config = LlamaConfig(
        vocab_size=1,
        hidden_size=hidden,
        n_layers=1,
        n_heads=1,
        n_kv_heads=1,
        head_dim=2,
        intermediate_size=intermediate,
    )
    mlp = MLP(config)
    generator = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            fan_in = linear.weight.shape[1]
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) / math.sqrt(fan_in))
    return mlp, torch.randn(*case["lead"], hidden, generator=generator)


def _indices(part, weight, axis: int) -> list[int] | None:
    """Where each row (axis 0) or column (axis 1) of ``part`` lies in ``weight`` (-1: nowhere); None when ``part`` is
    not a 2-D tensor whose other dimension is the weight's."""
    import torch

    if not isinstance(part, torch.Tensor) or part.dim() != 2 or part.shape[1 - axis] != weight.shape[1 - axis]:
        return None
    rows = weight if axis == 0 else weight.t()
    found = {rows[i].detach().numpy().tobytes(): i for i in range(rows.shape[0])}
    mine = part.detach().to(weight.dtype) if axis == 0 else part.detach().to(weight.dtype).t()
    return [found.get(mine[i].contiguous().numpy().tobytes(), -1) for i in range(mine.shape[0])]


def _shard_facts(shard, mlp) -> dict:
    """Which units a shard's gate, up and down hold, and their shapes."""
    import torch

    parts = {name: getattr(shard, name, None) for name in ("gate", "up", "down")}
    if any(part is None for part in parts.values()):
        return {"form": f"a {type(shard).__name__} without gate, up and down"}
    weights = {"gate": mlp.gate_proj.weight, "up": mlp.up_proj.weight, "down": mlp.down_proj.weight}
    return {
        "form": "ok",
        "shapes": {n: list(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__ for n, p in parts.items()},
        "gate": _indices(parts["gate"], weights["gate"], 0),
        "up": _indices(parts["up"], weights["up"], 0),
        "down": _indices(parts["down"], weights["down"], 1),
        "down_rows": _indices(parts["down"], weights["down"], 0),
    }


class ThreadAllReduce:
    """A summing all-reduce for ranks that are threads: each call waits for the same call of every other rank, then
    returns the sum of their tensors in rank order (a new tensor, the same on every rank). It counts each rank's
    calls, and a call that no other rank will match (the others finished, or never come) raises at once."""

    def __init__(self, world: int):
        self.world = world
        self.calls = [0] * world
        self.done = [False] * world
        self.rounds: dict[int, dict[int, object]] = {}
        self.cond = threading.Condition()

    def for_rank(self, rank: int):
        def all_reduce(tensor):
            return self._reduce(rank, tensor)

        return all_reduce

    def finished(self, rank: int) -> None:
        with self.cond:
            self.done[rank] = True
            self.cond.notify_all()

    def _reduce(self, rank: int, tensor):
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"rank {rank} passed a {type(tensor).__name__} to all_reduce: it sums tensors")
        with self.cond:
            self.calls[rank] += 1
            call = self.calls[rank]
            parts = self.rounds.setdefault(call, {})
            parts[rank] = tensor.detach().clone()
            self.cond.notify_all()
            self.cond.wait_for(
                lambda: len(parts) == self.world or any(self.done[r] for r in range(self.world) if r not in parts),
                timeout=RANK_TIMEOUT_S,
            )
            missing = [r for r in range(self.world) if r not in parts]
            if missing:
                counts = ", ".join(f"rank {r} {self.calls[r]}" for r in missing)
                raise RuntimeError(
                    f"rank {rank}'s all_reduce number {call} waits for ranks {missing}, which made fewer calls in "
                    f"their forward ({counts}): every rank calls all_reduce the same number of times"
                )
        shapes = sorted({tuple(p.shape) for p in parts.values()})
        if len(shapes) > 1:
            raise ValueError(
                f"all_reduce number {call} got tensors of shapes {[list(s) for s in shapes]} from the ranks: "
                "each rank passes its partial output, the same shape on every rank"
            )
        total = parts[0].clone()
        for r in range(1, self.world):
            total = total + parts[r]
        return total


def run_ranks(forward, shards: list, x, world: int) -> list[dict]:
    """``forward(x, shards[rank], all_reduce)`` on one thread per rank: per rank, its output, calls and error."""
    import torch

    reduce = ThreadAllReduce(world)
    results: list[dict] = [{} for _ in range(world)]

    def target(rank: int) -> None:
        try:
            out = forward(x.clone(), shards[rank], reduce.for_rank(rank))
            results[rank]["output"] = out.detach().float().tolist() if isinstance(out, torch.Tensor) else None
            results[rank]["returned"] = "a tensor" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        except BaseException as exc:  # noqa: BLE001 - reported per rank, the stub's error raised again below
            results[rank]["exception"] = exc
            results[rank]["error"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            reduce.finished(rank)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(RANK_TIMEOUT_S * 2)
    for rank, thread in enumerate(threads):
        if thread.is_alive():
            results[rank]["error"] = f"still running after {RANK_TIMEOUT_S * 2:g} s (a loop that never ends?)"
        exc = results[rank].pop("exception", None)
        if isinstance(exc, (NotImplementedError, MemoryError)):
            raise exc
        results[rank]["calls"] = reduce.calls[rank]
    return results


def _mistakes(mlp, x, world: int) -> dict:
    """What the usual mistakes give, from the contract's split: the SiLU applied to the summed output (of partials
    computed without it, or of the right partials), and each rank's partial alone."""
    import torch.nn.functional as F

    from infra_lib.training.zero import shard_bounds

    partials, plain = [], []
    for rank in range(world):
        start, end = shard_bounds(mlp.gate_proj.weight.shape[0], world, rank)
        gate, up = F.linear(x, mlp.gate_proj.weight[start:end]), F.linear(x, mlp.up_proj.weight[start:end])
        down = mlp.down_proj.weight[:, start:end]
        partials.append(F.linear(F.silu(gate) * up, down))
        plain.append(F.linear(gate * up, down))
    return {
        "silu_after_sum": F.silu(sum(plain)).tolist(),
        "silu_of_output": F.silu(sum(partials)).tolist(),
        "partials": [p.tolist() for p in partials],
    }


def drive_tp(answers, cases: list[dict]) -> list[dict]:
    import torch

    if not isinstance(answers, dict) or not all(callable(answers.get(k)) for k in ("shard_mlp", "tp_mlp_forward")):
        raise TypeError('check(...) needs {"shard_mlp": shard_mlp, "tp_mlp_forward": tp_mlp_forward}')
    records = []
    for case in cases:
        if records and records[-1].get("failed"):
            records.append({"skipped": True})  # one failed case is enough to judge; the rest would repeat it
            continue
        mlp, x = build_mlp(case)
        world = case["world"]
        with torch.no_grad():
            record = {"full": mlp(x).tolist(), **_mistakes(mlp, x, world)}
            shards = []
            for rank in range(world):
                try:
                    shards.append(answers["shard_mlp"](mlp, rank, world))
                except (NotImplementedError, MemoryError):
                    raise
                except Exception as exc:  # the learner's code may raise anything
                    record.update(failed=True, shard_error=f"rank {rank}: {type(exc).__name__}: {exc}"[:300])
                    break
            if "shard_error" not in record:
                record["shards"] = [_shard_facts(shard, mlp) for shard in shards]
                record["ranks"] = run_ranks(answers["tp_mlp_forward"], shards, x, world)
                record["failed"] = any("error" in r for r in record["ranks"])
        records.append(record)
    return records


def _describe(case: dict) -> str:
    return (
        f"an MLP {case['hidden']} -> {case['intermediate']} -> {case['hidden']} split over {case['world']} rank(s), "
        f"x of shape {[*case['lead'], case['hidden']]}"
    )


def _split_mismatch(shards: list[dict], case: dict, where: str) -> Mismatch | None:
    from infra_lib.training.zero import shard_bounds

    for rank, facts in enumerate(shards):
        if facts["form"] != "ok":
            return Mismatch(
                "shard_mlp must return an MLPShard", f"on {where}: rank {rank} got {facts['form']}", hint=SPLIT_HINT
            )
        start, end = shard_bounds(case["intermediate"], case["world"], rank)
        units = list(range(start, end))
        shapes = facts["shapes"]
        if facts["down"] != units and facts["down_rows"] is not None and -1 not in facts["down_rows"]:
            return Mismatch(
                "shard.down holds rows of down_proj.weight, not columns",
                f"on {where}: rank {rank}'s down is {shapes['down']}",
                hint=DOWN_HINT,
            )
        if facts["gate"] == units and facts["up"] != units:
            return Mismatch(
                "shard.up does not hold the same units as shard.gate",
                f"on {where}: rank {rank}'s gate is {shapes['gate']}, its up {shapes['up']} (units "
                f"{start}..{end - 1} expected in both)",
                hint=UP_HINT,
            )
        for name in ("gate", "up", "down"):
            if facts[name] != units:
                held = facts[name]
                shown = f"shape {shapes[name]}" if held is None else f"units {_ranges(held)}"
                return Mismatch(
                    f"rank {rank}'s shard.{name} does not hold its units",
                    f"on {where}: rank {rank} must hold units {start}..{end - 1} of the intermediate dimension "
                    f"({'rows' if name != 'down' else 'columns'} of {name}_proj.weight); it holds {shown}",
                    hint=SPLIT_HINT,
                )
    return None


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 7, -1] -> '0..2, 7, (a row found nowhere)'."""
    shown, run = [], []
    for i in indices + [None]:
        if run and (i is None or i != run[-1] + 1 or i < 0):
            shown.append(f"{run[0]}..{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        if i is not None and i >= 0:
            run.append(i)
        elif i is not None:
            shown.append("(one found nowhere in the weight)")
    return ", ".join(shown[:6]) + (", ..." if len(shown) > 6 else "")


def _output_mismatch(rank: int, output, expected: dict, where: str) -> Mismatch | None:
    import numpy as np

    def near(a, b) -> bool:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        return a.shape == b.shape and bool(np.allclose(a, b, atol=ATOL, rtol=RTOL))

    if near(output, expected["full"]):
        return None
    for key, what, hint in (
        ("silu_after_sum", "the SiLU applied after the all-reduce", SILU_HINT),
        ("silu_of_output", "the SiLU applied to the summed output", SILU_HINT),
    ):
        if near(output, expected[key]):
            return Mismatch(f"rank {rank}'s output is {what}", f"on {where}", hint=hint)
    if near(output, expected["partials"][rank]):
        return Mismatch(f"rank {rank} returned its own partial output, not the sum", f"on {where}", hint=RETURN_HINT)
    found = array_mismatch(
        output, expected["full"], f"rank {rank}'s output differs from the unsplit MLP's", where, atol=ATOL, rtol=RTOL
    )
    return Mismatch(found.what, found.detail, hint=VALUES_HINT) if found else None


def compare_tp(got, expected, cases: list[dict]) -> Mismatch | None:
    if type(got) is not list or len(got) != len(cases):
        return Mismatch("the check recorded the wrong number of cases")
    for mine, theirs, case in zip(got, expected, cases):
        if mine.get("skipped"):
            return Mismatch("an earlier case failed", "")
        where = _describe(case)
        if "shard_error" in mine:
            return Mismatch("shard_mlp raised an error", f"on {where}: {mine['shard_error']}", hint=SPLIT_HINT)
        split = _split_mismatch(mine["shards"], case, where)
        if split is not None:
            return split
        for rank, result in enumerate(mine["ranks"]):
            if result["calls"] != 1:
                return Mismatch(
                    f"rank {rank} called all_reduce {result['calls']} times in one forward",
                    f"on {where}" + (f": {result['error']}" if "error" in result else ""),
                    hint=CALLS_HINT,
                )
            if "error" in result:
                return Mismatch(
                    "tp_mlp_forward raised an error", f"on {where}: rank {rank}: {result['error']}", hint=VALUES_HINT
                )
            if result["output"] is None:
                return Mismatch(
                    "tp_mlp_forward must return a tensor",
                    f"on {where}: rank {rank} returned {result['returned']}",
                    hint=RETURN_HINT,
                )
            mismatch = _output_mismatch(rank, result["output"], theirs, where)
            if mismatch is not None:
                return mismatch
    return None


@functools.cache
def course_tp() -> dict:
    """The course's shard_mlp and tp_mlp_forward: the reference side of the checks."""
    from infra_lib.serving.tensor_parallel_decode import shard_mlp, tp_mlp_forward

    return {"shard_mlp": shard_mlp, "tp_mlp_forward": tp_mlp_forward}


course_tp.target = "infra_lib.serving.tensor_parallel_decode:shard_mlp"  # what a sandboxed kernel sees as a stub

register(
    Check(
        check_id="lab17.tp_mlp",
        task=TASKS[4],
        reference=course_tp,
        make_inputs=tp_cases,
        drive=drive_tp,
        compare=compare_tp,
        hint=VALUES_HINT,
    )
)

register(
    Check(
        check_id="lab17.tp_mlp_sizes",
        task=TASKS[4],
        reference=course_tp,
        make_inputs=tp_edge_cases,
        drive=drive_tp,
        compare=compare_tp,
        hint=SPLIT_HINT + "; one rank holds everything, and ranks may hold a single unit",
    )
)
