"""Batch-1 decode speed of SmolLM2-135M-Instruct: infra_lib's model with its KV cache, the same
model recomputing without a cache, and transformers' ``generate`` on the same weights, against
this machine's memory-bandwidth bound, all measured in one run.

Decode rate is measured as a difference, the same way for every engine: the time to generate
N tokens minus the time to generate 1 (the prefill and the first token), divided by N - 1.
The bound assumes every decode step reads every weight once from main memory:
tokens/s <= bandwidth / weight bytes.

Usage:
    python benchmarks/decode.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import os
import sys

import torch

from benchmark_cli import benchmark_main, load_average
from infra_lib.hardware.probes import machine_info, measure_memory_bandwidth
from infra_lib.model import SamplingParams, generate, load_default
from infra_lib.timing import time_op

SEED = 0
PROMPT = "What is Python?"


def _decode_rate(generate_n, new_tokens: int, iters: int, warmup: int = 1) -> dict:
    """Seconds for 1 and for ``new_tokens`` tokens (median of ``iters``, after ``warmup`` untimed
    calls each), and the decode rate."""
    one = time_op(lambda: generate_n(1), warmup=warmup, iters=iters)
    many = time_op(lambda: generate_n(new_tokens), warmup=warmup, iters=iters)
    return {"first_token_s": one, "total_s": many, "new_tokens": new_tokens,
            "decode_tokens_per_s": (new_tokens - 1) / (many - one)}


def _transformers_model(model):
    """transformers' LlamaForCausalLM holding exactly our weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    fields = {k: v for k, v in model.config.to_hf_dict().items() if k not in ("architectures", "model_type")}
    with no_init_weights():  # no random weights drawn (seconds on a CPU): every one is loaded just below
        hf = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    hf.tie_weights()  # as the plain constructor ties them (SmolLM2's head is its embedding table)
    hf.load_state_dict({(k if k == "lm_head.weight" else "model." + k): v for k, v in model.state_dict().items()})
    return hf


def run_decode(device: torch.device, quick: bool) -> dict:
    if device.type != "cpu":
        raise SystemExit("this benchmark measures the CPU (the model runs on CPU in chapter 06); pass --device cpu")
    torch.manual_seed(SEED)
    load_before = load_average()
    loaded = load_default()
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    # --quick: no warm-up calls of their own; the token comparison just below has already run each
    # engine's model once (first-call costs paid) before any timing starts.
    new_tokens, iters, warmup = (8, 1, 0) if quick else (64, 3, 1)
    never_stop = dict(stop_ids=(), temperature=0.0)

    def ours(n, use_cache=True):
        return generate(model, tokenizer, prompt, SamplingParams(max_new_tokens=n, **never_stop), use_cache=use_cache)

    hf = _transformers_model(model)
    ids = torch.tensor([prompt])

    def theirs(n):
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=tokenizer.eos_id)

    same_tokens = ours(new_tokens).token_ids == theirs(new_tokens)[0, len(prompt):].tolist()
    engines = {
        "infra_lib, KV cache": _decode_rate(ours, new_tokens, iters, warmup),
        "infra_lib, no cache": _decode_rate(lambda n: ours(n, use_cache=False), new_tokens, iters, warmup),
        "transformers generate": _decode_rate(theirs, new_tokens, iters, warmup),
    }
    bandwidth = measure_memory_bandwidth(64 if quick else 256, iters=3 if quick else 5, quick=quick)
    weight_bytes = model.weight_bytes()
    bound = bandwidth["bandwidth_gbps"] * 1e9 / weight_bytes
    for row in engines.values():
        row["fraction_of_bound"] = row["decode_tokens_per_s"] / bound
    cached, uncached = engines["infra_lib, KV cache"], engines["infra_lib, no cache"]
    return {
        "benchmark": "decode",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
        "seed": SEED,
        "flags": {"quick": quick, "device": str(device), "dtype": "float32", "batch": 1, "prompt": PROMPT,
                  "prompt_tokens": len(prompt), "new_tokens": new_tokens, "iters": iters},
        "model": {"source": loaded.source, "parameters": model.config.parameter_count(), "weight_bytes": weight_bytes},
        "bandwidth": bandwidth,
        "bandwidth_bound_tokens_per_s": bound,
        "engines": engines,
        "kv_cache_speedup": cached["decode_tokens_per_s"] / uncached["decode_tokens_per_s"],
        "ours_over_transformers": cached["decode_tokens_per_s"] / engines["transformers generate"]["decode_tokens_per_s"],
        "same_greedy_tokens_as_transformers": same_tokens,
    }


def format_table(result: dict) -> str:
    flags = result["flags"]
    lines = [
        f"SmolLM2-135M-Instruct fp32, batch 1, {flags['prompt_tokens']}-token prompt, {flags['new_tokens']} new tokens",
        f"memory bandwidth {result['bandwidth']['bandwidth_gbps']:.1f} GB/s, weights "
        f"{result['model']['weight_bytes'] / 1e6:.0f} MB -> bound {result['bandwidth_bound_tokens_per_s']:.1f} tokens/s",
        f"{'engine':24s} {'tokens/s':>9s} {'of bound':>9s} {'first token':>12s}",
    ]
    for name, row in result["engines"].items():
        lines.append(f"{name:24s} {row['decode_tokens_per_s']:9.1f} {row['fraction_of_bound']:9.0%} "
                     f"{row['first_token_s'] * 1000:10.0f} ms")
    lines.append(f"KV cache speedup {result['kv_cache_speedup']:.1f}x; ours / transformers "
                 f"{result['ours_over_transformers']:.2f}; same greedy tokens: {result['same_greedy_tokens_as_transformers']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "decode", run_decode, format_table)


if __name__ == "__main__":
    sys.exit(main())
