"""Offline throughput of SmolLM2-135M-Instruct: continuous batching against static batching (with and
without padding) and sequential ``transformers`` generation on the same weights, against this
machine's compute bound, all measured in one run.

A backlog of prompts with seeded lengths (random token ids; every request produces exactly its
drawn number of tokens, no stop token) is served three ways:

* **continuous batching**: ``LLM.generate`` on every prompt at once; at most ``B`` sequences run,
  and a finished sequence's place goes to the next waiting prompt in the very next step. The
  engine's steps (decodes and prefill chunks, up to 512 tokens) run as one call into C each
  (``infra_lib.serving.native_runner.NativeModelRunner``, the same fp32 weights packed in panels),
  any larger ones in PyTorch on the model's decode layout (``infra_lib.model.decode_layout``: the
  same fp32 weights, fused and packed for oneDNN's product). Once more at ``B``, every step in
  PyTorch on the decode layout, and once on the model as loaded (one ``nn.Linear`` product per
  projection): each lever's effect, side by side. Once more with the C step reading the GGUF file's
  own Q4_1 blocks (and its Q8_0 head) instead of fp32 weights. Where the C step cannot be built, the
  first row runs in PyTorch too, the Q4_1 row is left out, and the JSON says why;
* **static batching**: the prompts cut once into batches of ``B`` in order; each batch runs on
  the same engine and layout (``max_num_seqs=B``) until its longest member finishes, and nothing joins a
  batch while it runs. Finished sequences drop out of the batch rather than being padded, so
  this baseline is kinder than a padded static batch: it loses only the empty rows;
* **padded static batching**: the classic static baseline, in ``transformers``: each batch of ``B``
  prompts is left-padded to its longest prompt and runs in one ``generate`` call until its longest
  output is done; every row is computed at every step, finished or not, and each request keeps
  only its own drawn number of tokens;
* **sequential transformers**: ``LlamaForCausalLM.generate`` one prompt at a time (batch 1).

A sweep then serves the backlog with continuous batching at each batch limit and token budget, and
runs the padded static baseline at the same batch limit right after each limit's rows: continuous
batching against the classic baseline at equal limits, each pair measured minutes apart at most.

Throughput is output tokens per second of wall time. The bound: all the work is about
2 × parameters FLOPs per computed token (every prompt token and every output token but the
last), and no run can be faster than that work at this machine's measured GEMM peak, so
``roofline_tokens_per_s`` is an upper bound on output tokens per second (attention is left out:
it is small at these lengths).

Usage:
    python benchmarks/offline_throughput.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch
from benchmark_cli import benchmark_main, load_average
from decode import _transformers_model

from infra_lib.hardware.probes import machine_info, measure_peak_gemm_flops
from infra_lib.model import SamplingParams, load_default
from infra_lib.model.decode_layout import decode_layout
from infra_lib.model.loaders import default_gguf_path
from infra_lib.model.native_decode import native_decode_available
from infra_lib.model.quant import load_gguf_q4_1
from infra_lib.serving import LLM, LLMEngine, PagedKVStore, SchedulerConfig
from infra_lib.serving.native_runner import NativeModelRunner

SEED = 0


def plan(quick: bool) -> dict:
    """Backlog size, length ranges (inclusive), the batch limit B, and the sweep's limits."""
    if quick:
        return {
            "num_prompts": 4,
            "prompt_len": [8, 24],
            "output_len": [2, 6],
            "batch": 3,
            "sweep_batches": [2, 4],
            "sweep_budgets": [32],
        }
    return {
        "num_prompts": 64,
        "prompt_len": [16, 128],
        "output_len": [8, 96],
        "batch": 8,
        "sweep_batches": [4, 8, 16, 32, 64],
        "sweep_budgets": [256, 512],
    }


def make_backlog(num_prompts: int, prompt_len, output_len, vocab_size: int, seed: int = SEED):
    """Seeded prompts (token ids) and output lengths."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_prompts):
        prompts.append([rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_len))])
        outputs.append(rng.randint(*output_len))
    return prompts, outputs


def _config(batch: int, prompts, outputs) -> SchedulerConfig:
    longest = max(len(p) + n for p, n in zip(prompts, outputs))
    blocks = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, outputs)) + 16  # never preempts
    return SchedulerConfig(
        max_num_seqs=batch, max_num_batched_tokens=max(512, longest), block_size=16, num_blocks=blocks
    )


def _row(seconds: float, tokens: int, token_ids: list[list[int]], steps: int | None = None) -> dict:
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "steps": steps,
        "output_token_counts": [len(t) for t in token_ids],
    }


def timed_generate(llm: LLM, prompts, params) -> tuple[dict, list]:
    """Serve the whole backlog with ``llm``: its row (wall time, tokens, steps) and its outputs."""
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return _row(seconds, sum(len(o.token_ids) for o in out), [o.token_ids for o in out], len(llm.engine.steps)), out


def engine_llm(model, fast, tokenizer, config: SchedulerConfig, native: bool, weights: str = "fp32") -> LLM:
    """The benchmark's engine: steps of up to 512 tokens in C (``native``, in format ``weights``) and any
    larger in PyTorch on ``fast`` (the decode layout); without ``native``, every step in PyTorch on ``fast``."""
    if not native:
        return LLM(fast, tokenizer, config)
    store = PagedKVStore.for_model(model.config, config.num_blocks, config.block_size)
    return LLM(engine=LLMEngine(NativeModelRunner(model, store, weights, fallback=fast), config, tokenizer))


def sweep(engine, tokenizer, prompts, outputs, batches, budgets) -> list[dict]:
    """Continuous batching on the same backlog at each ``max_num_seqs`` in ``batches`` and token budget
    (``max_num_batched_tokens``) in ``budgets``: output tokens/s, steps and preemptions of each.
    ``engine(config)`` builds the ``LLM`` for one configuration."""
    params = [SamplingParams(max_new_tokens=n, stop_ids=()) for n in outputs]
    rows = []
    for batch in batches:
        for budget in budgets:
            config = _config(batch, prompts, outputs)
            config = SchedulerConfig(
                max_num_seqs=batch,
                max_num_batched_tokens=budget,
                block_size=config.block_size,
                num_blocks=config.num_blocks,
            )
            llm = engine(config)
            start = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in out)
            rows.append(
                {
                    "max_num_seqs": batch,
                    "max_num_batched_tokens": budget,
                    "seconds": seconds,
                    "output_tokens": tokens,
                    "tokens_per_s": tokens / seconds,
                    "steps": len(llm.engine.steps),
                    "preemptions": sum(len(step.output.preempted) for step in llm.engine.steps),
                }
            )
    return rows


def _padded_static(hf, prompts, outputs, batch: int, pad_id: int) -> dict:
    """The classic static batch: left-padded prompts, one ``generate`` per batch until its longest
    output is done, every row computed at every step; each request keeps its drawn number of tokens."""
    kept, computed_rows = [], 0
    with torch.inference_mode():
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            group, wants = prompts[i : i + batch], outputs[i : i + batch]
            width, steps = max(len(p) for p in group), max(wants)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=pad_id,
            )
            kept += [row[width : width + n].tolist() for row, n in zip(out, wants)]
            computed_rows += len(group) * steps
        seconds = time.perf_counter() - start
    row = _row(seconds, sum(len(t) for t in kept), kept, len(range(0, len(prompts), batch)))
    row["computed_output_slots"] = computed_rows  # what the padded batches computed, used or not
    return row


def run_offline_throughput(device: torch.device, quick: bool, loaded=None) -> dict:
    """Run the three engines and the bound; ``loaded`` reuses a model from ``load_default()``."""
    if device.type != "cpu":
        raise SystemExit("this benchmark measures the CPU (the serving engine runs on CPU here); pass --device cpu")
    torch.manual_seed(SEED)
    load_before = load_average()
    loaded = loaded if loaded is not None else load_default()
    model, tokenizer = loaded.model, loaded.tokenizer
    fast = decode_layout(model)  # the same fp32 weights, fused and packed once, at load time
    settings = plan(quick)
    batch = settings["batch"]
    prompts, outputs = make_backlog(
        settings["num_prompts"], settings["prompt_len"], settings["output_len"], model.config.vocab_size
    )
    params = [SamplingParams(max_new_tokens=n, stop_ids=()) for n in outputs]
    config = _config(batch, prompts, outputs)
    expected_tokens = sum(outputs)
    native, native_reason = native_decode_available()

    def engine(engine_config: SchedulerConfig) -> LLM:
        return engine_llm(model, fast, tokenizer, engine_config, native)

    # Warm-up: one small request through each engine, so first-call costs land in no measurement.
    for llm in (engine(config), LLM(fast, tokenizer, config), LLM(model, tokenizer, config)):
        llm.generate(prompts[:1], SamplingParams(max_new_tokens=2, stop_ids=()), use_tqdm=False)

    llm = engine(config)
    continuous, continuous_out = timed_generate(llm, prompts, params)
    runner = llm.engine.runner
    q4_1 = None
    if native and Path(loaded.source) == default_gguf_path():  # the same engine, its C step on the file's Q4_1 blocks
        # (a step over 512 tokens, a long prefill, runs in PyTorch on the fp32 decode layout: the same values)
        q4_1_llm = engine_llm(load_gguf_q4_1(loaded.source).model, fast, tokenizer, config, True, "q4_1")
        q4_1_llm.generate(prompts[:1], SamplingParams(max_new_tokens=2, stop_ids=()), use_tqdm=False)
        q4_1, q4_1_out = timed_generate(q4_1_llm, prompts, params)
    native_steps = {
        "native_steps": getattr(runner, "native_steps", 0),
        "fallback_steps": getattr(runner, "fallback_steps", len(llm.engine.steps)),
        "max_tokens": getattr(runner, "max_tokens", None),
    }

    torch_step, torch_out = timed_generate(LLM(fast, tokenizer, config), prompts, params)
    as_loaded, loaded_out = timed_generate(LLM(model, tokenizer, config), prompts, params)

    static_llm = engine(config)
    static_out, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        static_out += static_llm.generate(prompts[i : i + batch], params[i : i + batch], use_tqdm=False)
    static = _row(
        time.perf_counter() - start,
        sum(len(o.token_ids) for o in static_out),
        [o.token_ids for o in static_out],
        len(static_llm.engine.steps),
    )

    hf = _transformers_model(model)
    hf_tokens = []
    with torch.inference_mode():
        warm = torch.tensor([prompts[0]])
        hf.generate(
            warm,
            attention_mask=torch.ones_like(warm),
            max_new_tokens=2,
            min_new_tokens=2,
            do_sample=False,
            pad_token_id=tokenizer.eos_id,
        )
        start = time.perf_counter()
        for prompt, n in zip(prompts, outputs):
            ids = torch.tensor([prompt])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tokenizer.eos_id,
            )
            hf_tokens.append(out[0, len(prompt) :].tolist())
        seconds = time.perf_counter() - start
    sequential = _row(seconds, sum(len(t) for t in hf_tokens), hf_tokens)
    padded = _padded_static(hf, prompts, outputs, batch, tokenizer.eos_id)
    curve, padded_curve = [], []
    for sweep_batch in settings["sweep_batches"]:
        # Each batch limit's continuous rows, then the padded static baseline at the same limit right after
        # them, so that a busy minute slows both sides of that batch's ratio.
        rows = sweep(engine, tokenizer, prompts, outputs, [sweep_batch], settings["sweep_budgets"])
        baseline = _padded_static(hf, prompts, outputs, sweep_batch, tokenizer.eos_id)
        best = max(row["tokens_per_s"] for row in rows)
        curve += rows
        padded_curve.append(
            {
                "batch": sweep_batch,
                "padded_static_tokens_per_s": baseline["tokens_per_s"],
                "padded_static_output_tokens": baseline["output_tokens"],
                "computed_output_slots": baseline["computed_output_slots"],
                # the most continuous batching could gain by skipping the padded rows alone,
                # were a row as cheap to compute in both engines
                "computed_over_kept_slots": baseline["computed_output_slots"] / expected_tokens,
                "continuous_best_tokens_per_s": best,
                "continuous_over_padded_static": best / baseline["tokens_per_s"],
            }
        )

    parameters = model.config.parameter_count()
    computed_tokens = sum(len(p) + n - 1 for p, n in zip(prompts, outputs))  # the last token is never fed back
    flops = 2 * parameters * computed_tokens
    peak = measure_peak_gemm_flops(
        device, sizes=(512, 1024) if quick else (512, 1024, 1536, 2048), iters=3 if quick else 5
    )
    bound_s = flops / (peak["peak_gflops"] * 1e9)
    bound_tokens_per_s = expected_tokens / bound_s
    engines = {
        "continuous batching": continuous,
        **({"continuous batching, Q4_1 C step": q4_1} if q4_1 else {}),
        "continuous batching, PyTorch step": torch_step,
        "continuous batching, model as loaded": as_loaded,
        "static batching": static,
        "padded static batching": padded,
        "sequential transformers": sequential,
    }
    for row in engines.values():
        row["fraction_of_roofline"] = row["tokens_per_s"] / bound_tokens_per_s
    same_as_transformers = sum(a.token_ids == b for a, b in zip(continuous_out, hf_tokens))
    return {
        "benchmark": "offline_throughput",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
        "seed": SEED,
        "flags": {
            "quick": quick,
            "device": str(device),
            "dtype": "float32",
            **settings,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "block_size": config.block_size,
            "num_blocks": config.num_blocks,
            "prompts": "random token ids, seeded lengths",
            "stop": "none: every request produces exactly its drawn output length",
        },
        "notes": [
            "padded static batching: transformers' generate on each batch of `batch` prompts, left-padded "
            "to the longest, until the longest output is done; every row computed at every step; each "
            "request keeps its own drawn number of tokens",
            "static batching: batches of `batch` prompts formed once, in order; each runs on the same engine "
            "with max_num_seqs=batch until its longest member finishes and nothing joins it; finished "
            "sequences drop out of the batch rather than being padded (a padded batch would be slower still)",
            "continuous batching, static batching and the sweep run steps of up to 512 tokens in C "
            "(NativeModelRunner, the same fp32 weights packed in panels) and larger steps in PyTorch on the "
            "decode layout (the same fp32 weights fused and packed for oneDNN); 'continuous batching, "
            "PyTorch step' runs every step on the decode layout, 'continuous batching, model as loaded' on "
            "the model's own nn.Linear products, both at the same batch limit; 'continuous batching, Q4_1 C "
            "step' runs the C step on the GGUF file's Q4_1 blocks and Q8_0 head (activations rounded to int8 "
            "per block of 32, so a near tie may pick another token than fp32's)",
            "roofline: 2 x parameters FLOPs per computed token (prompt tokens + output tokens - 1 per request) "
            "at the measured GEMM peak; attention FLOPs left out: a lower bound on time",
        ],
        "model": {"source": loaded.source, "parameters": parameters},
        "workload": {
            "prompt_tokens": [len(p) for p in prompts],
            "output_tokens": outputs,
            "total_prompt_tokens": sum(len(p) for p in prompts),
            "total_output_tokens": expected_tokens,
            "computed_tokens": computed_tokens,
        },
        "peak_gemm": {k: peak[k] for k in ("peak_gflops", "best_n", "dtype", "torch_threads")},
        "roofline": {"flops": flops, "seconds_lower_bound": bound_s, "tokens_per_s_upper_bound": bound_tokens_per_s},
        "engines": engines,
        "sweep": curve,
        "padded_sweep": padded_curve,
        "native_step": {"available": native, "reason": native_reason, "weights": "fp32", **native_steps},
        "continuous_over_static": continuous["tokens_per_s"] / static["tokens_per_s"],
        "native_step_over_pytorch_step": continuous["tokens_per_s"] / torch_step["tokens_per_s"],
        "q4_1_over_fp32_native_step": q4_1["tokens_per_s"] / continuous["tokens_per_s"] if q4_1 else None,
        "requests_same_tokens_q4_1_and_fp32": sum(a.token_ids == b.token_ids for a, b in zip(continuous_out, q4_1_out))
        if q4_1
        else None,
        "requests_same_tokens_native_and_pytorch_step": sum(
            a.token_ids == b.token_ids for a, b in zip(continuous_out, torch_out)
        ),
        "decode_layout_over_model_as_loaded": torch_step["tokens_per_s"] / as_loaded["tokens_per_s"],
        "requests_same_tokens_in_both_layouts": sum(a.token_ids == b.token_ids for a, b in zip(torch_out, loaded_out)),
        "continuous_over_padded_static": continuous["tokens_per_s"] / padded["tokens_per_s"],
        "continuous_over_sequential": continuous["tokens_per_s"] / sequential["tokens_per_s"],
        "requests_same_greedy_tokens_as_transformers": same_as_transformers,
    }


def format_table(result: dict) -> str:
    flags, work, bound = result["flags"], result["workload"], result["roofline"]
    lines = [
        f"SmolLM2-135M-Instruct fp32, {flags['num_prompts']} prompts ({work['total_prompt_tokens']} prompt tokens, "
        f"{work['total_output_tokens']} output tokens), batch limit {flags['batch']}",
        f"compute bound: {bound['flops'] / 1e12:.2f} TFLOP at {result['peak_gemm']['peak_gflops']:.0f} GFLOP/s -> "
        f">= {bound['seconds_lower_bound']:.2f} s, <= {bound['tokens_per_s_upper_bound']:.0f} output tokens/s",
        f"{'engine':37s} {'seconds':>8s} {'tokens/s':>9s} {'of bound':>9s}",
    ]
    for name, row in result["engines"].items():
        lines.append(f"{name:37s} {row['seconds']:8.2f} {row['tokens_per_s']:9.1f} {row['fraction_of_roofline']:9.1%}")
    lines.append(f"{'max_num_seqs':>12s} {'token budget':>12s} {'tokens/s':>9s} {'steps':>6s} {'preempted':>9s}")
    for row in result["sweep"]:
        lines.append(
            f"{row['max_num_seqs']:12d} {row['max_num_batched_tokens']:12d} {row['tokens_per_s']:9.1f} "
            f"{row['steps']:6d} {row['preemptions']:9d}"
        )
    lines.append(
        f"{'batch limit':>12s} {'padded static':>14s} {'continuous (best budget)':>25s} {'ratio':>6s} "
        f"{'padded slots / kept':>20s}"
    )
    for row in result["padded_sweep"]:
        lines.append(
            f"{row['batch']:12d} {row['padded_static_tokens_per_s']:14.1f} "
            f"{row['continuous_best_tokens_per_s']:25.1f} {row['continuous_over_padded_static']:5.2f}x "
            f"{row['computed_over_kept_slots']:19.2f}x"
        )
    step = result["native_step"]
    lines.append(
        f"engine steps in C: {step['native_steps']}, in PyTorch: {step['fallback_steps']}"
        + ("" if step["available"] else f" (the C step is unavailable here: {step['reason'].splitlines()[0]})")
    )
    lines.append(
        f"C step / PyTorch step {result['native_step_over_pytorch_step']:.2f}x (same tokens: "
        f"{result['requests_same_tokens_native_and_pytorch_step']}/{flags['num_prompts']} requests)"
    )
    if result["q4_1_over_fp32_native_step"] is not None:
        lines.append(
            f"C step on the file's Q4_1 blocks / on fp32 weights {result['q4_1_over_fp32_native_step']:.2f}x "
            f"(same tokens: {result['requests_same_tokens_q4_1_and_fp32']}/{flags['num_prompts']} requests)"
        )
    lines.append(
        f"continuous / static {result['continuous_over_static']:.2f}x; continuous / padded static "
        f"{result['continuous_over_padded_static']:.2f}x; continuous / sequential "
        f"{result['continuous_over_sequential']:.2f}x; decode layout / model as loaded "
        f"{result['decode_layout_over_model_as_loaded']:.2f}x (same tokens: "
        f"{result['requests_same_tokens_in_both_layouts']}/{flags['num_prompts']} requests)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "offline_throughput", run_offline_throughput, format_table)


if __name__ == "__main__":
    sys.exit(main())
