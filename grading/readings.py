"""Where each lab task's idea is taught: the lesson sections a learner should read before starting.

An untouched task's feedback points here instead of giving a hint: a hint written for a wrong
answer would hand a learner who has not started the recipe. tests/test_labs.py checks that every
task of every lab has an entry and that each section named here is a heading of its lesson.
"""

from __future__ import annotations

# task (as its stub names it) -> (lesson file stem, [section headings, as written after "## "])
READINGS: dict[str, tuple[str, list[str]]] = {
    "lab01 task 1: gemm_flops": ("01_gemm_profiling", ["1 · The idea: C = A @ B costs 2·m·n·k"]),
    "lab01 task 2: time_op": (
        "01_gemm_profiling",
        [
            "5 · Gotcha 1: the first call is not a typical call",
            "6 · Gotcha 2: stopping the clock before the work is done",
        ],
    ),
    "lab01 task 3: dominant_op": ("01_gemm_profiling", ["2 · Where does `a @ b` go?"]),
    "lab01 task 4: achieved_tflops": ("01_gemm_profiling", ["7 · How fast, compared with what?"]),
    "lab02 task 1: arithmetic_intensity": (
        "02_hardware_roofline",
        ["2 · The roofline: FLOPs per byte decide which ceiling you hit"],
    ),
    "lab02 task 2: attainable_flops": (
        "02_hardware_roofline",
        ["2 · The roofline: FLOPs per byte decide which ceiling you hit"],
    ),
    "lab02 task 3: kv_bytes_per_token": ("02_hardware_roofline", ["5 · From bandwidth to capacity: the KV cache"]),
    "lab02 task 4: max_concurrency": ("02_hardware_roofline", ["5 · From bandwidth to capacity: the KV cache"]),
    "lab03 task 1: softmax_kernel": (
        "03_triton",
        [
            "2 · The programming model: programs, blocks, masks, strides",
            "4 · Fused softmax: the same maths, half the bytes",
        ],
    ),
    "lab03 task 2: matmul_kernel": ("03_triton", ["5 · Tiled matrix multiplication", "6 · Catching a missing mask"]),
    "lab03 task 3: rmsnorm_kernel": (
        "03_triton",
        ["4 · Fused softmax: the same maths, half the bytes", "Lab 03: what you will write"],
    ),
    "lab04 task 1: op_histogram": ("04_compilation", ["7 · Writing a graph pass with torch.fx"]),
    "lab04 task 2: fuse_silu": ("04_compilation", ["7 · Writing a graph pass with torch.fx"]),
    "lab04 task 3: fuse_add_relu": ("04_compilation", ["7 · Writing a graph pass with torch.fx"]),
    "lab05 task 1: Value": ("05_training_parallelism", ["1 · The chain rule as a graph"]),
    "lab05 task 2: add, mul, exp, log": ("05_training_parallelism", ["1 · The chain rule as a graph"]),
    "lab05 task 3: matmul, reduce_sum, reduce_mean": ("05_training_parallelism", ["1 · The chain rule as a graph"]),
    "lab05 task 4: softmax, rms_norm, embedding, cross_entropy": (
        "05_training_parallelism",
        ["1 · The chain rule as a graph"],
    ),
    "lab05 task 5: adamw_update": (
        "05_training_parallelism",
        ["2 · One training step, measured: memory, mixed precision, checkpointing"],
    ),
    "lab05 task 6: shard_bounds": (
        "05_training_parallelism",
        ["4 · Collectives: all-reduce, reduce-scatter, all-gather"],
    ),
    "lab05 task 7: ring_all_reduce": (
        "05_training_parallelism",
        ["4 · Collectives: all-reduce, reduce-scatter, all-gather"],
    ),
    "lab05 task 8: DDP": ("05_training_parallelism", ["5 · Data parallelism"]),
    "lab05 task 9: reduce_scatter and all_gather": (
        "05_training_parallelism",
        ["4 · Collectives: all-reduce, reduce-scatter, all-gather", "6 · ZeRO: sharding the training state"],
    ),
    "lab05 task 9: ZeroAdamW": ("05_training_parallelism", ["6 · ZeRO: sharding the training state"]),
    "lab06 task 1: rms_norm": ("06_request_journey", ["1 · The model on the table", "Lab 06"]),
    "lab06 task 2: rope": ("06_request_journey", ["1 · The model on the table", "Lab 06"]),
    "lab06 task 3: Llama": ("06_request_journey", ["1 · The model on the table", "Lab 06"]),
    "lab06 task 4: causal_mask": (
        "06_request_journey",
        ["4 · Inside `generate`: prefill and decode by hand", "Lab 06"],
    ),
    "lab06 task 5: repeat_kv": ("06_request_journey", ["1 · The model on the table", "Lab 06"]),
    "lab06 task 6: cached_attention": (
        "06_request_journey",
        ["4 · Inside `generate`: prefill and decode by hand", "6 · What the KV cache saves"],
    ),
    "lab06 task 7: greedy_decode": ("06_request_journey", ["4 · Inside `generate`: prefill and decode by hand"]),
    "lab07 task 1: BlockPool.allocate": ("07_paged_attention", ["2 · Blocks, block tables and the block pool"]),
    "lab07 task 2: BlockPool.free": ("07_paged_attention", ["2 · Blocks, block tables and the block pool"]),
    "lab07 task 3: BlockPool.fork": (
        "07_paged_attention",
        ["6 · Parallel sampling: one prompt, several answers, shared blocks"],
    ),
    "lab07 task 4: BlockPool.prepare_write": (
        "07_paged_attention",
        ["6 · Parallel sampling: one prompt, several answers, shared blocks"],
    ),
    "lab07 task 5: forward_step": ("07_paged_attention", ["8 · One step for many sequences: the flattened batch"]),
    "lab08 task 1: schedule": (
        "08_continuous_batching",
        [
            "2 · One step's plan: iteration-level scheduling under a token budget",
            "4 · Preemption: a pool too small for the load",
            "5 · Head-of-line blocking, and chunked prefill",
        ],
    ),
    "lab08 task 2: engine_step": (
        "08_continuous_batching",
        ["8 · The engine loop: from sampled tokens to streamed text"],
    ),
    "lab09 task 1: quantize_int8_groupwise": ("09_spec_quant", ["5 · Weight-only quantisation"]),
    "lab09 task 2: dequantize_int8_groupwise": ("09_spec_quant", ["5 · Weight-only quantisation"]),
    "lab09 task 3: expected_tokens_per_step": ("09_spec_quant", ["2 · The acceptance rule"]),
    "lab09 task 4: accept_or_resample": (
        "09_spec_quant",
        ["2 · The acceptance rule", "4 · With sampling: a valid sample, not the same text"],
    ),
    "lab10 task 1: ttft": ("10_serving", ["2 · One chat through the official client: whole, then streamed"]),
    "lab10 task 1: e2el": ("10_serving", ["2 · One chat through the official client: whole, then streamed"]),
    "lab10 task 2: tpot": ("10_serving", ["2 · One chat through the official client: whole, then streamed"]),
    "lab10 task 3: itl": ("10_serving", ["2 · One chat through the official client: whole, then streamed"]),
    "lab10 task 4: percentile": ("10_serving", ["4 · A load test: open loop, Poisson and bursty arrivals"]),
    "lab10 task 5: latency_percentiles": (
        "10_serving",
        ["4 · A load test: open loop, Poisson and bursty arrivals", "5 · Latency against throughput"],
    ),
    "lab10 task 6: goodput": ("10_serving", ["6 · SLOs and goodput"]),
    "lab10 task 7: diagnose": ("11_operations", ["5 · The drill: P99 jumped, find the layer"]),
    "lab10 task 8: passes_gate": (
        "11_operations",
        ["7 · LLMOps: a registry, an evaluation gate, a canary, a rollback"],
    ),
    "lab10 task 9: canary_verdict": (
        "11_operations",
        ["7 · LLMOps: a registry, an evaluation gate, a canary, a rollback"],
    ),
    "lab12 task 1: chunk_text": ("12_rag", ["3 · Chunk size and overlap versus recall@5"]),
    "lab12 task 2: top_k_cosine": ("12_rag", ["2 · Why embeddings work", "4 · Exact search versus IVF, next to faiss"]),
    "lab12 task 3: recall_at_k": ("12_rag", ["3 · Chunk size and overlap versus recall@5"]),
    "lab12 task 4: your retriever in the pipeline": ("12_rag", ["5 · An answer with its sources"]),
    "lab13 task 1: next_node": ("13_agents", ["1 · A state graph: nodes, edges, reducers"]),
    "lab13 task 2: call_with_retry": ("13_agents", ["7 · Retries with exponential backoff, under a flaky tool"]),
    "lab13 task 3: run_graph": ("13_agents", ["2 · The runner loop"]),
    "lab13 task 4: resume after a crash": ("13_agents", ["5 · Crash and resume from an SQLite checkpoint"]),
    "lab15 task 1: online_softmax_kernel": (
        "15_serving_kernels",
        ["1 · Where attention's bytes go", "2 · Online softmax"],
    ),
    "lab15 task 2: flash_attention_kernel": (
        "15_serving_kernels",
        [
            "3 · FlashAttention: tiles and a running max",
            "4 · Causal tiles and grouped heads",
            "7 · The real model through the kernels",
        ],
    ),
    "lab15 task 3: paged_decode_kernel": ("15_serving_kernels", ["5 · Paged decode: reading blocks in place"]),
    "lab15 task 4: q4_gemv_kernel": ("15_serving_kernels", ["6 · A fused 4-bit GEMV"]),
    "lab16 task 1: lab06_kv_cache": ("16_capstone", ["1 · Your engine, assembled from your labs"]),
    "lab16 task 2: lab07_paged_kv": ("16_capstone", ["1 · Your engine, assembled from your labs"]),
    "lab16 task 3: lab08_scheduler": ("16_capstone", ["1 · Your engine, assembled from your labs"]),
    "lab16 task 4: lab09_spec_quant": ("16_capstone", ["1 · Your engine, assembled from your labs"]),
    "lab16 task 5: the assembled engine": (
        "16_capstone",
        ["1 · Your engine, assembled from your labs", "2 · The race: one open-loop load, two engines"],
    ),
    "lab17 task 1: PrefixRouter": ("17_serving_beyond_one_engine", ["2 · Routing by prefix, within a load bound"]),
    "lab17 task 2: pack_kv": (
        "17_serving_beyond_one_engine",
        [
            "4 · Prefill and decode on separate workers",
            "5 · The KV handoff: its bytes, its time, and when the split pays",
        ],
    ),
    "lab17 task 3: install_kv": (
        "17_serving_beyond_one_engine",
        [
            "4 · Prefill and decode on separate workers",
            "5 · The KV handoff: its bytes, its time, and when the split pays",
        ],
    ),
    "lab17 task 4: shard_mlp and tp_mlp_forward": ("17_serving_beyond_one_engine", ["6 · Tensor-parallel decode"]),
    "lab17 task 5: top_k_gating": ("17_serving_beyond_one_engine", ["7 · Experts across processes"]),
    "lab18 task 1: ring_attention_step": ("18_training_at_scale", ["5 · Context parallelism: ring attention"]),
    "lab18 task 2: the checkpoint and resume of a training loop": (
        "18_training_at_scale",
        ["3 · A killed rank, resumed under torchrun"],
    ),
    "lab18 task 3: LoRALinear": ("18_training_at_scale", ["7 · LoRA: fine-tuning a sliver of the model"]),
}


def reading(task: str) -> str:
    """Where to read before starting ``task``: 'chapter 01 (notebooks/01_gemm_profiling.ipynb),
    section “2 · ...”'."""
    lesson, sections = READINGS[task]
    where = " and ".join(f"“{s}”" for s in sections)
    return f"chapter {lesson[:2]} (notebooks/{lesson}.ipynb), section{'s' if len(sections) > 1 else ''} {where}"


def not_started_hint(task: str, own: bool) -> str:
    """The hint for a check that met an untouched stub: where to read, never what to write."""
    short = task.split(": ", 1)[0]  # "lab01 task 3"
    if not own:
        return (
            f"this check also runs {short} ({task.split(': ', 1)[1]}), which is not written yet: finish that task first"
        )
    return f"{short} is not started yet. Read {reading(task)}, then the task's instructions above its cell in the lab"
