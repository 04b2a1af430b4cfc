"""Data parallelism: every rank holds the whole model, computes gradients on its slice of the
global batch, and the gradients are averaged across ranks before every optimizer step.

Averaging the ranks' mean gradients over equal slices gives exactly the mean gradient of the
global batch, so N ranks with batch B/N each follow the same trajectory as one process with batch
B (up to float summation order): ``train_single`` and ``ddp_worker`` check it. Gradients are
flattened into buckets of at most ``bucket_bytes`` and each bucket is all-reduced in one call,
as PyTorch's DDP does (fewer, larger messages).

``DDP`` overlaps them with the backward pass, as PyTorch's does: the buckets are packed in the
reverse order of ``model.parameters()`` (the order in which backward produces gradients), a hook
on every parameter notes its gradient, and a bucket's all-reduce starts in the background the
moment its last gradient is in, while backward goes on with the earlier layers. ``finish()``
waits for them and writes the mean back. ``overlap_worker`` times it against an all-reduce after
the whole backward (``benchmarks/ddp_overlap.py``).
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


class DDP:
    """Data-parallel gradients with bucketed all-reduces started by hooks during ``loss.backward()``.

        ddp = DDP(model, all_reduce_async, world_size, bucket_bytes=1 << 20)
        loss.backward()   # buckets start their all-reduce as soon as their last gradient is in
        ddp.finish()      # every p.grad now holds the mean over the ranks
        optimizer.step()

    Args:
        model: the same module (same parameters, same order) on every rank.
        all_reduce_async: ``flat -> handle``: starts summing ``flat`` over the ranks in place, in the
            background; ``handle.wait()`` returns when it is done (``BackgroundAllReduce``, or
            ``collectives.dist_all_reduce_async``). Every rank calls it in the same order.
        world_size: the number of ranks (the mean divides by it).
        bucket_bytes: a bucket is closed when the next parameter's gradient would take it past this;
            a larger parameter is a bucket of its own.

    Attributes:
        buckets: the parameters that require grad, in reverse order of ``model.parameters()``,
            packed greedily; launched in this order.
    """

    def __init__(self, model: nn.Module, all_reduce_async, world_size: int, bucket_bytes: int):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        self.all_reduce_async, self.world_size = all_reduce_async, world_size
        self.names = {id(p): name for name, p in model.named_parameters()}
        params = [p for p in model.parameters() if p.requires_grad]  # a tied parameter once
        self.buckets = gradient_buckets(params[::-1], bucket_bytes)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]

    def _reset(self) -> None:
        self._missing = [len(bucket) for bucket in self.buckets]  # gradients each bucket still waits for
        self._ready: set[int] = set()
        self._launched: list[tuple[torch.Tensor, object]] = []  # (flat, handle) per launched bucket

    def _on_gradient(self, param: torch.Tensor) -> None:
        """The hook: ``param.grad`` has just been accumulated (once per backward, a tied one too)."""
        if id(param) in self._ready:
            raise RuntimeError(
                f"{self.names[id(param)]} got a second gradient before finish(): call ddp.finish() after every backward"
            )
        self._ready.add(id(param))
        self._missing[self._bucket_of[id(param)]] -= 1
        while len(self._launched) < len(self.buckets) and self._missing[len(self._launched)] == 0:
            bucket = self.buckets[len(self._launched)]
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            self._launched.append((flat, self.all_reduce_async(flat)))

    def finish(self) -> None:
        """Wait for this backward's all-reduces, write the mean over the ranks into every ``p.grad``, reset.

        Raises:
            RuntimeError: a parameter that requires grad got no gradient in this backward (it took no
                part in the loss); its bucket and those after it were never started.
        """
        launched, buckets = self._launched, self.buckets
        missing = [self.names[id(p)] for bucket in buckets for p in bucket if id(p) not in self._ready]
        self._reset()
        for _, handle in launched:  # every rank waits for what it started, so the next step starts level
            handle.wait()
        if missing:
            raise RuntimeError(
                f"no gradient reached {', '.join(missing)} in this backward, so its bucket was never all-reduced: "
                "every parameter that requires grad must take part in the loss (or set requires_grad=False)"
            )
        for (flat, _), bucket in zip(launched, buckets):
            flat /= self.world_size
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()

    def remove_hooks(self) -> None:
        """Detach from the model (its parameters keep no hook of this object)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def log_gradient_arrivals(model: nn.Module, log: list, clock=None) -> list:
    """Append ``{"event": "ready", "param": index in model.parameters(), "t"}`` to ``log`` each time a
    parameter's gradient has been accumulated. Register before ``DDP`` so that a parameter's arrival
    comes before the launch it causes. Returns the hook handles."""
    import time

    clock = clock or time.perf_counter
    index = {id(p): i for i, p in enumerate(model.parameters())}

    def arrived(param: torch.Tensor) -> None:
        log.append({"event": "ready", "param": index[id(param)], "t": clock()})

    return [p.register_post_accumulate_grad_hook(arrived) for p in model.parameters() if p.requires_grad]


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


def overlap_worker(
    rank: int,
    world_size: int,
    steps: int = 10,
    batch_per_rank: int = 2,
    seq_len: int = 64,
    bucket_bytes: int = 1 << 18,
    transport: str = "ring",
    model_size: dict | None = None,
    seed: int = 0,
) -> dict:
    """A worker for ``run_workers``: one step time with ``DDP`` (all-reduces started by hooks, in the background,
    during backward) against one with the same buckets all-reduced after the whole backward, interleaved step by
    step on two copies of the tiny Llama so that both see the same load.

    ``transport``: ``"ring"`` (the course's ring over ``DistComm``, on a ``BackgroundAllReduce`` thread) or
    ``"gloo"`` (``dist.all_reduce``, asynchronous where overlapped). Returns per variant the step times, the
    backward's end and the communication left after it (what the step pays for), in seconds.
    """
    import time

    from infra_lib.training.collectives import BackgroundAllReduce, DistComm, dist_all_reduce_async
    from infra_lib.training.train_step import text_batches, text_tokens, tiny_config, tiny_model

    if transport not in ("ring", "gloo"):
        raise ValueError(f"transport must be 'ring' or 'gloo', got {transport!r}")
    config = tiny_config(**(model_size or {}))
    models = {name: tiny_model(config, seed=seed) for name in ("overlap", "after")}
    comm = DistComm()
    runner = BackgroundAllReduce(lambda t: ring_all_reduce(t, comm)) if transport == "ring" else dist_all_reduce_async
    ddp = DDP(models["overlap"], runner, world_size, bucket_bytes)
    after_params = [p for p in models["after"].parameters() if p.requires_grad][::-1]  # DDP's buckets, DDP's order
    data = text_batches(text_tokens(), batch_per_rank * world_size, seq_len, seed=seed)
    mine = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
    rows: dict[str, list[dict]] = {"overlap": [], "after": []}
    try:
        for step in range(steps + 1):  # step 0 warms up, not recorded
            inputs, targets = next(data)
            for name in ("overlap", "after") if step % 2 else ("after", "overlap"):
                model = models[name]
                dist.barrier()
                start = time.perf_counter()
                model.zero_grad(set_to_none=True)
                logits = model(inputs[mine])
                F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten()).backward()
                backward_end = time.perf_counter()
                if name == "overlap":
                    ddp.finish()
                else:
                    allreduce_gradients(after_params, bucket_bytes, use_ring=transport == "ring")
                comm_end = time.perf_counter()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 1e-3 * p.grad
                end = time.perf_counter()
                if step:
                    rows[name].append(
                        {
                            "step_s": end - start,
                            "backward_s": backward_end - start,
                            "exposed_comm_s": comm_end - backward_end,
                        }
                    )
    finally:
        if isinstance(runner, BackgroundAllReduce):
            runner.close()
        ddp.remove_hooks()
    same = all(torch.equal(a, b) for a, b in zip(models["overlap"].parameters(), models["after"].parameters()))
    return {
        "rows": rows,
        "buckets": len(ddp.buckets),
        "grad_bytes": sum(p.numel() * p.element_size() for p in models["overlap"].parameters()),
        "same_parameters": same,
    }
