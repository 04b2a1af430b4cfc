"""The resumable training loop, its checkpoint, the elastic job under torchrun, and the checkpoint interval."""

from __future__ import annotations

import math
import os

import psutil
import pytest
import torch

from infra_lib.training import elastic
from infra_lib.training.elastic import (
    ShuffledLoader,
    daly_checkpoint_interval,
    expected_waste_fraction,
    job_mtbf_s,
    load_checkpoint,
    make_run,
    optimal_checkpoint_interval,
    per_gpu_failure_rate,
    save_checkpoint,
    simulate_waste_fraction,
    train_loop,
)
from infra_lib.training.elastic_train import lost_work, run_elastic, run_forked, uninterrupted


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as each rank of a job uses: on a busy machine two threads make these tiny steps ~20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _plain(records):
    return [{k: v for k, v in r.items() if k not in ("t0", "t1")} for r in records]


def _resumed(tmp_path, stop_at: int, total: int, every: int, load=load_checkpoint):
    """A job stopped after ``stop_at`` steps (its process gone: a fresh run) and resumed with ``load``."""
    path = tmp_path / "ckpt.pt"
    first = make_run(5)
    train_loop(first, stop_at, every, path, save_checkpoint, load_checkpoint)
    again = make_run(5)
    return again, train_loop(again, total, every, path, save_checkpoint, load)


def test_a_resumed_run_repeats_the_uninterrupted_one_bit_for_bit(tmp_path):
    full = make_run(5)
    records = train_loop(full, 12, 4, tmp_path / "full.pt", save_checkpoint, load_checkpoint)
    again, rest = _resumed(tmp_path, 10, 12, 4)  # the last checkpoint holds step 8: steps 9 and 10 are redone
    assert [r["step"] for r in rest] == [9, 10, 11, 12]
    assert _plain(rest) == _plain(records[8:])
    assert elastic.digest(*again.model.parameters()) == elastic.digest(*full.model.parameters())


def test_the_loops_randomness_matters_so_the_data_position_and_rng_must_be_saved(tmp_path):
    full = make_run(5)
    records = train_loop(full, 12, 4, tmp_path / "full.pt", save_checkpoint, load_checkpoint)

    def weights_and_adamw_only(path, run):
        state = torch.load(path, weights_only=True)
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.step = state["step"]

    _, rest = _resumed(tmp_path, 10, 12, 4, load=weights_and_adamw_only)
    assert rest[0]["batch"] != records[8]["batch"] and rest[0]["rng"] != records[8]["rng"]
    assert [r["loss"] for r in rest] != [r["loss"] for r in records[8:]]


def test_a_kill_during_the_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    run = make_run(1)
    train_loop(run, 3, 3, path, save_checkpoint, load_checkpoint)
    original = torch.save

    def dies_halfway(obj, f, *args, **kwargs):
        original({"half": torch.zeros(3)}, f)
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        train_loop(run, 6, 3, path, save_checkpoint, load_checkpoint)
    monkeypatch.undo()
    fresh = make_run(1)
    load_checkpoint(path, fresh)
    assert fresh.step == 3


def test_no_checkpoint_yet_means_from_scratch(tmp_path):
    run = make_run(2)
    before = elastic.digest(*run.model.parameters()), run.step, torch.get_rng_state()
    load_checkpoint(tmp_path / "missing.pt", run)
    assert (elastic.digest(*run.model.parameters()), run.step) == before[:2]
    assert torch.equal(torch.get_rng_state(), before[2])


def test_the_loader_splits_each_global_batch_and_reshuffles_every_epoch():
    loaders = [ShuffledLoader(10, 4, rank, 2, seed=0) for rank in range(2)]
    epochs = {}
    for _ in range(6):  # 2 steps per epoch (the last 2 samples dropped)
        (batch, share0), (same, share1) = (loader.next_batch() for loader in loaders)
        assert torch.equal(batch, same) and torch.equal(torch.cat([share0, share1]), batch)
        epochs.setdefault(loaders[0].epoch, []).append(batch)
    orders = [torch.cat(batches) for batches in epochs.values()]
    assert len(orders) == 3 and not torch.equal(orders[0], orders[1]) and len(set(orders[0].tolist())) == 8
    with pytest.raises(ValueError, match="multiple of world_size"):
        ShuffledLoader(10, 3, 0, 2, seed=0)
    with pytest.raises(ValueError, match="rank must lie"):
        ShuffledLoader(10, 4, 2, 2, seed=0)


def test_young_daly_and_the_waste_they_minimise():
    rate = per_gpu_failure_rate(419, 16_384, 54)  # Llama 3 (Meta 2024): unexpected interruptions in 54 days
    mtbf = job_mtbf_s(10_000, rate)
    assert mtbf / 3600 == pytest.approx(5.07, abs=0.01)
    young = optimal_checkpoint_interval(20, mtbf)
    assert young == pytest.approx(math.sqrt(2 * 20 * mtbf))
    daly = daly_checkpoint_interval(20, mtbf)
    grid = [young * f for f in (0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 2.0)]
    best = min(grid, key=lambda tau: expected_waste_fraction(tau, 20, mtbf))
    assert best in (young * 0.95, young, young * 1.05) and abs(daly - young) / young < 0.05
    assert daly_checkpoint_interval(50, 10) == 10  # a checkpoint longer than two MTBFs: save every MTBF
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            optimal_checkpoint_interval(bad, mtbf)


def test_the_simulated_failures_waste_what_the_formula_says():
    for tau in (200.0, 854.0, 4000.0):
        formula = expected_waste_fraction(tau, 20, 18_244, restart_s=600)
        played = simulate_waste_fraction(tau, 20, 18_244, 600, work_s=18_244 * 3000, seed=1)
        assert played == pytest.approx(formula, rel=0.06)


def test_lost_work_reads_the_kill_and_the_resume_from_the_logs():
    logs = {
        0: [
            {"life": 0, "event": "checkpoint", "step": 5, "t": 10.0},
            {"life": 0, "step": 6, "t0": 10.1},
            {"life": 1, "event": "start", "step": 5, "t": 14.0},
            {"life": 1, "step": 6, "t0": 14.5},
            {"life": 1, "step": 7, "t0": 14.6},
            {"life": 1, "step": 8, "t0": 14.7},
        ],
        1: [
            {"life": 0, "event": "checkpoint", "step": 5, "t": 10.02},
            {"life": 0, "event": "killed", "step": 7, "t": 10.3},
        ],
    }
    lost = lost_work(logs)
    assert lost["checkpoint_step"] == 5 and lost["steps_recomputed"] == 2
    assert lost["work_lost_s"] == pytest.approx(0.28) and lost["restart_s"] == pytest.approx(4.2)
    with pytest.raises(ValueError, match="no rank was killed"):
        lost_work({0: logs[0][:2]})


def test_forked_ranks_restarted_after_a_kill_end_where_the_uninterrupted_job_ends(tmp_path):
    from infra_lib.training.elastic import read_jsonl

    job = {"world": 2, "steps": 9, "every": 3, "seed": 4, "kills": [(0, 0, 8)]}
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    played = run_forked(job, tmp_path)
    assert played["codes"][0][0] == -9 and played["codes"][-1] == [0, 0] and not played["timed_out"]
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    logs = [read_jsonl(tmp_path / f"rank{r}.jsonl") for r in (0, 1)]
    starts = [(e["life"], e["step"]) for e in logs[1] if e.get("event") == "start"]
    assert starts == [(0, 0), (1, 6)]
    base = uninterrupted(2, 9, 3, seed=4)
    for rank in (0, 1):
        done = next(e["digest"] for e in logs[rank] if e.get("event") == "done")
        assert done == base[rank]["digest"]
    with pytest.raises(ValueError, match="every >= 1"):
        run_forked({**job, "every": 0}, tmp_path)


@pytest.mark.slow  # torchrun's agent and two ranks start and import torch, twice
def test_a_rank_killed_under_torchrun_resumes_to_the_same_bits_and_leaves_no_process(tmp_path):
    job = run_elastic(tmp_path / "job", steps=12, every=4, kill_rank=1, kill_step=11, timeout_s=240)
    assert job.returncode == 0, job.output[-3000:]
    assert job.lives == 2 and job.leftover == [] and len(job.pids_seen) == 5  # torchrun, 2 ranks, 2 ranks again
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in job.pids_seen)
    lost = lost_work(job.logs)
    assert (lost["checkpoint_step"], lost["steps_recomputed"]) == (8, 3)
    base = uninterrupted(2, 12, 4, seed=0)
    for rank in (0, 1):
        assert job.results[rank]["digest"] == base[rank]["digest"]
        last_life = {int(step): loss for step, loss in job.results[rank]["losses"].items()}
        assert last_life == {r["step"]: r["loss"] for r in base[rank]["records"] if r["step"] > 8}
    assert sorted(os.listdir(tmp_path / "job" / "ckpt")) == ["rank0.pt", "rank1.pt"]  # no temporary file left
