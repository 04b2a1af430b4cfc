"""The script ``torchrun`` runs for lab 05: the tiny Llama trained data-parallel on real processes, first with a
``DDP`` (bucketed all-reduces overlapped with backward, over a ring on ``DistComm`` through
``BackgroundAllReduce``) and ``torch.optim.AdamW``, then from the same weights with ``ZeroAdamW`` (AdamW's state
sharded, a reduce-scatter and an all-gather per step).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m infra_lib.training.torchrun_train \\
        --out DIR [--answers answers.py] [--steps 3] [--fail-rank 1 --fail-step 2]

``torchrun`` starts one process per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its
environment; each joins a gloo group, and writes ``DIR/rank{r}.json``: the global loss of every step of both
runs (the mean over the ranks of their local losses), a digest of the final parameters (the same on every rank
when the gradients were averaged right), the bytes its ring sent and the bytes of optimizer state it held.
``--answers`` is a file of source text (lab answer cells) defining ``DDP``, ``ring_all_reduce`` and ``ZeroAdamW``
(and what they call); without it the course's own run. ``--fail-rank R --fail-step S`` makes rank R raise at step S
of the first run, to see how ``torchrun`` reports a rank that failed (``--hang-rank R``: rank R sleeps there
instead, and the launcher's time-out has to stop the run). ``single_process_losses`` gives what one
process on the whole global batch makes of the same steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.1


def tiny_llama(seed: int):
    """The lab's tiny byte-level Llama (vocabulary 256, width 32, two layers, tied embedding), fp32."""
    from infra_lib.training.train_step import tiny_config, tiny_model

    config = tiny_config(256, 32, 2, 2, 1, 16, 96, 32)
    return tiny_model(config, seed=seed)


def global_batches(steps: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``steps`` global batches of 32-token windows of the course's text."""
    from infra_lib.training.train_step import text_batches, text_tokens

    windows = text_batches(text_tokens(), batch, 32, seed=seed)
    return [next(windows) for _ in range(steps)]


def loss_of(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def params_digest(model) -> str:
    """sha256 of the parameters' bytes, in order: equal on two ranks only if every bit is."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def single_process_losses(world_size: int, steps: int = 3, batch_per_rank: int = 2, seed: int = 0) -> list[float]:
    """One process, the whole global batch, ``torch.optim.AdamW``: the losses both distributed runs must follow."""
    model = tiny_llama(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False)
    losses = []
    for inputs, targets in global_batches(steps, world_size * batch_per_rank, seed):
        opt.zero_grad()
        loss = loss_of(model, inputs, targets)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def load_answers(path: str | None) -> dict:
    """``DDP``, ``ring_all_reduce`` and ``ZeroAdamW`` from answer cells' source (or the course's own)."""
    if path is None:
        from infra_lib.training.collectives import ring_all_reduce
        from infra_lib.training.ddp import DDP
        from infra_lib.training.zero import ZeroAdamW

        return {"DDP": DDP, "ring_all_reduce": ring_all_reduce, "ZeroAdamW": ZeroAdamW}
    namespace = {"__name__": "lab05_answers", "torch": torch, "math": math}
    exec(compile(Path(path).read_text(encoding="utf-8"), path, "exec"), namespace)  # noqa: S102 - the learner's own
    missing = [name for name in ("DDP", "ring_all_reduce", "ZeroAdamW") if name not in namespace]
    if missing:
        raise NameError(f"{path} does not define {', '.join(missing)}")
    return namespace


def _global_loss(loss: torch.Tensor, world_size: int) -> float:
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world_size


def train_ddp(answers: dict, args, rank: int, world_size: int) -> dict:
    """Every step: the local loss's backward (buckets all-reduced as it goes), finish(), AdamW."""
    from infra_lib.training.collectives import BackgroundAllReduce, DistComm

    model = tiny_llama(args.seed)
    comm = DistComm()
    runner = BackgroundAllReduce(lambda t: answers["ring_all_reduce"](t, comm))
    ddp = answers["DDP"](model, runner, world_size, args.bucket_bytes)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False)
    losses, start = [], time.perf_counter()
    mine = slice(rank * args.batch_per_rank, (rank + 1) * args.batch_per_rank)
    try:
        for step, (inputs, targets) in enumerate(
            global_batches(args.steps, world_size * args.batch_per_rank, args.seed)
        ):
            if rank == args.hang_rank and step + 1 == args.fail_step:
                time.sleep(3600)  # a rank stuck: the others wait for it in their collectives
            if rank == args.fail_rank and step + 1 == args.fail_step:
                raise RuntimeError(
                    f"rank {rank} raises at step {step + 1}, as --fail-rank {rank} --fail-step {args.fail_step} asked"
                )
            opt.zero_grad()
            loss = loss_of(model, inputs[mine], targets[mine])
            loss.backward()
            ddp.finish()
            opt.step()
            losses.append(_global_loss(loss, world_size))
    finally:
        runner.close()
    return {
        "losses": losses,
        "params_digest": params_digest(model),
        "ring_bytes_sent": comm.bytes_sent,
        "buckets": len(ddp.buckets),
        "seconds": time.perf_counter() - start,
    }


def train_zero(answers: dict, args, rank: int, world_size: int) -> dict:
    """Every step: the local loss's backward, then ZeroAdamW.step() (reduce-scatter, AdamW on the shard, all-gather)."""
    from infra_lib.training.collectives import DistComm

    model = tiny_llama(args.seed)
    comm = DistComm()
    opt = answers["ZeroAdamW"](model.parameters(), comm, LR, BETAS, EPS, WEIGHT_DECAY)
    losses, start = [], time.perf_counter()
    mine = slice(rank * args.batch_per_rank, (rank + 1) * args.batch_per_rank)
    for inputs, targets in global_batches(args.steps, world_size * args.batch_per_rank, args.seed):
        for p in model.parameters():
            p.grad = None
        loss = loss_of(model, inputs[mine], targets[mine])
        loss.backward()
        opt.step()
        losses.append(_global_loss(loss, world_size))
    state = sum(t.nbytes for t in (getattr(opt, "exp_avg", None), getattr(opt, "exp_avg_sq", None)) if t is not None)
    return {
        "losses": losses,
        "params_digest": params_digest(model),
        "bytes_sent": comm.bytes_sent,
        "optimizer_state_bytes": state,
        "num_params": sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - start,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for rank{r}.json")
    parser.add_argument("--answers", help="a file of answer cells' source defining DDP, ring_all_reduce, ZeroAdamW")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-per-rank", type=int, default=2)
    parser.add_argument("--bucket-bytes", type=int, default=1 << 14)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fail-rank", type=int, default=-1, help="this rank raises at --fail-step")
    parser.add_argument("--hang-rank", type=int, default=-1, help="this rank sleeps for an hour at --fail-step")
    parser.add_argument("--fail-step", type=int, default=1)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    @record  # a failing rank's traceback goes into torchrun's report
    def run() -> None:
        args = parse_args(argv)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.set_num_threads(1)  # the ranks share this machine's cores
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        try:
            answers = load_answers(args.answers)
            result = {"rank": rank, "world_size": world_size, "ddp": train_ddp(answers, args, rank, world_size)}
            result["zero"] = train_zero(answers, args, rank, world_size)
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
        finally:
            dist.destroy_process_group()

    run()


if __name__ == "__main__":
    main()
