"""Training parallelism on real process groups (gloo, several processes on this machine): the ring
all-reduce, data parallelism against one process, ZeRO stage 1 against the calculator, tensor
parallel layers, the launcher's failures, and the pipeline schedule. Every group is spawned with
a time-out and no process outlives its test."""

from __future__ import annotations

import time

import psutil
import pytest
import torch
import torch.distributed as dist

from infra_lib.training import (
    WorkerError,
    bubble_fraction,
    gpipe_schedule,
    ring_bytes_sent,
    run_workers,
    schedule_bubble,
    shard_bounds,
    zero_memory_per_device,
    zero_table,
)
from infra_lib.training.collectives import ring_all_reduce
from infra_lib.training.ddp import ddp_worker, gradient_buckets, make_model, train_single
from infra_lib.training.tensor_parallel import tensor_parallel_worker

SHAPES = [(1,), (2,), (7,), (3, 5), (64, 33), (0,)]


def workers_left() -> list:
    """Child processes other than multiprocessing's resource tracker and fork server (one each per
    interpreter, by design: the launcher's workers are forked from the server) and the grader's
    warm-kernel template (one per grading process, when this test worker graded a notebook)."""
    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
            if not any(helper in command for helper in ("resource_tracker", "forkserver", "-m grading.run.warm")):
                left.append(child)
        except psutil.NoSuchProcess:
            pass
    return left


def no_children_left():
    deadline = time.monotonic() + 10
    while workers_left():
        assert time.monotonic() < deadline, f"processes left behind: {workers_left()}"
        time.sleep(0.1)


def ring_against_dist(rank: int, world_size: int, seed: int) -> float:
    """Ring all-reduce and dist.all_reduce on the same seeded tensors (sizes below, at and above the
    world size, not divisible by it, empty); the largest difference."""
    worst = 0.0
    for i, shape in enumerate(SHAPES):
        t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed * 100 + i * 10 + rank))
        expected = t.clone()
        dist.all_reduce(expected)
        view = t.t() if t.dim() == 2 else t  # a non-contiguous tensor too
        ring_all_reduce(view)
        worst = max(worst, float((t - expected).abs().max()) if t.numel() else 0.0)
    return worst


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_equals_dist_all_reduce(world_size):
    errors = run_workers(ring_against_dist, world_size, (world_size,), timeout_s=120)
    assert max(errors) < 1e-5, errors
    no_children_left()


def test_data_parallel_follows_the_single_process_trajectory_and_zero1_shards_adam():
    single = train_single(steps=15, global_batch=64)
    ranks = run_workers(ddp_worker, 4, (15, 64, 0, "sgd", 0.1, 2048, True), timeout_s=180)
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks), "every rank must see the same global loss"
    assert max(abs(a - b) for a, b in zip(ranks[0]["losses"], single["losses"])) < 1e-5
    for rank in ranks:
        for got, want in zip(rank["params"], single["params"]):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-5)
    model = make_model(0)
    assert ranks[0]["allreduce_calls"] == len(gradient_buckets(list(model.parameters()), 2048)) > 1
    assert single["losses"][-1] < single["losses"][0]

    adam = train_single(steps=10, global_batch=64, optimizer="adam", lr=0.01)
    zero = run_workers(ddp_worker, 4, (10, 64, 0, "adam", 0.01, 1 << 16, False, True), timeout_s=180)
    for got, want in zip(zero[0]["params"], adam["params"]):
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=1e-4)
    n = zero[0]["num_params"]
    assert n == sum(p.numel() for p in model.parameters())
    # fp32 training: 4-byte parameters and gradients, 8 bytes of Adam state (momentum, variance)
    for rank, r in enumerate(zero):
        start, end = shard_bounds(n, 4, rank)
        assert r["optimizer_state_bytes"] == 8 * (end - start)
        measured = r["param_bytes"] + r["grad_bytes"] + r["optimizer_state_bytes"]
        predicted = zero_memory_per_device(n, 4, 1, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
        assert abs(measured - predicted) <= 8, (measured, predicted)  # shards differ by at most one element
    plain = run_workers(ddp_worker, 2, (2, 64, 0, "adam", 0.01), timeout_s=120)
    assert plain[0]["optimizer_state_bytes"] == 8 * n  # stage 0: every rank holds all of Adam's state
    no_children_left()


def test_tensor_parallel_layers_equal_the_unsplit_layers():
    for errors in run_workers(tensor_parallel_worker, 3, (0,), timeout_s=120):
        assert max(errors.values()) < 1e-4, errors
    no_children_left()


def failing_worker(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 has bad data")
    return rank


def hanging_worker(rank: int, world_size: int) -> int:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # waits for rank 1, which never joins
    else:
        time.sleep(600)
    return rank


def test_launcher_reports_failures_and_leaves_no_process():
    assert run_workers(_identity, 3, timeout_s=60) == [0, 1, 2]
    with pytest.raises(WorkerError, match=r"rank 1 failed:(.|\n)*bad data"):
        run_workers(failing_worker, 2, timeout_s=60)
    no_children_left()
    start = time.monotonic()
    with pytest.raises(WorkerError, match="did not finish within 8"):
        run_workers(hanging_worker, 2, timeout_s=8)
    assert time.monotonic() - start < 30
    no_children_left()
    with pytest.raises(ValueError, match="world_size"):
        run_workers(failing_worker, 0)


def test_launcher_starts_the_group_again_when_its_port_is_taken(monkeypatch):
    """Another program holding the port the group was given: the launcher starts it again on another."""
    import socket

    from infra_lib.training import launcher

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports = iter([taken])
    real_free_port = launcher._free_port
    monkeypatch.setattr(launcher, "_free_port", lambda: next(ports, None) or real_free_port())
    try:
        assert run_workers(_identity, 2, timeout_s=60) == [0, 1]
        monkeypatch.setattr(launcher, "_free_port", lambda: taken)
        with pytest.raises(WorkerError, match=r"could not form a process group \(3 attempt"):
            run_workers(_identity, 2, timeout_s=60)
    finally:
        squatter.close()
    no_children_left()


def _identity(rank: int, world_size: int) -> int:
    return rank


def test_zero_calculator_reproduces_the_papers_figure():
    table = zero_table(7.5e9, 64)
    assert table[0] == pytest.approx(120.0)
    assert table[1] == pytest.approx(31.4, abs=0.05)
    assert table[2] == pytest.approx(16.6, abs=0.05)
    assert table[3] == pytest.approx(1.9, abs=0.05)
    assert zero_memory_per_device(100, 1, 3) == zero_memory_per_device(100, 1, 0) == 1600
    for bad in ({"stage": 4}, {"num_devices": 0}, {"num_params": -1}):
        with pytest.raises(ValueError):
            zero_memory_per_device(**{"num_params": 10, "num_devices": 2, "stage": 1, **bad})
    assert [shard_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert ring_bytes_sent(1000, 4) == 1500


def test_gpipe_schedule_and_bubble():
    for p, m in ((1, 1), (2, 1), (4, 8), (8, 4), (4, 32)):
        slots = gpipe_schedule(p, m, 1.0, 1.0)
        assert len(slots) == 2 * p * m
        assert schedule_bubble(slots) == pytest.approx(bubble_fraction(p, m))
        for stage in range(p):  # one stage never runs two things at once
            mine = sorted((s.start, s.end) for s in slots if s.stage == stage)
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))
        for s in slots:  # micro-batch i's forward on stage k waits for stage k - 1
            if s.kind == "F" and s.stage:
                before = next(
                    o for o in slots if o.kind == "F" and o.stage == s.stage - 1 and o.microbatch == s.microbatch
                )
                assert before.end <= s.start
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError):
        bubble_fraction(0, 4)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_ring_all_reduce_on_threads_sums_and_sends_its_share(world_size):
    from infra_lib.training import ThreadGroup

    for shape in SHAPES:
        tensors = [torch.randn(*shape, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
        expected = sum(t.clone() for t in tensors)
        group = ThreadGroup(world_size)
        comms = []

        def rank_fn(comm, t):
            comms.append(comm)
            return ring_all_reduce(t, comm)

        results = group.run(rank_fn, [(t,) for t in tensors])
        for r in results:
            torch.testing.assert_close(r, expected, atol=1e-5, rtol=1e-5)
        if world_size > 1 and tensors[0].numel() % world_size == 0:
            assert all(c.bytes_sent == ring_bytes_sent(tensors[0].nbytes, world_size) for c in comms)


def test_thread_group_names_a_rank_that_never_sends():
    from infra_lib.training import ThreadGroup

    def lonely(comm):
        if comm.rank == 0:
            comm.exchange(torch.ones(1), 1, torch.empty(1), 1)

    with pytest.raises((TimeoutError, RuntimeError)):
        ThreadGroup(2).run(lonely, timeout_s=2)


def test_allreduce_bandwidth_benchmark_writes_json(tmp_path):
    from conftest import run_benchmark

    result = run_benchmark("allreduce_bandwidth", tmp_path / "allreduce.json")
    assert result["results"] and all(r["ring_s"] > 0 and r["dist_s"] > 0 for r in result["results"])
    assert {r["world_size"] for r in result["results"]} == set(result["plan"]["world_sizes"])
    assert all(
        r["ring_bus_gb_s"] == pytest.approx(ring_bytes_sent(r["bytes"], r["world_size"]) / r["ring_s"] / 1e9)
        for r in result["results"]
    )
    no_children_left()


# --- DDP with overlapped buckets, ZeRO stage 1 over exchange, torchrun ------------------------------------------


def _mlp_and_batch(seed: int = 0):
    model = make_model(seed, sizes=(8, 16, 16, 4))
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(seed))
    return model, x, (x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(seed + 1))).argmax(1)


def test_ddp_on_threads_launches_each_bucket_when_its_last_gradient_arrives_and_averages():
    import copy

    import torch.nn.functional as F

    from infra_lib.training import ThreadGroup
    from infra_lib.training.collectives import BackgroundAllReduce
    from infra_lib.training.ddp import DDP, log_gradient_arrivals

    base, x, y = _mlp_and_batch()
    world, local = 3, 4

    def rank_fn(comm):
        model, log = copy.deepcopy(base), []
        log_gradient_arrivals(model, log)
        with BackgroundAllReduce(lambda t: ring_all_reduce(t, comm), log) as run:
            ddp = DDP(model, run, world, bucket_bytes=600)
            grads = []
            for _ in range(2):  # finish() leaves it ready for the next backward
                model.zero_grad(set_to_none=True)
                mine = slice(comm.rank * local, (comm.rank + 1) * local)
                F.cross_entropy(model(x[mine]), y[mine]).backward()
                log.append({"event": "backward"})
                ddp.finish()
                grads.append([p.grad.clone() for p in model.parameters()])
        index = {id(p): i for i, p in enumerate(model.parameters())}
        return grads, log, [[index[id(p)] for p in bucket] for bucket in ddp.buckets]

    results = ThreadGroup(world).run(rank_fn)
    single = copy.deepcopy(base)
    F.cross_entropy(single(x), y).backward()
    for grads, log, buckets in results:
        assert buckets == [[5, 4, 3], [2], [1, 0]]  # reverse order, greedy under 600 bytes, the big weight alone
        for step_grads in grads:
            for got, param in zip(step_grads, single.parameters()):
                torch.testing.assert_close(got, param.grad, atol=1e-6, rtol=1e-5)
        first_step = log[: next(i for i, e in enumerate(log) if e["event"] == "backward")]
        # the background thread's "done" events interleave with these as the machine's load has it: left out
        order = [
            e["param"] if e["event"] == "ready" else ("launch", e["numel"]) for e in first_step if e["event"] != "done"
        ]
        # each bucket starts right after its last gradient, before the next gradient arrives
        assert order == [5, 4, 3, ("launch", 4 + 64 + 16), 2, ("launch", 256), 1, 0, ("launch", 16 + 128)]
        assert sum(e["event"] == "done" for e in log) == 2 * len(buckets)


def test_ddp_refuses_bad_arguments_and_names_a_parameter_that_got_no_gradient():
    from torch import nn

    from infra_lib.training.ddp import DDP

    model, x, _ = _mlp_and_batch()
    for bad in ({"world_size": 0}, {"bucket_bytes": 0}, {"world_size": 2.0}):
        with pytest.raises(ValueError):
            DDP(model, lambda t: None, **{"world_size": 2, "bucket_bytes": 64, **bad})

    class Done:
        def wait(self):
            return None

    model.spare = nn.Parameter(torch.zeros(2))  # registered, never used by the forward
    ddp = DDP(model, lambda t: Done(), 1, 1 << 20)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="no gradient reached spare"):
        ddp.finish()
    model(x).sum().backward()  # the failed step was reset: the next one reports the same, not a double gradient
    with pytest.raises(RuntimeError, match="no gradient reached spare"):
        ddp.finish()


def test_background_all_reduce_keeps_the_order_and_hands_errors_to_wait():
    from infra_lib.training.collectives import BackgroundAllReduce

    seen = []

    def record(t):
        time.sleep(0.01)
        seen.append(float(t[0]))
        if t[0] == 2:
            raise ValueError("boom")

    run = BackgroundAllReduce(record)
    handles = [run(torch.tensor([float(i)])) for i in range(4)]
    assert [float(h.wait(5)[0]) for h in handles[:2]] == [0.0, 1.0]
    with pytest.raises(RuntimeError, match="all-reduce number 2 .* ValueError: boom"):
        handles[2].wait(5)
    handles[3].wait(5)
    assert seen == [0.0, 1.0, 2.0, 3.0]  # first in, first out, one at a time
    run.close()
    with pytest.raises(RuntimeError, match="closed"):
        run(torch.ones(1))
    stuck = BackgroundAllReduce(lambda t: time.sleep(0.3))
    with pytest.raises(TimeoutError, match="same all-reduces in the same order"):
        stuck(torch.ones(1)).wait(0.05)
    stuck.close()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reduce_scatter_leaves_each_rank_its_own_shard_summed_and_all_gather_restores_the_rest(world_size):
    from infra_lib.training import ThreadGroup
    from infra_lib.training.zero import all_gather, reduce_scatter

    for numel in (0, 1, 3, 8, 13):
        tensors = [torch.randn(numel, dtype=torch.float64) for _ in range(world_size)]
        total, comms = sum(t.clone() for t in tensors), []

        def scatter(comm, t):
            comms.append(comm)
            return reduce_scatter(t, comm)

        assert all(out is t for out, t in zip(ThreadGroup(world_size).run(scatter, [(t,) for t in tensors]), tensors))
        for rank, t in enumerate(tensors):
            start, end = shard_bounds(numel, world_size, rank)
            torch.testing.assert_close(t[start:end], total[start:end])
        if numel % world_size == 0:
            assert all(c.bytes_sent == (world_size - 1) * numel // world_size * 8 for c in comms)
        ThreadGroup(world_size).run(lambda comm, t: all_gather(t, comm), [(t,) for t in tensors])
        for t in tensors:
            torch.testing.assert_close(t, total)
    with pytest.raises(RuntimeError, match="1-D"):
        ThreadGroup(1).run(lambda comm: reduce_scatter(torch.ones(2, 2), comm))


def test_zero_adamw_equals_torch_adamw_on_the_mean_gradient_and_holds_one_shard_of_state():
    from infra_lib.training import ThreadGroup
    from infra_lib.training.zero import ZeroAdamW

    world, shapes, steps = 3, [(5, 3), (7,), (1,)], 3
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(*s, generator=gen) for s in shapes]
    grads = [[[torch.randn(*s, generator=gen) for s in shapes] for _ in range(world)] for _ in range(steps)]
    reference = [torch.nn.Parameter(t.clone()) for t in init]
    opt = torch.optim.AdamW(reference, lr=0.01, weight_decay=0.1, foreach=False)
    for step_grads in grads:
        for i, p in enumerate(reference):
            p.grad = sum(rank_grads[i] for rank_grads in step_grads) / world
        opt.step()

    def rank_fn(comm):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        zero = ZeroAdamW(params, comm, lr=0.01, weight_decay=0.1)
        sent = []
        for step_grads in grads:
            for p, g in zip(params, step_grads[comm.rank]):
                p.grad = g.clone()
            before = comm.bytes_sent
            zero.step()
            sent.append(comm.bytes_sent - before)
        return params, zero, sent

    numel = sum(t.numel() for t in init)
    for rank, (params, zero, sent) in enumerate(ThreadGroup(world).run(rank_fn)):
        for got, want in zip(params, reference):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        start, end = shard_bounds(numel, world, rank)
        assert zero.exp_avg.shape == zero.exp_avg_sq.shape == (end - start,)
        measured = 4 * numel + 4 * numel + zero.state_bytes()  # fp32: parameters, gradients, Adam's two moments
        predicted = zero_memory_per_device(numel, world, 1, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
        assert abs(measured - predicted) <= 8  # shards differ by at most one element
        sizes = [e - s for s, e in (shard_bounds(numel, world, r) for r in range(world))]
        # every shard but its own in the reduce-scatter, every shard but its right neighbour's in the all-gather
        assert sent == [4 * (2 * numel - sizes[rank] - sizes[(rank + 1) % world])] * steps


def test_torchrun_trains_learner_style_ddp_and_zero_like_one_process_and_reports_a_failing_rank(tmp_path):
    """Two real ranks under torchrun run answer cells given as source (tests/learner_style/ddp_zero.py); then a
    run whose rank 1 raises comes back with torchrun's own account of it."""
    from conftest import REPO

    from infra_lib.training.launcher import run_torchrun
    from infra_lib.training.torchrun_train import single_process_losses

    answers = tmp_path / "answers.py"
    answers.write_text((REPO / "tests" / "learner_style" / "ddp_zero.py").read_text())
    result = run_torchrun(["--answers", answers, "--steps", "2"], nproc=2, timeout_s=180)
    assert result.ok, result.output[-3000:]
    single = single_process_losses(2, steps=2)
    assert [r["rank"] for r in result.ranks] == [0, 1]
    for run in ("ddp", "zero"):
        digests = {r[run]["params_digest"] for r in result.ranks}
        assert len(digests) == 1, f"{run}: the ranks' parameters differ"
        for r in result.ranks:
            assert r[run]["losses"] == pytest.approx(single, rel=1e-5)
    numel = result.ranks[0]["zero"]["num_params"]
    for rank, r in enumerate(result.ranks):
        start, end = shard_bounds(numel, 2, rank)
        assert r["zero"]["optimizer_state_bytes"] == 8 * (end - start)  # two fp32 moments of its shard only
    assert result.ranks[0]["zero"]["bytes_sent"] == 2 * ring_bytes_sent(4 * numel, 2)  # two steps
    failed = run_torchrun(["--steps", "3", "--fail-rank", "1", "--fail-step", "2"], nproc=2, timeout_s=180)
    assert not failed.ok and failed.ranks == []
    report = failed.error_report()
    assert "Root Cause" in report and "rank      : 1" in report and "exitcode  : 1" in report
    assert "rank 1 raises at step 2" in report  # the traceback of the failing rank
    no_children_left()


def test_run_torchrun_stops_every_process_of_a_run_that_hangs():
    from infra_lib.training.launcher import run_torchrun

    start = time.monotonic()
    with pytest.raises(WorkerError, match="did not finish within 8"):
        run_torchrun(["--hang-rank", "0", "--fail-step", "1"], nproc=2, timeout_s=8)
    assert time.monotonic() - start < 60
    no_children_left()
    with pytest.raises(ValueError, match="nproc"):
        run_torchrun([], nproc=0)


def test_ddp_overlap_benchmark_writes_json(tmp_path):
    from conftest import run_benchmark

    result = run_benchmark("ddp_overlap", tmp_path / "ddp_overlap.json")
    for row in result["results"]:
        assert row["same_parameters"], "overlapping the all-reduces must not change the sums"
        assert row["buckets"] > 1 and row["after_over_overlap"] > 0
        assert row["after_over_overlap"] == pytest.approx(row["after_step_s"] / row["overlap_step_s"])
    no_children_left()
