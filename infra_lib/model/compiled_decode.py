"""Batch-1 greedy decoding with a static KV cache and the decoder layer compiled once for every layer.

``torch.compile`` needs what chapter 04 teaches: shapes that do not change from call to call, and
no Python it cannot capture. The course's ``DenseKVCache`` returns a longer key tensor every step
(a new shape each time) and keeps its length in a Python integer, so ``StaticDecoder`` keeps its
own cache instead:

* one ``[1, n_kv_heads, capacity, head_dim]`` buffer per layer for keys and one for values, written
  in place at the step's position (``index_copy_`` with the position as a tensor);
* attention over the whole buffer, with a boolean mask that lets a query see the positions up to
  its own: every decode step has the same shapes, whatever its position, so one graph serves all.

Only the decoder layer is compiled (**regional compilation**): the thirty layers of SmolLM2 run the
same code on tensors of the same shapes, and with PyTorch's default of treating a module's
parameters as inputs, Dynamo captures one graph and every layer reuses it. Compiling the whole step
would unroll thirty copies of the layer into one graph, and compile about fifteen times longer here
for about the same speed. The prompt (the prefill) runs the same layer function uncompiled.

The model may be the one ``load_default`` gives or its decode layout (``decode_layout``, any weight
format): the layer function calls the layer's own ``qkv``, ``o_proj``, ``mlp`` and norms, so the
compiled graph contains whatever products that layout uses. In fp32 and int8 the compiled step
gives the uncompiled model's greedy tokens; in bf16 Inductor fuses the casts around each product and
rounds a little differently, so a long answer can part from the uncompiled bf16 one (the benchmark
reports the prefix they share). ``benchmarks/decode.py`` times it
against the uncompiled loop; chapter 04 takes it as its worked example.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from infra_lib.model.model import Llama, apply_rope


def layer_step(
    layer: torch.nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """One decoder layer on ``x`` ``[1, t, d]`` at ``positions`` ``[t]``: its keys and values are
    written into ``keys``/``values`` ``[1, n_kv_heads, capacity, head_dim]`` at those positions, and
    its queries attend over the whole buffers under ``mask`` ``[1, 1, t, capacity]`` (True: may attend)."""
    attn = layer.self_attn
    batch, t, _ = x.shape
    q, k, v = attn.qkv(layer.input_layernorm(x))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys.index_copy_(2, positions, k)
    values.index_copy_(2, positions, v)
    # grouped-query attention without copying K/V per query head: SDPA pairs the head groups itself
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, t, attn.n_heads * attn.head_dim))
    return x + layer.mlp(layer.post_attention_layernorm(x))


class StaticDecoder:
    """Greedy batch-1 decoding of ``model`` with a KV cache of fixed ``capacity`` tokens.

    Args:
        model: an infra_lib ``Llama`` (as loaded, or its ``decode_layout`` copy), float32 activations.
        capacity: the most tokens (prompt and output) one call of ``greedy`` may hold.
        compile: compile the decoder layer for decode steps (``False``: the same code, eager).

    The first decode step after construction pays the compile (a few seconds on this course's
    CPU); later calls, with any prompt that fits, reuse it.
    """

    def __init__(self, model: Llama, capacity: int = 512, compile: bool = True):
        if not isinstance(model, Llama):
            raise TypeError(f"StaticDecoder takes an infra_lib Llama, got {type(model).__name__}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 2:
            raise ValueError(f"capacity must be an int >= 2, got {capacity!r}")
        if capacity > model.config.max_position:
            raise ValueError(f"capacity {capacity} exceeds the model's context of {model.config.max_position}")
        config = model.config
        self.model, self.capacity, self.compiled = model, capacity, compile
        shape = (1, config.n_kv_heads, capacity, config.head_dim)
        self.keys = [torch.zeros(shape) for _ in range(config.n_layers)]
        self.values = [torch.zeros(shape) for _ in range(config.n_layers)]
        self._slots = torch.arange(capacity)
        self._decode_layer = torch.compile(layer_step, dynamic=False) if compile else layer_step

    def _forward(self, tokens: torch.Tensor, start: int, layer_fn) -> torch.Tensor:
        """Logits ``[vocab]`` of the last of ``tokens`` ``[1, t]``, which continue a sequence of ``start``."""
        model = self.model
        positions = torch.arange(start, start + tokens.shape[1])
        cos, sin = model.rope_cos.index_select(0, positions), model.rope_sin.index_select(0, positions)
        mask = (self._slots[None, :] <= positions[:, None])[None, None]  # [1, 1, t, capacity]
        x = model.embed_tokens(tokens)
        for layer, keys, values in zip(model.layers, self.keys, self.values):
            x = layer_fn(layer, x, cos, sin, mask, positions, keys, values)
        return model.lm_head(model.norm(x[:, -1:]))[0, -1]

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int, stop_id: int | None = None) -> list[int]:
        """The generated ids, as ``greedy_decode(model, prompt, max_new_tokens, stop_id)`` returns them.

        The prompt runs uncompiled in one pass; each decode step runs the compiled layer.
        """
        self._check(prompt, max_new_tokens)
        for buffer in (*self.keys, *self.values):
            buffer.zero_()  # a slot past the sequence is masked anyway; zeros keep a stale one harmless
        logits = self._forward(torch.tensor([prompt]), 0, layer_step)
        out: list[int] = []
        while True:
            token = int(logits.argmax())
            out.append(token)
            if token == stop_id or len(out) == max_new_tokens:
                return out
            logits = self._step(token, len(prompt) + len(out) - 1)

    def _check(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token id")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self._check_ids(prompt)
        if len(prompt) + max_new_tokens - 1 > self.capacity:
            raise ValueError(
                f"{len(prompt)} prompt tokens and {max_new_tokens} new ones need "
                f"{len(prompt) + max_new_tokens - 1} cache slots; this decoder holds {self.capacity} "
                "(build it with a larger capacity)"
            )

    def _check_ids(self, tokens: list[int]) -> None:
        vocab = self.model.config.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}); got {min(tokens)}..{max(tokens)}")

    @torch.inference_mode()
    def teacher_forced(self, prompt: list[int], continuation: list[int]) -> list[int]:
        """The greedy pick after the prompt and after each token of ``continuation`` but the last
        (``len(continuation)`` picks), the decoder reading ``continuation`` whatever it picks: how
        often these equal ``continuation`` is how often this decoder agrees with the one that wrote it."""
        return [int(logits.argmax()) for logits in self._read(prompt, continuation)]

    @torch.inference_mode()
    def perplexity(self, token_ids: list[int]) -> float:
        """exp(mean negative log-likelihood) of ``token_ids[1:]``, each predicted from the tokens before
        it: the first token is the prompt, every later one a decode step. ``quant.perplexity(model,
        token_ids)`` gives the same number for up to 513 tokens (one window), read in one pass."""
        if len(token_ids) < 2:
            raise ValueError("perplexity needs at least two tokens")
        nll = 0.0
        for logits, target in zip(self._read(token_ids[:1], token_ids[1:]), token_ids[1:]):
            nll -= float(torch.log_softmax(logits.float(), dim=-1)[target])
        return math.exp(nll / (len(token_ids) - 1))

    def _read(self, prompt: list[int], continuation: list[int]):
        """Logits after the prompt, then after each token of ``continuation`` but the last, as the
        decoder reads them one step at a time (each valid until the next is taken)."""
        if not continuation:
            raise ValueError("the continuation is empty: give at least one token id")
        self._check(prompt, len(continuation))
        self._check_ids(continuation)
        for buffer in (*self.keys, *self.values):
            buffer.zero_()
        yield self._forward(torch.tensor([prompt]), 0, layer_step)
        for i, token in enumerate(continuation[:-1]):
            yield self._step(token, len(prompt) + i)

    def _step(self, token: int, position: int) -> torch.Tensor:
        """Logits ``[vocab]`` after ``token`` at ``position``: one decode step through the compiled layer."""
        return self._forward(torch.tensor([[token]]), position, self._decode_layer)
