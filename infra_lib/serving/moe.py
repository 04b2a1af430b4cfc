"""A mixture-of-experts block, on one process and with its experts spread over processes.

    x [tokens, hidden] -> router logits [tokens, E] -> top-k experts per token, softmax over those k logits
      -> each expert takes at most ``capacity = ceil(C * tokens * k / E)`` of the (token, choice) slots sent to
         it; the rest are dropped (that slot adds nothing: the token goes on through the residual alone,
         as in GShard and Switch Transformer)
      -> out[t] = sum over t's kept choices of weight * expert(x[t])      (each expert a SwiGLU MLP)

SmolLM2 is a dense model: every token goes through its one MLP. The block here is built at its sizes (hidden
576, 1536 per expert) with seeded weights, so that the dispatch and its costs are measured at a real width;
it is no part of the model and nothing is trained.

Which slots an expert keeps when more arrive than it has room for: every token's first choice comes
before any token's second choice (GShard's order), and within one choice the earlier token comes first.

Expert parallelism (``expert_parallel_forward``): E experts over W processes, expert ``e`` on the rank
``shard_bounds`` gives it, each rank with its own slice of the tokens. Each rank routes its tokens, the
ranks all-gather their per-(choice, expert) counts, from which every rank knows the whole queue of
every expert, so each drops exactly the slots the one-process block drops, before sending anything. The
kept slots go to their experts' ranks in one ``all_to_all_single`` (gloo has it on this build), the
experts run, and a second all-to-all brings the outputs back to be weighted and summed.

What the capacity factor does (``benchmarks/moe.py``, one full run on 2026-12-06: 8 seeded batches of 512
tokens, E=4, top-2; imbalance is the busiest expert's slots over the mean before drops):

    tokens                     imbalance   dropped at C = 0.5    1.0    1.25   2.0
    Gaussian                   1.05                      50.0%  1.7%   0%     0%
    SmolLM2 embedding rows     1.32                      53.4%  15.9%  1.9%   0%

A capacity factor below 1 drops slots even when the load is even; above it, the drops follow the
imbalance: an expert takes ``C`` times the mean load, so no slot is dropped once ``C`` reaches the imbalance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from infra_lib.training.zero import shard_bounds


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int = 576
    intermediate_size: int = 1536
    n_experts: int = 4
    top_k: int = 2

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must lie in [1, n_experts={self.n_experts}], got {self.top_k}")


def top_k_gating(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``k`` experts and their gate weights.

    Args:
        router_logits: ``[tokens, n_experts]``, one row per token.
        k: experts per token, ``1 <= k <= n_experts``.

    Returns:
        ``experts`` ``[tokens, k]`` int64: per row, the indices of the ``k`` largest logits of that row, largest
        first; equal logits go to the lower expert index first. ``weights`` ``[tokens, k]``, the logits' dtype:
        the softmax over those ``k`` logits only (each row sums to 1; the other experts' logits play no part).
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, n_experts], got shape {list(router_logits.shape)}")
    if not isinstance(k, int) or not 1 <= k <= router_logits.shape[1]:
        raise ValueError(f"k must be an integer in [1, {router_logits.shape[1]}], got {k!r}")
    ordered, experts = torch.sort(router_logits, dim=-1, descending=True, stable=True)
    return experts[:, :k], torch.softmax(ordered[:, :k], dim=-1)


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots each expert takes: ``ceil(capacity_factor * n_tokens * top_k / n_experts)``."""
    if not capacity_factor > 0:
        raise ValueError(f"the capacity factor must be positive, got {capacity_factor!r}")
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def choice_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``[k, n_experts]``: how many tokens chose each expert as their j-th choice."""
    return F.one_hot(experts, n_experts).sum(0)


def queue_positions(experts: torch.Tensor, n_experts: int, offsets: torch.Tensor) -> torch.Tensor:
    """``[tokens, k]``: each slot's place in its expert's queue, ``offsets[j, e]`` plus the number of earlier
    tokens here whose j-th choice is also ``e``."""
    one_hot = F.one_hot(experts, n_experts)  # [tokens, k, E]
    before = one_hot.cumsum(0) - one_hot  # earlier tokens, same choice, same expert
    return ((before + offsets.unsqueeze(0)) * one_hot).sum(-1)


def single_offsets(counts: torch.Tensor) -> torch.Tensor:
    """Queue offsets when all tokens are in one place: choice j waits behind every earlier choice."""
    return counts.cumsum(0) - counts


class MoEBlock:
    """The router ``[E, hidden]`` and the experts this process holds (all of them by default), seeded.

    Expert ``e``'s weights depend only on ``seed`` and ``e``, so a rank can build just its own experts.
    """

    def __init__(self, config: MoEConfig | None = None, seed: int = 0, experts: range | None = None):
        config = config or MoEConfig()
        self.config, self.seed = config, seed
        self.expert_ids = experts if experts is not None else range(config.n_experts)
        d, inter = config.hidden_size, config.intermediate_size
        g = torch.Generator().manual_seed(seed)
        self.router = torch.randn(config.n_experts, d, generator=g) / math.sqrt(d)
        self.experts = {}
        for e in self.expert_ids:
            g = torch.Generator().manual_seed(seed * 1000 + 1 + e)
            gate, up = (torch.randn(inter, d, generator=g) / math.sqrt(d) for _ in range(2))
            self.experts[e] = (gate, up, torch.randn(d, inter, generator=g) / math.sqrt(inter))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s SwiGLU MLP on ``x`` ``[n, hidden]``."""
        gate, up, down = self.experts[e]
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts and gate weights: ``top_k_gating`` of the router's logits for ``x`` ``[tokens, hidden]``."""
        if x.dim() != 2 or x.shape[1] != self.config.hidden_size:
            raise ValueError(f"x must be [tokens, hidden={self.config.hidden_size}], got shape {list(x.shape)}")
        return top_k_gating(F.linear(x, self.router), self.config.top_k)


@dataclass
class MoEOutput:
    """The block's output and its routing: ``out`` ``[tokens, hidden]``; ``experts``, ``weights`` and ``kept``
    (a bool per slot) ``[tokens, k]``; ``capacity`` per expert; ``load`` ``[E]``, the slots sent to each expert
    before any was dropped."""

    out: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    capacity: int
    load: torch.Tensor

    def imbalance(self) -> float:
        """Max expert load over the mean load."""
        return float(self.load.max() / self.load.float().mean())

    def dropped_fraction(self) -> float:
        return 1.0 - float(self.kept.float().mean())


@torch.inference_mode()
def moe_forward(block: MoEBlock, x: torch.Tensor, capacity_factor: float) -> MoEOutput:
    """The single-process reference: every expert on this process, ``x`` ``[tokens, hidden]`` all here."""
    if len(block.experts) != block.config.n_experts:
        raise ValueError(
            f"the reference needs all {block.config.n_experts} experts; this block has {list(block.experts)}"
        )
    c = block.config
    experts, weights = block.route(x)
    counts = choice_counts(experts, c.n_experts)
    capacity = expert_capacity(x.shape[0], c.top_k, c.n_experts, capacity_factor)
    kept = queue_positions(experts, c.n_experts, single_offsets(counts)) < capacity
    out = torch.zeros_like(x)
    for e in range(c.n_experts):
        tokens, choice = torch.nonzero((experts == e) & kept, as_tuple=True)
        out.index_add_(0, tokens, weights[tokens, choice, None] * block.expert(e, x[tokens]))
    return MoEOutput(out, experts, weights, kept, capacity, counts.sum(0))


def expert_owner(n_experts: int, world_size: int) -> list[int]:
    """The rank that holds each expert (contiguous ranges, ``shard_bounds``)."""
    owner = []
    for rank in range(world_size):
        start, end = shard_bounds(n_experts, world_size, rank)
        owner += [rank] * (end - start)
    return owner


@torch.inference_mode()
def expert_parallel_forward(block: MoEBlock, x: torch.Tensor, capacity_factor: float) -> MoEOutput:
    """This rank's share of the block on the default process group: its tokens ``x`` ``[local tokens, hidden]``
    (rank r's tokens follow rank r-1's in the global order) and its experts (``block.expert_ids`` must be
    ``shard_bounds(E, world_size, rank)``). Every rank must call it. Returns the output for its own tokens,
    equal to the rows of ``moe_forward`` on all ranks' tokens together, drops included."""
    c, rank, world = block.config, dist.get_rank(), dist.get_world_size()
    mine = range(*shard_bounds(c.n_experts, world, rank))
    if block.expert_ids != mine:
        raise ValueError(f"rank {rank} of {world} must hold experts {list(mine)}, holds {list(block.expert_ids)}")
    experts, weights = block.route(x)
    counts = choice_counts(experts, c.n_experts)  # [k, E]
    gathered = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    every = torch.stack(gathered)  # [W, k, E]
    capacity = expert_capacity(int(every[:, 0].sum()), c.top_k, c.n_experts, capacity_factor)
    # the queue of expert e: all ranks' choices before j, then ranks before r at choice j, then this rank
    start = every.sum(0).cumsum(0) - every.sum(0)  # [k, E]
    offsets = start.unsqueeze(0) + every.cumsum(0) - every  # [W, k, E]
    kept = queue_positions(experts, c.n_experts, offsets[rank]) < capacity
    kept_counts = (capacity - offsets).clamp(min=0).minimum(every).sum(1)  # [W, E]: slots each rank sends

    # dispatch: kept slots ordered by expert (hence by owner), then by choice, then by token
    tokens, choice = torch.nonzero(kept, as_tuple=True)
    order = torch.argsort(experts[tokens, choice] * kept.shape[1] + choice, stable=True)
    tokens, choice = tokens[order], choice[order]
    owner = torch.tensor(expert_owner(c.n_experts, world))
    send_sizes = [int(kept_counts[rank][owner == r].sum()) for r in range(world)]
    recv_sizes = [int(kept_counts[r][list(mine)].sum()) for r in range(world)]
    received = x.new_empty(sum(recv_sizes), x.shape[1])
    dist.all_to_all_single(received, x[tokens].contiguous(), recv_sizes, send_sizes)

    # each source's rows arrive grouped by expert, in this rank's expert order
    results, row = torch.empty_like(received), 0
    for source in range(world):
        for e in mine:
            n = int(kept_counts[source, e])
            results[row : row + n] = block.expert(e, received[row : row + n])
            row += n
    returned = x.new_empty(len(tokens), x.shape[1])
    dist.all_to_all_single(returned, results, send_sizes, recv_sizes)
    out = torch.zeros_like(x)
    out.index_add_(0, tokens, weights[tokens, choice, None] * returned)
    return MoEOutput(out, experts, weights, kept, capacity, every.sum((0, 1)))


def moe_worker(rank: int, world_size: int, config: MoEConfig, seed: int, x: torch.Tensor, factors: list[float]) -> dict:
    """A worker for ``run_workers``: the expert-parallel block on this rank's rows of ``x`` at each capacity factor;
    returns its output rows and kept mask per factor."""
    block = MoEBlock(config, seed, range(*shard_bounds(config.n_experts, world_size, rank)))
    start, end = shard_bounds(x.shape[0], world_size, rank)
    rows = {}
    for factor in factors:
        result = expert_parallel_forward(block, x[start:end], factor)
        rows[factor] = {"out": result.out, "kept": result.kept, "capacity": result.capacity, "load": result.load}
    return {"rank": rank, "rows": (start, end), "results": rows}
