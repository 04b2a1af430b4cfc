"""Training that survives a killed rank: a loop whose every random draw and data position can be saved and
restored, so a job resumed from a checkpoint ends with the same bits as one never interrupted; and how often
to save.

    run = make_run(seed, rank, world_size)             # model, AdamW, shuffled loader, step 0, torch's RNG seeded
    records = train_loop(run, steps, every, path, save_checkpoint, load_checkpoint)

``train_loop`` first calls ``load(path, run)`` (a restarted rank picks up where the last checkpoint left off;
with no checkpoint yet it starts from scratch), then trains data-parallel (gradients averaged with
``torch.distributed`` when the group has more than one rank) and calls ``save(path, run)`` after every
``every``-th step. Two things make its result depend on more than the weights: the loader draws a fresh
permutation of the samples from its own generator at each epoch, and the model applies dropout to its
embeddings, drawing from torch's global generator (seeded per rank). ``kill_step`` makes the process SIGKILL
itself in the middle of that step, after its backward and before the gradients are averaged: the failure a
launcher such as ``torchrun`` restarts the group after.

The interval: with a checkpoint costing δ seconds and failures arriving at random with mean time M between
them, Young (1974) showed that saving every τ ≈ √(2δM) seconds minimises the time lost to saving plus the
time lost to recomputing (first order); Daly (2006) gave the higher-order interval and the expected wall time
under exponential failures, which ``expected_waste_fraction`` evaluates and ``simulate_waste_fraction``
checks by playing failures.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

N_SAMPLES = 40  # windows of the course's text; an epoch is N_SAMPLES // GLOBAL_BATCH = 5 steps
SEQ_LEN = 16
GLOBAL_BATCH = 8
DROPOUT = 0.1
LR, BETAS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 0.1


class ShuffledLoader:
    """Epochs over ``n_samples`` samples, each in a new order drawn from the loader's own generator, split
    across ranks: every step takes the next ``global_batch`` indices of the epoch's order and rank ``r``
    keeps its contiguous share; an epoch's last incomplete batch is dropped.

    ``state_dict()`` / ``load_state_dict()`` capture and restore where it is (epoch, position, order and
    generator), as torch's modules and optimizers do.
    """

    def __init__(self, n_samples: int, global_batch: int, rank: int, world_size: int, seed: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in 0..world_size-1, got rank={rank}, world_size={world_size}")
        if global_batch < 1 or global_batch % world_size:
            raise ValueError(f"global_batch {global_batch} must be a positive multiple of world_size {world_size}")
        if n_samples < global_batch:
            raise ValueError(f"{n_samples} samples cannot fill one global batch of {global_batch}")
        self.n_samples, self.global_batch, self.rank, self.world_size = n_samples, global_batch, rank, world_size
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch, self.position = 0, 0
        self.order = torch.randperm(n_samples, generator=self.generator)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the step's global indices ``[global_batch]``, this rank's share ``[global_batch // world_size]``)."""
        if self.position + self.global_batch > self.n_samples:
            self.epoch, self.position = self.epoch + 1, 0
            self.order = torch.randperm(self.n_samples, generator=self.generator)
        batch = self.order[self.position : self.position + self.global_batch]
        self.position += self.global_batch
        share = self.global_batch // self.world_size
        return batch, batch[self.rank * share : (self.rank + 1) * share]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "order": self.order.clone(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order = state["order"].clone()
        self.generator.set_state(state["generator"])


@dataclass
class TrainingRun:
    """One rank's training: what ``train_loop`` advances and a checkpoint has to bring back.

    Attributes:
        model: the tiny Llama, with dropout on its embeddings.
        optimizer: ``torch.optim.AdamW`` over the model's parameters.
        loader: the ``ShuffledLoader`` that says which samples each step trains on.
        step: the steps completed so far.
        rank, world_size, seed: where this rank sits, fixed for the job.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: ShuffledLoader
    step: int
    rank: int
    world_size: int
    seed: int
    samples: torch.Tensor  # [N_SAMPLES, SEQ_LEN + 1] token windows


def _embedding_dropout(module, inputs, output):
    return F.dropout(output, DROPOUT, training=module.training)


def make_run(seed: int, rank: int = 0, world_size: int = 1) -> TrainingRun:
    """A fresh run: the seeded tiny Llama (the same on every rank), AdamW, the loader (the same order on every
    rank) and torch's global generator seeded for this rank's dropout."""
    from infra_lib.training.torchrun_train import tiny_llama
    from infra_lib.training.train_step import text_tokens

    model = tiny_llama(seed)
    model.embed_tokens.register_forward_hook(_embedding_dropout)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=False)
    tokens = text_tokens()
    stride = (tokens.numel() - SEQ_LEN - 1) // N_SAMPLES
    samples = torch.stack([tokens[i * stride : i * stride + SEQ_LEN + 1] for i in range(N_SAMPLES)])
    loader = ShuffledLoader(N_SAMPLES, GLOBAL_BATCH, rank, world_size, seed)
    torch.manual_seed(seed * 1000 + rank)
    return TrainingRun(model, optimizer, loader, 0, rank, world_size, seed, samples)


def digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' bytes, in order (16 hex digits): equal only if every bit is."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_digest(optimizer: torch.optim.Optimizer) -> str:
    """The digest of every tensor of the optimizer's state (AdamW: step, exp_avg, exp_avg_sq), in parameter order."""
    tensors = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            tensors += [torch.as_tensor(state[k]) for k in sorted(state)]
    return digest(*tensors)


class JsonlLog:
    """Appends one JSON line per record to ``path`` and flushes it at once, so a record written before a
    SIGKILL survives it; ``stamp`` fields (the rank, the life) go into every record."""

    def __init__(self, path: str | os.PathLike, **stamp):
        self.path, self.stamp = Path(path), stamp
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({**self.stamp, **record}) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a ``JsonlLog`` (none if the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class TorchGroup:
    """The loop's two collectives on the default ``torch.distributed`` group (gloo under ``torchrun``)."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


class StoreGroup:
    """The loop's two collectives through a key-value store (torch's ``FileStore``), for ranks that cannot open a
    socket: a sandbox with no network has no loopback for gloo. Every rank posts its tensor under the call's key
    and reads every rank's, then reduces them in rank order, so every rank gets the same bits (for two ranks, the
    bits gloo's sum gives)."""

    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        self.calls += 1
        flat = tensor.detach().contiguous().view(-1)
        self.store.set(f"reduce{self.calls}/{self.rank}", flat.numpy().tobytes())
        parts = [
            torch.frombuffer(bytearray(self.store.get(f"reduce{self.calls}/{r}")), dtype=flat.dtype)
            for r in range(self.world_size)
        ]
        result = parts[0].clone()
        for part in parts[1:]:
            result = torch.maximum(result, part) if op == "max" else result + part
        tensor.copy_(result.view_as(tensor))

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))


def _all_reduce_mean(tensor: torch.Tensor, world_size: int, group) -> torch.Tensor:
    if world_size > 1:
        group.all_reduce(tensor)
        tensor /= world_size
    return tensor


def _same_step_everywhere(run: TrainingRun, group) -> None:
    if run.world_size == 1:
        return
    bounds = torch.tensor([run.step, -run.step])
    group.all_reduce(bounds, op="max")
    if int(bounds[0]) != -int(bounds[1]):
        raise RuntimeError(
            f"the ranks resumed from different steps ({-int(bounds[1])} to {int(bounds[0])}): a job's checkpoint "
            "is one step's state on every rank, so every rank must have finished saving it before it counts"
        )


def train_loop(
    run: TrainingRun,
    total_steps: int,
    every: int,
    checkpoint: str | os.PathLike,
    save: Callable,
    load: Callable,
    log: Callable[[dict], None] | None = None,
    kill_step: int | None = None,
    group=None,
) -> list[dict]:
    """Resume from ``checkpoint`` (``load(checkpoint, run)``), train until ``run.step == total_steps``, saving
    (``save(checkpoint, run)``) after every ``every``-th step; returns one record per step trained here.

    A record holds the step (counted from 1), digests of what the step starts from (``weights``, ``moments``:
    the optimizer's state, ``rng``: torch's global generator), the step's global ``batch`` of sample indices,
    the global ``loss`` and wall times ``t0``/``t1``. ``log`` also gets events: ``start`` (with the step
    resumed from), ``checkpoint``, ``killed``. ``kill_step``: SIGKILL this process during that step. ``group``: the
    collectives between ranks (``TorchGroup``, the default, or ``StoreGroup``).
    """
    if every < 1 or total_steps < 0:
        raise ValueError(f"every must be >= 1 and total_steps >= 0, got every={every}, total_steps={total_steps}")
    log = log or (lambda record: None)
    group = group or TorchGroup()
    load(checkpoint, run)
    _same_step_everywhere(run, group)
    log({"event": "start", "step": run.step, "t": time.time()})
    records = []
    while run.step < total_steps:
        batch, mine = run.loader.next_batch()
        record = {
            "step": run.step + 1,
            "t0": time.time(),
            "batch": batch.tolist(),
            "rng": digest(torch.get_rng_state()),
            "weights": digest(*run.model.parameters()),
            "moments": optimizer_digest(run.optimizer),
        }
        windows = run.samples[mine]
        logits = run.model(windows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        run.optimizer.zero_grad()
        loss.backward()
        if kill_step is not None and run.step + 1 == kill_step:
            log({"event": "killed", "step": kill_step, "t": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        grads = [p.grad for p in run.model.parameters()]
        flat = _all_reduce_mean(torch.cat([g.reshape(-1) for g in grads]), run.world_size, group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
        run.optimizer.step()
        run.step += 1
        record["loss"] = float(_all_reduce_mean(loss.detach().clone(), run.world_size, group))
        record["t1"] = time.time()
        log(record)
        records.append(record)
        if run.step % every == 0:
            save(checkpoint, run)
            if run.world_size > 1:
                group.barrier()  # every rank's file holds this step before any rank goes on
            log({"event": "checkpoint", "step": run.step, "t": time.time()})
    return records


def save_checkpoint(path: str | os.PathLike, run: TrainingRun) -> None:
    """Everything the next step depends on (weights, AdamW's moments and step count, the loader's position,
    order and generator, torch's global generator, the step counter), written to a temporary file first and
    renamed over ``path``: a process killed while saving leaves the previous checkpoint whole."""
    state = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "loader": run.loader.state_dict(),
        "rng": torch.get_rng_state(),
        "step": run.step,
    }
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)  # atomic on POSIX: readers see the old file or the new, never half of one


def load_checkpoint(path: str | os.PathLike, run: TrainingRun) -> None:
    """Restore ``run`` in place from ``path``; without a checkpoint there, leave it as it is (from scratch)."""
    if not os.path.exists(path):
        return
    state = torch.load(path, weights_only=True)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"])
    run.step = int(state["step"])


# --- how often to checkpoint ------------------------------------------------------------------------------------


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def optimal_checkpoint_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimum: the work between two checkpoints, √(2·δ·M) seconds, for a
    checkpoint costing δ = ``checkpoint_cost_s`` and failures every M = ``mtbf_s`` on average."""
    _positive(checkpoint_cost_s=checkpoint_cost_s, mtbf_s=mtbf_s)
    return math.sqrt(2 * checkpoint_cost_s * mtbf_s)


def daly_checkpoint_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum: √(2δM)·(1 + √(δ/2M)/3 + (δ/2M)/9) − δ while δ < 2M, else M."""
    _positive(checkpoint_cost_s=checkpoint_cost_s, mtbf_s=mtbf_s)
    delta, m = checkpoint_cost_s, mtbf_s
    if delta >= 2 * m:
        return m
    x = delta / (2 * m)
    return math.sqrt(2 * delta * m) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def expected_waste_fraction(
    interval_s: float, checkpoint_cost_s: float, mtbf_s: float, restart_s: float = 0.0
) -> float:
    """The expected share of wall time not spent on new work, with failures a Poisson process of mean
    ``mtbf_s`` that can strike while working, saving or restarting (Daly 2006): the wall time is
    M·e^(R/M)·(e^((τ+δ)/M) − 1) per τ of work, so the waste is 1 − τ / that."""
    _positive(interval_s=interval_s, checkpoint_cost_s=checkpoint_cost_s, mtbf_s=mtbf_s)
    if restart_s < 0:
        raise ValueError(f"restart_s must be >= 0, got {restart_s!r}")
    m = mtbf_s
    wall_per_segment = m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_cost_s) / m)
    return 1 - interval_s / wall_per_segment


def simulate_waste_fraction(
    interval_s: float, checkpoint_cost_s: float, mtbf_s: float, restart_s: float, work_s: float, seed: int = 0
) -> float:
    """Play a job of ``work_s`` seconds of work, saving after every ``interval_s`` of it, with failures drawn
    from an exponential clock of mean ``mtbf_s`` (a failure while working or saving loses everything since
    the last finished checkpoint; the restart, ``restart_s``, can fail too); returns 1 − work / wall time."""
    _positive(interval_s=interval_s, checkpoint_cost_s=checkpoint_cost_s, mtbf_s=mtbf_s, work_s=work_s)
    rng = random.Random(seed)
    wall, done = 0.0, 0.0
    next_failure = rng.expovariate(1 / mtbf_s)
    while done < work_s:
        segment = min(interval_s, work_s - done) + checkpoint_cost_s
        if wall + segment <= next_failure:
            wall += segment
            done += segment - checkpoint_cost_s
            continue
        wall = next_failure  # the segment is lost; restart until a restart finishes before the next failure
        while True:
            next_failure = wall + rng.expovariate(1 / mtbf_s)
            if wall + restart_s <= next_failure:
                wall += restart_s
                break
            wall = next_failure
    return 1 - work_s / wall


def per_gpu_failure_rate(interruptions: int, gpus: int, days: float) -> float:
    """Failures per GPU per hour from a report of ``interruptions`` over ``days`` on ``gpus`` GPUs."""
    if interruptions < 0 or gpus < 1 or days <= 0:
        raise ValueError(f"need interruptions >= 0, gpus >= 1, days > 0; got {interruptions}, {gpus}, {days}")
    return interruptions / (gpus * days * 24)


def job_mtbf_s(gpus: int, failures_per_gpu_hour: float) -> float:
    """The mean time between failures of a synchronous job on ``gpus`` GPUs (any one failing stops it)."""
    if gpus < 1 or failures_per_gpu_hour <= 0:
        raise ValueError(f"need gpus >= 1 and a positive failure rate; got {gpus}, {failures_per_gpu_hour}")
    return 3600 / (gpus * failures_per_gpu_hour)
