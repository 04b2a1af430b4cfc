"""FSDP2: every parameter, gradient and optimizer state sharded over the data-parallel ranks (ZeRO stage 3).

    forward:  per block, all-gather its parameters -> compute -> free the gathered copy (reshard)
    backward: per block, all-gather again -> gradients -> reduce-scatter them to the owners -> free
    step:     each rank's AdamW updates its own shard of every parameter; nothing is gathered

``torch.distributed.fsdp.fully_shard`` (FSDP2; Zhao et al. 2023, "PyTorch FSDP", VLDB) turns each
parameter into a DTensor sharded on dim 0: rank r holds rows ``shard_rows(dim0, W, r)`` (``torch.chunk``'s
split: ceil(dim0 / W) rows each, the last ranks fewer or none). Each ``fully_shard`` call makes one unit whose
parameters travel together in one all-gather and one reduce-scatter, over buffers padded to ceil(dim0 / W)
rows a rank. ``shard_llama`` makes one unit per decoder block and one at the root (embedding, final norm,
tied head).

``reshard_after_forward`` says what a unit does with its gathered parameters after its forward:

* ``None`` (the default): ``True`` for every block, ``False`` for the root (backward needs the root first).
  A block is gathered in forward and again in backward, the root once: a little under ZeRO-3's
  3 Ψ (W - 1) / W bytes a step per rank (Rajbhandari et al. 2020, section 7).
* ``True`` for every unit, the root included: the full 3 Ψ (W - 1) / W, the least memory.
* ``False``: every unit stays gathered from its forward to its backward; 2 Ψ (W - 1) / W, ZeRO-2's
  traffic, with the whole model unsharded at the peak.

The workers here run under ``launcher.run_workers`` (a gloo group, one process per rank); each trains on
its slice of the same global batches that ``train_single`` takes whole.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from infra_lib.model.config import LlamaConfig

LR, BETAS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 0.1
FINE_TUNING_LR = 1e-5  # a trained model: steps of LR's size would undo its training


def shard_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows of a ``dim0``-row parameter that ``rank`` holds under FSDP2 (``torch.chunk``: ceil(dim0 / W) each)."""
    if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    chunk = math.ceil(dim0 / world_size)
    return max(0, min(chunk, dim0 - rank * chunk))


def shard_numel(shapes: list[tuple[int, ...]], world_size: int, rank: int) -> int:
    """Elements of the parameters with ``shapes`` that ``rank`` holds (its local shards, no padding)."""
    return sum(shard_rows(s[0], world_size, rank) * math.prod(s[1:]) for s in shapes)


def unit_shapes(model) -> list[list[tuple[int, ...]]]:
    """The parameter shapes of each FSDP unit ``shard_llama`` makes: every block, then the root's (a tied
    table once)."""
    blocks = [[tuple(p.shape) for p in layer.parameters()] for layer in model.layers]
    in_blocks = {id(p) for layer in model.layers for p in layer.parameters()}
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks]
    return [*blocks, root]


def expected_traffic(
    units: list[list[tuple[int, ...]]],
    world_size: int,
    element_bytes: int = 4,
    reshard_after_forward: bool | None = None,
) -> dict[str, int]:
    """Bytes each rank sends per training step, by collective, for ``units`` as ``unit_shapes`` gives them
    (the last is the root).

    One all-gather of a unit moves its padded buffer (ceil(dim0 / W) rows of every parameter, times W):
    each rank sends (W - 1) / W of it, as a ring does. Every unit is gathered in forward, again in backward
    each unit that was resharded after its forward (see the module's note), and every unit's gradients are
    reduce-scattered once.
    """
    _check_reshard(reshard_after_forward)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    padded = [sum(math.ceil(s[0] / world_size) * world_size * math.prod(s[1:]) for s in u) for u in units]
    regathered = {None: padded[:-1], True: padded, False: []}[reshard_after_forward]

    def sent(numel: int) -> int:
        return numel * element_bytes * (world_size - 1) // world_size

    return {"all_gather": sent(sum(padded) + sum(regathered)), "reduce_scatter": sent(sum(padded))}


@contextmanager
def counting_collectives(world_size: int):
    """Count the bytes this rank sends in FSDP2's all-gathers and reduce-scatters inside the block.

    FSDP2 calls ``dist.all_gather_single`` and ``dist.reduce_scatter_single`` (torch 2.13); they are wrapped
    here to add (W - 1) / W of each call's full buffer (the gathered output, the reduced input). Yields a
    dict: ``all_gather`` / ``reduce_scatter`` bytes and ``calls`` of each.
    """
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_gather_calls": 0, "reduce_scatter_calls": 0}
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def counted_gather(output_tensor, input_tensor, *args, **kwargs):
        counts["all_gather"] += output_tensor.nbytes * (world_size - 1) // world_size
        counts["all_gather_calls"] += 1
        return gather(output_tensor, input_tensor, *args, **kwargs)

    def counted_scatter(output, input, *args, **kwargs):  # noqa: A002 - torch's own keyword names
        counts["reduce_scatter"] += input.nbytes * (world_size - 1) // world_size
        counts["reduce_scatter_calls"] += 1
        return scatter(output, input, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = counted_gather, counted_scatter
    try:
        yield counts
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter


def _check_reshard(reshard_after_forward) -> None:
    if not (reshard_after_forward is None or isinstance(reshard_after_forward, bool)):
        raise ValueError(f"reshard_after_forward must be None, True or False here, got {reshard_after_forward!r}")


def shard_llama(model, world_size: int, reshard_after_forward: bool | None = None):
    """Wrap ``model`` (a ``Llama``) with ``fully_shard``: each decoder block, then the root. In place; returns it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _check_reshard(reshard_after_forward)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def make_optimizer(model, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def global_batches(
    steps: int, batch: int, seq_len: int, seed: int = 0, tokens: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``steps`` global batches of windows of ``tokens`` (default: the course's text as bytes):
    ``(inputs, targets)``, each ``[batch, seq_len]``."""
    from infra_lib.training.train_step import text_batches, text_tokens

    windows = text_batches(text_tokens() if tokens is None else tokens, batch, seq_len, seed=seed)
    return [next(windows) for _ in range(steps)]


def rank_slice(batch: int, world_size: int, rank: int) -> slice:
    """The rows of a global batch of ``batch`` that ``rank`` trains on."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if batch % world_size:
        raise ValueError(f"the global batch ({batch}) must split evenly over {world_size} ranks")
    per_rank = batch // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def train_step(model, optimizer, inputs, targets, rank: int, world_size: int, before_zero_grad=None) -> float:
    """One step on this rank's slice of the global batch; returns the global loss (the mean over the ranks).

    ``before_zero_grad()``, if given, runs after the optimizer's step while the gradients are still held.
    """
    mine = rank_slice(inputs.shape[0], world_size, rank)
    loss = F.cross_entropy(model(inputs[mine]).flatten(0, 1), targets[mine].flatten())
    loss.backward()
    optimizer.step()
    if before_zero_grad is not None:
        before_zero_grad()
    optimizer.zero_grad()
    total = loss.detach().clone()
    if world_size > 1:
        dist.all_reduce(total)
    return float(total) / world_size


def local_bytes(tensors) -> int:
    """Bytes of the local shards of ``tensors`` (DTensors; plain tensors count whole)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def held_bytes(model, optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients (call between backward and ``zero_grad``) and AdamW's
    momentum and variance (its per-parameter step counters, a few bytes each, left out)."""
    params = list(model.parameters())
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s]
    return {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(moments),
    }


def recording_held_bytes(held: dict, model, optimizer):
    """A ``before_zero_grad`` for ``train_step`` that keeps ``held_bytes`` of this step in ``held``."""
    return lambda: held.update(held_bytes(model, optimizer))


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (an all-gather of each: every rank must call it)."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def fsdp_worker(
    rank: int, world_size: int, config: LlamaConfig, batches, seed: int = 0, reshard_after_forward: bool | None = None
) -> dict:
    """``run_workers`` target: the Llama of ``config`` under FSDP2, one AdamW step per global batch.

    Returns the global losses, the bytes held (measured after every step's update, before its ``zero_grad``;
    the last step's kept), the collectives' bytes counted over all steps and, on rank 0, every parameter whole
    after training.
    """
    from infra_lib.training.train_step import tiny_model

    model = shard_llama(tiny_model(config, seed=seed), world_size, reshard_after_forward)
    optimizer = make_optimizer(model)
    held: dict[str, int] = {}
    with counting_collectives(world_size) as traffic:
        losses = [
            train_step(
                model, optimizer, inputs, targets, rank, world_size, recording_held_bytes(held, model, optimizer)
            )
            for inputs, targets in batches
        ]
    params = full_parameters(model)
    return {
        "losses": losses,
        "held": held,
        "traffic": dict(traffic),
        "steps": len(batches),
        "params": params if rank == 0 else None,
    }


def train_single(config: LlamaConfig, batches, seed: int = 0) -> dict:
    """One process, the whole global batch, the same AdamW: what every FSDP2 run must equal."""
    from infra_lib.training.train_step import tiny_model

    model = tiny_model(config, seed=seed)
    optimizer = make_optimizer(model)
    losses = [train_step(model, optimizer, inputs, targets, 0, 1) for inputs, targets in batches]
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def zero1_worker(rank: int, world_size: int, config: LlamaConfig, batches, seed: int = 0) -> dict:
    """``run_workers`` target: chapter 05's ZeRO stage 1 (``ZeroAdamW`` over a ring of point-to-point sends)
    on the same model and batches, for the comparison: the global losses, the bytes held (whole parameters and
    gradients, a shard of the optimizer's moments) and the bytes this rank sent per step."""
    from infra_lib.training.collectives import DistComm
    from infra_lib.training.train_step import tiny_model
    from infra_lib.training.zero import ZeroAdamW

    model = tiny_model(config, seed=seed)
    comm = DistComm()
    optimizer = ZeroAdamW(model.parameters(), comm, LR, BETAS, weight_decay=WEIGHT_DECAY)
    held: dict[str, int] = {}

    def measure():
        held.update(
            params=local_bytes(optimizer.params),
            grads=local_bytes(p.grad for p in optimizer.params),
            optimizer=optimizer.state_bytes(),
        )

    losses = [train_step(model, optimizer, inputs, targets, rank, world_size, measure) for inputs, targets in batches]
    return {"losses": losses, "held": held, "bytes_sent_per_step": comm.bytes_sent // len(batches)}


def sharding_worker(rank: int, world_size: int, config: LlamaConfig, batches, seed: int = 0) -> dict:
    """``run_workers`` target for one group that compares: FSDP2 under each ``reshard_after_forward`` (None,
    True, False; ``fsdp_worker``'s results, keyed by ``str``) and ZeRO-1 (``zero1_worker``)."""
    runs = {str(r): fsdp_worker(rank, world_size, config, batches, seed, r) for r in (None, True, False)}
    return {"fsdp": runs, "zero1": zero1_worker(rank, world_size, config, batches, seed)}


def smollm2_step_worker(rank: int, world_size: int, seq_len: int = 32, batch_per_rank: int = 1, steps: int = 2) -> dict:
    """``run_workers`` target: SmolLM2-135M (fp32) under FSDP2, ``steps`` AdamW steps (``FINE_TUNING_LR``) on
    ``batch_per_rank`` windows of ``seq_len`` tokens of the course's text a rank.

    Returns each step's seconds (the first includes FSDP2's lazy set-up), the bytes held, the last step's
    traffic and what the formula expects of it, and the process's peak resident memory (which includes the
    whole model each rank loaded before sharding it).
    """
    from infra_lib.model.loaders import build_model, default_gguf_path, load_weights
    from infra_lib.model.quant import heldout_text
    from infra_lib.model.tokenizer import Tokenizer

    config, state, fields = load_weights(default_gguf_path())
    model = build_model(config, state).train()
    del state
    num_params = sum(p.numel() for p in model.parameters())
    units = unit_shapes(model)
    shard_llama(model, world_size)
    optimizer = make_optimizer(model, lr=FINE_TUNING_LR)
    tokens = torch.tensor(Tokenizer.from_gguf_fields(fields).encode(heldout_text()[:20_000]))
    batches = global_batches(steps, batch_per_rank * world_size, seq_len, tokens=tokens)
    held: dict[str, int] = {}
    seconds, losses = [], []
    for inputs, targets in batches:
        dist.barrier()
        with counting_collectives(world_size) as traffic:
            start = time.perf_counter()
            record = recording_held_bytes(held, model, optimizer)
            losses.append(train_step(model, optimizer, inputs, targets, rank, world_size, record))
            seconds.append(time.perf_counter() - start)
    return {
        "seconds": seconds,
        "losses": losses,
        "held": held,
        "traffic": dict(traffic),
        "expected_traffic": expected_traffic(units, world_size),
        "num_params": num_params,
        "peak_rss_bytes": peak_resident_bytes(),
    }


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory (Linux reports it in KiB); None where the OS does not say."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
