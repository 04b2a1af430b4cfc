"""Prefill/decode disaggregation: one process prefills, another decodes, and the KV cache moves between them.

A prompt's prefill is one long compute-bound pass; its decode is many short memory-bound steps. In one
engine they share each step, so a long prompt's chunk stretches the step of every request that is
streaming (its inter-token latency jumps), and a stream of decodes delays the next prompt's first token.
Disaggregation (DistServe, Splitwise, Mooncake) gives each phase its own workers:

    prefill worker (rank 0)                                       decode worker (rank 1)
    engine step: prefill the prompts, sample the first token      receiver thread: header, ids, payload
    pack_kv(store, table, n) -> payload, metadata   --gloo-->     install_kv(store, pool, payload, metadata)
    free the blocks                                                  -> ITS OWN block table; join the batch
                                                                  engine steps: continuous batching of decodes

The handoff is two small functions with a contract (``pack_kv`` / ``install_kv``); the rest is the
course's engine: the prefill worker is an ``LLMEngine`` whose step finishes every request after its first
token (``prefill_step``), and the decode worker an ordinary ``LLMEngine`` into whose running queue an
installed request is placed with its prompt already computed (``adopt``).

Transport. The bytes go over ``torch.distributed`` send/recv on a gloo group of two processes on
127.0.0.1, because that is what a CPU-only laptop has: gloo moves CPU tensors over TCP (here the
loopback), with the same point-to-point API a cluster uses. A GPU cluster moves KV from GPU memory to GPU
memory without a CPU copy: within a node over NVLink (NCCL send/recv, or CUDA IPC), between nodes over
RDMA (InfiniBand/RoCE, GPUDirect), usually through a transfer library that registers the KV pool's memory
once and lets the decode side pull blocks by address: Mooncake's transfer engine, NVIDIA's NIXL (vLLM's
and Dynamo's KV connectors). The contract below does not change with the wire: the payload is whole
blocks in the paged layout, the metadata says how to read them, and the receiver's block ids are its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from infra_lib.model.sampling import SamplingParams
from infra_lib.serving.block_pool import BlockAllocator
from infra_lib.serving.block_table import blocks_needed
from infra_lib.serving.engine import LLMEngine, RequestOutput
from infra_lib.serving.kv_store import PagedKVStore
from infra_lib.serving.sequence import Sequence, SequenceStatus

# The dtypes a payload may carry, by their code on the wire.
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- the handoff's contract ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KVMetadata:
    """How to read a KV payload: the tokens it holds, the paged layout, the sender's block table.

    Attributes:
        num_tokens: positions with K/V, ``0 .. num_tokens - 1`` (the last block may be part-full).
        block_size, n_layers, n_kv_heads, head_dim, dtype: the layout of the blocks.
        source_blocks: the sender's block ids in table order (the record of where the bytes came from;
            the receiver never uses them as its own ids).
    """

    num_tokens: int
    block_size: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    source_blocks: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.source_blocks)

    @property
    def payload_shape(self) -> tuple[int, ...]:
        """``(n_layers, 2, num_blocks, block_size, n_kv_heads, head_dim)``: K at index 0, V at 1."""
        return (self.n_layers, 2, self.num_blocks, self.block_size, self.n_kv_heads, self.head_dim)

    def layout(self) -> tuple:
        return (self.block_size, self.n_layers, self.n_kv_heads, self.head_dim, self.dtype)


def _store_layout(store: PagedKVStore) -> tuple:
    _, block_size, n_kv_heads, head_dim = store.k[0].shape
    return (block_size, store.n_layers, n_kv_heads, head_dim, store.k[0].dtype)


def pack_kv(store: PagedKVStore, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, KVMetadata]:
    """The prefill side of the handoff: one sequence's KV blocks as one contiguous payload.

    Args:
        store: the sender's paged K/V (``store.k[l]``, ``store.v[l]`` ``[num_blocks, block_size, n_kv_heads,
            head_dim]``).
        block_table: the sequence's block ids in order (position ``p`` lives in ``block_table[p //
            block_size]``); every id in ``0 .. store.num_blocks - 1``, none twice.
        num_tokens: positions whose K/V are written; the table must have exactly the blocks they need.

    Returns:
        ``(payload, metadata)``. ``payload`` is a new contiguous tensor of shape ``(n_layers, 2,
        len(block_table), block_size, n_kv_heads, head_dim)`` in the store's dtype: ``payload[l, 0, i]`` is
        layer ``l``'s keys of the table's ``i``-th block, ``payload[l, 1, i]`` its values: whole blocks, in
        table order, so a part-full last block travels whole. ``metadata`` is a ``KVMetadata`` naming the
        tokens, the layout and the sender's table. The store and the sender's pool are not changed: freeing
        the blocks is the caller's business once the payload is sent.

    Raises:
        ValueError: an id outside the store, a repeated id, or a table that does not fit ``num_tokens``.
    """
    table = [int(b) for b in block_table]
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    if len(table) != blocks_needed(num_tokens, store.block_size):
        raise ValueError(
            f"{num_tokens} tokens fill {blocks_needed(num_tokens, store.block_size)} blocks of {store.block_size} "
            f"slots, but the table has {len(table)}: {table}"
        )
    outside = [b for b in table if not 0 <= b < store.num_blocks]
    if outside or len(set(table)) != len(table):
        raise ValueError(
            f"block table {table} must name distinct blocks in 0..{store.num_blocks - 1}"
            + (f" ({outside} are outside)" if outside else " (a block appears twice)")
        )
    index = torch.tensor(table, dtype=torch.long, device=store.k[0].device)
    payload = torch.stack(
        [torch.stack((k.index_select(0, index), v.index_select(0, index))) for k, v in zip(store.k, store.v)]
    )
    block_size, n_layers, n_kv_heads, head_dim, dtype = _store_layout(store)
    return payload, KVMetadata(num_tokens, block_size, n_layers, n_kv_heads, head_dim, dtype, tuple(table))


def install_kv(store: PagedKVStore, pool: BlockAllocator, payload: torch.Tensor, metadata: KVMetadata) -> list[int]:
    """The decode side of the handoff: blocks from the receiver's pool, the payload's bytes written into them.

    Args:
        store: the receiver's paged K/V; its layout (block size, layers, KV heads, head dim, dtype) must be
            the metadata's.
        pool: the receiver's block pool, of the store's ``num_blocks`` and ``block_size``.
        payload: what ``pack_kv`` returned (on any device: it is copied to the store's), shape
            ``metadata.payload_shape``.
        metadata: what ``pack_kv`` returned with it.

    Returns:
        The new block table: ``metadata.num_blocks`` ids taken from ``pool`` (reference count 1 each), in
        the payload's order, so that block ``table[i]`` of every layer holds ``payload[l, :, i]``'s bytes
        exactly. These are the receiver's ids: they need not equal ``metadata.source_blocks``.

    Raises:
        ValueError: a layout or shape that differs from the store's (nothing allocated).
        OutOfBlocks: the pool has fewer free blocks than the payload needs (nothing changed).
    """
    if (store.num_blocks, store.block_size) != (pool.num_blocks, pool.block_size):
        raise ValueError(
            f"the store has {store.num_blocks} blocks of {store.block_size} slots but the pool {pool.num_blocks} "
            f"of {pool.block_size}: build both with the same numbers"
        )
    if metadata.layout() != _store_layout(store):
        raise ValueError(
            "the payload's layout (block_size, n_layers, n_kv_heads, head_dim, dtype) is "
            f"{metadata.layout()}, the store's {_store_layout(store)}: both sides must serve the same model "
            "with the same block size and dtype"
        )
    if tuple(payload.shape) != metadata.payload_shape or payload.dtype != metadata.dtype:
        raise ValueError(
            f"the payload is {tuple(payload.shape)} {payload.dtype}; its metadata says "
            f"{metadata.payload_shape} {metadata.dtype}"
        )
    table = pool.allocate(metadata.num_blocks)
    index = torch.tensor(table, dtype=torch.long, device=store.k[0].device)
    payload = payload.to(store.k[0].device)
    for layer, (k, v) in enumerate(zip(store.k, store.v)):
        k.index_copy_(0, index, payload[layer, 0])
        v.index_copy_(0, index, payload[layer, 1])
    return table


# --- the two engines' parts --------------------------------------------------------------------------


def prefill_step(engine: LLMEngine, handoff) -> list[RequestOutput]:
    """The prefill worker's engine step: schedule and run as ``engine_step`` does, and every request that
    sampled its first token is handed off (``handoff(engine, seq)``, while its blocks are still held) and
    then finished, which returns its blocks to the pool. ``engine_class(partial(prefill_step, handoff=...))``
    is the prefill worker's engine."""
    out = engine.scheduler.schedule()
    batch = engine.begin_step(out)
    if not batch:
        return []
    sampled = engine.runner.run(batch)
    engine.scheduler.commit(out)
    outputs = []
    for seq_id, token in sampled.items():
        seq = engine.sequences[seq_id]
        seq.append_token(token)
        engine.record_token(seq)
        handoff(engine, seq)
        engine.finish(seq, "length")  # this worker's part of the request is done
        outputs.append(engine.output(seq_id, [token]))
    return outputs


@dataclass(frozen=True)
class Handoff:
    """What travels with a payload: the request, its first token, and when it arrived and was sent
    (seconds on the run's shared clock)."""

    request_id: int
    prompt_ids: tuple[int, ...]
    first_token: int
    max_new_tokens: int
    arrival_time: float
    sent_time: float = float("nan")


def adopt(engine: LLMEngine, handoff: Handoff, block_table: list[int]) -> int:
    """Put a prefilled request into the decode engine's running queue: its prompt computed in
    ``block_table`` (blocks the engine's pool already counts as held, from ``install_kv``) and its first
    token known, so that its next step is a decode. Returns the engine's id for it. A request whose first
    token was its last (``max_new_tokens`` 1) finishes at once, its blocks freed."""
    n = len(handoff.prompt_ids)
    if len(engine.scheduler.running) >= engine.config.max_num_seqs:
        raise ValueError(
            f"the decode engine runs {len(engine.scheduler.running)} sequences, its max_num_seqs: adopt request "
            f"{handoff.request_id} once one finishes"
        )
    if len(block_table) != blocks_needed(n, engine.config.block_size):
        raise ValueError(
            f"a prompt of {n} tokens needs {blocks_needed(n, engine.config.block_size)} blocks, got {block_table}"
        )
    params = SamplingParams(max_new_tokens=handoff.max_new_tokens, stop_ids=())
    seq_id = engine.add_request(list(handoff.prompt_ids), params, arrival_time=handoff.arrival_time)
    seq: Sequence = engine.sequences[seq_id]
    engine.scheduler.waiting.remove(seq)  # admitted with its blocks, not through the waiting queue
    seq.block_table.blocks, seq.num_computed_tokens = list(block_table), n
    seq.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(seq)
    now = engine.clock.now()
    seq.append_token(handoff.first_token)
    seq.metrics.first_scheduled_time = seq.metrics.first_token_time = now
    seq.metrics.token_times.append(now)
    if seq.num_tokens >= seq.max_tokens:
        engine.finish(seq, "length")
    return seq_id


# --- the wire ------------------------------------------------------------------------------------------

_DONE, _REQUEST = 0, 1
_HEADER_LEN = 13  # kind, request, first token, max new, arrival, sent, prompt len, then the layout


def send_handoff(handoff: Handoff, payload: torch.Tensor, metadata: KVMetadata, dst: int) -> None:
    """Ship one request to rank ``dst``: a fixed-size header, the prompt ids and the sender's table, the payload."""
    if metadata.dtype not in WIRE_DTYPES:
        raise ValueError(f"a payload of {metadata.dtype} cannot travel; the wire carries {WIRE_DTYPES}")
    floats = torch.tensor([handoff.arrival_time, handoff.sent_time], dtype=torch.float64).view(torch.int64)
    header = torch.tensor(
        [_REQUEST, handoff.request_id, handoff.first_token, handoff.max_new_tokens, 0, 0, len(handoff.prompt_ids),
         metadata.num_tokens, metadata.block_size, metadata.n_layers, metadata.n_kv_heads, metadata.head_dim,
         WIRE_DTYPES.index(metadata.dtype)],
        dtype=torch.int64,
    )  # fmt: skip
    header[4:6] = floats
    ids = torch.tensor(list(handoff.prompt_ids) + list(metadata.source_blocks), dtype=torch.int64)
    for tensor in (header, ids, payload.contiguous()):
        dist.send(tensor, dst)


def send_done(dst: int) -> None:
    """Tell rank ``dst`` that no more requests come."""
    dist.send(torch.zeros(_HEADER_LEN, dtype=torch.int64), dst)


def recv_handoff(src: int) -> tuple[Handoff, torch.Tensor, KVMetadata] | None:
    """Receive what ``send_handoff`` sent from rank ``src``; None after ``send_done``."""
    header = torch.empty(_HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src)
    if int(header[0]) == _DONE:
        return None
    request_id, first, max_new = (int(x) for x in header[1:4])
    arrival, sent = header[4:6].view(torch.float64).tolist()
    prompt_len, num_tokens, block_size, n_layers, n_kv_heads, head_dim, code = (int(x) for x in header[6:])
    ids = torch.empty(prompt_len + blocks_needed(num_tokens, block_size), dtype=torch.int64)
    dist.recv(ids, src)
    ids = ids.tolist()
    metadata = KVMetadata(
        num_tokens, block_size, n_layers, n_kv_heads, head_dim, WIRE_DTYPES[code], tuple(ids[prompt_len:])
    )
    payload = torch.empty(metadata.payload_shape, dtype=metadata.dtype)
    dist.recv(payload, src)
    return Handoff(request_id, tuple(ids[:prompt_len]), first, max_new, arrival, sent), payload, metadata
