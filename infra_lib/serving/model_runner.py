"""The model runner: one forward pass per engine step over a ragged batch of sequences.

A step mixes prefill chunks (many tokens of one sequence) and decodes (one token each). The
runner flattens every scheduled token into one row ``[1, T]`` with its own position, so the
projections, the MLP and the norms run once over all ``T`` tokens, whatever sequence they
belong to. Only attention needs to know the sequences apart:

    embed [1, T, d] -> per layer: RMSNorm -> q/k/v [1, heads, T, hd] -> RoPE at each token's position
        -> write k/v of every token into its slot of the PagedKVStore
        -> attention per sequence through its block table (all decodes together, each chunk alone)
        -> o_proj + residual -> RMSNorm -> MLP + residual
    -> logits only at the last token of each sequence that samples this step

The model's own modules do the work (``infra_lib.model`` is not modified), so the tokens equal
the ones ``greedy_decode`` produces for each request alone.
"""

from __future__ import annotations

import torch

from infra_lib.model.model import Llama
from infra_lib.model.sampling import sample
from infra_lib.serving.kv_store import PagedKVStore
from infra_lib.serving.paged_attention import gather_kv, paged_attention
from infra_lib.serving.scheduler_output import ScheduledSeq
from infra_lib.serving.sequence import Sequence

Batch = list[tuple[Sequence, ScheduledSeq]]
ATTENTION_BACKENDS = ("torch", "triton")


def _flash_chunk(q, k_cache, v_cache, block_tables, seq_lens):
    """A prefill chunk's attention with the Triton FlashAttention kernel: the sequence's keys and
    values gathered from their blocks, then the chunk's queries (the last ``t`` positions) over them."""
    from infra_lib.kernels.flash_attention import flash_attention

    k, v = gather_kv(k_cache, block_tables, seq_lens), gather_kv(v_cache, block_tables, seq_lens)
    return flash_attention(q, k, v, causal=True)[0]


def attention_backends(name: str):
    """``(decode, chunk)`` attention for an engine step: ``"torch"`` (``paged_attention``, the
    default) or ``"triton"`` (the paged decode kernel, which reads the blocks in place, and the
    FlashAttention kernel for prefill chunks). Both take ``(q, k_cache, v_cache, block_tables,
    seq_lens)``; on a CPU the Triton kernels run in the interpreter, slowly but exactly."""
    if name == "torch":
        return paged_attention, paged_attention
    if name == "triton":
        from infra_lib.kernels.paged_decode import paged_decode_attention

        return paged_decode_attention, _flash_chunk
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")


class ModelRunner:
    """Runs a ``Llama`` over scheduled sequences whose K/V live in ``store``.

    Args:
        model: the decoder: the course's ``Llama`` or any module with its parameter names, ``config`` and
            ``rope(x, positions)`` (its modules are used as they are).
        store: the paged K/V tensors, with as many blocks as the scheduler's pool.
    """

    def __init__(self, model: Llama, store: PagedKVStore, attention_backend: str = "torch"):
        if store.n_layers != model.config.n_layers:
            raise ValueError(
                f"the store has {store.n_layers} layers, the model {model.config.n_layers}: "
                "build it with PagedKVStore.for_model(model.config, ...)"
            )
        self.model, self.store = model, store
        self.max_position = model.config.max_position
        self.decode_attention, self.chunk_attention = attention_backends(attention_backend)
        self.attention_backend = attention_backend

    def run(self, batch: Batch) -> dict[int, int]:
        """Compute the step; return the next token of every sequence that samples, by seq_id."""
        samplers = [seq for seq, s in batch if s.samples]
        logits = self.forward(batch).cpu()  # [len(samplers), vocab]; per-request generators live on the CPU
        return {
            seq.seq_id: int(sample(logits[i : i + 1], seq.params, seq.generator)[0]) for i, seq in enumerate(samplers)
        }

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Write every scheduled token's K/V; return logits ``[num_sampling, vocab]`` in batch order."""
        model, device = self.model, self.model.embed_tokens.weight.device
        tokens, positions, slots = [], [], []
        for seq, s in batch:
            tokens += self.scheduled_ids(seq, s)
            positions += range(s.start, s.start + s.num_tokens)
            slots.append(seq.block_table.slot_mapping(s.start, s.start + s.num_tokens, device=device))
        if max(positions) >= self.max_position:
            raise ValueError(f"position {max(positions)} exceeds the model's context of {self.max_position}")
        tokens_t = torch.tensor([tokens], device=device)  # [1, T]
        positions_t = torch.tensor(positions, device=device)
        slots_t = torch.cat(slots)  # [T]
        plan = self._attention_plan(batch, device)  # the same for every layer: built once per step
        x = model.embed_tokens(tokens_t)  # [1, T, d]
        for i, layer in enumerate(model.layers):
            x = x + self._attention(i, layer.self_attn, layer.input_layernorm(x), positions_t, slots_t, plan)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        ends = torch.tensor(self._sampling_rows(batch), dtype=torch.long, device=device)
        return model.lm_head(model.norm(x[0, ends]))  # [num_sampling, vocab]

    @staticmethod
    def scheduled_ids(seq: Sequence, s: ScheduledSeq) -> list[int]:
        """The token ids of the positions the step computes for ``seq``; ValueError if it lacks them."""
        ids = seq.token_ids[s.start : s.start + s.num_tokens]
        if len(ids) != s.num_tokens:
            raise ValueError(
                f"seq {seq.seq_id} has {seq.num_tokens} tokens; step asks for {s.start}..{s.start + s.num_tokens - 1}"
            )
        return ids

    def _attention_plan(self, batch: Batch, device) -> dict:
        """Where each sequence's rows sit in the flattened step, and what its attention reads: the
        prefill chunks one by one, and the decodes (one query each) together, with their rows as a
        tensor and, for the course's own ``paged_attention``, their block tables as one padded
        tensor. Every layer attends with the same plan, so the loop over sequences runs once a step,
        not once a layer."""
        rows, chunks, decodes = 0, [], []
        for seq, s in batch:
            if s.num_tokens == 1:  # decodes (and 1-token chunks) attend together, one query each
                decodes.append((rows, seq.block_table.blocks, s.context_len))
            else:
                chunks.append((rows, s.num_tokens, seq.block_table.blocks, s.context_len))
            rows += s.num_tokens
        plan = {"chunks": chunks, "decode_rows": None}
        if decodes:
            plan["decode_rows"] = torch.tensor([r for r, _, _ in decodes], device=device)
            plan["decode_lens"] = [c for _, _, c in decodes]
            tables = [list(b) for _, b, _ in decodes]
            if self.decode_attention is paged_attention:  # it takes a padded tensor as it takes lists
                width = max(len(t) for t in tables)
                tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)
            plan["decode_tables"] = tables
        return plan

    def _attention(self, index: int, attn, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, plan: dict):
        """One layer's attention for the flattened step, ``h`` ``[1, T, d]`` -> ``[1, T, d]``."""
        t, config = h.shape[1], self.model.config
        hd = config.head_dim
        if hasattr(attn, "q_proj"):
            # [1, T, heads * hd] -> [1, heads, T, hd]: the projections as the weights name them (any model
            # with the course's parameter names and a rope(x, positions) method runs here)
            q = attn.q_proj(h).view(1, t, config.n_heads, hd).transpose(1, 2)
            k = attn.k_proj(h).view(1, t, config.n_kv_heads, hd).transpose(1, 2)
            v = attn.v_proj(h).view(1, t, config.n_kv_heads, hd).transpose(1, 2)
        else:  # a decode layout's fused projection (infra_lib.model.decode_layout): one matrix for all three
            q, k, v = attn.qkv(h)
        q, k = self.model.rope(q, positions), self.model.rope(k, positions)
        self.store.write(index, slots, k, v)
        k_cache, v_cache = self.store.k[index], self.store.v[index]
        out = torch.empty_like(q)  # [1, heads, T, hd]
        for rows, n, blocks, context_len in plan["chunks"]:
            chunk = q[:, :, rows : rows + n]  # [1, heads, n, hd]
            out[:, :, rows : rows + n] = self.chunk_attention(chunk, k_cache, v_cache, [blocks], [context_len])
        at = plan["decode_rows"]
        if at is not None:
            q_dec = q[0][:, at].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, hd]
            o_dec = self.decode_attention(q_dec, k_cache, v_cache, plan["decode_tables"], plan["decode_lens"])
            out[0][:, at] = o_dec.squeeze(2).transpose(0, 1)  # [heads, B, hd]
        return attn.o_proj(out.transpose(1, 2).reshape(1, t, config.n_heads * hd))

    @staticmethod
    def _sampling_rows(batch: Batch) -> list[int]:
        """Row in the flattened step of the last token of each sequence that samples."""
        rows, ends = 0, []
        for _, s in batch:
            rows += s.num_tokens
            if s.samples:
                ends.append(rows - 1)
        return ends
