"""The engine's step in C: ``NativeModelRunner``, the batched sibling of ``NativeDecoder``.

``ModelRunner`` runs a step as about 400 PyTorch operations (thirty layers of norms, projections,
RoPE, a paged-KV write, a gather and two batched products for attention, the MLP). At the batch
sizes this machine serves, 8 to 32 sequences decoding, most of a step's time is not in the
products but between them: measured on the 64-prompt offline workload at a batch limit of 8, a
decode step of about 8 tokens took 62 ms, where streaming the weights once takes under 20.

``NativeModelRunner`` sends every step of up to ``max_tokens`` tokens (512, the engine's default
token budget) into one C call (``infra_native_batch_step`` in ``infra_lib/model/native/decode_step.c``):

* the step's tokens flattened as ``ModelRunner`` flattens them (decodes and prefill chunks
  of any sequences), each with its id, position, KV slot and sequence;
* each product's weights packed once, at load time, in panels of output rows stored input-major
  (``pack_panels``), the panels split between the threads of PyTorch's OpenMP pool; each panel
  streams from memory once per step, and every token's sums for its rows stay in vector registers;
* each layer writes every token's K/V into its slot of the engine's ``PagedKVStore`` before any
  token attends; each (token, head) pair then reads its sequence's keys and values through the
  block table, causally (a chunk's tokens see each other);
* logits only for the tokens that sample, which the runner samples as ``ModelRunner`` does.

Measured side by side on this machine (SmolLM2, 2 threads), a decode step of 8 sequences at a
context of 100 took 32 ms in C and 62 ms in ``ModelRunner`` on the model's ``decode_layout``; 64
sequences, 113 and 162 ms; a prefill chunk of 504 tokens beside 7 decodes, 590 and 888 ms. Steps
larger than ``max_tokens`` run in PyTorch on ``fallback`` (the model itself unless another is
given, e.g. its ``decode_layout`` copy). Both paths read and write the same store, so a prompt
can be prefilled in PyTorch and decoded in C.
"""

from __future__ import annotations

import ctypes

import torch

from infra_lib.kernels.paged_gather import block_table_tensor
from infra_lib.model.model import Llama
from infra_lib.model.native_decode import (
    BLOCK,
    FORMAT_CODE,
    INT4_GROUP,
    QUANTISED,
    NativeUnavailable,
    check_native_model,
    data_pointer,
    fp32,
    head_format,
    native_library,
    stored_head,
    stored_projection,
    stored_weight,
    take_shared_tensors,
)
from infra_lib.serving.kv_store import PagedKVStore
from infra_lib.serving.model_runner import Batch, ModelRunner

# the step's own fields of dims[] (B_ROWS, B_SAMPLES, B_TABLE_WIDTH, B_THREADS in C)
_ROWS, _SAMPLES, _TABLE_WIDTH, _THREADS = 8, 9, 10, 12


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """``[out, in]`` rows as the batched step reads them: ``[panels, in, width]``, each panel
    ``width`` consecutive output rows stored input-major, the last panel padded with zero rows."""
    rows, n = weight.shape
    padded = -(-rows // width) * width
    if padded != rows:
        weight = torch.cat([weight, weight.new_zeros(padded - rows, n)])
    return weight.reshape(padded // width, width, n).transpose(1, 2).contiguous()


class PanelWeights:
    """A model's weights packed for the batched step, in format ``weights`` (fp32, bf16, int8 with
    per-row scales: in panels; q4_1 and int4: in their rows of blocks, as ``NativeDecoder`` reads
    them, the head in Q8_0), with q, k and v as one weight, and the per-layer pointer array the
    step takes (each layer's pointers name its K/V tensors in the paged ``store``)."""

    def __init__(self, model: Llama, weights: str, store: PagedKVStore, group_size: int = INT4_GROUP):
        keys, values = store.k, store.v
        library = native_library()
        width = library.infra_native_panel_width()

        def packed(*linears) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            if weights in QUANTISED:  # each module's rows of blocks, in order
                parts = [stored_projection(m, weights, group_size) for m in linears]
                return tuple(None if p[0] is None else torch.cat(p).contiguous() for p in zip(*parts))
            weight = torch.cat([m.weight.detach().float() for m in linears])  # rows of each, in order
            stored, scale = stored_weight(weight, weights)
            return pack_panels(stored, width), scale, None

        self.keep: list[torch.Tensor] = []
        pointers = []
        for layer, k_cache, v_cache in zip(model.layers, keys, values, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o = packed(attn.q_proj, attn.k_proj, attn.v_proj), packed(attn.o_proj)
            gate, up, down = packed(mlp.gate_proj), packed(mlp.up_proj), packed(mlp.down_proj)
            tensors = [
                fp32(layer.input_layernorm.weight),
                qkv[0],
                qkv[1],
                fp32(attn.q_proj.bias),
                fp32(attn.k_proj.bias),
                fp32(attn.v_proj.bias),
                o[0],
                o[1],
                fp32(attn.o_proj.bias),
                fp32(layer.post_attention_layernorm.weight),
                gate[0],
                gate[1],
                up[0],
                up[1],
                down[0],
                down[1],
                k_cache,
                v_cache,
                qkv[2],
                o[2],
                gate[2],
                up[2],
                down[2],
            ]
            self.keep += [t for t in tensors if t is not None]
            pointers += [data_pointer(t) for t in tensors]
        if len(pointers) != model.config.n_layers * library.infra_native_batch_param_count():
            raise NativeUnavailable("the C step and this module disagree on the batched step's parameters")
        self.pointers = (ctypes.c_void_p * len(pointers))(*pointers)
        take_shared_tensors(self, model)
        if weights in QUANTISED:
            self.lm_head, self.lm_head_scale = stored_head(model.lm_head.weight, weights)
        else:
            self.lm_head, self.lm_head_scale, _ = packed(model.lm_head)


class NativeModelRunner(ModelRunner):
    """A ``ModelRunner`` whose steps of up to ``max_tokens`` tokens are one call into C.

    Args:
        model: an fp32 infra_lib ``Llama`` as loaded (``nn.Linear`` projections) on the CPU.
        store: the engine's paged K/V tensors (fp32, CPU), as for ``ModelRunner``.
        weights: the C step's weight format: ``"fp32"`` (the model's own tensors), ``"bf16"``,
            ``"int8"``, ``"int4"`` (copies, as ``NativeDecoder`` makes them) or ``"q4_1"`` (the GGUF
            file's blocks, from a model that ``load_gguf_q4_1`` loaded).
        max_tokens: the largest step (tokens over all its sequences) that runs in C.
        fallback: the model for larger steps (default ``model``); it must have ``model``'s shape.
        attention_backend: the fallback's attention, as for ``ModelRunner``.
        group_size: the int4 step's weights per scale.

    ``native_steps`` and ``fallback_steps`` count the steps each path ran.
    """

    def __init__(
        self,
        model: Llama,
        store: PagedKVStore,
        weights: str = "fp32",
        max_tokens: int = 512,
        fallback: Llama | None = None,
        attention_backend: str = "torch",
        group_size: int = INT4_GROUP,
    ):
        check_native_model(model, weights, "NativeModelRunner", group_size)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        fallback = model if fallback is None else fallback
        if fallback.config != model.config:
            raise ValueError("the fallback model must have the model's config (the same layers and shapes)")
        layer = store.k[0]
        if (
            layer.dtype != torch.float32
            or layer.device.type != "cpu"
            or not all(t.is_contiguous() for t in store.k + store.v)
        ):
            raise ValueError(
                f"NativeModelRunner reads a contiguous fp32 store on the CPU, got {layer.dtype} on {layer.device}"
            )
        super().__init__(fallback, store, attention_backend)
        self.library = native_library()
        self.weights, self.max_tokens = weights, max_tokens
        self.native = PanelWeights(model, weights, store, group_size)
        config = model.config
        dims = [
            config.hidden_size,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.vocab_size,
            config.n_layers,
            config.max_position,
            max_tokens,
            0,
            0,
            store.block_size,
            1,
            FORMAT_CODE[weights],
            group_size // BLOCK,
            FORMAT_CODE[head_format(weights)],
        ]
        if len(dims) != self.library.infra_native_batch_dim_count() or self.library.infra_native_row_fields() != 4:
            raise NativeUnavailable("the C step and this module disagree on the batched step's fields")
        self._dims = (ctypes.c_long * len(dims))(*dims)
        self._scratch = torch.empty(0)
        self._logits = torch.empty(max_tokens, config.vocab_size)
        self.native_steps = self.fallback_steps = 0

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Write every scheduled token's K/V; return logits ``[num_sampling, vocab]`` in batch order."""
        if sum(s.num_tokens for _, s in batch) > self.max_tokens:
            self.fallback_steps += 1
            return super().forward(batch)
        self.native_steps += 1
        return self._native_forward(batch)

    def _native_forward(self, batch: Batch) -> torch.Tensor:
        if not batch:
            raise ValueError("a step needs at least one scheduled sequence")
        rows, tables, samples = [], [], []
        for index, (seq, s) in enumerate(batch):
            end = s.start + s.num_tokens
            ids = self.scheduled_ids(seq, s)
            if end > self.max_position:
                raise ValueError(f"position {end - 1} exceeds the model's context of {self.max_position}")
            table = seq.block_table
            if end > table.capacity:
                raise IndexError(
                    f"seq {seq.seq_id}: positions up to {end - 1} lie outside its table's {table.capacity} slots"
                )
            for position, token in zip(range(s.start, end), ids):
                rows.append((token, position, table.slot(position), index))
            tables.append(table.blocks)
            if s.samples:
                samples.append(len(rows) - 1)
        blocks = [b for t in tables for b in t]
        if blocks and not 0 <= min(blocks) <= max(blocks) < self.store.num_blocks:
            raise IndexError(f"a block table names a block outside the store's {self.store.num_blocks}")
        width = max(len(t) for t in tables)
        rows_t = torch.tensor(rows, dtype=torch.long)  # [T, 4]: token, position, slot, sequence
        tables_t = block_table_tensor(tables, width, "cpu")  # [sequences, width], padded with block 0 (never read)
        samples_t = torch.tensor(samples, dtype=torch.long)
        if rows_t[:, 0].min() < 0 or rows_t[:, 0].max() >= self.native.embed.shape[0]:
            raise ValueError(f"token ids must lie in [0, {self.native.embed.shape[0]})")
        threads = torch.get_num_threads()
        dims = self._dims
        dims[_ROWS], dims[_SAMPLES], dims[_TABLE_WIDTH], dims[_THREADS] = self.max_tokens, len(samples), width, threads
        needed = self.library.infra_native_batch_scratch_floats(dims)  # sized for max_tokens rows
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed)
        dims[_ROWS] = len(rows)
        w = self.native
        status = self.library.infra_native_batch_step(
            dims,
            w.eps,
            w.pointers,
            w.embed.data_ptr(),
            w.final_norm.data_ptr(),
            w.lm_head.data_ptr(),
            data_pointer(w.lm_head_scale),
            w.cos.data_ptr(),
            w.sin.data_ptr(),
            rows_t.data_ptr(),
            tables_t.data_ptr(),
            samples_t.data_ptr() if samples else None,
            self._scratch.data_ptr(),
            self._logits.data_ptr(),
        )
        if status != 0:
            raise ValueError(f"a position lies past the model's context of {self.max_position}")
        return self._logits[: len(samples)].clone()
