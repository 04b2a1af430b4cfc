"""Data parallelism: every rank holds the whole model, computes gradients on its slice of the
global batch, and the gradients are averaged across ranks before every optimizer step.

Averaging the ranks' mean gradients over equal slices gives exactly the mean gradient of the
global batch, so N ranks with batch B/N each follow the same trajectory as one process with batch
B (up to float summation order): ``train_single`` and ``ddp_worker`` check it. Gradients are
flattened into buckets of at most ``bucket_bytes`` and each bucket is all-reduced in one call,
as PyTorch's DDP does (fewer, larger messages; its real version overlaps them with backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from infra_lib.training.collectives import ring_all_reduce


def make_model(seed: int = 0, sizes=(16, 64, 64, 4)) -> nn.Sequential:
    """A small MLP classifier (the same weights on every rank for a given seed)."""
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def make_dataset(num_samples: int = 512, seed: int = 0, sizes=(16, 64, 64, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded synthetic classification: points labelled by a fixed random linear rule."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_samples, sizes[0], generator=g)
    w = torch.randn(sizes[0], sizes[-1], generator=g)
    return x, (x @ w).argmax(dim=1)


def batches(x, y, global_batch: int, steps: int):
    """The global batches of each step (cycling through the data)."""
    for step in range(steps):
        start = (step * global_batch) % len(x)
        idx = torch.arange(start, start + global_batch) % len(x)
        yield x[idx], y[idx]


def make_optimizer(model, name: str, lr: float):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {name!r}")


def train_single(
    steps: int = 20, global_batch: int = 64, seed: int = 0, optimizer: str = "sgd", lr: float = 0.1
) -> dict:
    """One process, the whole global batch per step: the reference trajectory."""
    model = make_model(seed)
    x, y = make_dataset(seed=seed)
    opt = make_optimizer(model, optimizer, lr)
    losses = []
    for xb, yb in batches(x, y, global_batch, steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def gradient_buckets(params, bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Parameters grouped in order into buckets of at most ``bucket_bytes`` of gradient (one at least)."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def allreduce_gradients(params, bucket_bytes: int = 1 << 16, use_ring: bool = False) -> int:
    """Average the gradients of ``params`` over all ranks, one flat all-reduce per bucket; returns
    the number of all-reduce calls."""
    world = dist.get_world_size()
    buckets = gradient_buckets([p for p in params if p.grad is not None], bucket_bytes)
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        ring_all_reduce(flat) if use_ring else dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
    return len(buckets)


def ddp_worker(
    rank: int,
    world_size: int,
    steps: int = 20,
    global_batch: int = 64,
    seed: int = 0,
    optimizer: str = "sgd",
    lr: float = 0.1,
    bucket_bytes: int = 1 << 16,
    use_ring: bool = False,
    zero1: bool = False,
) -> dict:
    """A worker for ``run_workers``: data-parallel training on this rank's slice of each global batch.

    Returns the global loss of every step (the mean over ranks of the local losses), the final
    parameters (as lists), the number of all-reduce calls per step and the bytes of parameters,
    gradients and optimizer state this rank held (``zero1``: ZeRO stage 1 Adam, its state sharded).
    """
    from infra_lib.training.zero import ZeroStage1Adam

    if zero1 and optimizer != "adam":
        raise ValueError(f"zero1 shards Adam's state; optimizer must be 'adam', got {optimizer!r}")
    if global_batch % world_size:
        raise ValueError(f"global_batch {global_batch} must divide evenly over {world_size} ranks")
    model = make_model(seed)
    x, y = make_dataset(seed=seed)
    opt = ZeroStage1Adam(model.parameters(), lr=lr) if zero1 else make_optimizer(model, optimizer, lr)
    local = global_batch // world_size
    losses, calls = [], 0
    for xb, yb in batches(x, y, global_batch, steps):
        xb, yb = xb[rank * local : (rank + 1) * local], yb[rank * local : (rank + 1) * local]
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        calls = allreduce_gradients(model.parameters(), bucket_bytes, use_ring)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    out = {
        "losses": losses,
        "params": [p.detach().tolist() for p in model.parameters()],
        "allreduce_calls": calls,
        "param_bytes": sum(p.nbytes for p in model.parameters()),
        "grad_bytes": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
    }
    if zero1:
        out["optimizer_state_bytes"] = opt.state_bytes()
        out["num_params"] = opt.numel
    else:
        out["optimizer_state_bytes"] = sum(
            t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0
        )
    return out
