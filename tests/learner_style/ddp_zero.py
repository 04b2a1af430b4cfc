"""Answers to lab 05's tasks 8 and 9 written from the lab's text alone, the plain way a learner writes them:
``DDP`` (buckets, hooks, overlap), ``reduce_scatter``, ``all_gather`` and ``ZeroAdamW``, with the task 5 and
task 6 answers they call (``adamw_update``, ``shard_bounds``) and a ring (task 7) for the torchrun cell.

Each function looks up the others as globals, as answer cells in one notebook do: ``answer_namespace()`` runs this
file's source in a fresh namespace, so a test can swap one piece (a typical mistake) and the others call it.
"""

from __future__ import annotations

import math

import torch


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    small = numel // world_size
    bigger = numel - small * world_size  # the first `bigger` ranks get one element more
    start = rank * small + min(rank, bigger)
    size = small + (1 if rank < bigger else 0)
    return start, start + size


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay) -> None:
    param -= lr * weight_decay * param  # decoupled: the weight shrinks before the moments move
    exp_avg.copy_(beta1 * exp_avg + (1 - beta1) * grad)
    exp_avg_sq.copy_(beta2 * exp_avg_sq + (1 - beta2) * grad.square())
    denominator = (exp_avg_sq / (1 - beta2**step)).sqrt() + eps
    param -= lr / (1 - beta1**step) * exp_avg / denominator


def ring_all_reduce(tensor: torch.Tensor, comm) -> torch.Tensor:
    world, me = comm.world_size, comm.rank
    flat = tensor.reshape(-1)
    parts = [flat[slice(*shard_bounds(flat.numel(), world, i))] for i in range(world)]
    for step in range(world - 1):
        out, into = (me - step) % world, (me - step - 1) % world
        buffer = torch.empty_like(parts[into])
        comm.exchange(parts[out], (me + 1) % world, buffer, (me - 1) % world)
        parts[into] += buffer
    for step in range(world - 1):
        comm.exchange(parts[(me + 1 - step) % world], (me + 1) % world, parts[(me - step) % world], (me - 1) % world)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


# --- task 8 ----------------------------------------------------------------------------------------------------


class DDP:
    def __init__(self, model, all_reduce_async, world_size, bucket_bytes):
        self.all_reduce_async = all_reduce_async
        self.world_size = world_size
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        trainable = [p for p in reversed(list(model.parameters())) if p.requires_grad]
        self.buckets = []
        current, used = [], 0
        for p in trainable:
            size = p.numel() * p.element_size()
            if current and used + size > bucket_bytes:
                self.buckets.append(current)
                current, used = [], 0
            current.append(p)
            used += size
        if current:
            self.buckets.append(current)
        self.bucket_index = {}
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                self.bucket_index[id(p)] = i
        for p in trainable:
            p.register_post_accumulate_grad_hook(self.gradient_ready)
        self.start_over()

    def start_over(self):
        self.still_missing = [{id(p) for p in bucket} for bucket in self.buckets]
        self.next_to_launch = 0
        self.in_flight = []

    def gradient_ready(self, param):
        self.still_missing[self.bucket_index[id(param)]].discard(id(param))
        while self.next_to_launch < len(self.buckets) and not self.still_missing[self.next_to_launch]:
            bucket = self.buckets[self.next_to_launch]
            flat = torch.cat([p.grad.flatten() for p in bucket])
            self.in_flight.append((bucket, flat, self.all_reduce_async(flat)))
            self.next_to_launch += 1

    def finish(self):
        missing = [self.param_names[i] for ids in self.still_missing for i in ids]
        in_flight = self.in_flight
        self.start_over()
        for _, _, handle in in_flight:
            handle.wait()
        if missing:
            raise RuntimeError(f"these parameters got no gradient in this backward: {missing}")
        for bucket, flat, _ in in_flight:
            flat = flat / self.world_size
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].reshape(p.grad.shape))
                offset += p.numel()


# --- task 9 ----------------------------------------------------------------------------------------------------


def reduce_scatter(tensor, comm):
    world, me = comm.world_size, comm.rank
    bounds = [shard_bounds(tensor.numel(), world, i) for i in range(world)]

    def piece(i):
        start, end = bounds[i % world]
        return tensor[start:end]

    outgoing = piece(me - 1).clone()  # my contribution to the shard that travels furthest
    for step in range(1, world):
        arriving = (me - 1 - step) % world
        buffer = torch.empty_like(piece(arriving))
        comm.exchange(outgoing, (me + 1) % world, buffer, (me - 1) % world)
        outgoing = buffer + piece(arriving)
    if world > 1:
        piece(me).copy_(outgoing)  # the last arrival was my own shard, now summed over every rank
    return tensor


def all_gather(tensor, comm):
    world, me = comm.world_size, comm.rank
    bounds = [shard_bounds(tensor.numel(), world, i) for i in range(world)]
    have = me
    for _ in range(world - 1):
        coming = (have - 1) % world
        s_out, e_out = bounds[have]
        s_in, e_in = bounds[coming]
        comm.exchange(tensor[s_out:e_out], (me + 1) % world, tensor[s_in:e_in], (me - 1) % world)
        have = coming
    return tensor


class ZeroAdamW:
    def __init__(self, params, comm, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.params = [p for p in params if p.requires_grad]
        self.comm = comm
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        total = sum(p.numel() for p in self.params)
        self.lo, self.hi = shard_bounds(total, comm.world_size, comm.rank)
        self.exp_avg = torch.zeros(self.hi - self.lo, dtype=self.params[0].dtype)
        self.exp_avg_sq = torch.zeros(self.hi - self.lo, dtype=self.params[0].dtype)
        self.t = 0

    def step(self):
        with torch.no_grad():
            grads = torch.cat([p.grad.flatten() for p in self.params])
            reduce_scatter(grads, self.comm)
            mean = grads[self.lo : self.hi] / self.comm.world_size
            weights = torch.cat([p.flatten() for p in self.params])
            mine = weights[self.lo : self.hi].clone()
            self.t += 1
            adamw_update(
                mine, mean, self.exp_avg, self.exp_avg_sq, self.t, self.lr, *self.betas, self.eps, self.weight_decay
            )
            weights[self.lo : self.hi] = mine
            all_gather(weights, self.comm)
            i = 0
            for p in self.params:
                p.copy_(weights[i : i + p.numel()].view(p.shape))
                i += p.numel()


def answer_namespace(**swaps) -> dict:
    """This file's answers run as notebook cells run: one namespace (with ``torch`` and ``math``), then ``swaps``
    replace some names, which the others then call."""
    import inspect
    import sys

    namespace = {"__name__": "lab05_answers", "torch": torch, "math": math}
    exec(compile(inspect.getsource(sys.modules[__name__]), __file__, "exec"), namespace)  # noqa: S102
    namespace.update(swaps)
    return namespace
