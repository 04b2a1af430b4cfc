"""What task 3's checks and task 6's checks inside a decoder share: the contract's parameters and seeded weights for
them, SmolLM2's weights read without building the course's model, and a cached pass over a model's named modules.

The learner's kernel never builds the course's ``Llama`` while lab 06 is checked (it is task 3's reference, and
calling it is a shortcut), so both sides of a check build their own class from the same weights.
"""

from __future__ import annotations

import functools

LLAMA = "infra_lib.model.model"  # where the reference decoder lives


def parameter_shapes(config) -> dict[str, list[int]]:
    """Every parameter's name and shape in the contract (the course's ``Llama``'s), ``lm_head`` included."""
    d, hd, f = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {"embed_tokens.weight": [config.vocab_size, d]}
    for i in range(config.n_layers):
        layer = f"layers.{i}."
        shapes[layer + "input_layernorm.weight"] = [d]
        shapes[layer + "self_attn.q_proj.weight"] = [config.n_heads * hd, d]
        shapes[layer + "self_attn.k_proj.weight"] = [config.n_kv_heads * hd, d]
        shapes[layer + "self_attn.v_proj.weight"] = [config.n_kv_heads * hd, d]
        shapes[layer + "self_attn.o_proj.weight"] = [d, config.n_heads * hd]
        shapes[layer + "post_attention_layernorm.weight"] = [d]
        shapes[layer + "mlp.gate_proj.weight"] = [f, d]
        shapes[layer + "mlp.up_proj.weight"] = [f, d]
        shapes[layer + "mlp.down_proj.weight"] = [d, f]
    shapes["norm.weight"] = [d]
    shapes["lm_head.weight"] = [config.vocab_size, d]
    return shapes


def seeded_weights(config, seed: int) -> dict:
    """A state dict for ``config``, the same for the same seed: norm scales near 1, matrices large enough that greedy
    decoding has clear winners; a tied ``lm_head.weight`` holds the embedding table's values."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in parameter_shapes(config).items():
        if name == "lm_head.weight" and config.tie_embeddings:
            weights[name] = weights["embed_tokens.weight"].clone()
        elif len(shape) == 1:
            weights[name] = 1.0 + 0.2 * torch.randn(*shape, generator=generator)
        else:
            weights[name] = 0.35 * torch.randn(*shape, generator=generator)
    return weights


@functools.lru_cache(maxsize=1)
def smollm2_weights() -> tuple:
    """SmolLM2-135M-Instruct's config and fp32 state dict (``lm_head.weight`` included), as the course's loader
    keeps them (from its cache when it holds them) but without building the course's model, which a graded
    kernel cannot build."""
    from infra_lib.model.loaders import default_gguf_path, load_weights

    config, state, _ = load_weights(default_gguf_path())
    state = dict(state)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return config, state


def build(Llama, config, weights):
    """``Llama(config)`` holding ``weights`` (a state dict, or a function giving it, called once the class is built),
    loaded strictly, in eval mode; built without drawing the random weights the load replaces at once."""
    from infra_lib.model.loaders import without_init

    with without_init():
        model = Llama(config)
    model.load_state_dict(weights() if callable(weights) else weights, strict=True)
    return model.eval()


def smollm2_config() -> dict:
    """SmolLM2's LlamaConfig as plain data, for a case (made where the course's model may be loaded)."""
    from dataclasses import asdict

    from infra_lib.model.loaders import load_default

    return asdict(load_default().model.config)


def smollm2_model(Llama, config: dict):
    """SmolLM2-135M-Instruct in ``Llama`` (``config``: ``smollm2_config()``): the course's class is its loaded model,
    any other is built first (a blank answer raises before the weights are read) and then loaded."""
    from infra_lib.model.config import LlamaConfig
    from infra_lib.model.model import Llama as Course

    if Llama is Course:
        from infra_lib.model.loaders import load_default

        return load_default().model
    return build(Llama, LlamaConfig(**config), lambda: smollm2_weights()[1])


class CachedDecoder:
    """``model``'s named modules run over a ``DenseKVCache`` with ``attention_fn`` as every layer's cached attention
    step: ``decoder(tokens, cache, last_only)`` as the course's model is called in a decode loop."""

    def __init__(self, model, attention_fn):
        self.model, self.config, self.attention_fn = model, model.config, attention_fn

    def __call__(self, tokens, cache, last_only: bool = False):
        import torch

        model, c = self.model, self.config
        batch, t = tokens.shape
        start = cache.seq_len
        positions = torch.arange(start, start + t)
        x = model.embed_tokens(tokens)  # [batch, t, d]
        for index, layer in enumerate(model.layers):
            h, attn = layer.input_layernorm(x), layer.self_attn
            heads = [
                proj(h).view(batch, t, n, c.head_dim).transpose(1, 2)  # [batch, n, t, head_dim]
                for proj, n in ((attn.q_proj, c.n_heads), (attn.k_proj, c.n_kv_heads), (attn.v_proj, c.n_kv_heads))
            ]
            q, k = model.rope(heads[0], positions), model.rope(heads[1], positions)
            out = self.attention_fn(q, k, heads[2], cache.layer(index))
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, t, c.n_heads * c.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(model.norm(x[:, -1:] if last_only else x))
