"""Lab 05's checks name the classic mistakes of splitting a tensor into shards, of the ring all-reduce
and of the AdamW update; a ring that hangs or loops is stopped in seconds with the ranks
named, and the learner's answer cells run on a real gloo process group for the lab's last cell."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from conftest import REPO, answer_cells, check_fails, solution_namespace

from grading import check
from grading.check import RECORD_ENV, SEED_ENV
from grading.registry import all_checks

SOLUTION = REPO / "solutions" / "lab05_parallel" / "lab05_parallel.ipynb"
RING_CHECKS = (
    "lab05.ring_sum",
    "lab05.ring_sum_more",
    "lab05.ring_traffic",
    "lab05.ring_traffic_more",
    "lab05.ring_any_tensor",
    "lab05.ring_edges",
)


@pytest.fixture(scope="module")
def solution() -> dict:
    """The instructor's answers, run as the notebook runs them (setup first, then every answer cell)."""
    import math

    return solution_namespace(SOLUTION, torch=torch, math=math)


_fails = check_fails


# --- task 6: shard_bounds -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bounds, named",
    [
        (lambda n, w, r: (min(r * -(-n // w), n), min((r + 1) * -(-n // w), n)), "as torch.chunk does"),
        (
            lambda n, w, r: (r * (n // w), n if r == w - 1 else (r + 1) * (n // w)),
            "the last rank took all the leftover",
        ),
        (lambda n, w, r: (r * n / w, (r + 1) * n / w), "use integer arithmetic"),
    ],
)
def test_task6_mistakes_are_named(bounds, named):
    assert named in _fails("lab05.shard_bounds", bounds)


def test_task6_tensor_split_passes():
    def from_tensor_split(numel, world_size, rank):
        sizes = [len(part) for part in torch.tensor_split(torch.arange(numel), world_size)]
        start = sum(sizes[:rank])
        return start, start + sizes[rank]

    check("lab05.shard_bounds", from_tensor_split)
    check(
        "lab05.shard_bounds_more",
        lambda n, w, r: (r * (n // w) + min(r, n % w), (r + 1) * (n // w) + min(r + 1, n % w)),
    )


# --- task 7: ring_all_reduce ----------------------------------------------------------------------


def _ring(
    *,
    gather=True,
    average=False,
    flatten="auto",
    buffer="like",
    to_left=False,
    reduce_steps=None,
    ret=True,
    gather_adds=False,
):
    """A ring with one deliberate change from the correct one."""

    def ring_all_reduce(tensor, comm):
        world, rank = comm.world_size, comm.rank
        if flatten == "view":
            flat = tensor.view(-1)
        else:
            flat = tensor.reshape(-1)
        chunks = list(torch.tensor_split(flat, world))
        right, left = (rank + 1) % world, (rank - 1) % world
        if to_left:
            right = left
        for step in range(world - 1 if reduce_steps is None else reduce_steps(world)):
            send, receive = (rank - step) % world, (rank - step - 1) % world
            incoming = torch.empty_like(chunks[receive]) if buffer == "like" else torch.empty(chunks[receive].numel())
            comm.exchange(chunks[send], right, incoming, left)
            chunks[receive] += incoming
        if gather:
            for step in range(world - 1):
                send, receive = (rank + 1 - step) % world, (rank - step) % world
                if gather_adds:
                    incoming = torch.empty_like(chunks[receive])
                    comm.exchange(chunks[send], right, incoming, left)
                    chunks[receive] += incoming
                else:
                    comm.exchange(chunks[send], right, chunks[receive], left)
        if average:
            flat /= world
        if flatten == "auto" and flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor if ret else None

    return ring_all_reduce


def test_task7_the_solution_and_a_tensor_split_ring_pass_every_check(solution):
    for check_id in RING_CHECKS:
        check(check_id, solution["ring_all_reduce"])
        check(check_id, _ring())


def test_task7_passing_the_whole_tensor_around_gives_the_sum_but_fails_the_traffic():
    def whole_tensor(tensor, comm):
        world, rank = comm.world_size, comm.rank
        total, message = tensor.clone(), tensor.clone()
        for _ in range(world - 1):
            incoming = torch.empty_like(message)
            comm.exchange(message, (rank + 1) % world, incoming, (rank - 1) % world)
            total += incoming
            message = incoming
        return tensor.copy_(total)

    check("lab05.ring_sum", whole_tensor)
    check("lab05.ring_any_tensor", whole_tensor)
    text = _fails("lab05.ring_traffic", whole_tensor)
    assert "sent a different number of bytes" in text and "2 (W - 1) / W" in text
    assert "the whole tensor in each of W - 1 steps" in text


@pytest.mark.parametrize(
    "ring, check_id, named",
    [
        (_ring(gather=False), "lab05.ring_sum", "that is where the reduce-scatter ends"),
        (_ring(average=True), "lab05.ring_sum", "averaged instead of summing"),
        (_ring(reduce_steps=lambda w: 0), "lab05.ring_sum", "nothing was added into it"),
        (_ring(gather_adds=True), "lab05.ring_sum", "added twice"),
        (_ring(ret=False), "lab05.ring_sum", "return tensor"),
        (_ring(flatten="view"), "lab05.ring_any_tensor", "tensor.view(-1) needs a contiguous tensor"),
        (_ring(flatten="reshape"), "lab05.ring_any_tensor", "reshape(-1) gave you a copy"),
        (_ring(buffer="float32"), "lab05.ring_any_tensor", "right to float32 precision only"),
        (_ring(buffer="float32"), "lab05.ring_edges", "torch.empty(n) is float32"),
    ],
)
def test_task7_mistakes_are_named(ring, check_id, named):
    assert named in _fails(check_id, ring)


def test_task7_an_extra_reduce_scatter_step_gives_the_sum_but_not_the_traffic():
    ring = _ring(reduce_steps=lambda w: w)  # the all-gather then overwrites the chunk it spoilt
    check("lab05.ring_sum", ring)
    text = _fails("lab05.ring_traffic", ring)
    assert "sent a different number of bytes" in text and "messages of one" in text


def test_task7_returning_a_new_tensor_is_not_in_place():
    def copy(tensor, comm):
        return _ring()(tensor.clone(), comm)

    text = _fails("lab05.ring_sum", copy)
    assert "returned the sum but left the input tensor unchanged" in text and "in place" in text


def test_task7_sharing_memory_between_threads_sends_nothing():
    """Threads could add each other's tensors directly; a process group cannot, and the traffic shows it."""
    lock, groups = threading.Lock(), {}

    def shared(tensor, comm):
        with lock:  # one barrier per case: the traffic cases have 2, 3 and 4 ranks
            barrier, tensors = groups.setdefault(comm.world_size, (threading.Barrier(comm.world_size), {}))
        tensors[comm.rank] = tensor.clone()
        barrier.wait(timeout=5)
        total = sum(tensors[r] for r in range(comm.world_size))
        barrier.wait(timeout=5)
        return tensor.copy_(total)

    text = _fails("lab05.ring_traffic", shared)
    assert "sent 0 bytes" in text and "only exchange moves data" in text


def test_task7_a_deadlock_is_a_time_out_naming_the_waiting_ranks():
    started = time.monotonic()
    text = _fails("lab05.ring_sum", _ring(to_left=True))  # every rank sends left and waits for the left
    assert time.monotonic() - started < 20
    assert "waited for a message that never came" in text and "ranks [0, 1, 2] were waiting in exchange" in text
    assert "rank 0 sent to 2 and waits for 2" in text and "(rank + 1) % W" in text


def test_task7_a_loop_that_never_ends_is_stopped_and_named():
    def spin(tensor, comm):
        count = 0
        while True:
            count += 1

    before, started = set(threading.enumerate()), time.monotonic()
    text = _fails("lab05.ring_sum", spin)
    assert time.monotonic() - started < 20
    assert "still running your code" in text and "outside exchange" in text
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in set(threading.enumerate()) - before):
        assert time.monotonic() < deadline, "a rank thread kept running"
        time.sleep(0.05)


def test_task7_a_rank_that_skips_the_exchange_of_an_empty_chunk_is_told_the_number_of_exchanges():
    """With fewer elements than ranks some chunks are empty; leaving their exchange out shifts every later message,
    which surfaces as a size mismatch. The message must name the count of exchanges, not the chunk indices."""

    def skips(both: bool):
        def ring_all_reduce(tensor, comm):
            world, rank = comm.world_size, comm.rank
            flat = tensor.reshape(-1)
            chunks = list(torch.tensor_split(flat, world))
            right, left = (rank + 1) % world, (rank - 1) % world

            def empty(send, receive):
                sizes = (chunks[send].numel(), chunks[receive].numel())
                return sizes == (0, 0) if both else sizes[0] == 0

            for step in range(world - 1):
                send, receive = (rank - step) % world, (rank - step - 1) % world
                if empty(send, receive):
                    continue
                incoming = torch.empty_like(chunks[receive])
                comm.exchange(chunks[send], right, incoming, left)
                chunks[receive] += incoming
            for step in range(world - 1):
                send, receive = (rank + 1 - step) % world, (rank - step) % world
                if not empty(send, receive):
                    comm.exchange(chunks[send], right, chunks[receive], left)
            if flat.data_ptr() != tensor.data_ptr():
                tensor.copy_(flat.view_as(tensor))
            return tensor

        return ring_all_reduce

    for both in (False, True):
        check("lab05.ring_sum", skips(both))  # sizes W divides: no empty chunk, nothing to skip
        for check_id in ("lab05.ring_any_tensor", "lab05.ring_edges"):
            text = _fails(check_id, skips(both))
            assert "left out the exchange of an empty chunk" in text and "the number of exchanges is not" in text
            assert "exactly 2 (W - 1) =" in text and "check which chunk index" not in text


def test_task7_a_wrong_chunk_index_still_points_at_the_indices():
    def wrong_receive(tensor, comm):
        world, rank = comm.world_size, comm.rank
        flat = tensor.reshape(-1)
        chunks = list(torch.tensor_split(flat, world))
        right, left = (rank + 1) % world, (rank - 1) % world
        for step in range(world - 1):
            send, receive = (rank - step) % world, (rank - step + 1) % world  # the right neighbour's chunk
            incoming = torch.empty_like(chunks[receive])
            comm.exchange(chunks[send], right, incoming, left)
            chunks[receive] += incoming
        for step in range(world - 1):
            send, receive = (rank + 1 - step) % world, (rank - step) % world
            comm.exchange(chunks[send], right, chunks[receive], left)
        return tensor

    text = _fails("lab05.ring_any_tensor", wrong_receive)
    assert "left out the exchange" not in text


def test_task7_a_rank_that_raises_is_named():
    def rank1_fails(tensor, comm):
        if comm.rank == 1:
            raise KeyError("chunk 7")
        return _ring()(tensor, comm)

    text = _fails("lab05.ring_sum", rank1_fails)
    assert "rank 1 raised KeyError" in text


# --- under the grader -----------------------------------------------------------------------------


def test_inputs_are_plain_data_and_the_same_for_the_same_seed():
    for check_id, registered in all_checks().items():
        if check_id.startswith("lab05."):
            first = json.dumps(registered.inputs(7), sort_keys=True)
            assert first == json.dumps(registered.inputs(7), sort_keys=True), check_id
            assert first != json.dumps(registered.inputs(8), sort_keys=True), check_id


def test_under_the_grader_answers_are_recorded_and_the_reference_is_a_shortcut_even_on_rank_threads(
    solution, tmp_path, monkeypatch
):
    from infra_lib.training.collectives import ring_all_reduce
    from infra_lib.training.zero import shard_bounds

    record = tmp_path / "answers.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "11")
    check("lab05.ring_any_tensor", solution["ring_all_reduce"])
    check("lab05.shard_bounds", solution["shard_bounds"])
    check("lab05.ring_sum", lambda tensor, comm: ring_all_reduce(tensor, comm))  # runs on the ranks' threads
    check("lab05.shard_bounds", lambda *args: shard_bounds(*args))
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [row["kind"] for row in rows] == [None, None, "reference shortcut", "reference shortcut"]
    assert "ring_all_reduce" in rows[2]["error"]


# --- the lab's last cell --------------------------------------------------------------------------


def test_answer_cells_run_on_a_gloo_process_group(solution):
    from grading.checks.lab05 import run_on_process_group
    from infra_lib.training import WorkerError

    cells = answer_cells(SOLUTION)
    sources = list(cells.values())
    ranks = run_on_process_group(sources, world_size=2, shapes=((1000,), (7, 3), (1,)), repeats=1, timeout_s=120)
    assert len(ranks) == 2
    for rows in ranks:
        assert [row["shape"] for row in rows] == [[1000], [7, 3], [1]]
        for row in rows:
            assert row["max_abs_error"] == 0.0  # two ranks: every sum is the same a + b
            assert row["ring_s"] > 0 and row["all_reduce_s"] > 0
        assert rows[0]["bytes_sent"] == 4000  # 2 (W - 1) / W = 1 tensor with two ranks
    no_ring = "def ring_all_reduce(tensor, comm):\n    raise KeyError('no ring yet')\n"
    broken = [no_ring if cell_id == "task7_ring_all_reduce" else source for cell_id, source in cells.items()]
    with pytest.raises(WorkerError, match=r"rank \d failed:(.|\n)*no ring yet"):
        run_on_process_group(broken, world_size=2, shapes=((4,),), repeats=1, timeout_s=120)


def test_answer_source_is_the_whole_cell(tmp_path):
    import linecache

    from grading.checks.lab05 import answer_source

    cell = "import math\n\n\ndef helper(x):\n    return math.floor(x)\n\n\ndef answer(x):\n    return helper(x) + 1\n"
    filename = str(tmp_path / "cell-1.py")  # as IPython registers a cell's source
    linecache.cache[filename] = (len(cell), None, cell.splitlines(keepends=True), filename)
    namespace = {}
    exec(compile(cell, filename, "exec"), namespace)
    assert answer_source(namespace["answer"]) == cell


# --- task 5: adamw_update -------------------------------------------------------------------------


def _adamw_mistake(kind):
    def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
        if kind == "l2":
            grad = grad + weight_decay * param
        else:
            param.mul_(1 - lr * weight_decay)
        step = step + 1 if kind == "from_zero" else step
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        c1, c2 = (1.0, 1.0) if kind == "no_bias_correction" else (1 - beta1**step, 1 - beta2**step)
        m_hat, v_hat = exp_avg / c1, exp_avg_sq / c2
        denom = (v_hat + eps).sqrt() if kind == "eps_inside" else v_hat.sqrt() + eps
        param.sub_(lr * m_hat / denom)

    return adamw_update


@pytest.mark.parametrize(
    "kind, named",
    [
        ("no_bias_correction", "need the bias corrections"),
        ("l2", "that is Adam's L2 penalty"),
        ("eps_inside", "eps goes outside the square root"),
        ("from_zero", "step is 1 on the first update"),
    ],
)
def test_task5_mistakes_are_named(kind, named):
    text = _fails("lab05.adamw_update", _adamw_mistake(kind))
    assert named in text and "after step" in text


def test_task5_an_update_that_is_not_in_place_and_torch_optim_are_refused():
    def rebinds(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
        param = param - lr * grad  # noqa: F841 - the classic slip: a new tensor, lost on return

    assert "in place" in _fails("lab05.adamw_update", rebinds)

    def via_torch(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
        p = param.clone().requires_grad_(True)
        optimizer = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        p.grad = grad.clone()
        optimizer.step()
        param.copy_(p.detach())

    assert "asks for the update itself" in _fails("lab05.adamw_update", via_torch)
    p = torch.zeros(2, requires_grad=True)  # torch's optimizer works again after the check
    p.grad = torch.ones(2)
    torch.optim.AdamW([p], lr=0.1).step()
    assert p.detach().tolist() != [0.0, 0.0]


def test_task5_an_update_that_returns_the_parameter_is_told_it_returns_none(solution):
    def returns(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
        solution["adamw_update"](param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay)
        return param

    text = _fails("lab05.adamw_update", returns)
    assert "returns None" in text and "returned a Tensor" in text
    check("lab05.adamw_update", solution["adamw_update"])


def test_task5_the_reference_update_is_torchs_adamw():
    from infra_lib.training.scratch_train import adamw_update

    generator = torch.Generator().manual_seed(3)
    mine = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    theirs = mine.clone().requires_grad_(True)
    optimizer = torch.optim.AdamW([theirs], lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3, foreach=False)
    exp_avg, exp_avg_sq = torch.zeros_like(mine), torch.zeros_like(mine)
    for step in range(1, 8):
        grad = torch.randn(4, 5, generator=generator, dtype=torch.float64) * 1e-3
        theirs.grad = grad.clone()
        optimizer.step()
        adamw_update(mine, grad, exp_avg, exp_avg_sq, step, 0.02, 0.8, 0.95, 1e-6, 0.3)
        assert torch.allclose(mine, theirs.detach(), rtol=0, atol=1e-14)
        assert torch.allclose(exp_avg_sq, optimizer.state[theirs]["exp_avg_sq"], rtol=0, atol=1e-20)


def test_train_tiny_is_seeded_and_learns():
    from infra_lib.training.scratch_train import train_tiny

    norms: list = []
    losses = train_tiny(6, seed=5, grad_norms=norms)
    assert losses == train_tiny(6, seed=5) and losses != train_tiny(6, seed=6)
    assert len(losses) == 6 and losses[-1] < losses[0] and len(norms) == 6
    assert "norm.weight" in norms[0] and "lm_head.weight" not in norms[0]  # the tied table counts once


def test_under_the_grader_the_reference_update_is_a_shortcut(solution, tmp_path, monkeypatch):
    from infra_lib.training.scratch_train import adamw_update

    record = tmp_path / "answers.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "5")
    check("lab05.adamw_update", solution["adamw_update"])
    check("lab05.adamw_update", lambda *args: adamw_update(*args))
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [row["kind"] for row in rows] == [None, "reference shortcut"]
    assert "adamw_update" in rows[1]["error"]


def test_the_labs_last_cells_run_the_answers_on_a_process_group_and_under_torchrun(tmp_path, capsys):
    """The cells after the last test (grading never runs them): the ring's traffic on threads, the answers on a
    gloo group next to dist.all_reduce, then the answers' DDP and ZeroAdamW on two processes started by
    torchrun, equal to one process, and a run whose rank 1 raises, reported by torchrun."""
    from conftest import run_cells_after_the_tests

    run_cells_after_the_tests(SOLUTION, tmp_path)
    out = capsys.readouterr().out
    (tmp_path / "out.txt").write_text(out)
    assert "2 (W - 1) / W" in out and "max |yours - dist.all_reduce|" in out
    assert out.count("the ranks' final parameters are the same, bit for bit") == 2, out
    assert "largest relative difference from one process" in out and "DIFFERENT" not in out
    assert "torchrun exited with code 1" in out and "Root Cause" in out
    assert "rank 1 raises at step 2" in out
