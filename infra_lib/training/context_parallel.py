"""Context parallelism: one attention over a sequence split across ranks, by a ring or by all-to-all.

A long sequence's activations outgrow one device long before its weights do, so context parallelism
gives each of W ranks a contiguous slice of the positions: Q, K and V of shape
``[batch, heads, seq / W, head_dim]``. Everything in a transformer layer is per position except
attention, where every query needs the keys and values of all earlier positions. Two ways to get them:

    ring attention (Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers")
        K/V blocks travel the ring (send to rank + 1, receive from rank - 1) W - 1 times; each rank folds
        every block it sees into its queries' output with the online softmax (running max, running sum,
        rescaled accumulator), so no rank ever holds the whole score matrix or the whole K/V. Causal: a
        rank's queries see its own block under the diagonal mask, earlier ranks' blocks whole and later
        ranks' blocks not at all (their compute is skipped; the block is still forwarded). The backward
        recomputes each block's probabilities from the saved log-sum-exp and passes the dK/dV partial sums
        around the ring with their block, one more hop taking each home.
    Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses")
        an all-to-all turns sequence-sharded Q, K, V into head-sharded ones (all positions, H / W heads),
        each rank runs ordinary attention on its heads, and an all-to-all turns the output back. Its
        traffic per rank falls as 1 / W at a fixed sequence, the ring's does not; but W can be at most
        the number of KV heads.

Communication goes through the course's point-to-point interface (``collectives.DistComm`` over
``torch.distributed``, ``collectives.ThreadComm`` for ranks that are threads): ``exchange(send, to,
recv, source)``, counting the bytes each rank sends, so the traffic a run measures can be set against
``ring_attention_traffic`` and ``ulysses_traffic``.

Conventions: scores are ``q . k / sqrt(head_dim)``; k and v may have fewer heads than q (grouped-query
attention, query head ``h`` reading KV head ``h // (heads / kv_heads)``); the log-sum-exp ``lse`` is the
natural log of each query row's softmax denominator, ``[batch, heads, t]`` (as ``kernels.flash_attention``
returns it). The online softmax state is kept in float32 for half-precision inputs, else in their dtype.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import torch.nn.functional as F

DIAGONAL, FULL, SKIP = "diagonal", "full", "skip"  # how a query block sees a key block under the causal mask
LAYOUTS = ("contiguous", "zigzag")


class RingState(NamedTuple):
    """The online softmax of one query slice over the key blocks folded in so far.

    row_max: [batch, heads, t], the largest scaled score each query row has met.
    row_sum: [batch, heads, t], the sum of exp(score - row_max) over the keys met.
    acc: [batch, heads, t, head_dim], the sum of exp(score - row_max) * value over the keys met.
    """

    row_max: torch.Tensor
    row_sum: torch.Tensor
    acc: torch.Tensor


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def empty_state(q: torch.Tensor) -> RingState:
    """The state before any key block: max -inf, sum 0, accumulator 0."""
    dtype = _state_dtype(q.dtype)
    return RingState(
        torch.full(q.shape[:-1], -math.inf, dtype=dtype, device=q.device),
        torch.zeros(q.shape[:-1], dtype=dtype, device=q.device),
        torch.zeros(q.shape, dtype=dtype, device=q.device),
    )


def _expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """K or V [batch, kv_heads, s, d] repeated to [batch, n_heads, s, d] (grouped-query attention)."""
    if x.shape[1] == n_heads:
        return x
    if n_heads % x.shape[1]:
        raise ValueError(
            f"q has {n_heads} heads and k/v {x.shape[1]}: the query heads must be a multiple of the KV heads"
        )
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient for the expanded heads [batch, n_heads, s, d] summed back onto the KV heads."""
    batch, n_heads, s, d = grad.shape
    return grad if n_heads == kv_heads else grad.view(batch, kv_heads, n_heads // kv_heads, s, d).sum(2)


def _block_scores(q: torch.Tensor, k_block: torch.Tensor, causal_kind: str) -> torch.Tensor:
    """Scaled scores [batch, heads, t, s] in the state's dtype, -inf where the diagonal mask hides a key."""
    if causal_kind not in (DIAGONAL, FULL):
        raise ValueError(f"causal_kind must be {DIAGONAL!r} or {FULL!r}, got {causal_kind!r}")
    dtype = _state_dtype(q.dtype)
    keys = _expand_heads(k_block, q.shape[1]).to(dtype)
    scores = (q.to(dtype) @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal_kind == DIAGONAL:
        t, s = scores.shape[-2:]
        if t != s:
            raise ValueError(f"a diagonal block pairs a query slice with its own keys: got {t} queries and {s} keys")
        hidden = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1)  # key j > query i
        scores = scores.masked_fill(hidden, -math.inf)
    return scores


def ring_attention_step(
    q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, state: RingState, causal_kind: str
) -> RingState:
    """Fold one K/V block into the online softmax of ``q``'s rows.

    Args:
        q: [batch, heads, t, head_dim], this rank's queries.
        k_block, v_block: [batch, kv_heads, s, head_dim], one rank's keys and values.
        state: the ``RingState`` so far, or any (row_max, row_sum, acc) (``empty_state(q)`` before the first block).
        causal_kind: ``"diagonal"`` (the queries' own block: query i sees keys 0..i, so s == t) or
            ``"full"`` (every key visible: an earlier rank's block, or any block without the causal mask).

    Returns:
        The new ``RingState``: the max raised where the block holds a larger score, and what was
        accumulated under the old max rescaled by exp(old max - new max).
    """
    old_max, old_sum, old_acc = state
    scores = _block_scores(q, k_block, causal_kind)
    row_max = torch.maximum(old_max, scores.amax(-1))  # finite: every row sees a key in either kind
    rescale = torch.exp(old_max - row_max)
    weights = torch.exp(scores - row_max.unsqueeze(-1))
    values = _expand_heads(v_block, q.shape[1]).to(weights.dtype)
    return RingState(row_max, old_sum * rescale + weights.sum(-1), old_acc * rescale.unsqueeze(-1) + weights @ values)


def finish_state(state: RingState) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) from a state: the accumulator divided by the sum, and max + log(sum)."""
    return state.acc / state.row_sum.unsqueeze(-1), state.row_max + torch.log(state.row_sum)


def chunks_held(world: int, rank: int, layout: str = "contiguous") -> list[int]:
    """The sequence chunks ``rank`` holds, in order: ``[rank]`` of W chunks (contiguous), or chunks ``rank``
    and ``2W - 1 - rank`` of 2W (zigzag, which gives every rank the same causal work)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not a rank of a group of {world}")
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def block_kind(query_chunk: int, key_chunk: int, causal: bool = True) -> str:
    """How a query chunk sees a key chunk: ``"full"`` (earlier, or no causal mask), ``"diagonal"`` (the same
    chunk) or ``"skip"`` (later: every key is in the queries' future)."""
    if not causal or key_chunk < query_chunk:
        return FULL
    return DIAGONAL if key_chunk == query_chunk else SKIP


def block_pairs(world: int, rank: int, origin: int, causal: bool, layout: str) -> list[tuple[int, int, str]]:
    """(query part, key part, kind) for ``rank``'s queries against the block that ``origin`` holds, skips left out."""
    mine, theirs = chunks_held(world, rank, layout), chunks_held(world, origin, layout)
    pairs = [(a, b, block_kind(qc, kc, causal)) for a, qc in enumerate(mine) for b, kc in enumerate(theirs)]
    return [pair for pair in pairs if pair[2] != SKIP]


def causal_work(seq_len: int, world: int, layout: str = "contiguous", causal: bool = True) -> list[int]:
    """Query-key scores each rank computes in one forward (a diagonal block counted whole), by rank:
    what the ring's skips leave of each rank's share."""
    parts = len(chunks_held(world, 0, layout))
    _split_length(seq_len, world * parts, "seq_len")
    side = seq_len // (world * parts)
    return [
        side * side * sum(len(block_pairs(world, rank, origin, causal, layout)) for origin in range(world))
        for rank in range(world)
    ]


def _split_length(length: int, parts: int, what: str) -> None:
    if length % parts:
        raise ValueError(f"{what} {length} does not split into {parts} equal chunks: pad the sequence to a multiple")


def shard_sequence(x: torch.Tensor, world: int, rank: int, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """``rank``'s slice of a full-sequence tensor (positions along ``dim``) under ``layout``."""
    held = chunks_held(world, rank, layout)
    parts = world * len(held)
    _split_length(x.shape[dim], parts, "the sequence length")
    chunks = x.chunk(parts, dim=dim)
    return torch.cat([chunks[c] for c in held], dim=dim)


def unshard_sequence(slices: list[torch.Tensor], layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The full-sequence tensor from every rank's slice (by rank): ``shard_sequence`` undone."""
    world = len(slices)
    pieces: dict[int, torch.Tensor] = {}
    for rank, part in enumerate(slices):
        held = chunks_held(world, rank, layout)
        pieces.update(zip(held, part.chunk(len(held), dim=dim)))
    return torch.cat([pieces[c] for c in sorted(pieces)], dim=dim)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, heads, seq_slice, head_dim], got {_describe(x)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(
            f"q {list(q.shape)} and k {list(k.shape)} must share batch, slice length and head_dim "
            "(each rank holds the same positions of all three)"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q's {q.shape[1]} heads must be a multiple of k's {k.shape[1]} (grouped-query attention)")


def _describe(x) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def _default_comm(comm):
    if comm is not None:
        return comm
    from infra_lib.training.collectives import DistComm

    return DistComm()


def _neighbours(comm) -> tuple[int, int]:
    return (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size


def ring_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm,
    causal: bool = True,
    layout: str = "contiguous",
    overlap: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (out, lse) of attention over the whole sequence, K/V blocks passed around the ring.

    Args:
        q, k, v: this rank's slice, [batch, heads (kv_heads for k, v), t, head_dim], every rank the same t.
        comm: ``exchange``, ``rank`` and ``world_size`` (``DistComm``, ``ThreadComm``).
        causal: the causal mask over the whole sequence.
        layout: how the positions were sharded (``shard_sequence``): "contiguous" or "zigzag".
        overlap: send the next block on a background thread while this one is computed.

    Returns:
        out [batch, heads, t, head_dim] in the state's dtype, lse [batch, heads, t].
    """
    _check_qkv(q, k, v)
    world, rank = comm.world_size, comm.rank
    parts = len(chunks_held(world, rank, layout))
    _split_length(q.shape[2], parts, "the slice length")
    right, left = _neighbours(comm)
    q_parts = q.chunk(parts, dim=2)
    states = [empty_state(part) for part in q_parts]
    block = torch.stack([k, v])  # one message per step: [2, batch, kv_heads, t, head_dim]
    with ThreadPoolExecutor(max_workers=1) as sender:
        for step in range(world):
            origin = (rank - step) % world  # the rank whose K/V this block is
            pending, incoming = None, None
            if step < world - 1:
                incoming = torch.empty_like(block)
                if overlap:
                    pending = sender.submit(comm.exchange, block, right, incoming, left)
                else:
                    comm.exchange(block, right, incoming, left)
            k_parts, v_parts = block[0].chunk(parts, dim=2), block[1].chunk(parts, dim=2)
            for a, b, kind in block_pairs(world, rank, origin, causal, layout):
                states[a] = ring_attention_step(q_parts[a], k_parts[b], v_parts[b], states[a], kind)
            if pending is not None:
                pending.result()
            block = incoming
    finished = [finish_state(state) for state in states]
    return torch.cat([o for o, _ in finished], dim=2), torch.cat([lse for _, lse in finished], dim=2)


def _block_backward(q, k_block, v_block, grad_out, lse, delta, kind):
    """dq, dk, dv of one (query part, key part) pair, its probabilities recomputed from the saved lse."""
    dtype = _state_dtype(q.dtype)
    scale = 1 / math.sqrt(q.shape[-1])
    keys = _expand_heads(k_block, q.shape[1]).to(dtype)
    values = _expand_heads(v_block, q.shape[1]).to(dtype)
    probs = torch.exp(_block_scores(q, k_block, kind) - lse.unsqueeze(-1))  # [batch, heads, t, s]
    dv = probs.transpose(-1, -2) @ grad_out
    dscores = probs * (grad_out @ values.transpose(-1, -2) - delta.unsqueeze(-1))
    dq = dscores @ keys * scale
    dk = dscores.transpose(-1, -2) @ q.to(dtype) * scale
    return dq, _fold_heads(dk, k_block.shape[1]), _fold_heads(dv, k_block.shape[1])


def ring_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    comm,
    causal: bool = True,
    layout: str = "contiguous",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's slice: each K/V block travels the ring again with its dK/dV partial sums.

    At each step a rank adds its queries' contribution to the block it holds (probabilities recomputed
    from ``lse``, FlashAttention's backward) and passes block and partial sums on together; after W - 1
    steps every rank holds the block of rank + 1, complete, and one more hop takes each dK/dV home.

    Args:
        q, k, v: as for ``ring_attention_forward``; out, lse: what it returned; grad_out: d loss / d out.
        comm, causal, layout: as for ``ring_attention_forward``.
    """
    _check_qkv(q, k, v)
    world, rank = comm.world_size, comm.rank
    parts = len(chunks_held(world, rank, layout))
    dtype = _state_dtype(q.dtype)
    right, left = _neighbours(comm)
    grad_out = grad_out.to(dtype)
    delta = (grad_out * out.to(dtype)).sum(-1)  # [batch, heads, t]: row . its gradient, softmax's backward
    split = lambda x: x.chunk(parts, dim=2)  # noqa: E731 - the same query and key parts everywhere
    q_parts, go_parts, lse_parts, delta_parts = split(q), split(grad_out), split(lse.to(dtype)), split(delta)
    dq_parts = [torch.zeros(p.shape, dtype=dtype, device=q.device) for p in q_parts]
    block = torch.stack([k, v])
    grads = torch.zeros(block.shape, dtype=dtype, device=q.device)  # dK, dV of the block held, travelling with it
    for step in range(world):
        origin = (rank - step) % world
        k_parts, v_parts = split(block[0]), split(block[1])
        dk_parts, dv_parts = split(grads[0]), split(grads[1])
        for a, b, kind in block_pairs(world, rank, origin, causal, layout):
            dq, dk, dv = _block_backward(
                q_parts[a], k_parts[b], v_parts[b], go_parts[a], lse_parts[a], delta_parts[a], kind
            )
            dq_parts[a] += dq
            dk_parts[b].add_(dk)  # views of grads: the sums travel with the block
            dv_parts[b].add_(dv)
        if step < world - 1:
            incoming, incoming_grads = torch.empty_like(block), torch.empty_like(grads)
            comm.exchange(block, right, incoming, left)
            comm.exchange(grads, right, incoming_grads, left)
            block, grads = incoming, incoming_grads
    if world > 1:  # the partial sums held now are rank + 1's, complete: one hop takes them home
        home = torch.empty_like(grads)
        comm.exchange(grads, right, home, left)
        grads = home
    return torch.cat(dq_parts, dim=2).to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Ring attention with its ring backward, for autograd: ``RingAttention.apply(q, k, v, comm, causal, layout)``."""

    @staticmethod
    def forward(ctx, q, k, v, comm, causal, layout):
        out, lse = ring_attention_forward(q.detach(), k.detach(), v.detach(), comm, causal, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.layout = comm, causal, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(q, k, v, out, lse, grad_out, ctx.comm, ctx.causal, ctx.layout)
        return dq, dk, dv, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm=None, causal: bool = True, layout: str = "contiguous"
) -> torch.Tensor:
    """This rank's output of attention over the whole sequence [batch, heads, t, head_dim], by the ring;
    differentiable (``RingAttention``). ``comm`` defaults to ``DistComm()`` (the default process group)."""
    return RingAttention.apply(q, k, v, _default_comm(comm), causal, layout)


# --- Ulysses: all-to-all over heads -------------------------------------------------------------------------


def all_to_all(chunks: list[torch.Tensor], comm) -> list[torch.Tensor]:
    """Send ``chunks[j]`` to rank j and return what each rank sent here, by rank (this rank's own chunk kept).

    Built from W - 1 pairwise exchanges (at step i, send to rank + i, receive from rank - i), so it runs
    on any ``comm`` of the course and its bytes are counted there; every chunk must have the shape of the
    chunk its peer sends back. gloo's ``dist.all_to_all_single`` gives the same result on a process group.
    """
    world, rank = comm.world_size, comm.rank
    if len(chunks) != world:
        raise ValueError(f"all_to_all needs one chunk per rank ({world}), got {len(chunks)}")
    received = [None] * world
    received[rank] = chunks[rank]
    for step in range(1, world):
        to, source = (rank + step) % world, (rank - step) % world
        received[source] = torch.empty_like(chunks[to])
        comm.exchange(chunks[to], to, received[source], source)
    return received


def _sequence_to_heads(x: torch.Tensor, comm) -> torch.Tensor:
    """[batch, heads, s / W, d] sharded by positions -> [batch, heads / W, s, d] sharded by heads."""
    parts = all_to_all([c.contiguous() for c in x.chunk(comm.world_size, dim=1)], comm)
    return torch.cat(parts, dim=2)


def _heads_to_sequence(x: torch.Tensor, comm) -> torch.Tensor:
    """[batch, heads / W, s, d] -> [batch, heads, s / W, d]: ``_sequence_to_heads`` undone."""
    parts = all_to_all([c.contiguous() for c in x.chunk(comm.world_size, dim=2)], comm)
    return torch.cat(parts, dim=1)


class SequenceHeadsSwap(torch.autograd.Function):
    """The all-to-all between sequence and head sharding, for autograd: the gradient takes the way back."""

    @staticmethod
    def forward(ctx, x, comm, to_heads: bool):
        ctx.comm, ctx.to_heads = comm, to_heads
        return _sequence_to_heads(x, comm) if to_heads else _heads_to_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad):
        back = _heads_to_sequence(grad, ctx.comm) if ctx.to_heads else _sequence_to_heads(grad, ctx.comm)
        return back, None, None


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm=None, causal: bool = True
) -> torch.Tensor:
    """This rank's output of attention over the whole sequence, DeepSpeed-Ulysses style; differentiable.

    Args:
        q, k, v: this rank's contiguous slice, [batch, heads (kv_heads for k, v), s / W, head_dim].
        comm: as for ``ring_attention``.

    Raises:
        ValueError: W does not divide the heads or the KV heads (Ulysses splits heads, so W <= kv_heads).
    """
    comm = _default_comm(comm)
    _check_qkv(q, k, v)
    world = comm.world_size
    if q.shape[1] % world or k.shape[1] % world:
        raise ValueError(
            f"Ulysses gives each of the {world} ranks whole heads: {world} must divide the {q.shape[1]} query heads "
            f"and the {k.shape[1]} KV heads (so at most {k.shape[1]} ranks); use ring attention beyond that"
        )
    heads = [SequenceHeadsSwap.apply(x, comm, True) for x in (q, k, v)]  # [batch, heads / W, s, d]
    out = F.scaled_dot_product_attention(*heads, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return SequenceHeadsSwap.apply(out, comm, False)


# --- what each moves ----------------------------------------------------------------------------------------


def ring_attention_traffic(
    batch: int,
    seq_len: int,
    n_heads: int,
    head_dim: int,
    world: int,
    n_kv_heads: int | None = None,
    element_size: int = 4,
) -> dict[str, int]:
    """Bytes each rank sends in ring attention (``ring_attention_forward``/``_backward``), and all ranks together.

    A K/V block is B * S/W * H_kv * d elements each of K and V. Forward: W - 1 steps of one K and one V block.
    Backward: W - 1 steps of K, V and their dK, dV partial sums, then one hop of dK, dV home.
    """
    block = batch * (seq_len // world) * (n_kv_heads or n_heads) * head_dim * element_size
    backward = (world - 1) * 4 * block + (2 * block if world > 1 else 0)
    return _per_rank_and_total((world - 1) * 2 * block, backward, world)


def ulysses_traffic(
    batch: int,
    seq_len: int,
    n_heads: int,
    head_dim: int,
    world: int,
    n_kv_heads: int | None = None,
    element_size: int = 4,
) -> dict[str, int]:
    """Bytes each rank sends in ``ulysses_attention``, and all ranks together.

    Forward: four all-to-alls (Q, K, V in, O out), each sending (W - 1) / W of the rank's slice of that
    tensor (B * S/W * heads * d elements). Backward: the same four, the way back (dO in; dQ, dK, dV out).
    """
    kv = n_kv_heads or n_heads
    slice_elements = batch * (seq_len // world) * head_dim * (2 * n_heads + 2 * kv)  # Q, O and K, V
    forward = (world - 1) * slice_elements // world * element_size
    return _per_rank_and_total(forward, forward, world)


def ring_hidden_slice(
    n_heads: int, n_kv_heads: int, flops_per_s: float, link_bytes_per_s: float, element_size: int = 2
) -> float:
    """The slice length t = S / W from which the ring hides its traffic behind compute.

    One full block's attention is 4 t^2 H d FLOPs (Q K^T and P V, two multiply-adds each); sending the next
    K/V block is 2 t H_kv d elements. Compute lasts at least as long as the transfer when
    t >= H_kv * element_size * flops / (2 H * link bandwidth); head_dim cancels. Peak FLOP/s make this a floor:
    attention that runs below peak hides the transfer from shorter slices.
    """
    if min(n_heads, n_kv_heads, flops_per_s, link_bytes_per_s, element_size) <= 0:
        raise ValueError("heads, FLOP/s, link bandwidth and element size must all be positive")
    return n_kv_heads * element_size * flops_per_s / (2 * n_heads * link_bytes_per_s)


def _per_rank_and_total(forward: int, backward: int, world: int) -> dict[str, int]:
    return {
        "forward_per_rank": forward,
        "backward_per_rank": backward,
        "forward_total": world * forward,
        "backward_total": world * backward,
    }


# --- one run on a process group, for the chapter --------------------------------------------------------------


def context_parallel_worker(
    rank: int, world_size: int, batch: int, seq_len: int, n_heads: int, head_dim: int, seed: int = 0
) -> dict:
    """A worker for ``run_workers``: ring attention (contiguous and zigzag) and Ulysses on gloo against full
    causal attention (``scaled_dot_product_attention`` on the whole sequence, in every process), values and
    gradients; the bytes each sent, forward and backward; and gloo's own all-to-all against ``all_to_all``."""
    import torch.distributed as dist

    from infra_lib.training.collectives import DistComm

    generator = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(batch, n_heads, seq_len, head_dim, generator=generator) for _ in range(4))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=True)
    expected.backward(grad_out)
    row: dict = {"rank": rank}
    runs = {
        "ring": lambda xs, comm: ring_attention(*xs, comm),
        "ring zigzag": lambda xs, comm: ring_attention(*xs, comm, layout="zigzag"),
        "ulysses": lambda xs, comm: ulysses_attention(*xs, comm),
    }
    for name, attend in runs.items():
        layout = "zigzag" if "zigzag" in name else "contiguous"
        mine = [shard_sequence(x, world_size, rank, layout).requires_grad_() for x in (q, k, v)]
        comm = DistComm()
        out = attend(mine, comm)
        sent_forward = comm.bytes_sent
        out.backward(shard_sequence(grad_out, world_size, rank, layout))
        wanted = [expected.detach(), *(x.grad for x in full)]
        errors = [
            float((got - shard_sequence(want, world_size, rank, layout)).abs().max())
            for got, want in zip([out.detach(), *(x.grad for x in mine)], wanted)
        ]
        row[name] = {
            "out_error": errors[0],
            "grad_error": max(errors[1:]),
            "forward_bytes": sent_forward,
            "backward_bytes": comm.bytes_sent - sent_forward,
        }
    chunks = list(torch.randn(world_size, 3, generator=generator).add(10 * rank).unbind(0))
    gloo = torch.empty(world_size, 3)
    dist.all_to_all_single(gloo, torch.stack(chunks))
    row["all_to_all_matches_gloo"] = bool(torch.equal(torch.stack(all_to_all(chunks, DistComm())), gloo))
    return row
