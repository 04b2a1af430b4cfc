"""Where training memory goes, and how ZeRO shards it across data-parallel ranks.

Mixed-precision Adam keeps, per parameter: fp16 weights (2 bytes), fp16 gradients (2 bytes),
and K = 12 bytes of optimizer state (fp32 master weights, momentum and variance). With Ψ
parameters on N_d data-parallel devices, the bytes per device are:

    stage 0 (plain DP)              (2 + 2 + K) Ψ
    stage 1 (shard optimizer state) (2 + 2) Ψ + K Ψ / N_d
    stage 2 (+ shard gradients)     2 Ψ + (2 + K) Ψ / N_d
    stage 3 (+ shard parameters)    (2 + 2 + K) Ψ / N_d

For Ψ = 7.5e9 and N_d = 64 that is 120, 31.4, 16.6 and 1.9 GB (ZeRO, Rajbhandari et al. 2020,
figure 1). Activations, buffers and fragmentation come on top.

``ZeroStage1Adam`` is stage 1 for real: each rank keeps Adam state for its shard of the
flattened parameters only, updates that shard, and an all-gather gives every rank the new
parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

STAGES = (0, 1, 2, 3)


def zero_memory_per_device(
    num_params: float,
    num_devices: int,
    stage: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> float:
    """Bytes of parameters, gradients and optimizer state per device under ZeRO ``stage``."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if not num_params >= 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    p, g, k = param_bytes * num_params, grad_bytes * num_params, optimizer_bytes * num_params
    n = num_devices
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]


def zero_table(num_params: float, num_devices: int, **bytes_per) -> dict[int, float]:
    """GB per device for every stage."""
    return {s: zero_memory_per_device(num_params, num_devices, s, **bytes_per) / 1e9 for s in STAGES}


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s shard when ``numel`` elements are split as evenly as possible."""
    base, extra = divmod(numel, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class ZeroStage1Adam:
    """Adam with its state sharded across the data-parallel ranks (ZeRO stage 1).

    Call ``step()`` after the gradients were averaged over the ranks (``allreduce_gradients``):
    each rank updates only its shard of the flattened parameters with its own Adam state, then
    an all-gather puts the full updated parameters back on every rank.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps = lr, betas, eps
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.end = shard_bounds(self.numel, self.world, self.rank)
        self.exp_avg = torch.zeros(self.end - self.start)
        self.exp_avg_sq = torch.zeros(self.end - self.start)
        self.steps = 0

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: momentum and variance of its shard (training in fp32,
        the parameters themselves are the master weights, so there is no extra copy)."""
        return self.exp_avg.nbytes + self.exp_avg_sq.nbytes

    @torch.no_grad()
    def step(self) -> None:
        grad = torch.cat([p.grad.reshape(-1) for p in self.params])[self.start : self.end]
        b1, b2 = self.betas
        self.steps += 1
        self.exp_avg.mul_(b1).add_(grad, alpha=1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        bias1, bias2 = 1 - b1**self.steps, 1 - b2**self.steps
        denom = (self.exp_avg_sq / bias2).sqrt_().add_(self.eps)
        shard = self._flat_params()[self.start : self.end]  # this rank's slice of the (identical) parameters
        shard.addcdiv_(self.exp_avg, denom, value=-self.lr / bias1)
        sizes = [shard_bounds(self.numel, self.world, r) for r in range(self.world)]
        gathered = [torch.empty(e - s) for s, e in sizes]
        dist.all_gather(gathered, shard)
        flat = torch.cat(gathered)
        offset = 0
        for p in self.params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
