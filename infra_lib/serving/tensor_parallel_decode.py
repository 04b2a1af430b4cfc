"""Tensor-parallel decode: one Llama split across ranks, Megatron style, each rank with its own KV cache.

    per layer, on every rank:
      x -> RMSNorm -> q/k/v of this rank's heads (column-parallel) -> attention over this rank's cache
        -> o_proj over this rank's heads (row-parallel): a partial sum -> all-reduce -> + x
        -> RMSNorm -> gate/up of this rank's slice of the intermediate (column-parallel)
        -> down_proj over that slice (row-parallel): a partial sum -> all-reduce -> + x
    embeddings, norms and lm_head are replicated: every rank holds the whole residual stream and the logits

Two all-reduces per layer, no other communication; each rank stores keys and values only for its heads.

How the heads split. Grouped-query attention ties query head ``h`` to key/value head
``h // (n_heads // n_kv_heads)``, so a rank must hold whole KV-head groups: its KV heads and every query
head that reads them. SmolLM2 has 3 KV heads of 3 query heads each; over 2 ranks the groups split 2 + 1
(rank 0: KV heads 0-1, query heads 0-5; rank 1: KV head 2, query heads 6-8), the split ``shard_bounds``
gives. The alternatives cost more: padding to 4 groups (12 query heads) adds a third of the attention
weights and work as zeros, and splitting the query heads 5 + 4 puts KV head 1 on both ranks (its
projections computed twice and its cache stored twice). The 2 + 1 split leaves rank 0 with 54% of each
layer's weights (its 6 heads and half the MLP) against rank 1's 46%; a decode step waits for rank 0.
More ranks than KV heads would need KV heads replicated; ``kv_head_range`` refuses that case.

When TP helps decode on a GPU. At batch 1 a decode step reads every weight once and does little
arithmetic, so a step costs about ``weight bytes / HBM bandwidth``. TP=2 halves the layers' bytes per
rank but adds ``2 * n_layers`` all-reduces of one ``hidden``-sized vector, each paying its latency α
(the bytes, 576 x 2 = 1.2 KB in bf16, take nanoseconds on NVLink's 450 GB/s each way).
``tp_decode_estimate`` does this arithmetic; for SmolLM2 in bf16 on H100s (``specs``: 3.35 TB/s HBM,
NVLink 4 at 900 GB/s in all) with α = 6 µs (about what ``all_reduce_perf`` reports for a small
all-reduce between two H100s over NVLink, in NVIDIA/nccl issue 1259; a measured figure, not a datasheet's):

    one GPU   (106 M layer + 28 M embedding params) x 2 B = 269 MB  -> 80 µs per token
    TP=2      rank 0 reads 0.54 x 212 MB + 57 MB     = 172 MB  -> 51 µs, + 60 all-reduces x 6 µs = 360 µs

so TP=2 makes SmolLM2's decode about 5x slower. TP pays when the time a rank saves per layer,
``layer bytes x (1 - 1/TP) / HBM bandwidth``, exceeds ``2 α``: with α = 6 µs that is a layer of about
80 MB in bf16 at TP=2 (Llama-2-70B's layers are 1.7 GB each; SmolLM2's are 7 MB). On this course's CPU the
all-reduce is gloo over loopback and ``benchmarks/tp_decode.py`` measures its share: in one full run on 2
shared cores (2026-12-06, fp32, one thread per rank) a TP=2 step took 122 ms against 58 ms unsplit, 59-61% of
it inside the 60 all-reduces, whose latency alone was about 120 µs each (the rest is waiting for the other
rank, each rank's compute and its wake-ups jittering on a busy machine).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from infra_lib.model.attention import cached_attention
from infra_lib.model.cache import DenseKVCache
from infra_lib.model.model import MLP, Attention, Llama, apply_rope
from infra_lib.training.zero import shard_bounds

# Sums a tensor over the ranks and returns the sum (every rank gets the same tensor back).
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")


# --- the MLP: column-parallel gate/up, row-parallel down ----------------------------------------


@dataclass(frozen=True)
class MLPShard:
    """One rank's slices of a SwiGLU MLP: the rows ``[start, end)`` of the intermediate dimension.

    Attributes:
        gate: ``[end - start, hidden]``, rows of ``gate_proj.weight``.
        up: ``[end - start, hidden]``, the same rows of ``up_proj.weight``.
        down: ``[hidden, end - start]``, the same columns of ``down_proj.weight``.
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def shard_mlp(mlp: MLP, rank: int, world_size: int) -> MLPShard:
    """Rank ``rank``'s share of ``mlp`` when its intermediate dimension is split over ``world_size`` ranks.

    Args:
        mlp: a module with ``gate_proj``, ``up_proj`` (``[intermediate, hidden]``) and ``down_proj``
            (``[hidden, intermediate]``) linear layers without bias.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: the number of ranks.

    Returns:
        An ``MLPShard`` holding intermediate units ``shard_bounds(intermediate, world_size, rank)``: rows of
        gate and up and the matching columns of down (as evenly as possible, the first ranks one more
        when it does not divide). The slices are views of the module's weights. Every unit of the
        intermediate dimension belongs to exactly one rank.
    """
    _check_rank(rank, world_size)
    intermediate = mlp.gate_proj.weight.shape[0]
    if world_size > intermediate:
        raise ValueError(f"cannot split an intermediate dimension of {intermediate} over {world_size} ranks")
    start, end = shard_bounds(intermediate, world_size, rank)
    return MLPShard(mlp.gate_proj.weight[start:end], mlp.up_proj.weight[start:end], mlp.down_proj.weight[:, start:end])


def tp_mlp_forward(x: torch.Tensor, shard: MLPShard, all_reduce: AllReduce) -> torch.Tensor:
    """The MLP's output for ``x`` computed from one rank's shard and one all-reduce.

    Args:
        x: ``[..., hidden]``, the same on every rank (the replicated residual stream after its norm).
        shard: this rank's ``MLPShard``.
        all_reduce: called exactly once, with this rank's partial output ``[..., hidden]``; returns
            the sum of every rank's partial.

    Returns:
        ``[..., hidden]``, what ``all_reduce`` returned: equal (to float rounding) to the unsplit
        ``down(silu(gate(x)) * up(x))``. With an ``all_reduce`` that returns its input unchanged, the
        rank's partial, and the partials of all ranks sum to the unsplit output.
    """
    hidden = F.silu(F.linear(x, shard.gate)) * F.linear(x, shard.up)  # [..., this rank's units]
    return all_reduce(F.linear(hidden, shard.down))


# --- attention: whole KV-head groups per rank ------------------------------------------------


def kv_head_range(n_heads: int, n_kv_heads: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the KV heads rank ``rank`` holds; its query heads are ``start * group .. end * group``
    with ``group = n_heads // n_kv_heads``."""
    _check_rank(rank, world_size)
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads do not group evenly over {n_kv_heads} KV heads")
    if world_size > n_kv_heads:
        raise ValueError(
            f"{world_size} ranks but only {n_kv_heads} KV heads: each rank needs a whole KV head "
            "(replicating KV heads is not implemented); use at most {n_kv_heads} ranks"
        )
    return shard_bounds(n_kv_heads, world_size, rank)


@dataclass(frozen=True)
class AttentionShard:
    """One rank's heads: rows of q/k/v (and their biases), columns of o_proj."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None  # added once, after the all-reduce
    n_heads: int
    n_kv_heads: int
    head_dim: int


def shard_attention(attn: Attention, rank: int, world_size: int) -> AttentionShard:
    """Rank ``rank``'s whole KV-head groups of ``attn`` (see ``kv_head_range``)."""
    kv_start, kv_end = kv_head_range(attn.n_heads, attn.n_kv_heads, world_size, rank)
    group, d = attn.n_heads // attn.n_kv_heads, attn.head_dim
    q_rows, kv_rows = slice(kv_start * group * d, kv_end * group * d), slice(kv_start * d, kv_end * d)

    def rows(layer, part):
        return layer.weight[part], None if layer.bias is None else layer.bias[part]

    (q, qb), (k, kb), (v, vb) = rows(attn.q_proj, q_rows), rows(attn.k_proj, kv_rows), rows(attn.v_proj, kv_rows)
    heads = kv_end - kv_start
    o = attn.o_proj.weight[:, q_rows]
    return AttentionShard(q, k, v, qb, kb, vb, o, attn.o_proj.bias, heads * group, heads, d)


def tp_attention_forward(x, shard: AttentionShard, cos, sin, layer_cache, all_reduce: AllReduce) -> torch.Tensor:
    """Attention of ``x`` ``[batch, t, hidden]`` over this rank's heads and cache, summed over ranks."""
    batch, t, _ = x.shape

    def heads(weight, bias, n):  # [batch, t, n * head_dim] -> [batch, n, t, head_dim]
        return F.linear(x, weight, bias).view(batch, t, n, shard.head_dim).transpose(1, 2)

    q = apply_rope(heads(shard.q, shard.q_bias, shard.n_heads), cos, sin)
    k = apply_rope(heads(shard.k, shard.k_bias, shard.n_kv_heads), cos, sin)
    out = cached_attention(q, k, heads(shard.v, shard.v_bias, shard.n_kv_heads), layer_cache)
    summed = all_reduce(F.linear(out.transpose(1, 2).reshape(batch, t, -1), shard.o))
    return summed if shard.o_bias is None else summed + shard.o_bias


# --- the whole model ---------------------------------------------------------------------------


def dist_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """``dist.all_reduce`` (sum, in place over the default group) in the ``AllReduce`` form."""
    dist.all_reduce(tensor)
    return tensor


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of one rank: its seconds, and the seconds of them spent inside the all-reduces."""

    seconds: float
    all_reduce_seconds: float


class TensorParallelDecoder:
    """One rank's share of ``model``: its heads and MLP slice per layer, replicated embeddings/norms/lm_head.

    ``all_reduce_seconds`` adds up the time spent inside ``all_reduce`` (on a rank that finishes its
    share first this includes waiting for the slower rank to reach the same all-reduce)."""

    def __init__(self, model: Llama, rank: int, world_size: int, all_reduce: AllReduce = dist_all_reduce):
        self.model, self.rank, self.world_size = model, rank, world_size
        self.attention = [shard_attention(layer.self_attn, rank, world_size) for layer in model.layers]
        self.mlps = [shard_mlp(layer.mlp, rank, world_size) for layer in model.layers]
        self._all_reduce, self.all_reduce_seconds, self.all_reduce_calls = all_reduce, 0.0, 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self._all_reduce(tensor)
        self.all_reduce_seconds += time.perf_counter() - start
        self.all_reduce_calls += 1
        return out

    def new_cache(self, capacity: int) -> DenseKVCache:
        """A cache for this rank's KV heads only."""
        shard = self.attention[0]
        return DenseKVCache(self.model.config.n_layers, 1, shard.n_kv_heads, capacity, shard.head_dim)

    def weight_bytes(self) -> int:
        """Bytes this rank reads per token: its slices of the layers plus everything replicated."""
        split = [layer.self_attn for layer in self.model.layers] + [layer.mlp for layer in self.model.layers]
        whole = sum(p.nbytes for module in split for p in module.parameters())
        kept = sum(
            t.nbytes
            for shard in (*self.attention, *self.mlps)
            for t in vars(shard).values()
            if isinstance(t, torch.Tensor)
        )
        return self.model.weight_bytes() - whole + kept

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: DenseKVCache) -> torch.Tensor:
        """Logits of the last position, ``[batch, vocab]``, for ``tokens`` ``[batch, t]`` after the cached ones."""
        positions = slice(cache.seq_len, cache.seq_len + tokens.shape[1])
        cos, sin = self.model.rope_cos[positions], self.model.rope_sin[positions]
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            x = x + tp_attention_forward(h, self.attention[i], cos, sin, cache.layer(i), self.all_reduce)
            x = x + tp_mlp_forward(layer.post_attention_layernorm(x), self.mlps[i], self.all_reduce)
        return self.model.lm_head(self.model.norm(x[:, -1]))

    def greedy(
        self, prompt: list[int], max_new_tokens: int, stop_id: int | None = None
    ) -> tuple[list[int], list[DecodeStep]]:
        """``greedy_decode``'s tokens from this rank's shard (every rank must call it with the same
        arguments), and the timing of each decode step (prefill excluded)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if not prompt or len(prompt) + max_new_tokens > self.model.config.max_position:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) must be non-empty and, with {max_new_tokens} new tokens, fit "
                f"the model's context of {self.model.config.max_position}"
            )
        cache = self.new_cache(len(prompt) + max_new_tokens)
        out = [int(self.forward(torch.tensor([prompt]), cache)[0].argmax())]
        steps = []
        while out[-1] != stop_id and len(out) < max_new_tokens:
            reduce_before, begin = self.all_reduce_seconds, time.perf_counter()
            logits = self.forward(torch.tensor([[out[-1]]]), cache)
            steps.append(DecodeStep(time.perf_counter() - begin, self.all_reduce_seconds - reduce_before))
            out.append(int(logits[0].argmax()))
        return out, steps


def all_reduce_latency(numel: int, iters: int) -> float:
    """Median seconds of one ``dist.all_reduce`` of ``numel`` float32 values on the default group (every rank
    must call it): the α of this transport at a decode step's message size."""
    tensor, times = torch.ones(numel), []
    dist.barrier()
    for _ in range(iters):
        begin = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _decode_all(decoder: TensorParallelDecoder, prompts, max_new_tokens, stop_id) -> tuple[list, list[DecodeStep]]:
    tokens, steps = [], []
    for prompt in prompts:
        out, timed = decoder.greedy(prompt, max_new_tokens, stop_id)
        tokens.append(out)
        steps.extend(timed)
    return tokens, steps


def tp_decode_worker(
    rank: int,
    world_size: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_id: int | None = None,
    baseline: bool = False,
    latency_iters: int = 0,
) -> dict:
    """A worker for ``run_workers``: greedy decode of each prompt with SmolLM2 split over the group.

    Returns this rank's tokens per prompt, the seconds of each decode step and the seconds of it spent
    inside ``dist.all_reduce``, the all-reduces per step, this rank's heads and weight bytes. With
    ``baseline`` rank 0 then decodes the same prompts unsplit through the same code (one rank, no
    all-reduce) while the others wait; with ``latency_iters`` every rank times that many all-reduces of
    one hidden vector."""
    from infra_lib.model import load_default

    model = load_default().model
    decoder = TensorParallelDecoder(model, rank, world_size)
    tokens, steps = _decode_all(decoder, prompts, max_new_tokens, stop_id)
    result = {
        "rank": rank,
        "tokens": tokens,
        "step_s": [s.seconds for s in steps],
        "all_reduce_s": [s.all_reduce_seconds for s in steps],
        "all_reduces_per_step": decoder.all_reduce_calls // sum(len(t) for t in tokens),
        "weight_bytes": decoder.weight_bytes(),
        "query_heads": decoder.attention[0].n_heads,
        "kv_heads": decoder.attention[0].n_kv_heads,
    }
    if latency_iters:
        result["all_reduce_latency_s"] = all_reduce_latency(model.config.hidden_size, latency_iters)
    if baseline:
        dist.barrier()
        if rank == 0:
            single = TensorParallelDecoder(model, 0, 1, all_reduce=lambda tensor: tensor)
            single_tokens, single_steps = _decode_all(single, prompts, max_new_tokens, stop_id)
            result["single_tokens"], result["single_step_s"] = single_tokens, [s.seconds for s in single_steps]
        dist.barrier()
    return result


# --- when TP pays on a GPU -----------------------------------------------------------------


def tp_decode_estimate(
    config, world_size: int, hbm_bytes_per_s: float, all_reduce_latency_s: float, bytes_per_param: int = 2
) -> dict:
    """Batch-1 decode step, memory-bound, with and without TP over ``world_size`` ranks split as here.

    One GPU reads every weight per token; the busiest rank reads its whole KV-head groups (the largest
    share ``kv_head_range`` gives), its MLP slice and the replicated embedding/lm_head, then waits
    ``2 * n_layers`` all-reduces of ``all_reduce_latency_s`` each (their bytes are neglected: one hidden
    vector per all-reduce). Norms are neglected. Returns bytes and seconds of both, and their ratio.
    """
    c = config
    d, group = c.hidden_size, c.n_heads // c.n_kv_heads
    attention = d * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)  # q, o and k, v
    mlp = 3 * d * c.intermediate_size
    embedding = c.vocab_size * d * (1 if c.tie_embeddings else 2)
    kv_start, kv_end = kv_head_range(c.n_heads, c.n_kv_heads, world_size, 0)  # rank 0 holds the most
    heads = kv_end - kv_start
    rank_attention = d * c.head_dim * (2 * heads * group + 2 * heads)
    start, end = shard_bounds(c.intermediate_size, world_size, 0)
    rank_layer = rank_attention + 3 * d * (end - start)
    one_gpu_bytes = bytes_per_param * (c.n_layers * (attention + mlp) + embedding)
    rank_bytes = bytes_per_param * (c.n_layers * rank_layer + embedding)
    all_reduce_s = 2 * c.n_layers * all_reduce_latency_s
    one_gpu_s, tp_s = one_gpu_bytes / hbm_bytes_per_s, rank_bytes / hbm_bytes_per_s + all_reduce_s
    layer_bytes = bytes_per_param * (attention + mlp)
    return {
        "world_size": world_size,
        "one_gpu_bytes": one_gpu_bytes,
        "rank_bytes": rank_bytes,
        "rank_layer_share": rank_layer / (attention + mlp),
        "one_gpu_s": one_gpu_s,
        "tp_memory_s": rank_bytes / hbm_bytes_per_s,
        "tp_all_reduce_s": all_reduce_s,
        "tp_s": tp_s,
        "tp_speedup": one_gpu_s / tp_s,
        "layer_bytes": layer_bytes,
        # the layer size at which an even split saves 2 all-reduces' latency per layer
        "break_even_layer_bytes": 2 * all_reduce_latency_s * hbm_bytes_per_s / (1 - 1 / world_size),
    }
