"""Batch-1 decode speed of SmolLM2-135M-Instruct: infra_lib's model with its KV cache, the same
model with its weights in the decode layout (``infra_lib.model.decode_layout``: fused; fp32 packed for
oneDNN, and once more input-major to show what the packing alone is worth),
each layout again with its decoder layer compiled over a static cache
(``infra_lib.model.compiled_decode``), the decode step written in C (``infra_lib.model.native_decode``,
fp32, bf16, int8, the GGUF file's own Q4_1 blocks and chapter 09's int4; where this machine can build
it), the model recomputing without a cache, transformers' ``generate`` on the same weights, and
llama.cpp (the ``llama-cpp-python`` package, ``pip install -e .[bench]``) on the same GGUF file with
the same threads, prompt and number of new tokens, against this machine's memory-bandwidth bound, all
measured in one run. llama.cpp runs in a process of its own (its OpenMP runtime is not PyTorch's);
without the package its row says how to get it and the rest runs as before.

``--quick`` (the test suite's run) times fewer rows: the plain model with and without its cache,
transformers, the fp32 decode layout and its compiled step, every C step and llama.cpp; the other
layouts' weights are still measured (perplexity, agreement, bytes), not timed.

Decode rate is measured as a difference, the same way for every engine: the time to generate
N tokens minus the time to generate 1 (the prefill and the first token), divided by N - 1.
The bound assumes every decode step reads every weight once from main memory:
tokens/s <= bandwidth / weight bytes.

Usage:
    python benchmarks/decode.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info, measure_memory_bandwidth
from infra_lib.model import SamplingParams, generate, load_default
from infra_lib.model.compiled_decode import StaticDecoder
from infra_lib.model.decode_layout import WEIGHT_FORMATS, bytes_per_step, decode_layout, greedy_answers, top1_agreement
from infra_lib.model.loaders import default_gguf_path, stored_blocks
from infra_lib.model.native_decode import NATIVE_FORMATS, NativeDecoder, native_decode_available
from infra_lib.model.quant import heldout_text, load_gguf_q4_1, perplexity
from infra_lib.timing import time_op

SEED = 0
PROMPT = "What is Python?"
LLAMA_CPP = "llama.cpp (llama-cpp-python), Q4_1 file"
LLAMA_CPP_HINT = (
    "install the optional bench extra: `.venv/bin/pip install -e '.[bench]'` (llama-cpp-python 0.3.36 builds "
    "llama.cpp from source: about 4 minutes on 2 cores; on a CPU with AMX, add "
    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON "
    "-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON', as its AMX path "
    "crashed on prompts of more than one token here)"
)
# teacher-forced greedy agreement of each weight format with fp32 (the test's prompt set)
AGREEMENT_PROMPTS = (
    "What is Python?",
    "Name three planets.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is.",
    "How many legs does a spider have?",
)


def decode_rate(generate_n, new_tokens: int, iters: int, warmup: int = 1) -> dict:
    """Seconds for 1 and for ``new_tokens`` tokens, and the decode rate from their difference.

    The two calls alternate (after ``warmup`` untimed calls of each), so a change in how busy the
    machine is falls on both alike, and each keeps its least of ``iters`` timings: other work on the
    machine only ever adds time, and a median of three could still take one busy 1-token call against
    quiet longer ones and make the difference negative (seen on a fast engine, whose eight tokens take
    about as long as its prompt)."""
    for _ in range(warmup):
        generate_n(1), generate_n(new_tokens)
    one, many = [], []
    for _ in range(iters):
        one.append(time_op(lambda: generate_n(1), warmup=0, iters=1))
        many.append(time_op(lambda: generate_n(new_tokens), warmup=0, iters=1))
    one_s, many_s = min(one), min(many)
    return {
        "first_token_s": one_s,
        "total_s": many_s,
        "new_tokens": new_tokens,
        "decode_tokens_per_s": (new_tokens - 1) / (many_s - one_s),
    }


def _shared_prefix(reference: list[int], tokens: list[int]) -> int:
    """How many tokens ``tokens`` shares with ``reference`` before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), len(tokens))


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


def llama_cpp_worker(job: dict) -> dict:
    """In its own process: llama.cpp on the GGUF file, greedy from the prompt's token ids, timed as
    every other row (``decode_rate``); its tokens, and the time per token its own counters give
    (the C side of ``llama_decode``, without the Python loop around it)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=job["gguf"],
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        n_ctx=len(job["prompt"]) + job["new_tokens"] + 8,
        verbose=False,
    )

    def greedy(n: int) -> list[int]:
        out = []
        for token in llm.generate(job["prompt"], temp=0.0, top_k=1, reset=True):  # llama.cpp's own greedy sampler
            out.append(int(token))
            if len(out) == n:
                return out
        return out

    tokens = greedy(job["new_tokens"])
    row = decode_rate(greedy, job["new_tokens"], job["iters"], job["warmup"])
    llama_cpp.llama_perf_context_reset(llm.ctx)
    greedy(job["new_tokens"])
    perf = llama_cpp.llama_perf_context(llm.ctx)
    return {
        "available": True,
        "version": llama_cpp.__version__,
        "tokens": tokens,
        "row": row,
        "eval_ms_per_token": perf.t_eval_ms / max(perf.n_eval, 1),
        "prompt_ms": perf.t_p_eval_ms,
    }


def run_llama_cpp(gguf: Path, prompt: list[int], new_tokens: int, iters: int, warmup: int) -> dict:
    """llama.cpp's row, measured in a child process with this process's thread count; where
    ``llama-cpp-python`` is missing or the child fails, ``{"available": False, "reason": ...}``
    saying what to do."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {"available": False, "reason": "llama-cpp-python is not installed: " + LLAMA_CPP_HINT}
    job = {
        "gguf": str(gguf),
        "prompt": prompt,
        "new_tokens": new_tokens,
        "iters": iters,
        "warmup": warmup,
        "threads": torch.get_num_threads(),
    }
    try:
        child = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--llama-cpp-worker", json.dumps(job)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": "llama.cpp did not finish in 600 s"}
    if child.returncode != 0:
        how = f"signal {-child.returncode}" if child.returncode < 0 else f"exit status {child.returncode}"
        return {
            "available": False,
            "reason": f"llama.cpp stopped with {how}: {child.stderr.strip()[-300:]}; " + LLAMA_CPP_HINT,
        }
    return json.loads(child.stdout.strip().splitlines()[-1])


def gguf_bytes_per_step(gguf: Path, model) -> int:
    """What a llama.cpp step reads from this GGUF file: its Q4_1 projections and its Q8_0 table (the
    output head, tied to the embedding), one Q8_0 row of that table, and the fp32 norms."""
    projections = sum(rows.numel() for rows in stored_blocks(gguf, "Q4_1")[1].values())
    table = sum(rows.numel() for rows in stored_blocks(gguf, "Q8_0")[1].values())
    norms = sum(t.nbytes for name, t in model.named_parameters() if name.endswith("norm.weight"))
    return projections + table + table // model.config.vocab_size + norms


def run_decode(device: torch.device, quick: bool) -> dict:
    if device.type != "cpu":
        raise SystemExit("this benchmark measures the CPU (the model runs on CPU in chapter 06); pass --device cpu")
    torch.manual_seed(SEED)
    load_before = load_average()
    loaded = load_default()
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    # --quick: no warm-up calls of their own; the token comparison just below has already run each
    # engine's model once (first-call costs paid) before any timing starts. Three timings each even
    # so, the least kept: the rate is a difference of two times, and one busy moment in a single
    # timing of the shorter call would make it negative.
    new_tokens, iters, warmup = (8, 3, 0) if quick else (64, 3, 1)
    # The 4-bit steps take 4 to 5 ms a token, and the Q4_1 step's prompt runs in PyTorch on Q4_1Linear,
    # which dequantises every weight at each call (0.15 s on a quiet machine, 0.7 s seen under load):
    # eight such tokens vanish in the prompt pass's noise, and the difference can come out negative
    # (it did, in a loaded test run). Their rates are taken over as many tokens as the full run's.
    rate_tokens = {"q4_1": 64, "int4": 64}
    never_stop = dict(stop_ids=(), temperature=0.0)
    phase_s: dict[str, float] = {}  # where this run's own time went
    started = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal started
        now = time.perf_counter()
        phase_s[name] = now - started
        started = now

    # --quick times one decode layout and compiles one step; the full run times and compiles all three
    timed = ("fp32",) if quick else WEIGHT_FORMATS

    formats = {weights: decode_layout(model, weights) for weights in WEIGHT_FORMATS}  # built once, at load time
    input_major = decode_layout(model, "fp32", pack=False)  # fp32 without oneDNN's packing: that lever alone

    def ours(n, use_cache=True, on=model):
        return generate(on, tokenizer, prompt, SamplingParams(max_new_tokens=n, **never_stop), use_cache=use_cache)

    hf = _transformers_model(model)
    ids = torch.tensor([prompt])

    def theirs(n):
        with torch.inference_mode():
            return hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tokenizer.eos_id,
            )

    reference_tokens = ours(new_tokens).token_ids
    same_tokens = reference_tokens == theirs(new_tokens)[0, len(prompt) :].tolist()
    held_out = tokenizer.encode(heldout_text())[: 64 if quick else 512]
    agreement_prompts = [
        tokenizer.encode_chat([{"role": "user", "content": text}]) for text in AGREEMENT_PROMPTS[: 2 if quick else None]
    ]
    agreement_tokens = 8 if quick else 24
    answers = greedy_answers(model, agreement_prompts, agreement_tokens)
    weight_formats = {
        "fp32, plain layout": {
            "perplexity": perplexity(model, held_out),
            "same_greedy_prefix": len(reference_tokens),
            "top1_agreement": 1.0,
            "bytes_per_step": bytes_per_step(model),
        }
    }
    for weights, laid_out in formats.items():
        tokens = ours(new_tokens, on=laid_out).token_ids
        shared = _shared_prefix(reference_tokens, tokens)
        weight_formats[f"{weights}, decode layout"] = {
            "perplexity": perplexity(laid_out, held_out),
            "same_greedy_prefix": shared,
            "top1_agreement": top1_agreement(model, laid_out, agreement_prompts, answers),
            "bytes_per_step": bytes_per_step(laid_out),
        }
    # the compiled step: its first greedy call compiles (timed here). fp32 and int8 give the
    # uncompiled layout's tokens; bf16's fused casts round differently, so a long answer may part
    # from the uncompiled one: the greedy prefix they share is reported
    phase("load, layouts, perplexity and agreement")
    compiled, compile_s, compiled_same_tokens = {}, {}, {}
    for weights, laid_out in ((w, formats[w]) for w in timed):
        compiled[weights] = StaticDecoder(laid_out, capacity=len(prompt) + new_tokens)
        started = time.perf_counter()
        tokens = compiled[weights].greedy(prompt, new_tokens)
        compile_s[weights] = time.perf_counter() - started
        uncompiled = ours(new_tokens, on=laid_out).token_ids
        compiled_same_tokens[weights] = _shared_prefix(uncompiled, tokens)
    # the step in C: fp32 on the model's own weights, bf16 and int8 on copies; fp32 gives the model's
    # tokens. Each format's perplexity and agreement are read through its own decode steps.
    phase("compiled steps: compile and tokens")
    native_ok, native_reason = native_decode_available()
    capacity = max(
        len(prompt) + max(new_tokens, *rate_tokens.values()),
        len(held_out),
        *(len(p) + agreement_tokens for p in agreement_prompts),
    )
    gguf = default_gguf_path()
    q4_1_model = load_gguf_q4_1(gguf).model if native_ok else None  # the file's Q4_1 blocks as stored
    native = (
        {w: NativeDecoder(q4_1_model if w == "q4_1" else model, capacity=capacity, weights=w) for w in NATIVE_FORMATS}
        if native_ok
        else {}
    )
    native_tokens = {w: decoder.greedy(prompt, new_tokens) for w, decoder in native.items()}
    for weights, decoder in native.items():
        picks = [decoder.teacher_forced(p, answer) for p, answer in zip(agreement_prompts, answers)]
        weight_formats[f"{weights}, native step"] = {
            "perplexity": decoder.perplexity(held_out),
            "same_greedy_prefix": _shared_prefix(reference_tokens, native_tokens[weights]),
            "top1_agreement": sum(a == b for got, answer in zip(picks, answers) for a, b in zip(got, answer))
            / sum(len(answer) for answer in answers),
            "bytes_per_step": decoder.bytes_per_step,
        }
    phase("C steps: tokens, perplexity and agreement")
    # llama.cpp on the same file: same threads, prompt ids and new tokens; its bytes are the file's
    llama = run_llama_cpp(gguf, prompt, new_tokens, iters, warmup)
    if llama["available"]:
        llama_tokens = llama["tokens"]
        llama["bytes_per_step"] = gguf_bytes_per_step(gguf, model)
        llama["greedy_prefix_shared"] = {
            "infra_lib, KV cache (fp32)": _shared_prefix(llama_tokens, reference_tokens),
            **{f"{w}, native step": _shared_prefix(llama_tokens, native_tokens[w]) for w in native},
        }
        # how often each C step picks llama.cpp's token, reading llama.cpp's tokens (teacher-forced)
        llama["top1_agreement"] = {
            f"{w}, native step": sum(a == b for a, b in zip(decoder.teacher_forced(prompt, llama_tokens), llama_tokens))
            / len(llama_tokens)
            for w, decoder in native.items()
        }
        weight_formats["Q4_1 file, llama.cpp"] = {
            "perplexity": None,
            "same_greedy_prefix": _shared_prefix(reference_tokens, llama_tokens),
            "top1_agreement": None,
            "bytes_per_step": llama["bytes_per_step"],
        }
    phase("llama.cpp (its own process)")
    engines = {
        "infra_lib, KV cache": decode_rate(ours, new_tokens, iters, warmup),
        **{
            name: row
            for weights, laid_out in ((w, formats[w]) for w in timed)
            for name, row in (
                (
                    f"infra_lib, decode layout {weights}",
                    decode_rate(lambda n, m=laid_out: ours(n, on=m), new_tokens, iters, warmup),
                ),
                (
                    f"infra_lib, compiled step {weights}",
                    decode_rate(lambda n, d=compiled[weights]: d.greedy(prompt, n), new_tokens, iters, warmup),
                ),
            )
        },
        **(
            {}
            if quick
            else {
                "infra_lib, decode layout fp32 input-major": decode_rate(
                    lambda n: ours(n, on=input_major), new_tokens, iters, warmup
                )
            }
        ),
        **{
            f"infra_lib, native step {w}": decode_rate(
                lambda n, d=decoder: d.greedy(prompt, n), rate_tokens.get(w, new_tokens), iters, warmup
            )
            for w, decoder in native.items()
        },
        "infra_lib, no cache": decode_rate(lambda n: ours(n, use_cache=False), new_tokens, iters, warmup),
        "transformers generate": decode_rate(theirs, new_tokens, iters, warmup),
        **({LLAMA_CPP: llama["row"]} if llama["available"] else {}),
    }
    phase("timing every row")
    bandwidth = measure_memory_bandwidth(64 if quick else 256, iters=3 if quick else 5, quick=quick)
    weight_bytes = model.weight_bytes()
    bound = bandwidth["bandwidth_gbps"] * 1e9 / weight_bytes
    for name, row in engines.items():
        weights = next(
            (w for w in WEIGHT_FORMATS if name in (f"infra_lib, decode layout {w}", f"infra_lib, compiled step {w}")),
            None,
        )
        native_weights = next((w for w in native if name == f"infra_lib, native step {w}"), None)
        row["weights"] = (
            "Q4_1 file, llama.cpp"
            if name == LLAMA_CPP
            else f"{native_weights}, native step"
            if native_weights
            else f"{weights}, decode layout"
            if weights
            else "fp32, decode layout"
            if name.endswith("input-major")
            else "fp32, plain layout"
        )
        row["bytes_per_step"] = weight_formats[row["weights"]]["bytes_per_step"]
        row["bound_tokens_per_s"] = bandwidth["bandwidth_gbps"] * 1e9 / row["bytes_per_step"]
        row["fraction_of_bound"] = row["decode_tokens_per_s"] / row["bound_tokens_per_s"]
    cached, uncached = engines["infra_lib, KV cache"], engines["infra_lib, no cache"]
    theirs_rate = engines["transformers generate"]["decode_tokens_per_s"]
    return {
        "benchmark": "decode",
        "machine_info": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_average()},
        "seed": SEED,
        "flags": {
            "quick": quick,
            "device": str(device),
            "dtype": "float32",
            "batch": 1,
            "prompt": PROMPT,
            "prompt_tokens": len(prompt),
            "new_tokens": new_tokens,
            "rate_tokens": {w: rate_tokens.get(w, new_tokens) for w in native},  # each C step's rate, over
            "iters": iters,
            "perplexity_tokens": len(held_out),
            "agreement_prompts": len(agreement_prompts),
            "agreement_tokens": agreement_tokens,
        },
        "model": {"source": loaded.source, "parameters": model.config.parameter_count(), "weight_bytes": weight_bytes},
        "bandwidth": bandwidth,
        "bandwidth_bound_tokens_per_s": bound,
        "engines": engines,
        "weight_formats": weight_formats,
        "kv_cache_speedup": cached["decode_tokens_per_s"] / uncached["decode_tokens_per_s"],
        "ours_over_transformers": cached["decode_tokens_per_s"] / theirs_rate,
        "decode_layout_over_transformers": {
            weights: engines[f"infra_lib, decode layout {weights}"]["decode_tokens_per_s"] / theirs_rate
            for weights in timed
        },
        "same_greedy_tokens_as_transformers": same_tokens,
        "input_major_same_greedy_tokens": ours(new_tokens, on=input_major).token_ids == reference_tokens,
        "fp32_packed_over_input_major": None
        if quick
        else engines["infra_lib, decode layout fp32"]["decode_tokens_per_s"]
        / engines["infra_lib, decode layout fp32 input-major"]["decode_tokens_per_s"],
        "native_step": {
            "available": native_ok,
            "reason": native_reason,
            "same_greedy_tokens_as_model": native_tokens.get("fp32") == reference_tokens if native_ok else None,
            "greedy_prefix_shared_with_fp32": {
                w: weight_formats[f"{w}, native step"]["same_greedy_prefix"] for w in native
            },
            "over_transformers": {
                w: engines[f"infra_lib, native step {w}"]["decode_tokens_per_s"] / theirs_rate for w in native
            },
            "over_compiled_step": {
                w: engines[f"infra_lib, native step {w}"]["decode_tokens_per_s"]
                / engines[f"infra_lib, compiled step {w}"]["decode_tokens_per_s"]
                for w in native
                if w in compiled
            },
        },
        "llama_cpp": _llama_summary(llama, engines),
        "phase_s": phase_s,
        "compiled_step": {
            "compile_s": compile_s,
            "greedy_prefix_shared_with_uncompiled": compiled_same_tokens,
            "over_uncompiled": {
                w: engines[f"infra_lib, compiled step {w}"]["decode_tokens_per_s"]
                / engines[f"infra_lib, decode layout {w}"]["decode_tokens_per_s"]
                for w in timed
            },
            "over_transformers": {
                w: engines[f"infra_lib, compiled step {w}"]["decode_tokens_per_s"] / theirs_rate for w in timed
            },
        },
    }


def _llama_summary(llama: dict, engines: dict) -> dict:
    """llama.cpp's part of the result: whether it ran (and if not, why and how to get it), and each
    C step's tokens/s over its, beside the agreement of their greedy tokens."""
    if not llama["available"]:
        return {"available": False, "reason": llama["reason"]}
    rate = engines[LLAMA_CPP]["decode_tokens_per_s"]
    return {
        "available": True,
        "reason": "",
        "version": llama["version"],
        "tokens": llama["tokens"],
        "eval_ms_per_token": llama["eval_ms_per_token"],
        "greedy_prefix_shared": llama["greedy_prefix_shared"],
        "top1_agreement": llama["top1_agreement"],
        "native_over_llama_cpp": {
            name.removeprefix("infra_lib, native step "): row["decode_tokens_per_s"] / rate
            for name, row in engines.items()
            if name.startswith("infra_lib, native step ")
        },
    }


def format_table(result: dict) -> str:
    flags = result["flags"]
    lines = [
        f"SmolLM2-135M-Instruct, batch 1, {flags['prompt_tokens']}-token prompt, {flags['new_tokens']} new tokens",
        f"memory bandwidth {result['bandwidth']['bandwidth_gbps']:.1f} GB/s; each row's bound: bandwidth / the bytes "
        "its weights make one step read",
        f"{'engine':42s} {'tokens/s':>9s} {'MB/step':>8s} {'bound':>7s} {'of bound':>9s} {'first token':>12s}",
    ]
    for name, row in result["engines"].items():
        lines.append(
            f"{name:42s} {row['decode_tokens_per_s']:9.1f} {row['bytes_per_step'] / 1e6:8.0f} "
            f"{row['bound_tokens_per_s']:7.1f} {row['fraction_of_bound']:9.0%} {row['first_token_s'] * 1000:10.0f} ms"
        )
    lines.append(
        f"{'weights':24s} {'perplexity':>10s} {'greedy prefix shared with fp32':>31s} {'top-1 agreement':>16s}"
    )
    for name, row in result["weight_formats"].items():
        perplexity_text = "-" if row["perplexity"] is None else f"{row['perplexity']:.3f}"
        agreement_text = "-" if row["top1_agreement"] is None else f"{row['top1_agreement']:.1%}"
        lines.append(f"{name:24s} {perplexity_text:>10s} {row['same_greedy_prefix']:31d} {agreement_text:>16s}")
    over = ", ".join(f"{w} {r:.2f}x" for w, r in result["decode_layout_over_transformers"].items())
    lines.append(
        f"KV cache speedup {result['kv_cache_speedup']:.1f}x; plain layout / transformers "
        f"{result['ours_over_transformers']:.2f}; decode layout / transformers: {over}; "
        f"same greedy tokens as transformers: {result['same_greedy_tokens_as_transformers']}"
    )
    step = result["compiled_step"]
    lines.append(
        "compiled step over the uncompiled layout: "
        + ", ".join(
            f"{w} {r:.2f}x (compile {step['compile_s'][w]:.1f} s, greedy prefix shared "
            f"{step['greedy_prefix_shared_with_uncompiled'][w]}/{result['flags']['new_tokens']})"
            for w, r in step["over_uncompiled"].items()
        )
    )
    if result["fp32_packed_over_input_major"] is not None:
        lines.append(
            f"fp32 decode layout, oneDNN-packed over input-major: {result['fp32_packed_over_input_major']:.2f}x "
            f"(input-major gives the same greedy tokens: {result['input_major_same_greedy_tokens']})"
        )
    lines.append(
        "compiled step over transformers: " + ", ".join(f"{w} {r:.2f}x" for w, r in step["over_transformers"].items())
    )
    native = result["native_step"]
    if native["available"]:
        lines.append(
            "native step (C) over transformers: "
            + ", ".join(f"{w} {r:.2f}x" for w, r in native["over_transformers"].items())
            + "; over the compiled step: "
            + ", ".join(f"{w} {r:.2f}x" for w, r in native["over_compiled_step"].items())
            + f"; fp32 gives the model's greedy tokens: {native['same_greedy_tokens_as_model']}; greedy prefix "
            "shared with fp32: "
            + ", ".join(f"{w} {n}/{flags['new_tokens']}" for w, n in native["greedy_prefix_shared_with_fp32"].items())
        )
    else:
        lines.append(f"native step (C): not built here ({native['reason'].splitlines()[0]})")
    llama = result["llama_cpp"]
    if llama["available"]:
        lines.append(
            f"llama.cpp {llama['version']}: {llama['eval_ms_per_token']:.2f} ms a token in its own counters; C steps "
            "over llama.cpp: "
            + ", ".join(f"{w} {r:.2f}x" for w, r in llama["native_over_llama_cpp"].items())
            + "; greedy prefix shared with llama.cpp: "
            + ", ".join(f"{w} {n}/{flags['new_tokens']}" for w, n in llama["greedy_prefix_shared"].items())
            + "; C steps picking llama.cpp's token, teacher-forced: "
            + ", ".join(f"{w} {a:.0%}" for w, a in llama["top1_agreement"].items())
        )
    else:
        lines.append(f"llama.cpp: not measured ({llama['reason']})")
    lines.append("this run's time: " + ", ".join(f"{k} {v:.1f} s" for k, v in result["phase_s"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--llama-cpp-worker"]:  # the child process of run_llama_cpp
        print(json.dumps(llama_cpp_worker(json.loads(argv[1]))))
        return 0
    return benchmark_main(argv, __doc__.splitlines()[0], "decode", run_decode, format_table)


if __name__ == "__main__":
    sys.exit(main())
