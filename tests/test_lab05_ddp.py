"""Lab 05 tasks 8 and 9: a learner-style DDP and ZeRO stage 1 (tests/learner_style/ddp_zero.py) pass every check,
blank stubs fail each as not started, and each typical mistake fails exactly the checks of its task, each with the
hint that names it."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import check_fails
from learner_style.ddp_zero import answer_namespace

import grading.checks.lab05.ddp  # noqa: F401  (registers lab05.ddp and lab05.ddp_edges)
import grading.checks.lab05.zero_step  # noqa: F401  (registers the ZeRO checks)
from grading import check
from grading.check import ERROR, drive, judge
from grading.checks.lab05 import ddp as ddp_checks
from grading.checks.lab05 import zero_step as zero_checks
from grading.registry import get_check

DDP_CHECKS = ("lab05.ddp", "lab05.ddp_edges")
HALVES_CHECKS = ("lab05.zero_halves", "lab05.zero_halves_edges")
STEP_CHECKS = ("lab05.zero_step", "lab05.zero_step_edges")
PIECES = ("reduce_scatter", "all_gather", "ZeroAdamW", "adamw_update", "shard_bounds")


def halves(ns: dict) -> dict:
    return {"reduce_scatter": ns["reduce_scatter"], "all_gather": ns["all_gather"]}


def step_pieces(ns: dict) -> dict:
    return {name: ns[name] for name in PIECES}


def implementation(check_id: str, ns: dict):
    if check_id in DDP_CHECKS:
        return ns["DDP"]
    return halves(ns) if check_id in HALVES_CHECKS else step_pieces(ns)


ALL_CHECKS = DDP_CHECKS + HALVES_CHECKS + STEP_CHECKS


@pytest.mark.parametrize("check_id", ALL_CHECKS)
def test_learner_style_answers_pass(check_id):
    check(check_id, implementation(check_id, answer_namespace()))


def _stub(task: str):
    def raise_stub(*args, **kwargs):
        raise NotImplementedError(task)

    return raise_stub


def blank_namespace() -> dict:
    """The lab as released: every answer of tasks 8 and 9 a stub (tasks 5 and 6 answered)."""

    class DDP:
        __init__ = _stub(ddp_checks.TASK)
        finish = _stub(ddp_checks.TASK)

    class ZeroAdamW:
        __init__ = _stub(zero_checks.STEP_TASK)
        step = _stub(zero_checks.STEP_TASK)

    halves_stub = _stub(zero_checks.HALVES_TASK)
    return answer_namespace(DDP=DDP, ZeroAdamW=ZeroAdamW, reduce_scatter=halves_stub, all_gather=halves_stub)


@pytest.mark.parametrize("check_id", ALL_CHECKS)
def test_blank_answers_fail_as_not_started(check_id):
    registered = get_check(check_id)
    inputs = registered.inputs(0)
    verdict = judge(registered, drive(registered, implementation(check_id, blank_namespace()), inputs), None, inputs)
    assert not verdict.passed and verdict.kind == ERROR
    assert verdict.what.startswith("your code raised NotImplementedError: lab05 task")


# --- task 8: the typical mistakes ------------------------------------------------------------------------------


def ddp_mistake(name: str):
    """The learner-style DDP with one classic mistake."""
    DDP = answer_namespace()["DDP"]  # noqa: N806 - a class

    class Mistaken(DDP):
        pass

    if name == "launch before the last gradient":

        def gradient_ready(self, param):
            self.still_missing[self.bucket_index[id(param)]].discard(id(param))
            while self.next_to_launch < len(self.buckets):
                bucket = self.buckets[self.next_to_launch]
                if len(self.still_missing[self.next_to_launch]) == len(bucket):
                    break  # launched as soon as ONE gradient of the bucket is in
                flat = torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in bucket])
                self.in_flight.append((bucket, flat, self.all_reduce_async(flat)))
                self.next_to_launch += 1

        Mistaken.gradient_ready = gradient_ready
    elif name == "forward order":

        def __init__(self, model, all_reduce_async, world_size, bucket_bytes):
            DDP.__init__(self, model, all_reduce_async, world_size, bucket_bytes)
            forward = [p for p in model.parameters() if p.requires_grad]
            self.buckets, current, used = [], [], 0
            for p in forward:
                if current and used + 4 * p.numel() > bucket_bytes:
                    self.buckets.append(current)
                    current, used = [], 0
                current.append(p)
                used += 4 * p.numel()
            self.buckets.append(current)
            self.bucket_index = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
            self.start_over()

        Mistaken.__init__ = __init__
    elif name == "all-reduce after the whole backward":

        def gradient_ready(self, param):
            self.still_missing[self.bucket_index[id(param)]].discard(id(param))

        def finish(self):
            self.in_flight = []
            for bucket in self.buckets:
                flat = torch.cat([p.grad.flatten() for p in bucket])
                self.in_flight.append((bucket, flat, self.all_reduce_async(flat)))
            DDP.finish(self)

        Mistaken.gradient_ready, Mistaken.finish = gradient_ready, finish
    elif name == "waits in the hook":

        def gradient_ready(self, param):
            started = len(self.in_flight)
            DDP.gradient_ready(self, param)
            for _, _, handle in self.in_flight[started:]:
                handle.wait()  # a synchronous all-reduce: right sums, nothing overlaps

        Mistaken.gradient_ready = gradient_ready
    elif name == "summed, not averaged":

        def finish(self):
            world, self.world_size = self.world_size, 1
            try:
                DDP.finish(self)
            finally:
                self.world_size = world

        Mistaken.finish = finish
    elif name == "no reset after finish":

        def finish(self):
            missing, launched = self.still_missing, self.next_to_launch
            DDP.finish(self)
            self.still_missing, self.next_to_launch = missing, launched  # this step's counts stay

        Mistaken.finish = finish
    else:
        raise ValueError(name)
    return Mistaken


DDP_MISTAKES = {
    # mistake: (what the failure says, the hint's idea)
    "launch before the last gradient": ("before its last gradient had arrived", ddp_checks._EARLY_HINT),
    "forward order": ("take the parameters in forward order", ddp_checks._ORDER_HINT),
    "all-reduce after the whole backward": ("after the whole backward", ddp_checks._AFTER_HINT),
    "waits in the hook": ("waited for an all-reduce during backward", ddp_checks._WAIT_HINT),
    "summed, not averaged": ("the sum over the ranks, not the mean", ddp_checks._MEAN_HINT),
    "no reset after finish": ("did not start an all-reduce for every bucket", ddp_checks._RESET_HINT),
}


@pytest.mark.parametrize("mistake", list(DDP_MISTAKES))
def test_task8_mistakes_fail_the_ddp_checks_with_their_hint(mistake):
    said, hint = DDP_MISTAKES[mistake]
    text = check_fails("lab05.ddp", ddp_mistake(mistake))
    assert said in text and hint in text, text
    assert "on world size" in text and "bucket_bytes=" in text  # the input it failed on


def test_task8_launch_before_the_last_gradient_is_named_even_when_the_hook_crashes():
    """The plain form of the mistake reads p.grad of a parameter whose gradient has not arrived: None."""
    Mistaken = ddp_mistake("launch before the last gradient")  # noqa: N806

    def gradient_ready(self, param):
        self.still_missing[self.bucket_index[id(param)]].discard(id(param))
        bucket = self.buckets[self.bucket_index[id(param)]]
        if param is bucket[0] and self.next_to_launch < len(self.buckets):  # the first one reported: launch
            flat = torch.cat([p.grad.flatten() for p in bucket])
            self.in_flight.append((bucket, flat, self.all_reduce_async(flat)))
            self.next_to_launch += 1

    Mistaken.gradient_ready = gradient_ready
    text = check_fails("lab05.ddp", Mistaken)
    assert ddp_checks._EARLY_HINT in text, text


def test_task8_an_unused_parameter_must_raise_naming_it():
    DDP = answer_namespace()["DDP"]  # noqa: N806

    class Silent(DDP):
        def finish(self):
            for ids in self.still_missing:
                ids.clear()
            DDP.finish(self)

    check("lab05.ddp", Silent)  # the visible cases have no unused parameter
    text = check_fails("lab05.ddp_edges", Silent)
    assert "got no gradient" in text and "spare" in text and ddp_checks._MISSING_HINT in text


def test_task8_mistakes_fail_no_task9_check():
    ns = answer_namespace(DDP=ddp_mistake("summed, not averaged"))
    for check_id in HALVES_CHECKS + STEP_CHECKS:
        check(check_id, implementation(check_id, ns))


def test_ddp_ranks_that_start_different_all_reduces_are_stopped_and_named():
    """One rank never starts an all-reduce: the others wait for it, and the check stops in seconds."""
    DDP = answer_namespace()["DDP"]  # noqa: N806
    lock, built = threading.Lock(), []

    class Lonely(DDP):
        def __init__(self, *args):
            DDP.__init__(self, *args)
            with lock:
                self.silent = not built  # the first rank to build its DDP launches nothing
                built.append(self)

        def gradient_ready(self, param):
            if not self.silent:
                DDP.gradient_ready(self, param)

    text = check_fails("lab05.ddp", Lonely)
    assert "did not all start the same all-reduces" in text and "waited in finish()" in text, text


# --- task 9: the typical mistakes ------------------------------------------------------------------------------


def reduce_scatter_ending_like_the_ring(tensor, comm):
    """The all-reduce ring's first half as it is: rank r ends with the sum of shard (r + 1) % W."""
    world, me = comm.world_size, comm.rank
    parts = [tensor[slice(*zero_checks._shards(tensor.numel(), world)[i])] for i in range(world)]
    for step in range(world - 1):
        out, into = (me - step) % world, (me - step - 1) % world
        buffer = torch.empty_like(parts[into])
        comm.exchange(parts[out], (me + 1) % world, buffer, (me - 1) % world)
        parts[into] += buffer
    return tensor


def reduce_scatter_off_by_one(tensor, comm):
    """Shards from bounds that forget the extra element of the first numel % W ranks (end = start + base)."""
    world, me = comm.world_size, comm.rank
    base, extra = divmod(tensor.numel(), world)
    starts = [r * base + min(r, extra) for r in range(world)]
    parts = [tensor[s : s + base] for s in starts]
    outgoing = parts[(me - 1) % world].clone()
    for step in range(1, world):
        arriving = (me - 1 - step) % world
        buffer = torch.empty_like(parts[arriving])
        comm.exchange(outgoing, (me + 1) % world, buffer, (me - 1) % world)
        outgoing = buffer + parts[arriving]
    if world > 1:
        parts[me].copy_(outgoing)
    return tensor


def zero_with_full_state(ns: dict):
    """ZeroAdamW keeping AdamW's state for every parameter (and using its own shard's part of it)."""
    ZeroAdamW = ns["ZeroAdamW"]  # noqa: N806

    class FullState(ZeroAdamW):
        def __init__(self, params, comm, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
            ZeroAdamW.__init__(self, params, comm, lr, betas, eps, weight_decay)
            total = sum(p.numel() for p in self.params)
            self.full_avg = torch.zeros(total, dtype=torch.float64)
            self.full_avg_sq = torch.zeros(total, dtype=torch.float64)
            self.exp_avg, self.exp_avg_sq = self.full_avg, self.full_avg_sq

        def step(self):
            self.exp_avg, self.exp_avg_sq = self.full_avg[self.lo : self.hi], self.full_avg_sq[self.lo : self.hi]
            ZeroAdamW.step(self)
            self.exp_avg, self.exp_avg_sq = self.full_avg, self.full_avg_sq

    return FullState


HALVES_MISTAKES = {
    "the sum left on shard (r + 1) % W": (
        {"reduce_scatter": reduce_scatter_ending_like_the_ring},
        "holds the sum of shard (r + 1) % W",
        zero_checks._RING_END_HINT,
    ),
    "a shard boundary off by one": (
        {"reduce_scatter": reduce_scatter_off_by_one},
        "wrong at the edge of a shard",
        zero_checks._BOUNDARY_HINT,
    ),
}


@pytest.mark.parametrize("mistake", list(HALVES_MISTAKES))
def test_task9_halves_mistakes_fail_zero_halves_with_their_hint_and_zero_step_names_them(mistake):
    swaps, said, hint = HALVES_MISTAKES[mistake]
    ns = answer_namespace(**swaps)
    text = check_fails("lab05.zero_halves", halves(ns))
    assert said in text and hint in text, text
    assert "rank" in text and "world size" in text
    step_text = check_fails("lab05.zero_step", step_pieces(ns))
    assert "your reduce_scatter does not do its part" in step_text, step_text
    for check_id in DDP_CHECKS:
        check(check_id, ns["DDP"])


def zero_without_all_gather(ns: dict):
    return answer_namespace(all_gather=lambda tensor, comm: tensor)["ZeroAdamW"]


STEP_MISTAKES = {
    "state kept for all parameters": (
        zero_with_full_state,
        "not the size of the rank's shard",
        zero_checks._STATE_HINT,
    ),
    "the all-gather skipped": (
        zero_without_all_gather,
        "only the rank's own shard is updated",
        zero_checks._GATHER_STEP_HINT,
    ),
}


@pytest.mark.parametrize("mistake", list(STEP_MISTAKES))
def test_task9_step_mistakes_fail_zero_step_with_their_hint(mistake):
    make, said, hint = STEP_MISTAKES[mistake]
    ns = answer_namespace()
    pieces = {**step_pieces(ns), "ZeroAdamW": make(ns)}
    text = check_fails("lab05.zero_step", pieces)
    assert said in text and hint in text, text
    assert "world size" in text and "rank" in text and "step()" in text or "exp_avg" in text
    for check_id in HALVES_CHECKS:
        check(check_id, halves(ns))
    check("lab05.ddp", ns["DDP"])


def test_task9_summing_instead_of_averaging_is_named():
    ns = answer_namespace()
    ZeroAdamW = ns["ZeroAdamW"]  # noqa: N806

    class Summed(ZeroAdamW):
        def step(self):
            world = self.comm.world_size
            for p in self.params:
                p.grad *= world  # what dividing the sum by W would have undone
            ZeroAdamW.step(self)

    for check_id in STEP_CHECKS:  # AdamW nearly hides a gradient's scale: only eps tells them apart
        text = check_fails(check_id, {**step_pieces(ns), "ZeroAdamW": Summed})
        assert "on the sum of the gradients" in text and zero_checks._MEAN_STEP_HINT in text


def test_task9_an_all_reduce_for_a_reduce_scatter_is_excess_traffic():
    ns = answer_namespace()
    text = check_fails("lab05.zero_halves", {**halves(ns), "reduce_scatter": ns["ring_all_reduce"]})
    assert "(excess traffic)" in text and zero_checks._TRAFFIC_HINT in text


def test_task9_a_wrong_adamw_update_is_named_as_task5():
    ns = answer_namespace(adamw_update=lambda p, g, m, v, step, lr, b1, b2, eps, wd: p.sub_(lr * g))
    text = check_fails("lab05.zero_step", step_pieces(ns))
    assert "your adamw_update (task 5)" in text


def test_ddp_that_never_returns_is_stopped_with_its_ranks_named(monkeypatch):
    import time

    monkeypatch.setattr(ddp_checks, "RANK_TIMEOUT_S", 2.0)
    DDP = answer_namespace()["DDP"]  # noqa: N806
    before = threading.active_count()

    class Spins(DDP):
        def finish(self):
            while True:
                pass

    text = check_fails("lab05.ddp", Spins)
    assert "DDP did not finish" in text and "rank 0 in finish() at step 1" in text and "a loop that never ends" in text
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, "a rank thread still spins after the check"


def test_zero_step_where_one_rank_skips_a_half_is_stopped_with_the_waiting_ranks_named(monkeypatch):
    monkeypatch.setattr(zero_checks, "RANK_TIMEOUT_S", 2.0)
    ns = answer_namespace()
    ZeroAdamW = ns["ZeroAdamW"]  # noqa: N806

    class RankZeroSkips(ZeroAdamW):
        def step(self):
            if self.comm.rank == 0:
                return  # rank 0 never exchanges: its neighbours wait for it
            ZeroAdamW.step(self)

    text = check_fails("lab05.zero_step", {**step_pieces(ns), "ZeroAdamW": RankZeroSkips})
    assert "did not finish" in text and "waiting in exchange" in text and "ranks [1]" in text, text
