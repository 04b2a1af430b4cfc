"""All-reduce by hand: the ring algorithm over point-to-point send and receive.

Every rank holds a tensor; afterwards every rank holds the element-wise sum. The ring splits
the tensor into W chunks and runs two phases of W - 1 steps, each rank sending one chunk to its
right neighbour and receiving one from its left:

    reduce-scatter: after step s, rank r holds the sum over s + 2 ranks of chunk (r - s - 1) mod W;
                    at the end rank r owns the full sum of chunk (r + 1) mod W
    all-gather:     the finished chunks travel once more around the ring

Each rank sends 2 (W - 1) / W of the tensor in total, whatever W is: the bandwidth term of the
ring does not grow with the number of ranks, which is why NCCL, gloo and MPI use it for large
tensors (its latency term, 2 (W - 1) messages, does grow).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of the default group, in place, with a ring; returns it.

    Works for any size, including one not divisible by the world size (chunks differ by one
    element) and sizes smaller than the world size (some chunks are empty).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    chunks = list(torch.tensor_split(flat, world))
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):  # reduce-scatter
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv_i])
        _exchange(chunks[send_i], right, incoming, left)
        chunks[recv_i] += incoming
    for step in range(world - 1):  # all-gather
        send_i, recv_i = (rank + 1 - step) % world, (rank - step) % world
        _exchange(chunks[send_i], right, chunks[recv_i], left)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def _exchange(send: torch.Tensor, to: int, recv: torch.Tensor, source: int) -> None:
    """Send and receive at once (both non-blocking), so no rank waits for a neighbour that waits for it."""
    requests = [dist.isend(send.contiguous(), to), dist.irecv(recv, source)]
    for request in requests:
        request.wait()


def ring_bytes_sent(tensor_bytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of a ``tensor_bytes`` tensor: 2 (W - 1) / W of it."""
    return 2 * (world_size - 1) / world_size * tensor_bytes


def all_reduce_worker(rank: int, world_size: int, shapes: list, seed: int, use_ring: bool = True) -> list:
    """A worker for ``run_workers``: all-reduce seeded tensors of ``shapes``; returns them as lists."""
    out = []
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(seed * 1000 + i * 10 + rank)
        t = torch.randn(*shape, generator=g)
        if use_ring:
            ring_all_reduce(t)
        else:
            dist.all_reduce(t)
        out.append(t.tolist())
    return out


def bandwidth_worker(rank: int, world_size: int, numels: list[int], repeats: int = 3) -> list[dict]:
    """A worker timing ring and ``dist.all_reduce`` on float32 tensors; returns per-size seconds (best of)."""
    import time

    rows = []
    for numel in numels:
        t = torch.ones(numel)
        row = {"numel": numel, "bytes": numel * 4}
        for name, fn in (("ring", ring_all_reduce), ("dist.all_reduce", dist.all_reduce)):
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                fn(t)
                best = min(best, time.perf_counter() - start)
            row[name] = best
        rows.append(row)
    return rows
