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

``ZeroAdamW`` is the same stage built from the ring's two halves over point-to-point
``comm.exchange`` (a ``DistComm`` or a ``ThreadComm``), with the own-shard convention: rank r's
shard is ``shard_bounds(numel, W, r)``. ``reduce_scatter`` leaves on every rank the sum over the
ranks of its own shard (and anything elsewhere); ``all_gather`` starts from every rank's own shard
final and leaves every rank with all of them. Each half sends (W - 1) / W of the tensor per rank,
so the step costs what one all-reduce of the gradients costs, 2 (W - 1) / W, while each rank holds
the optimizer state of 1 / W of the parameters.
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


def _copy_flat_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors``, in order, each in its own shape."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _chunks(tensor: torch.Tensor, comm) -> list[torch.Tensor]:
    """Views of ``tensor`` (1-D), one per rank: rank i's shard."""
    if tensor.dim() != 1:
        raise ValueError(f"the ring's halves work on a 1-D tensor, got shape {list(tensor.shape)} (flatten it first)")
    n, world = tensor.numel(), comm.world_size
    return [tensor[slice(*shard_bounds(n, world, i))] for i in range(world)]


def reduce_scatter(tensor: torch.Tensor, comm) -> torch.Tensor:
    """Sum ``tensor`` over the ranks into each rank's own shard, in place; returns ``tensor``.

    Afterwards ``tensor[start:end]``, with ``(start, end) = shard_bounds(numel, W, rank)``, holds the
    sum over the ranks of those elements; the rest of ``tensor`` holds partial sums (anything). The
    ring's first half: at each of W - 1 steps a rank adds the partial sum that arrives from its left
    neighbour into its copy of that shard and passes it on, timed so that the last arrival is its own.
    """
    chunks, world, rank = _chunks(tensor, comm), comm.world_size, comm.rank
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send, receive = chunks[(rank - step - 1) % world], chunks[(rank - step - 2) % world]
        incoming = torch.empty_like(receive)
        comm.exchange(send, right, incoming, left)
        receive += incoming
    return tensor


def all_gather(tensor: torch.Tensor, comm) -> torch.Tensor:
    """Give every rank every owner's shard, in place; returns ``tensor``.

    On entry rank r's own shard (``shard_bounds(numel, W, r)``) is final and the rest is anything;
    afterwards every rank's ``tensor`` is the concatenation of the owners' shards. The ring's second
    half: each shard travels W - 1 hops, replacing the stale copies it passes.
    """
    chunks, world, rank = _chunks(tensor, comm), comm.world_size, comm.rank
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        comm.exchange(chunks[(rank - step) % world], right, chunks[(rank - step - 1) % world], left)
    return tensor


class ZeroAdamW:
    """AdamW with its state sharded over the ranks (ZeRO stage 1), over ``comm.exchange``.

    ``step()`` takes each ``p.grad`` as this rank's LOCAL gradient: a reduce-scatter of the flat
    gradient gives this rank the sum of its shard, divided by W the mean; AdamW updates the shard
    of the flat parameters; an all-gather gives every rank every shard. Afterwards every rank's
    parameters are those of ``torch.optim.AdamW(foreach=False)`` stepped on the mean gradient.

    Attributes:
        exp_avg, exp_avg_sq: 1-D, this rank's shard of the flattened parameters only.
    """

    def __init__(self, params, comm, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        self.params = list({id(p): p for p in params if p.requires_grad}.values())  # a tied parameter once
        if not self.params:
            raise ValueError("ZeroAdamW got no parameter that requires grad")
        self.comm, self.lr, self.betas, self.eps, self.weight_decay = comm, lr, betas, eps, weight_decay
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.end = shard_bounds(self.numel, comm.world_size, comm.rank)
        dtype = self.params[0].dtype
        self.exp_avg = torch.zeros(self.end - self.start, dtype=dtype)
        self.exp_avg_sq = torch.zeros(self.end - self.start, dtype=dtype)
        self.steps = 0

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (fp32 training: the parameters are the masters)."""
        return self.exp_avg.nbytes + self.exp_avg_sq.nbytes

    @torch.no_grad()
    def step(self) -> None:
        from infra_lib.training.scratch_train import adamw_update

        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:
            raise RuntimeError(f"parameters {missing} have no gradient: every rank steps every parameter")
        grad = reduce_scatter(torch.cat([p.grad.reshape(-1) for p in self.params]), self.comm)
        shard_grad = grad[self.start : self.end] / self.comm.world_size
        flat = torch.cat([p.reshape(-1) for p in self.params])
        self.steps += 1
        beta1, beta2 = self.betas
        adamw_update(
            flat[self.start : self.end],
            shard_grad,
            self.exp_avg,
            self.exp_avg_sq,
            self.steps,
            self.lr,
            beta1,
            beta2,
            self.eps,
            self.weight_decay,
        )
        all_gather(flat, self.comm)
        _copy_flat_into(flat, self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


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
        _copy_flat_into(flat, self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
