"""Lab 05's checks name the classic mistakes of the ZeRO calculator, of splitting a tensor into
shards and of the ring all-reduce; a ring that hangs or loops is stopped in seconds with the ranks
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


# --- task 1: zero_memory_per_device ---------------------------------------------------------------


def _zero(formula, validate=True):
    """A calculator with the per-stage ``formula(stage, p, g, k, n)``."""

    def zero_memory_per_device(num_params, num_devices, stage, *, param_bytes=2, grad_bytes=2, optimizer_bytes=12):
        if validate and (
            stage not in (0, 1, 2, 3) or not isinstance(num_devices, int) or num_devices < 1 or num_params < 0
        ):
            raise ValueError("invalid")
        return formula(
            stage, param_bytes * num_params, grad_bytes * num_params, optimizer_bytes * num_params, num_devices
        )

    return zero_memory_per_device


def _right(stage, p, g, k, n):
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]


@pytest.mark.parametrize(
    "formula, named",
    [
        (lambda s, p, g, k, n: (p + g + k) / n if s >= 2 else _right(s, p, g, k, n), "parameters stay whole"),
        (lambda s, p, g, k, n: _right(s, p, 0, k, n), "left out the gradients"),
        (
            lambda s, p, g, k, n: _right(s, p, g, p + g + k, n) if s in (1, 2) else _right(s, p, g, k, n),
            "whole per-parameter state",
        ),
        (lambda s, p, g, k, n: _right(s, p, g, k, n) / 1e9, "return bytes, not GB"),
        (lambda s, p, g, k, n: _right(min(s + 1, 3), p, g, k, n), "that is stage 1's figure"),
        (lambda s, p, g, k, n: _right(2 if s == 1 else s, p, g, k, n), "gradients are sharded from stage 2"),
    ],
)
def test_task1_mistakes_are_named(formula, named):
    text = _fails("lab05.zero_memory", _zero(formula))
    assert named in text and "expected" in text and "GB)" in text


def test_task1_ignoring_the_byte_counts_and_validation_are_named():
    def defaults_only(num_params, num_devices, stage, **ignored):
        return _right(stage, 2 * num_params, 2 * num_params, 12 * num_params, num_devices)

    assert "use the param_bytes, grad_bytes and optimizer_bytes passed in" in _fails("lab05.zero_memory", defaults_only)
    text = _fails(
        "lab05.zero_memory_edges", _zero(lambda s, p, g, k, n: _right(min(s, 3), p, g, k, max(n, 1)), validate=False)
    )
    assert "should raise ValueError on an invalid input" in text and "stage=4" in text


def test_task1_integer_arithmetic_passes():
    def integer(num_params, num_devices, stage, *, param_bytes=2, grad_bytes=2, optimizer_bytes=12):
        if stage not in range(4) or type(num_devices) is not int or num_devices < 1 or not num_params >= 0:
            raise ValueError("invalid")
        sharded = {
            0: 0,
            1: optimizer_bytes,
            2: grad_bytes + optimizer_bytes,
            3: param_bytes + grad_bytes + optimizer_bytes,
        }[stage]
        return (param_bytes + grad_bytes + optimizer_bytes - sharded) * num_params + sharded * num_params / num_devices

    check("lab05.zero_memory", integer)
    check("lab05.zero_memory_edges", integer)


def test_task1_stage_is_compared_by_value_and_a_nan_is_invalid(solution):
    """The text: 1.0 and True are stage 1 and False stage 0; 1.5 and nan raise, and so does a num_params of nan."""
    from infra_lib.training.zero import zero_memory_per_device as reference

    mine = solution["zero_memory_per_device"]
    for fn in (mine, reference):
        assert fn(1e9, 8, 1.0) == fn(1e9, 8, True) == fn(1e9, 8, 1) and fn(1e9, 8, False) == fn(1e9, 8, 0)
        for bad in ((1e9, 8, 1.5), (1e9, 8, float("nan")), (float("nan"), 8, 1)):
            with pytest.raises(ValueError):
                fn(*bad)
    check("lab05.zero_memory_edges", mine)

    def strict_stage(num_params, num_devices, stage, **bytes_per):
        if type(stage) is not int:
            raise ValueError(f"stage must be an int, got {stage!r}")
        return mine(num_params, num_devices, stage, **bytes_per)

    text = _fails("lab05.zero_memory_edges", strict_stage)
    assert "raised an exception on a valid input" in text and "compared by value" in text

    def nan_params_pass(num_params, num_devices, stage, **bytes_per):
        if num_params != num_params:  # nan: computed through, as `num_params < 0` lets it
            return float("nan")
        return mine(num_params, num_devices, stage, **bytes_per)

    text = _fails("lab05.zero_memory_edges", nan_params_pass)
    assert "should raise ValueError" in text and "num_params=nan" in text and "negative or nan" in text


# --- task 2: shard_bounds -------------------------------------------------------------------------


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
def test_task2_mistakes_are_named(bounds, named):
    assert named in _fails("lab05.shard_bounds", bounds)


def test_task2_tensor_split_passes():
    def from_tensor_split(numel, world_size, rank):
        sizes = [len(part) for part in torch.tensor_split(torch.arange(numel), world_size)]
        start = sum(sizes[:rank])
        return start, start + sizes[rank]

    check("lab05.shard_bounds", from_tensor_split)
    check(
        "lab05.shard_bounds_more",
        lambda n, w, r: (r * (n // w) + min(r, n % w), (r + 1) * (n // w) + min(r + 1, n % w)),
    )


# --- task 3: ring_all_reduce ----------------------------------------------------------------------


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


def test_task3_the_solution_and_a_tensor_split_ring_pass_every_check(solution):
    for check_id in RING_CHECKS:
        check(check_id, solution["ring_all_reduce"])
        check(check_id, _ring())


def test_task3_passing_the_whole_tensor_around_gives_the_sum_but_fails_the_traffic():
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
def test_task3_mistakes_are_named(ring, check_id, named):
    assert named in _fails(check_id, ring)


def test_task3_an_extra_reduce_scatter_step_gives_the_sum_but_not_the_traffic():
    ring = _ring(reduce_steps=lambda w: w)  # the all-gather then overwrites the chunk it spoilt
    check("lab05.ring_sum", ring)
    text = _fails("lab05.ring_traffic", ring)
    assert "sent a different number of bytes" in text and "messages of one" in text


def test_task3_returning_a_new_tensor_is_not_in_place():
    def copy(tensor, comm):
        return _ring()(tensor.clone(), comm)

    text = _fails("lab05.ring_sum", copy)
    assert "returned the sum but left the input tensor unchanged" in text and "in place" in text


def test_task3_sharing_memory_between_threads_sends_nothing():
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


def test_task3_a_deadlock_is_a_time_out_naming_the_waiting_ranks():
    started = time.monotonic()
    text = _fails("lab05.ring_sum", _ring(to_left=True))  # every rank sends left and waits for the left
    assert time.monotonic() - started < 20
    assert "waited for a message that never came" in text and "ranks [0, 1, 2] were waiting in exchange" in text
    assert "rank 0 sent to 2 and waits for 2" in text and "(rank + 1) % W" in text


def test_task3_a_loop_that_never_ends_is_stopped_and_named():
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


def test_task3_a_rank_that_skips_the_exchange_of_an_empty_chunk_is_told_the_number_of_exchanges():
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


def test_task3_a_wrong_chunk_index_still_points_at_the_indices():
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


def test_task3_a_rank_that_raises_is_named():
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
    from infra_lib.training.zero import zero_memory_per_device

    record = tmp_path / "answers.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "11")
    check("lab05.ring_any_tensor", solution["ring_all_reduce"])
    check("lab05.zero_memory", solution["zero_memory_per_device"])
    check("lab05.ring_sum", lambda tensor, comm: ring_all_reduce(tensor, comm))  # runs on the ranks' threads
    check("lab05.zero_memory", lambda *args, **kwargs: zero_memory_per_device(*args, **kwargs))
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [row["kind"] for row in rows] == [None, None, "reference shortcut", "reference shortcut"]
    assert "ring_all_reduce" in rows[2]["error"]


# --- the lab's last cell --------------------------------------------------------------------------


def test_answer_cells_run_on_a_gloo_process_group(solution):
    from grading.checks.lab05 import run_on_process_group
    from infra_lib.training import WorkerError

    sources = list(answer_cells(SOLUTION).values())
    ranks = run_on_process_group(sources, world_size=2, shapes=((1000,), (7, 3), (1,)), repeats=1, timeout_s=120)
    assert len(ranks) == 2
    for rows in ranks:
        assert [row["shape"] for row in rows] == [[1000], [7, 3], [1]]
        for row in rows:
            assert row["max_abs_error"] == 0.0  # two ranks: every sum is the same a + b
            assert row["ring_s"] > 0 and row["all_reduce_s"] > 0
        assert rows[0]["bytes_sent"] == 4000  # 2 (W - 1) / W = 1 tensor with two ranks
    broken = sources[:-1] + ["def ring_all_reduce(tensor, comm):\n    raise KeyError('no ring yet')\n"]
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


# --- tasks 4 to 6: softmax_backward, rms_norm_backward, adamw_update, and training with them -----

NEW_CHECKS = (
    "lab05.softmax_backward",
    "lab05.softmax_backward_edges",
    "lab05.rms_norm_backward",
    "lab05.rms_norm_backward_edges",
    "lab05.adamw_update",
    "lab05.adamw_edges",
)


def _pieces(solution, **changes) -> dict:
    pieces = {name: solution[name] for name in ("softmax_backward", "rms_norm_backward", "adamw_update")}
    return {**pieces, **changes}


def test_tasks4_to_6_the_solution_passes_every_check_and_trains_like_the_reference(solution):
    answers = {"softmax": "softmax_backward", "rms": "rms_norm_backward", "adamw": "adamw_update"}
    for check_id in NEW_CHECKS:
        check(check_id, solution[answers[check_id.split(".")[1].split("_")[0]]])
    check("lab05.train_tiny", _pieces(solution))


def _softmax_mistake(kind):
    def softmax_backward(probs, grad):
        weighted = (grad * probs).sum(-1, keepdim=True)
        return {
            "no_sum": probs * grad,
            "diagonal": grad * probs * (1 - probs),
            "wrong_dim": probs * (grad - (grad * probs).sum(0, keepdim=True)),
            "no_p": grad - weighted,
            "plus_constant": probs * (grad - weighted) + 1e-3,
        }[kind]

    return softmax_backward


@pytest.mark.parametrize(
    "kind, check_id, named",
    [
        ("no_sum", "lab05.softmax_backward", "that is probs * grad_probs"),
        ("diagonal", "lab05.softmax_backward", "only the diagonal of the Jacobian"),
        ("wrong_dim", "lab05.softmax_backward", "the sum runs over the wrong dim"),
        ("no_p", "lab05.softmax_backward", "without the factor p_i a masked entry"),
        ("plus_constant", "lab05.softmax_backward", "nonzero gradient where the probability is exactly 0"),
    ],
)
def test_task4_mistakes_are_named(kind, check_id, named):
    text = _fails(check_id, _softmax_mistake(kind))
    assert named in text and "on " in text and "“1 · The chain rule as a graph”" in text


def test_task4_a_gradient_at_a_masked_entry_is_caught_even_when_tiny(solution):
    def leaky(probs, grad):
        return solution["softmax_backward"](probs, grad) + 1e-30 * grad

    text = _fails("lab05.softmax_backward", leaky)
    assert "exactly 0 (a masked entry)" in text and "attention weights" in text


def test_task4_a_fully_masked_row_has_zero_probabilities_and_a_zero_gradient(solution):
    """The text: a row masked everywhere arrives as all-zero probabilities, and its gradient is exactly 0; a backward
    that renormalises by the row's sum turns it into nan, and the hidden check says where."""
    from grading.registry import get_check

    registered = get_check("lab05.softmax_backward_edges")
    assert any(case["mask"] == "padded" for case in registered.inputs(0))
    probs = torch.tensor([[0.0, 0.0, 0.0], [0.25, 0.75, 0.0]])
    grad = torch.tensor([[1.0, -2.0, 3.0], [0.5, 1.0, 2.0]])
    assert torch.equal(solution["softmax_backward"](probs, grad)[0], torch.zeros(3))
    check("lab05.softmax_backward_edges", solution["softmax_backward"])

    def renormalises(probs, grad):
        return probs * (grad - (grad * probs).sum(-1, keepdim=True) / probs.sum(-1, keepdim=True))

    check("lab05.softmax_backward", renormalises)  # no fully masked row there: the same numbers
    text = _fails("lab05.softmax_backward_edges", renormalises)
    assert "exactly 0 (a masked entry)" in text and "fully masked" in text


def test_tasks4_and_5_a_backward_through_torch_autograd_is_refused(solution):
    def softmax_by_autograd(probs, grad):
        scores = probs.clamp_min(1e-300).log().detach().requires_grad_(True)
        (torch.softmax(scores, -1) * grad).sum().backward()
        return torch.where(probs == 0, 0.0, scores.grad).to(probs.dtype)

    def rms_by_autograd(x, weight, grad_out, eps):
        from torch.autograd import grad  # imported by name: refused all the same

        x, weight = x.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
        return tuple(t.detach() for t in grad(y, (x, weight), grad_out))

    for check_id, fn in (("lab05.softmax_backward", softmax_by_autograd), ("lab05.rms_norm_backward", rms_by_autograd)):
        text = _fails(check_id, fn)
        assert "ask for the backward formula itself" in text
    x = torch.ones(2, requires_grad=True)  # torch's autograd works again after the checks
    (x * 3).sum().backward()
    assert x.grad.tolist() == [3.0, 3.0]
    check("lab05.rms_norm_backward", solution["rms_norm_backward"])


def _rms_mistake(kind):
    def rms_norm_backward(x, weight, grad_out, eps):
        mean_square = x.pow(2).mean(-1, keepdim=True)
        inv = 1 / (mean_square.sqrt() + eps) if kind == "eps_outside" else torch.rsqrt(mean_square + eps)
        normed, g = x * inv, grad_out * weight
        reduce = (g * normed).sum(-1, keepdim=True) if kind == "no_1_over_d" else (g * normed).mean(-1, keepdim=True)
        grad_x = inv * g if kind == "constant_rms" else inv * (g - normed * reduce)
        grad_weight = grad_out * normed
        if kind != "not_summed":
            grad_weight = grad_weight.reshape(-1, x.shape[-1]).sum(0)
        return grad_x, grad_weight

    return rms_norm_backward


@pytest.mark.parametrize(
    "kind, named",
    [
        ("constant_rms", "that treats the rms as a constant"),
        ("no_1_over_d", "the mean's 1/d is missing"),
        ("not_summed", "grad_weight must be summed over every leading dim"),
        ("eps_outside", "eps belongs inside the square root"),
    ],
)
def test_task5_mistakes_are_named(kind, named):
    text = _fails("lab05.rms_norm_backward", _rms_mistake(kind))
    assert named in text and "on " in text


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
def test_task6_mistakes_are_named(kind, named):
    text = _fails("lab05.adamw_update", _adamw_mistake(kind))
    assert named in text and "after step" in text


def test_task6_an_update_that_is_not_in_place_and_torch_optim_are_refused():
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


def test_task6_an_update_that_returns_the_parameter_is_told_it_returns_none(solution):
    def returns(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
        solution["adamw_update"](param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay)
        return param

    text = _fails("lab05.adamw_update", returns)
    assert "returns None" in text and "returned a Tensor" in text
    check("lab05.adamw_update", solution["adamw_update"])


def test_task6_the_reference_update_is_torchs_adamw():
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


@pytest.mark.parametrize(
    "piece, named",
    [
        ("adamw_update", "your adamw_update (task 6)"),
        ("softmax_backward", "your softmax_backward (task 4)"),
        ("rms_norm_backward", "your rms_norm_backward (task 5)"),
    ],
)
def test_training_catches_a_wrong_piece_and_names_the_step(solution, piece, named):
    wrong = {
        "adamw_update": _adamw_mistake("no_bias_correction"),
        "softmax_backward": _softmax_mistake("diagonal"),
        "rms_norm_backward": _rms_mistake("eps_outside"),
    }
    text = _fails("lab05.train_tiny", _pieces(solution, **{piece: wrong[piece]}))
    step = int(text.split("loss curve at step ")[1].split()[0])
    assert step >= 2 and f"the first {step - 1} losses agree, then step {step}'s loss is" in text
    assert named in text


def test_training_with_an_untouched_piece_points_at_that_task(solution):
    def untouched(probs, grad):
        raise NotImplementedError("lab05 task 4: softmax_backward")

    text = _fails("lab05.train_tiny", _pieces(solution, softmax_backward=untouched))
    assert "this check also runs lab05 task 4 (softmax_backward), which is not written yet" in text


def test_the_backward_seam_swaps_the_formulas_and_restores_the_reference():
    from infra_lib.training import autograd

    defaults = dict(autograd.BACKWARD)
    assert defaults == {"softmax": autograd.softmax_backward, "rms_norm": autograd.rms_norm_backward}
    calls = []

    def counting(probs, grad):
        calls.append(probs.shape)
        return autograd.softmax_backward(probs, grad)

    x = autograd.Value(torch.randn(2, 3, 3, dtype=torch.float64))
    with autograd.using_backward(softmax=counting):
        out = autograd.softmax(x, causal=True)
        assert autograd.BACKWARD["rms_norm"] is autograd.rms_norm_backward  # None keeps the current one
    assert autograd.BACKWARD == defaults
    out.sum().backward()  # made inside the block: keeps the formula it was made with
    assert calls == [torch.Size([2, 3, 3])]
    with pytest.raises(KeyError), autograd.using_backward(rms_norm=lambda *args: None):
        raise KeyError("an error inside the block")
    assert autograd.BACKWARD == defaults


def test_train_tiny_is_seeded_and_learns():
    from infra_lib.training.scratch_train import train_tiny

    norms: list = []
    losses = train_tiny(6, seed=5, grad_norms=norms)
    assert losses == train_tiny(6, seed=5) and losses != train_tiny(6, seed=6)
    assert len(losses) == 6 and losses[-1] < losses[0] and len(norms) == 6
    assert "norm.weight" in norms[0] and "lm_head.weight" not in norms[0]  # the tied table counts once


def test_under_the_grader_the_reference_pieces_are_shortcuts(solution, tmp_path, monkeypatch):
    from infra_lib.training.autograd import softmax_backward
    from infra_lib.training.scratch_train import adamw_update

    record = tmp_path / "answers.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "5")
    check("lab05.train_tiny", _pieces(solution))
    check("lab05.softmax_backward", lambda probs, grad: softmax_backward(probs, grad))
    check("lab05.train_tiny", _pieces(solution, adamw_update=lambda *args: adamw_update(*args)))
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [row["kind"] for row in rows] == [None, "reference shortcut", "reference shortcut"]
    assert "adamw_update" in rows[2]["error"]
