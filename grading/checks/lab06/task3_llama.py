"""Task 3's checks: the learner's ``Llama(config)``, loaded with seeded weights (the small model's shapes and others:
multi-head, multi-query, a large eps, untied embeddings) and then with SmolLM2-135M-Instruct's, against the course's.

Each case reads the model through the contract's surface, in the order a mistake is easiest to name: the
parameters' names and shapes, the norms, the SwiGLU block, ``rope``, then ``forward``'s logits on a batch, on one
token, and after the embedding table is changed in place (tied embeddings)."""

from __future__ import annotations

import random

from grading.checks.common import array_mismatch, reference, token_difference
from grading.checks.lab06.decoder import (
    LLAMA,
    CachedDecoder,
    parameter_shapes,
    seeded_weights,
    smollm2_config,
    smollm2_model,
)
from grading.checks.lab06.task1_rms_norm import MEAN_HINT, NO_EPS_HINT
from grading.checks.lab06.task2_rope import course_rope, mistake_hint, rotate_mistakes
from grading.checks.lab06.tensors import seeded, tensor_list
from grading.checks.model_cases import TINY
from grading.registry import Check, Mismatch, register

ATOL, RTOL = 1e-3, 1e-4  # logits, as the lab's text states: float32 sums in another order stay far inside it

# --- the small models ------------------------------------------------------------------------------


def _case(rng: random.Random, batch: int, t: int, **config) -> dict:
    config = {**TINY, **config}
    start = rng.randint(0, config["max_position"] - t)
    return {
        "config": config,
        "seed": rng.randrange(10**6),
        "tokens": [[rng.randrange(config["vocab_size"]) for _ in range(t)] for _ in range(batch)],
        "rope_positions": list(range(start, start + t)),
    }


def _tiny_cases(rng: random.Random) -> list[dict]:
    return [
        _case(rng, 2, rng.randint(3, 10)),  # the small model: 6 query heads over 2 KV heads
        _case(rng, 1, rng.randint(2, 8), n_kv_heads=1),  # every query head reads the one KV head
    ]


def _config_cases(rng: random.Random) -> list[dict]:
    return [
        _case(rng, 2, rng.randint(2, 9), n_heads=4, n_kv_heads=4),  # one KV head per query head
        _case(rng, 3, rng.randint(2, 6), n_heads=6, n_kv_heads=3, head_dim=16, rms_norm_eps=0.25, rope_theta=1e5),
        _case(rng, 1, rng.randint(4, 12), n_heads=4, n_kv_heads=2, tie_embeddings=False, n_layers=1),
        _case(rng, 2, 1, n_heads=8, n_kv_heads=2, head_dim=4, hidden_size=32, intermediate_size=64),  # t = 1
    ]


def _probes(case: dict, config):
    """The inputs the surface is read on: activations for the norms (one row tiny, one far from zero mean) and the
    MLP, queries for rope."""
    batch, t, seed = len(case["tokens"]), len(case["tokens"][0]), case["seed"]
    x = seeded(seed + 1, 2, t, config.hidden_size)
    x[0] *= 1e-3  # mean(x^2) of the order of eps
    x[1] += 2.0  # far from zero mean
    q = seeded(seed + 2, batch, config.n_heads, t, config.head_dim)
    return x, seeded(seed + 3, batch, t, config.hidden_size), q


def _drive_tiny(Llama, cases):
    import torch

    from infra_lib.model.config import LlamaConfig

    results = []
    for c in cases:
        config = LlamaConfig(**c["config"])
        model = Llama(config)
        record = {"parameters": {name: list(p.shape) for name, p in model.state_dict().items()}}
        results.append(record)
        if record["parameters"] != parameter_shapes(config):
            continue
        model.load_state_dict(seeded_weights(config, c["seed"]), strict=True)
        model.eval()
        norm_x, mlp_x, q = _probes(c, config)
        tokens = torch.tensor(c["tokens"])
        with torch.no_grad():
            record["keeps_config"] = getattr(model, "config", None) is config
            record["norms"] = tensor_list(model.layers[0].input_layernorm(norm_x), "layers[0].input_layernorm")
            record["final_norm"] = tensor_list(model.norm(norm_x), "norm")
            record["mlp"] = tensor_list(model.layers[-1].mlp(mlp_x), "layers[-1].mlp")
            record["rope"] = tensor_list(model.rope(q, torch.tensor(c["rope_positions"])), "rope")
            record["logits"] = tensor_list(model(tokens), "forward")
            record["one_token"] = tensor_list(model(tokens[:, -1:]), "forward")
            model.embed_tokens.weight.copy_(seeded(c["seed"] + 4, config.vocab_size, config.hidden_size) * 0.35)
            record["new_table"] = tensor_list(model(tokens)[:, -1], "forward")
    return results


def _describe(c: dict) -> str:
    config, tokens = c["config"], c["tokens"]
    other = {k: v for k, v in config.items() if TINY.get(k, object()) != v}
    return (
        f"a model with {config['n_heads']} query heads over {config['n_kv_heads']} KV heads"
        + (f" (differing from the small model in {other})" if other else " (the small model)")
        + f", tokens of shape [{len(tokens)}, {len(tokens[0])}]"
    )


PARAMETERS_HINT = (
    "the parameters are the contract: the same names and shapes as the course's model (what state_dict() lists), "
    "so that SmolLM2's weights load strictly into your class; no biases, lm_head.weight is listed even when it is "
    "the embedding table, and a table your model keeps for itself (RoPE's angles) stays out of state_dict "
    "(a buffer registered with persistent=False)."
)
GQA_HINT = (
    "the query heads that share a KV head are neighbours: with group = n_heads / n_kv_heads, query heads 0 .. "
    "group-1 read KV head 0, the next group read KV head 1, and so on; tiling the KV heads pairs query head h "
    "with KV head h mod n_kv_heads instead."
)
TIED_HINT = (
    "with config.tie_embeddings the output projection is the embedding table itself, one tensor under two names, "
    "not a copy of it: after embed_tokens.weight changes in place, the logits must change with it."
)
LOGITS_HINT = (
    "the norms, the MLP and rope agree, so look at attention and the residual stream: a causal mask (a position "
    "sees itself and the earlier ones), scores scaled by the root of head_dim, each query head reading its group's "
    "KV head, and each block adding its output to the stream it read."
)


def _norm_mistake(c: dict, config, got, weight_name: str) -> str:
    """The hint of the RMSNorm mistake the learner's norm output matches, if any."""
    import torch

    x, _, _ = _probes(c, config)
    x = x.double()
    weight = seeded_weights(config, c["seed"])[weight_name].double()
    got = torch.tensor(got, dtype=torch.float64)
    centred = x - x.mean(-1, keepdim=True)
    mistakes = {
        NO_EPS_HINT: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * weight,
        MEAN_HINT: centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weight,
    }
    found = [hint for hint, values in mistakes.items() if torch.allclose(got, values, atol=1e-5, rtol=1e-4)]
    return found[0] if found else ""


def _tiled_gqa_logits(c: dict, config) -> list:
    """The course's model's logits with each query head h reading KV head h mod n_kv_heads (the tiled mapping)."""
    import torch

    from infra_lib.model.attention import attention
    from infra_lib.model.cache import DenseKVCache
    from infra_lib.model.model import Llama

    def tiled(q, k_new, v_new, cache):
        keys, values = cache.append(k_new, v_new)
        group = q.shape[1] // keys.shape[1]
        return attention(q, keys.repeat(1, group, 1, 1), values.repeat(1, group, 1, 1))

    model = Llama(config)
    model.load_state_dict(seeded_weights(config, c["seed"]))
    tokens = torch.tensor(c["tokens"])
    cache = DenseKVCache.for_model(config, batch=tokens.shape[0], capacity=tokens.shape[1])
    with torch.no_grad():
        return CachedDecoder(model.eval(), tiled)(tokens, cache).tolist()


def _compare_case(c: dict, g: dict, e: dict) -> Mismatch | None:
    from infra_lib.model.config import LlamaConfig

    where, config = _describe(c), LlamaConfig(**c["config"])
    if g["parameters"] != e["parameters"]:
        missing = sorted(set(e["parameters"]) - set(g["parameters"]))
        extra = sorted(set(g["parameters"]) - set(e["parameters"]))
        shapes = [
            f"{name} {g['parameters'][name]} instead of {shape}"
            for name, shape in e["parameters"].items()
            if g["parameters"].get(name, shape) != shape
        ]
        detail = "; ".join(
            part
            for part in (
                f"missing {missing[:4]}" if missing else "",
                f"not in the contract {extra[:4]}" if extra else "",
                f"shapes {shapes[:3]}" if shapes else "",
            )
            if part
        )
        return Mismatch("your Llama's parameters are not the contract's", f"on {where}: {detail}", hint=PARAMETERS_HINT)
    if not g["keeps_config"]:
        return Mismatch(
            "your Llama does not keep its config as self.config",
            f"on {where}: model.config is not the LlamaConfig passed in",
            hint="the engine reads the model's shape from model.config: keep the config object you were given.",
        )
    for key, name, weight in (
        ("norms", "layers[0].input_layernorm", "layers.0.input_layernorm.weight"),
        ("final_norm", "norm", "norm.weight"),
    ):
        problem = array_mismatch(g[key], e[key], f"your model's {name}(x) differs from RMSNorm", where, 1e-5, 1e-4)
        if problem:
            return Mismatch(problem.what, problem.detail, hint=_norm_mistake(c, config, g[key], weight))
    problem = array_mismatch(
        g["mlp"], e["mlp"], "your model's layers[-1].mlp(x) differs from SwiGLU", where, 1e-4, 1e-4
    )
    if problem:
        return Mismatch(
            problem.what,
            problem.detail,
            hint="SwiGLU gates one projection of x, through SiLU, by the other (gate_proj through SiLU, up_proj as it "
            "is), multiplies them elementwise and projects the product back with down_proj.",
        )
    problem = array_mismatch(g["rope"], e["rope"], "your model's rope(x, positions) differs", where, 1e-4, 1e-4)
    if problem:
        import torch

        _, _, q = _probes(c, config)
        mistakes = rotate_mistakes(course_rope(), q, torch.tensor(c["rope_positions"]), config.rope_theta)
        detail = f"{problem.detail}; positions {c['rope_positions'][0]} .. {c['rope_positions'][-1]}"
        return Mismatch(problem.what, detail, hint=mistake_hint(g["rope"], mistakes))
    for key, what in (
        ("logits", "your model's logits differ"),
        ("one_token", "your model's logits for a single token differ"),
    ):
        problem = array_mismatch(g[key], e[key], what, where, ATOL, RTOL)
        if problem:
            gqa = 1 < config.n_kv_heads < config.n_heads and key == "logits"
            if gqa and array_mismatch(g[key], _tiled_gqa_logits(c, config), "", "", ATOL, RTOL) is None:
                return Mismatch(problem.what, problem.detail, hint=GQA_HINT)
            return Mismatch(problem.what, problem.detail, hint=LOGITS_HINT)
    problem = array_mismatch(
        g["new_table"], e["new_table"], "your model's logits do not follow its embedding table", where, ATOL, RTOL
    )
    if problem:
        detail = f"{problem.detail} (after embed_tokens.weight was changed in place, last position)"
        return Mismatch(problem.what, detail, hint=TIED_HINT if c["config"].get("tie_embeddings", True) else "")
    return None


def _compare_tiny(got, expected, cases):
    for c, g, e in zip(cases, got, expected):
        problem = _compare_case(c, g, e)
        if problem:
            return problem
    return None


def llama_parts(make_inputs) -> dict:
    """The fields task 3's checks on small models share, with their own inputs."""
    return dict(
        task="lab06 task 3: Llama",
        reference=reference(LLAMA, "Llama"),
        make_inputs=make_inputs,
        drive=_drive_tiny,
        compare=_compare_tiny,
    )


register(
    Check(
        check_id="lab06.llama_tiny",
        hint="the decoder of the contract: embedding, then per layer RMSNorm, causal grouped-query attention with RoPE "
        "on queries and keys, a residual add, RMSNorm, SwiGLU, a residual add; then the final norm and the output "
        "projection (chapter 06, section “1 · The model on the table”).",
        **llama_parts(_tiny_cases),
    )
)

register(
    Check(
        check_id="lab06.llama_configs",
        hint="other shapes of the same architecture: one KV head per query head (multi-head), one KV head for all "
        "(multi-query), a large rms_norm_eps, another rope_theta, untied embeddings (lm_head its own table), a "
        "single token. Read every size from the config.",
        **llama_parts(_config_cases),
    )
)


# --- SmolLM2 ---------------------------------------------------------------------------------------

_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?",
]
NEW_TOKENS = 6


def _smollm2_case(rng: random.Random) -> dict:
    from infra_lib.model.loaders import load_default

    question = rng.choice(_QUESTIONS)
    prompt = load_default().tokenizer.encode_chat([{"role": "user", "content": question}])
    return {"question": question, "prompt": prompt, "config": smollm2_config()}


def _drive_smollm2(Llama, case):
    """Logits at every prompt position, then greedy tokens, each step the whole sequence again (no cache)."""
    import torch

    model = smollm2_model(Llama, case["config"])
    sequence = list(case["prompt"])
    with torch.inference_mode():
        logits = model(torch.tensor([sequence]))[0]
        record = {"logits": logits[:, :: max(1, logits.shape[-1] // 512)].tolist()}  # 512 entries spread over the table
        for _ in range(NEW_TOKENS):
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
    record["tokens"] = sequence[len(case["prompt"]) :]
    return record


def _compare_smollm2(got, expected, case):
    where = f"SmolLM2-135M-Instruct, the question {case['question']!r} ({len(case['prompt'])} prompt tokens)"
    problem = array_mismatch(
        got["logits"], expected["logits"], "your model's logits on SmolLM2's weights differ", where, ATOL, RTOL
    )
    if problem:
        return problem
    if got["tokens"] != expected["tokens"]:
        return Mismatch(
            "your model's greedy tokens on SmolLM2 differ",
            f"on {where}: {token_difference(got['tokens'], expected['tokens'])}",
        )
    return None


register(
    Check(
        check_id="lab06.llama_smollm2",
        task="lab06 task 3: Llama",
        reference=reference(LLAMA, "Llama"),
        make_inputs=_smollm2_case,
        drive=_drive_smollm2,
        compare=_compare_smollm2,
        hint="SmolLM2's weights load into your class with load_state_dict(..., strict=True) and must give the course's "
        "logits: if the small models pass and this fails, look at what they do not exercise: 30 layers, 9 query heads "
        "over 3 KV heads, head_dim 64, rope_theta 100000, and logits of the order of 40.",
    )
)
