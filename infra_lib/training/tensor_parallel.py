"""Tensor parallelism: one linear layer's weight split across ranks (Megatron-LM's two halves).

    column-parallel  Y = X W^T, W [out, in] split by rows (output features): rank r computes
                     Y[:, its outputs]; an all-gather concatenates them (or the next layer takes
                     them split, as Megatron's MLP does)
    row-parallel     W split by columns (input features), X split to match: rank r computes a
                     partial Y_r = X_r W_r^T over its inputs; an all-reduce sums the partials

A column-parallel layer followed by a row-parallel one (the MLP's up and down projections) needs
one all-reduce for the pair and no communication in between.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from infra_lib.training.zero import shard_bounds


def column_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gather: bool = True
) -> torch.Tensor:
    """This rank's share of ``F.linear(x, weight, bias)`` with ``weight`` split by output rows;
    with ``gather`` the full output on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = shard_bounds(weight.shape[0], world, rank)
    local = F.linear(x, weight[start:end], None if bias is None else bias[start:end])
    if not gather:
        return local
    sizes = [shard_bounds(weight.shape[0], world, r) for r in range(world)]
    parts = [torch.empty(*x.shape[:-1], e - s) for s, e in sizes]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``weight`` split by input columns and ``x`` split to match;
    the partial products are summed with one all-reduce (the bias is added once, after)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = shard_bounds(weight.shape[1], world, rank)
    partial = F.linear(x[..., start:end], weight[:, start:end])
    dist.all_reduce(partial)
    return partial if bias is None else partial + bias


def tensor_parallel_worker(
    rank: int, world_size: int, seed: int = 0, batch: int = 5, d_in: int = 24, d_hidden: int = 30, d_out: int = 7
) -> dict:
    """A worker for ``run_workers``: an MLP's two layers split column- then row-wise against the unsplit
    layers on the same seeded weights; returns the max differences."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_in, generator=g)
    w1, b1 = torch.randn(d_hidden, d_in, generator=g), torch.randn(d_hidden, generator=g)
    w2, b2 = torch.randn(d_out, d_hidden, generator=g), torch.randn(d_out, generator=g)
    column = column_parallel_linear(x, w1, b1)
    column_err = float((column - F.linear(x, w1, b1)).abs().max())
    row = row_parallel_linear(x, w1, b1)
    row_err = float((row - F.linear(x, w1, b1)).abs().max())
    # Megatron's MLP: the column-parallel output stays split and feeds the row-parallel layer directly
    start, end = shard_bounds(d_hidden, world_size, rank)
    hidden_local = F.relu(column_parallel_linear(x, w1, b1, gather=False))
    partial = F.linear(hidden_local, w2[:, start:end])
    dist.all_reduce(partial)
    mlp = partial + b2
    mlp_err = float((mlp - F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)).abs().max())
    return {"column": column_err, "row": row_err, "mlp": mlp_err}
