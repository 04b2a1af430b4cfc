"""The lab's last cells: the learner's MLP split on a real gloo process group, against the unsplit MLP. The answers
travel as source text (``grading.checks.lab05.answer_source``) and each worker executes them."""

from __future__ import annotations


def run_tp_mlp_on_process_group(
    sources: list[str],
    world_size: int = 2,
    sizes: tuple = ((576, 1536),),
    tokens: int = 4,
    seed: int = 0,
    repeats: int = 3,
    timeout_s: float = 60.0,
) -> list[list[dict]]:
    """Run ``shard_mlp`` and ``tp_mlp_forward`` defined by ``sources`` (answer cells) on a gloo group of
    ``world_size`` processes, each rank with ``dist.all_reduce`` as its all-reduce, for each ``(hidden,
    intermediate)`` MLP of ``sizes`` (seeded, the same on every rank) on ``tokens`` tokens; per rank, one row per
    size: the largest difference from the unsplit MLP, the all-reduce calls, and the best of ``repeats`` timings
    of the split forward and of the unsplit one. Raises ``WorkerError`` naming the rank if a worker fails or hangs.
    """
    from infra_lib.training.launcher import run_workers

    args = (list(sources), [list(s) for s in sizes], tokens, seed, repeats)
    return run_workers(_tp_worker, world_size, args, timeout_s=timeout_s)


def setup_names() -> dict:
    """The names the lab's setup cell imports, which its answer cells may use."""
    import math
    from collections import OrderedDict

    import torch
    import torch.nn.functional as F

    from infra_lib.serving.disaggregated import KVMetadata
    from infra_lib.serving.router import NoReplicaAvailable, RoutingPolicy
    from infra_lib.serving.tensor_parallel_decode import MLPShard
    from infra_lib.training.zero import shard_bounds

    return {
        "torch": torch,
        "math": math,
        "F": F,
        "OrderedDict": OrderedDict,
        "KVMetadata": KVMetadata,
        "NoReplicaAvailable": NoReplicaAvailable,
        "RoutingPolicy": RoutingPolicy,
        "MLPShard": MLPShard,
        "shard_bounds": shard_bounds,
    }


def _tp_worker(rank: int, world_size: int, sources: list[str], sizes: list, tokens: int, seed: int, repeats: int):
    import time

    import torch
    import torch.distributed as dist

    from grading.checks.lab17.task4_tp_mlp import build_mlp

    torch.set_num_threads(1)
    namespace = {"__name__": "lab17_answers", **setup_names()}
    for source in sources:
        exec(compile(source, "<answer cell>", "exec"), namespace)  # noqa: S102 - the learner's own answers
    calls = 0

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        dist.all_reduce(tensor)
        return tensor

    def best_of(forward) -> float:
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            forward()
            best = min(best, time.perf_counter() - start)
        return best

    rows = []
    for hidden, intermediate in sizes:
        case = {"hidden": hidden, "intermediate": intermediate, "lead": [tokens], "seed": seed}
        mlp, x = build_mlp(case)
        with torch.no_grad():
            shard = namespace["shard_mlp"](mlp, rank, world_size)
            calls = 0
            out = namespace["tp_mlp_forward"](x, shard, all_reduce)
            one_forward = calls
            expected = mlp(x)
            rows.append(
                {
                    "hidden": hidden,
                    "intermediate": intermediate,
                    "units": int(shard.gate.shape[0]),
                    "all_reduce_calls": one_forward,
                    "max_abs_error": float((out - expected).abs().max()),
                    "split_s": best_of(lambda: namespace["tp_mlp_forward"](x, shard, all_reduce)),
                    "unsplit_s": best_of(lambda: mlp(x)),
                }
            )
    return rows
