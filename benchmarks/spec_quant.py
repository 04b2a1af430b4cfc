"""Speculative decoding and weight-only quantisation of SmolLM2-135M-Instruct, each against its
baseline measured in the same run.

Speculative decoding (greedy, so every variant must produce plain decoding's tokens exactly):
for each prompt, draft and γ, the decode time (prefill excluded, best of a few runs) against ``plain_decode`` on the
same prompt, the per-position acceptance rate a (accepted / checked draft tokens), tokens per
target pass, the measured cost ratio
c = (draft seconds per proposed token) / (target seconds per pass), and the predicted speedup
E / (γc + 1) with E = (1 - a^(γ+1)) / (1 - a).

Quantisation: fp32 (the baseline), group-wise symmetric int8 (group 64) and int4 (group 32) of the
decoder's linear weights, and the GGUF file's own Q4_1 blocks kept as stored: weight memory,
perplexity on held-out prose that ships with Python, and greedy decode tokens per second.

Usage:
    python benchmarks/spec_quant.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import time

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info
from infra_lib.model import SamplingParams, greedy_decode, load_default
from infra_lib.model.quant import heldout_text, load_gguf_q4_1, perplexity, quantize_model, weight_bytes
from infra_lib.serving.speculative import (
    LayerSkipDraft,
    NgramDraft,
    plain_decode,
    predicted_speedup,
    speculative_decode,
)

SEED = 0
PROMPTS = {
    "repeats its input": "Copy this list exactly, one item per line: apples, pears, plums, cherries, grapes, "
    "lemons, limes, melons.",
    "free answer": "Explain in two sentences why the sky is blue.",
}


def plan(quick: bool) -> dict:
    if quick:  # warmup_tokens 0: no untimed decode before each variant's timed one (CI sizes, not timings)
        return {
            "prompts": ["repeats its input"],
            "max_new_tokens": 12,
            "gammas": [2],
            "layer_skip": [28],
            "ppl_tokens": 64,
            "speed_tokens": 4,
            "repeats": 1,
            "warmup_tokens": 0,
        }
    return {
        "prompts": list(PROMPTS),
        "max_new_tokens": 64,
        "gammas": [1, 2, 4, 6],
        "layer_skip": [20, 26, 29],
        "ppl_tokens": 2048,
        "speed_tokens": 32,
        "repeats": 3,
    }


def fastest(run, repeats: int):
    """The run with the shortest decode time of ``repeats`` (timings on a shared machine are noisy)."""
    return min((run() for _ in range(repeats)), key=lambda r: r.decode_seconds)


def run_speculative(model, tokenizer, p: dict) -> list[dict]:
    rows = []
    params = SamplingParams(max_new_tokens=p["max_new_tokens"])
    for label in p["prompts"]:
        ids = tokenizer.encode_chat([{"role": "user", "content": PROMPTS[label]}])
        base = fastest(lambda: plain_decode(model, ids, params, (tokenizer.eos_id,)), p["repeats"])
        base_s = base.decode_seconds
        drafts = [NgramDraft(model.config.vocab_size)] + [LayerSkipDraft(model, k) for k in p["layer_skip"]]
        for draft in drafts:
            for gamma in p["gammas"]:
                r = fastest(
                    lambda: speculative_decode(model, ids, draft, gamma, params, (tokenizer.eos_id,)), p["repeats"]
                )
                per_pass = r.target_seconds / r.target_passes
                c = (r.draft_seconds / r.proposed) / per_pass if r.proposed else 0.0
                a = r.position_acceptance_rate if r.proposed else 0.0
                rows.append(
                    {
                        "prompt": label,
                        "draft": draft.name,
                        "gamma": gamma,
                        "tokens": len(r.token_ids),
                        "same_as_plain": r.token_ids == base.token_ids,
                        "acceptance_rate": r.acceptance_rate,
                        "position_acceptance_rate": a,
                        "tokens_per_target_pass": r.tokens_per_target_pass,
                        "cost_ratio_c": c,
                        "plain_decode_s": base_s,
                        "speculative_decode_s": r.decode_seconds,
                        "measured_speedup": base_s / r.decode_seconds * len(r.token_ids) / len(base.token_ids),
                        "predicted_speedup": predicted_speedup(a, gamma, c),
                    }
                )
    return rows


def run_quantisation(model, tokenizer, p: dict) -> list[dict]:
    ids = tokenizer.encode(heldout_text())[: p["ppl_tokens"]]
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    variants = {
        "fp32": model,
        "int8 g64": quantize_model(model, 8, 64),
        "int4 g32": quantize_model(model, 4, 32),
        "GGUF Q4_1 (as stored)": load_gguf_q4_1().model,
    }
    warmup_tokens = p.get("warmup_tokens", 2)
    rows, reference = [], None
    for name, variant in variants.items():
        if warmup_tokens:
            greedy_decode(variant, prompt, warmup_tokens)  # warm-up
        start = time.perf_counter()
        out = greedy_decode(variant, prompt, p["speed_tokens"])
        seconds = time.perf_counter() - start
        reference = out if reference is None else reference  # fp32 comes first: its tokens are the reference
        rows.append(
            {
                "variant": name,
                "weight_mb": weight_bytes(variant) / 1e6,
                "perplexity": perplexity(variant, ids, 512),
                "decode_tokens_per_s": len(out) / seconds,
                "greedy_same_as_fp32": out == reference,
            }
        )
    base = rows[0]
    for row in rows:
        row["memory_vs_fp32"] = row["weight_mb"] / base["weight_mb"]
        row["speed_vs_fp32"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row["perplexity_vs_fp32"] = row["perplexity"] / base["perplexity"]
    return rows


def run_spec_quant(device: torch.device, quick: bool) -> dict:
    torch.manual_seed(SEED)
    p = plan(quick)
    load_before = load_average()
    loaded = load_default()
    return {
        "benchmark": "spec_quant",
        "seed": SEED,
        "plan": p,
        "flags": {"quick": quick, "device": "cpu", "dtype": "float32", "sampling": "greedy"},
        "speculative": run_speculative(loaded.model, loaded.tokenizer, p),
        "quantisation": run_quantisation(loaded.model, loaded.tokenizer, p),
        "note": "the model runs on the CPU (the chapter's measurements); --device is recorded only",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
    }


def format_table(result: dict) -> str:
    lines = [
        f"{'prompt':<18} {'draft':<18} {'γ':>2} {'same':>4} {'accept':>6} {'tok/pass':>8} {'c':>5} "
        f"{'speedup':>7} {'predicted':>9}"
    ]
    for r in result["speculative"]:
        lines.append(
            f"{r['prompt']:<18} {r['draft']:<18} {r['gamma']:>2} {'yes' if r['same_as_plain'] else 'NO':>4} "
            f"{r['position_acceptance_rate']:>6.2f} {r['tokens_per_target_pass']:>8.2f} {r['cost_ratio_c']:>5.2f} "
            f"{r['measured_speedup']:>7.2f} {r['predicted_speedup']:>9.2f}"
        )
    lines.append("")
    lines.append(f"{'variant':<22} {'MB':>7} {'ppl':>7} {'tok/s':>6} {'mem':>5} {'speed':>6} {'same':>4}")
    for r in result["quantisation"]:
        lines.append(
            f"{r['variant']:<22} {r['weight_mb']:>7.1f} {r['perplexity']:>7.2f} "
            f"{r['decode_tokens_per_s']:>6.1f} {r['memory_vs_fp32']:>5.2f} {r['speed_vs_fp32']:>6.2f} "
            f"{'yes' if r['greedy_same_as_fp32'] else 'no':>4}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "spec_quant", run_spec_quant, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
