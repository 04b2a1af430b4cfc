"""Distributed checkpoints of a sharded model: each rank writes its own shards, and a resume reads what it needs.

    save:   every rank -> its shards of the parameters and of AdamW's state -> its own file, all in parallel;
            rank 0 writes one small metadata file: which piece of which tensor lies where
    resume: any number of ranks -> each asks for the rows its new shards cover -> reads only those pieces

Gathering a sharded model onto one rank to write one file would cost a full copy in one process's memory
and one writer's bandwidth; ``torch.distributed.checkpoint`` (DCP) instead plans the save across the ranks
so each writes in parallel what it already holds, and records every piece's global offsets. Loading plans the
other way: a rank of a group of another size (4 saved, 2 resuming) reads the overlaps of its new shards with
the saved pieces (a "resharded" load). ``get_state_dict`` / ``set_state_dict`` give the model's and the
optimizer's state keyed by parameter name, as DTensors, so the two sides need not share a sharding.

``dcp.async_save`` first copies (stages) the state into CPU memory owned by the save, returns, and writes
from a background thread; training may change the parameters meanwhile. Its collectives (the plan, the
final barrier) run on a process group of their own here, so they never interleave with the training's on
the default group.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from infra_lib.model.config import LlamaConfig
from infra_lib.training.fsdp import make_optimizer, recording_held_bytes, shard_llama, train_step


def training_state(model, optimizer, step: int) -> dict:
    """What a resume needs: the model's and the optimizer's state (sharded, keyed by name) and the step reached,
    from which the data position follows (batch ``step`` is the next to train on)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "trainer": {"step": step}}


def save(model, optimizer, step: int, path, *, asynchronous: bool = False, process_group=None):
    """Write the training state at ``step`` to the folder ``path``, every rank its own shards.

    Blocking, it returns once every rank's file is written. ``asynchronous=True`` returns after staging a
    copy of the state, with a future: call ``.result()`` before the next save (``process_group``: the group
    for the save's own collectives).
    """
    state = training_state(model, optimizer, step)
    if asynchronous:
        return dcp.async_save(state, checkpoint_id=str(path), process_group=process_group)
    dcp.save(state, checkpoint_id=str(path))
    return None


def load(model, optimizer, path) -> int:
    """Read the training state in ``path`` into ``model`` and ``optimizer`` (sharded over any number of
    ranks); returns the step it was saved at."""
    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{path} holds no distributed checkpoint (no .metadata file)")
    state = training_state(model, optimizer, step=-1)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(state["trainer"]["step"])


def checkpoint_contents(path) -> dict:
    """Every entry of the checkpoint in ``path``, whole, keyed ``"model.layers.0.mlp.up_proj.weight"`` and so
    on: read in this one process, without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{path} holds no distributed checkpoint (no .metadata file)")
    with tempfile.TemporaryDirectory(prefix="dcp-") as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(str(path), str(whole))
        nested = torch.load(whole, weights_only=False)
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            flat[prefix] = value

    walk("", nested)
    return flat


def shard_files(path) -> dict[str, int]:
    """The files of the checkpoint in ``path`` and their sizes in bytes (one ``__<rank>_0.distcp`` per rank)."""
    return {f.name: f.stat().st_size for f in sorted(Path(path).iterdir()) if f.is_file()}


def save_worker(rank: int, world_size: int, config: LlamaConfig, batches, save_at: int, folder, seed: int = 0) -> dict:
    """``run_workers`` target: train the Llama of ``config`` under FSDP2 on ``batches``, saving three times.

    With m = (len(batches) - save_at) // 2: after ``save_at`` steps the same state is saved blocking into
    ``folder/blocking`` and then with ``async_save`` into ``folder/async``, and m steps train while the second is
    written; its future is waited on before the next save, blocking into ``folder/blocking_later`` after
    ``save_at + m`` steps, which m more steps follow. So the loop's time for a save and the m steps after it is
    measured both ways in one run.

    Returns the global losses, each step's seconds, the time each save call held the loop (``blocking_s``,
    ``async_s``, ``blocking_later_s``), the wait for the async write (``async_wait_s``), ``saved_step``,
    ``overlap_steps`` (m) and the bytes this rank held (``fsdp.held_bytes``).
    """
    from infra_lib.training.train_step import tiny_model

    overlap = (len(batches) - save_at) // 2
    if save_at < 1 or overlap < 1:
        raise ValueError(
            f"save_at must leave a step before it and two after it: got save_at={save_at} with {len(batches)} batches"
        )
    save_group = dist.new_group(backend="gloo")  # the async save's collectives, apart from training's
    model = shard_llama(tiny_model(config, seed=seed), world_size)
    optimizer = make_optimizer(model)
    saves = {save_at: ("blocking", "async"), save_at + overlap: ("blocking_later",)}
    losses, seconds, pending, stalls, held = [], [], None, {}, {}
    for step, (inputs, targets) in enumerate(batches):
        if step == save_at + overlap:
            start = time.perf_counter()
            pending.result()  # the async write must be done before the next save starts
            stalls["async_wait_s"] = time.perf_counter() - start
        for kind in saves.get(step, ()):
            dist.barrier()
            start = time.perf_counter()
            future = save(
                model, optimizer, step, Path(folder) / kind, asynchronous=kind == "async", process_group=save_group
            )
            stalls[f"{kind}_s"] = time.perf_counter() - start
            pending = future or pending
        start = time.perf_counter()
        record = recording_held_bytes(held, model, optimizer)
        losses.append(train_step(model, optimizer, inputs, targets, rank, world_size, record))
        seconds.append(time.perf_counter() - start)
    dist.barrier()
    return {
        "losses": losses,
        "step_seconds": seconds,
        "saved_step": save_at,
        "overlap_steps": overlap,
        "held": held,
        **stalls,
    }


def resume_worker(rank: int, world_size: int, config: LlamaConfig, batches, path, seed: int = 1) -> dict:
    """``run_workers`` target: a fresh model (drawn from another ``seed``: the checkpoint must overwrite it) under
    FSDP2 on this group's ranks, loaded from ``path``, trained on the batches from the saved step on.

    Returns the step it resumed at, the seconds its load took (reading this rank's pieces of every shard file and
    setting them) and the global losses of the steps after it.
    """
    from infra_lib.training.train_step import tiny_model

    model = shard_llama(tiny_model(config, seed=seed), world_size)
    optimizer = make_optimizer(model)
    start = time.perf_counter()
    step = load(model, optimizer, path)
    load_s = time.perf_counter() - start
    losses = [train_step(model, optimizer, inputs, targets, rank, world_size) for inputs, targets in batches[step:]]
    return {"resumed_at": step, "load_s": load_s, "losses": losses}
