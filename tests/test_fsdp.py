"""FSDP2 on gloo ranks (``infra_lib.training.fsdp``): the same training as one process, the bytes each rank
holds equal to the stage-3 accounting shard by shard, and the all-gathers and reduce-scatters counted equal
to the formula for each ``reshard_after_forward``. One group of two ranks runs every variant."""

from __future__ import annotations

import math

import psutil
import pytest
import torch

from infra_lib.training.fsdp import (
    expected_traffic,
    rank_slice,
    shard_llama,
    shard_numel,
    shard_rows,
    sharding_worker,
    train_single,
    unit_shapes,
)
from infra_lib.training.fsdp import global_batches as fsdp_batches
from infra_lib.training.launcher import run_workers
from infra_lib.training.train_step import tiny_config, tiny_model
from infra_lib.training.zero import zero_memory_per_device

# One worker runs the module: its 2-rank training fixture then runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("fsdp")

# Odd row counts (3 heads of 10, a 75-wide MLP) so that the two ranks' shards differ in size.
CONFIG = tiny_config(256, 30, 2, 3, 1, 10, 75, 32)
WORLD, STEPS = 2, 3
FP32_ADAMW = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}
# fp32 sums over 2 ranks in another order than one process differ in the last bits: the losses by a few
# 1e-7. AdamW divides each gradient by its own running size, so where a gradient is nearly zero those bits can
# move a parameter by a fair part of the learning rate (3e-3): the parameters are held to 1e-4.
LOSS_TOLERANCE, PARAM_TOLERANCE = 1e-5, 1e-4


def fork_server_idle() -> bool:
    servers = [c for c in psutil.Process().children() if "forkserver" in " ".join(c.cmdline())]
    return not any(server.children() for server in servers)


@pytest.fixture(scope="module")
def runs():
    batches = fsdp_batches(STEPS, 4, 32)
    ranks = run_workers(sharding_worker, WORLD, (CONFIG, batches), timeout_s=120)
    assert fork_server_idle(), "a worker of the run outlived it"
    return ranks, train_single(CONFIG, batches)


@pytest.fixture(scope="module")
def shapes():
    return unit_shapes(tiny_model(CONFIG))


def test_fsdp2_trains_as_one_process(runs):
    ranks, single = runs
    fsdp = ranks[0]["fsdp"]["None"]
    assert len(fsdp["losses"]) == STEPS
    for rank in ranks:
        assert rank["fsdp"]["None"]["losses"] == fsdp["losses"], "every rank reports the same global loss"
    assert max(abs(a - b) for a, b in zip(fsdp["losses"], single["losses"])) < LOSS_TOLERANCE, (
        fsdp["losses"],
        single["losses"],
    )
    assert fsdp["params"].keys() == single["params"].keys()
    gap = max(float((fsdp["params"][n] - single["params"][n]).abs().max()) for n in single["params"])
    assert gap < PARAM_TOLERANCE, f"parameters after {STEPS} AdamW steps differ by {gap:.2e}"
    assert single["losses"][-1] < single["losses"][0], "the steps train"


def test_every_reshard_choice_trains_the_same(runs):
    ranks, _ = runs
    reference = ranks[0]["fsdp"]["None"]["params"]
    for choice in ("True", "False"):
        params = ranks[0]["fsdp"][choice]["params"]
        assert all(torch.equal(params[n], reference[n]) for n in reference), f"reshard_after_forward={choice}"


def test_memory_per_rank_is_the_stage3_accounting(runs, shapes):
    ranks, _ = runs
    flat = [s for unit in shapes for s in unit]
    num_params = sum(math.prod(s) for s in flat)
    held = [rank["fsdp"]["None"]["held"] for rank in ranks]
    for r, bytes_held in enumerate(held):
        numel = shard_numel(flat, WORLD, r)
        assert bytes_held == {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel}, (r, bytes_held)
    assert held[0] != held[1], "the odd rows make rank 0's shards larger"
    total = sum(sum(h.values()) for h in held)
    # The calculator's stage 3 is the whole model's 16 bytes a parameter over W: the ranks' shards add up to it.
    assert total == WORLD * zero_memory_per_device(num_params, WORLD, 3, **FP32_ADAMW) == 16 * num_params


def test_traffic_per_step_is_the_formula(runs, shapes):
    ranks, _ = runs
    blocks = len(shapes) - 1
    gathers = {"None": 2 * blocks + 1, "True": 2 * blocks + 2, "False": blocks + 1}
    for rank in ranks:
        for choice, calls in gathers.items():
            traffic = rank["fsdp"][choice]["traffic"]
            expected = expected_traffic(shapes, WORLD, 4, {"None": None, "True": True, "False": False}[choice])
            assert traffic["all_gather"] == STEPS * expected["all_gather"], choice
            assert traffic["reduce_scatter"] == STEPS * expected["reduce_scatter"], choice
            assert traffic["all_gather_calls"] == STEPS * calls, choice
            assert traffic["reduce_scatter_calls"] == STEPS * (blocks + 1), choice


def test_zero1_holds_whole_parameters_and_a_shard_of_the_moments(runs, shapes):
    ranks, single = runs
    num_params = sum(math.prod(s) for unit in shapes for s in unit)
    for rank in ranks:
        zero1 = rank["zero1"]
        assert zero1["held"]["params"] == zero1["held"]["grads"] == 4 * num_params
        assert zero1["held"]["optimizer"] == 8 * num_params / WORLD  # an even split here (26 130 elements)
        assert zero1["bytes_sent_per_step"] == 2 * 4 * num_params * (WORLD - 1) // WORLD
        assert max(abs(a - b) for a, b in zip(zero1["losses"], single["losses"])) < LOSS_TOLERANCE


def test_shard_rows_is_torch_chunk():
    for dim0 in (1, 5, 7, 10, 75, 256):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.arange(dim0).chunk(world)
            rows = [shard_rows(dim0, world, r) for r in range(world)]
            assert rows == [len(c) for c in chunks] + [0] * (world - len(chunks)), (dim0, world)


def test_traffic_formula_is_zero3_when_rows_divide():
    units = [[(8, 4), (8,)], [(8, 4)], [(16, 4), (8,)]]  # two blocks, then the root
    numel = 32 + 8 + 32 + 64 + 8
    for world in (2, 4, 8):
        share = 4 * numel * (world - 1) // world
        assert expected_traffic(units, world, 4, True) == {"all_gather": 2 * share, "reduce_scatter": share}
        assert expected_traffic(units, world, 4, False) == {"all_gather": share, "reduce_scatter": share}
        root = 4 * 72 * (world - 1) // world
        assert expected_traffic(units, world, 4, None)["all_gather"] == 2 * share - root


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="rank"):
        shard_rows(10, 2, 2)
    with pytest.raises(ValueError, match="evenly"):
        rank_slice(5, 2, 0)
    with pytest.raises(ValueError, match="reshard_after_forward"):
        expected_traffic([[(4,)]], 2, 4, 2)
    with pytest.raises(ValueError, match="reshard_after_forward"):
        shard_llama(tiny_model(CONFIG), 2, "yes")
