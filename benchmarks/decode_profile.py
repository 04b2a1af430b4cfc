"""Where a decode step's time goes: SmolLM2-135M-Instruct at batch 1 (``generate``'s loop over a dense
KV cache) and a batch-32 step of the serving engine (paged KV, every sequence decoding), each split by
the profiler into GEMM/GEMV, attention, sampling, host syncs, other ops and the Python between them.

How the split is made: every step runs inside a profiler annotation; the ops called directly from
Python inside it (the top-level ops) are put in one category each by name, attention and sampling by
the annotation the benchmark wraps around them. An op's time includes the ops it calls. The Python
overhead is what the step's wall time, measured without the profiler in the same run, leaves once the
ops' time is taken out; the profiler's own cost per op inflates the op times a little, so that figure
is a lower bound.

The C decode steps (``infra_lib.model.native_decode``, fp32 and the GGUF file's Q4_1 blocks) and
llama.cpp on the same file are split another way, since no profiler sees inside them: the C step's
phases come from a build of it with timing marks (``-DINFRA_PROFILE``: thread 0's wall time between
marks, by phase), llama.cpp's time in ``llama_decode`` from its own counters; what the greedy loop
around each takes beyond that (Python, sampling, the call) is the rest of its wall time per token.
Beside them, the time streaming each step's weight bytes takes at the bandwidth the probe measures.

Usage:
    python benchmarks/decode_profile.py [--quick] [--device cpu] [--out PATH]
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch
from benchmark_cli import benchmark_main, load_average
from decode import decode_rate, gguf_bytes_per_step, run_llama_cpp
from torch.profiler import ProfilerActivity, profile, record_function

from infra_lib.hardware.probes import machine_info, measure_memory_bandwidth
from infra_lib.model import DenseKVCache, SamplingParams, load_default
from infra_lib.model.attention import cached_attention
from infra_lib.model.loaders import default_gguf_path
from infra_lib.model.native_decode import NativeDecoder, native_decode_available, native_library, step_profile
from infra_lib.model.quant import load_gguf_q4_1
from infra_lib.model.sampling import sample
from infra_lib.serving.engine import LLMEngine
from infra_lib.serving.scheduler_output import SchedulerConfig

SEED = 0
PROMPT = "What is Python?"
CATEGORIES = ("GEMM/GEMV", "attention", "sampling", "host sync", "other ops", "Python overhead")
GEMM_OPS = {"aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::addmv", "aten::mv"}
SYNC_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::cpu", "aten::tolist"}
STEP, ATTENTION, SAMPLING, FORWARD = "decode step", "attention", "sampling", "model forward"


def category(name: str, annotation: str | None) -> str:
    """The category of a top-level op (``annotation``: the innermost benchmark annotation around it)."""
    if annotation in (ATTENTION, SAMPLING):  # the categories share the annotations' names
        return annotation
    if name in GEMM_OPS:
        return "GEMM/GEMV"
    if name in SYNC_OPS:
        return "host sync"
    return "other ops"


def split_profile(prof, steps: int) -> dict[str, float]:
    """Milliseconds per step of each op category (all but the Python overhead) from a finished profile."""
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent, annotation, nested = event.cpu_parent, None, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True  # counted in its top-level parent's time
                break
            if parent.name in (ATTENTION, SAMPLING, FORWARD) and annotation is None:
                annotation = parent.name  # the innermost annotation decides
            if parent.name == STEP:
                break
            parent = parent.cpu_parent
        if nested or parent is None:
            continue
        totals[category(event.name, annotation)] += event.cpu_time_total / 1000  # µs -> ms
    return {name: totals.get(name, 0.0) / steps for name in CATEGORIES[:-1]}


def breakdown(reset, run_step, steps: int, rounds: int) -> dict:
    """Time ``steps`` calls of ``run_step()`` unprofiled (best of ``rounds``), then profile as many; each
    round and the profile start from ``reset()``, so that they see the same contexts."""
    reset()
    run_step()  # first-call costs paid before anything is measured
    walls = []
    for _ in range(rounds):
        reset()
        start = time.perf_counter()
        for _ in range(steps):
            run_step()
        walls.append((time.perf_counter() - start) * 1000 / steps)
    reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP):
                run_step()
    ms = split_profile(prof, steps)
    step_ms = min(walls)
    ms["Python overhead"] = max(0.0, step_ms - sum(ms.values()))
    whole = max(step_ms, sum(ms.values()))  # the profiler's cost per op can push the ops past the wall time
    return {
        "step_ms": step_ms,
        "step_ms_rounds": walls,
        "ms_per_step": ms,
        "fraction": {name: value / whole for name, value in ms.items()},
    }


def _annotated(fn, name: str):
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def batch1_steps(model, tokenizer, steps: int):
    """``generate``'s decode step (model call, then the sampler), repeated on one growing dense cache."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
    capacity = len(prompt) + steps + 2
    state = {}

    def reset():
        cache = DenseKVCache.for_model(model.config, capacity=capacity)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt]), cache, last_only=True)
        state.update(cache=cache, token=int(logits[0, -1].argmax()))

    attention = _annotated(cached_attention, ATTENTION)

    @torch.inference_mode()
    def step():
        with model.using_attention(attention):
            logits = model(torch.tensor([[state["token"]]]), state["cache"], last_only=True)
        with record_function(SAMPLING):
            state["token"] = int(sample(logits[:, -1].float().cpu(), greedy, greedy.generator())[0])

    return reset, step


def engine_steps(model, tokenizer, batch: int):
    """One serving-engine step with ``batch`` sequences all decoding (their prompts already prefilled)."""
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, batch), num_blocks=64 * batch)
    prompts = [f"Question {i}: {PROMPT}" for i in range(batch)]

    def fresh_engine():
        engine = LLMEngine.from_model(model, tokenizer, config)
        runner = engine.runner
        runner.decode_attention = _annotated(runner.decode_attention, ATTENTION)
        runner.chunk_attention = _annotated(runner.chunk_attention, ATTENTION)
        # the runner's own work outside the model's forward pass is moving the logits and sampling
        runner.forward = _annotated(runner.forward, FORWARD)
        runner.run = _annotated(runner.run, SAMPLING)
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=10_000, stop_ids=()))
        while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.sequences.values()):
            engine.step()  # the prefills, unmeasured
        return engine

    state = {}

    def reset():
        state["engine"] = fresh_engine()

    def step():
        state["engine"].step()

    return reset, step


def native_profiles(model, tokenizer, tokens: int, rounds: int, bandwidth_gbps: float) -> dict:
    """ms per token of the C step (fp32 and Q4_1) by phase, and of llama.cpp on the same file, each
    beside its wall time per token and the time its weight bytes take to stream."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    profiling = native_library(("-DINFRA_PROFILE",))
    q4_1_model = load_gguf_q4_1(default_gguf_path()).model
    out = {}
    for weights, held in (("fp32", model), ("q4_1", q4_1_model)):
        plain = NativeDecoder(held, capacity=len(prompt) + tokens, weights=weights)
        wall = decode_rate(lambda n, d=plain: d.greedy(prompt, n), tokens, rounds)
        marked = NativeDecoder(held, capacity=len(prompt) + tokens, weights=weights, library=profiling)
        marked.greedy(prompt, tokens)
        step_profile(profiling)  # from zero
        marked.greedy(prompt, tokens)  # tokens - 1 steps in C (the prompt's pass is PyTorch)
        phases = {k: v * 1000 / (tokens - 1) for k, v in step_profile(profiling).items()}
        token_ms = 1000 / wall["decode_tokens_per_s"]
        out[f"C step {weights}"] = {
            "token_ms": token_ms,
            "in_c_ms": sum(phases.values()),
            "ms": {**phases, "outside C (Python loop, call)": max(0.0, token_ms - sum(phases.values()))},
            "bytes_per_step": plain.bytes_per_step,
            "stream_ms": plain.bytes_per_step / (bandwidth_gbps * 1e9) * 1000,
        }
    llama = run_llama_cpp(default_gguf_path(), prompt, tokens, rounds, 1)
    if llama["available"]:
        token_ms = 1000 / llama["row"]["decode_tokens_per_s"]
        in_c = llama["eval_ms_per_token"]
        bytes_per_step = gguf_bytes_per_step(default_gguf_path(), model)
        out["llama.cpp"] = {
            "token_ms": token_ms,
            "in_c_ms": in_c,
            "ms": {"llama_decode (its counters)": in_c, "outside C (Python loop, call)": max(0.0, token_ms - in_c)},
            "bytes_per_step": bytes_per_step,
            "stream_ms": bytes_per_step / (bandwidth_gbps * 1e9) * 1000,
        }
    else:
        out["llama.cpp"] = {"available": False, "reason": llama["reason"]}
    return out


def run_profile(device: torch.device, quick: bool) -> dict:
    if device.type != "cpu":
        raise SystemExit("this benchmark profiles the CPU (the model runs on CPU in chapters 06-08); pass --device cpu")
    torch.manual_seed(SEED)
    load_before = load_average()
    loaded = load_default()
    model, tokenizer = loaded.model, loaded.tokenizer
    steps, rounds, batch = (4, 2, 8) if quick else (16, 3, 32)
    results = {
        "batch 1 (generate)": breakdown(*batch1_steps(model, tokenizer, steps), steps, rounds),
        f"batch {batch} (engine step)": breakdown(*engine_steps(model, tokenizer, batch), steps, rounds),
    }
    results[f"batch {batch} (engine step)"]["batch"] = batch
    results["batch 1 (generate)"]["batch"] = 1
    for row in results.values():
        row["tokens_per_s"] = row["batch"] * 1000 / row["step_ms"]
    native_ok, native_reason = native_decode_available()
    bandwidth = measure_memory_bandwidth(64 if quick else 256, iters=3 if quick else 5, quick=quick)
    native = (
        native_profiles(model, tokenizer, 8 if quick else 64, rounds, bandwidth["bandwidth_gbps"])
        if native_ok
        else {"available": False, "reason": native_reason}
    )
    return {
        "benchmark": "decode_profile",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
        "seed": SEED,
        "flags": {
            "quick": quick,
            "device": str(device),
            "dtype": "float32",
            "steps": steps,
            "rounds": rounds,
            "batch": batch,
            "torch_threads": torch.get_num_threads(),
            "prompt": PROMPT,
        },
        "categories": list(CATEGORIES),
        "steps": results,
        "bandwidth": bandwidth,
        "native": native,
    }


def format_table(result: dict) -> str:
    names = list(result["steps"])
    lines = [
        f"SmolLM2-135M-Instruct fp32, {result['flags']['torch_threads']} torch threads: ms per decode step",
        f"{'':18s}" + "".join(f"{name:>26s}" for name in names),
    ]
    for cat in result["categories"]:
        cells = [
            f"{result['steps'][n]['ms_per_step'][cat]:8.2f} ms {result['steps'][n]['fraction'][cat]:5.0%}"
            for n in names
        ]
        lines.append(f"{cat:18s}" + "".join(f"{c:>26s}" for c in cells))
    lines.append(
        f"{'step (unprofiled)':18s}"
        + "".join(f"{result['steps'][n]['step_ms']:8.2f} ms      ".rjust(26) for n in names)
    )
    lines.append(f"{'tokens/s':18s}" + "".join(f"{result['steps'][n]['tokens_per_s']:8.1f}".rjust(26) for n in names))
    lines.append(
        f"batch 1 in C and in llama.cpp, ms per token (streaming the weights at "
        f"{result['bandwidth']['bandwidth_gbps']:.1f} GB/s takes the last column):"
    )
    for name, row in result["native"].items():
        if not isinstance(row, dict) or "ms" not in row:
            lines.append(f"  {name}: not measured ({row['reason'] if isinstance(row, dict) else row})")
            continue
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row["ms"].items())
        lines.append(f"  {name}: {row['token_ms']:.2f} ms a token ({parts}); stream {row['stream_ms']:.2f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "decode_profile", run_profile, format_table)


if __name__ == "__main__":
    sys.exit(main())
