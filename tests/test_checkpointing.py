"""Distributed checkpoints of an FSDP2 model (``infra_lib.training.checkpointing``): saved by 4 ranks, resumed
by 2 with the losses of an uninterrupted run; an async save holds exactly what a blocking one holds although
training went on while it was written; each rank writes its own file."""

from __future__ import annotations

import psutil
import pytest
import torch

from infra_lib.training.checkpointing import checkpoint_contents, load, resume_worker, save_worker, shard_files
from infra_lib.training.fsdp import global_batches, train_single
from infra_lib.training.launcher import run_workers
from infra_lib.training.train_step import tiny_config

# One worker runs the module: its fixture (a 4-rank save, a 2-rank resume) then runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("checkpointing")

# Odd row counts, so the 4 ranks' shards (e.g. 19/19/19/18 rows of the MLP) are cut apart differently from the
# 2 ranks' (38/37): the resume must read pieces that straddle the saved ones.
CONFIG = tiny_config(256, 30, 2, 3, 1, 10, 75, 32)
STEPS, SAVE_AT = 4, 2
LOSS_TOLERANCE = 1e-5  # fp32 sums in another order than one process: a few 1e-7 (see tests/test_fsdp.py)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp")
    batches = global_batches(STEPS, 4, 32)
    saved = run_workers(save_worker, 4, (CONFIG, batches, SAVE_AT, str(folder)), timeout_s=120)
    resumed = run_workers(resume_worker, 2, (CONFIG, batches, str(folder / "blocking")), timeout_s=120)
    servers = [c for c in psutil.Process().children() if "forkserver" in " ".join(c.cmdline())]
    assert not any(server.children() for server in servers), "a worker of the runs outlived them"
    return {"folder": folder, "saved": saved, "resumed": resumed, "single": train_single(CONFIG, batches)}


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < LOSS_TOLERANCE


def test_resume_at_two_ranks_continues_the_same_losses(run):
    single = run["single"]["losses"]
    assert close(run["saved"][0]["losses"], single), "FSDP2 at 4 ranks trains as one process"
    for rank in run["resumed"]:
        assert rank["resumed_at"] == SAVE_AT
        assert close(rank["losses"], single[SAVE_AT:]), (rank["losses"], single[SAVE_AT:])
        assert close(rank["losses"], run["saved"][0]["losses"][SAVE_AT:]), "the uninterrupted run at 4 ranks"


def test_async_save_holds_what_the_blocking_save_holds(run):
    blocking = checkpoint_contents(run["folder"] / "blocking")
    written_late = checkpoint_contents(run["folder"] / "async")
    assert blocking.keys() == written_late.keys()
    assert blocking["trainer.step"] == written_late["trainer.step"] == SAVE_AT
    tensors = [k for k, v in blocking.items() if torch.is_tensor(v)]
    weight = "layers.1.mlp.up_proj.weight"
    assert {f"model.{weight}", f"optimizer.state.{weight}.exp_avg", f"optimizer.state.{weight}.exp_avg_sq"} <= set(
        tensors
    )
    assert blocking["model.layers.1.mlp.up_proj.weight"].shape == (75, 30), "whole tensors, put together"
    changed = [k for k in tensors if not torch.equal(blocking[k], written_late[k])]
    assert not changed, f"the async checkpoint took in later steps' values: {changed[:3]}"


def test_each_rank_writes_its_own_file(run):
    files = shard_files(run["folder"] / "blocking")
    assert set(files) == {".metadata", *(f"__{rank}_0.distcp" for rank in range(4))}
    assert all(size > 0 for size in files.values())


def test_every_save_is_timed_and_holds_its_step(run):
    for rank in run["saved"]:
        assert rank["saved_step"] == SAVE_AT and len(rank["step_seconds"]) == STEPS
        assert rank["overlap_steps"] == (STEPS - SAVE_AT) // 2
        assert all(rank[key] >= 0 for key in ("blocking_s", "async_s", "async_wait_s", "blocking_later_s"))
    later = checkpoint_contents(run["folder"] / "blocking_later")
    assert later["trainer.step"] == SAVE_AT + run["saved"][0]["overlap_steps"]


def test_a_folder_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no distributed checkpoint"):
        checkpoint_contents(tmp_path)
    with pytest.raises(FileNotFoundError, match="no distributed checkpoint"):
        load(None, None, tmp_path)
    for save_at, steps in ((0, 4), (2, 3)):
        with pytest.raises(ValueError, match="save_at"):
            save_worker(0, 1, CONFIG, global_batches(steps, 4, 32), save_at, tmp_path)


def test_four_ranks_hold_their_shards_only(run):
    from infra_lib.training.fsdp import shard_numel, unit_shapes
    from infra_lib.training.train_step import tiny_model

    shapes = [s for unit in unit_shapes(tiny_model(CONFIG)) for s in unit]
    for r, rank in enumerate(run["saved"]):
        numel = shard_numel(shapes, 4, r)
        assert rank["held"] == {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel}, r
