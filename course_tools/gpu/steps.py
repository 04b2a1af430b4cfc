"""The steps of ``python -m course_tools.gpu.check``: what a step is, the helpers all steps share, and
the steps outside the Triton kernels (chapter 01's timing and profile, the model and the engine
on the GPU, an all-reduce over NCCL); ``course_tools.gpu.kernel_steps`` holds the kernel steps.

A step is a function ``step(facts, quick)``. It writes what it measures into ``facts`` as it
goes, so a failure keeps everything measured before it; it raises ``StepSkipped`` when its path
cannot run on this machine, and ``StepFailed`` (or any error) when the path ran and a measured
fact is wrong. Sizes are small: a step proves that the path compiles and agrees with its
reference, not how fast it is (the benchmarks measure that).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infra_lib.backends import get_backend

SEED = 0
PROMPT = "What is the capital of France?"
ENGINE_PROMPTS = (PROMPT, "Name three primary colours.", "Write one sentence about the sea, in the voice of a sailor.")


class StepSkipped(Exception):
    """The step's code path cannot run on this machine; the message says why."""


class StepFailed(AssertionError):
    """The step ran, and a measured fact is not what it should be; the message names it."""


@dataclass(frozen=True)
class Step:
    """One code path: ``run(facts, quick)``, stopped after ``limit_s`` seconds (its process start included)."""

    name: str
    covers: str
    run: Callable[[dict, bool], None]
    limit_s: float


# --- helpers every step shares ----------------------------------------------------------------------


def cuda_device() -> torch.device:
    """The GPU the steps run on; raises ``StepSkipped`` with the reason where there is none."""
    reason = get_backend("cuda").unavailable_reason()
    if reason is not None:
        raise StepSkipped(f"no GPU: {reason}")
    return torch.device("cuda")


def randn(*shape: int, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = SEED) -> torch.Tensor:
    """Seeded normal numbers, drawn on the CPU (the same on every machine), then moved."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def check_case(facts: dict, case: str, fn: Callable[[], torch.Tensor], want: torch.Tensor, tol: float) -> None:
    """Run ``fn`` twice (the first call compiles), timing each; record how far it lands from ``want``.

    ``facts["cases"][case]`` gets the seconds of both calls, the largest absolute difference and
    whether every element is within ``tol`` (absolute and relative, as ``torch.isclose``).
    """
    row = facts.setdefault("cases", {}).setdefault(case, {"ok": False})  # stays False if fn raises
    for key in ("first_call_s", "second_call_s"):
        start = time.perf_counter()
        got = fn()
        torch.cuda.synchronize()
        row[key] = round(time.perf_counter() - start, 4)
    got, want = got.float(), want.float().to(got.device)
    row["max_abs_diff"] = (got - want).abs().max().item() if got.numel() else 0.0
    row["tolerance"] = tol
    row["ok"] = got.shape == want.shape and bool(torch.isclose(got, want, atol=tol, rtol=tol).all())


def require_cases_close(facts: dict) -> None:
    """Fail naming every case outside its tolerance; otherwise summarise the worst difference."""
    cases = facts.get("cases", {})
    bad = [
        f"{name} (max |diff| {row['max_abs_diff']}, tolerance {row['tolerance']})"
        for name, row in cases.items()
        if not row["ok"]
    ]
    if bad:
        raise StepFailed("outside tolerance against the PyTorch reference: " + "; ".join(bad))
    worst = max((row["max_abs_diff"] for row in cases.values()), default=0.0)
    facts["summary"] = f"{len(cases)} cases compiled, worst max |diff| {worst:.2g}"


def nccl_version() -> str:
    """The NCCL version this torch was built with, e.g. "2.27.3"."""
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def compiled_triton(facts: dict) -> torch.device:
    """The GPU, with Triton compiling kernels for it (never its interpreter); fails if it would interpret."""
    device = cuda_device()
    from infra_lib.kernels.triton_env import interpreter_active, load_triton

    triton, _ = load_triton()
    facts["triton"] = triton.__version__
    facts["compiled"] = not interpreter_active()
    if not facts["compiled"]:
        raise StepFailed(
            "Triton runs in its interpreter here (TRITON_INTERPRET=1 was set before triton was imported): "
            "nothing would be compiled; unset TRITON_INTERPRET and rerun"
        )
    return device


# --- chapter 01: timing and profiling --------------------------------------------------------------


def event_seconds(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of ``fn`` between two CUDA events recorded on the stream around it."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return sorted(samples)[len(samples) // 2]


def timing_step(facts: dict, quick: bool) -> None:
    device = cuda_device()
    from infra_lib.device import synchronizer
    from infra_lib.hardware.flops import achieved_tflops
    from infra_lib.timing import time_op

    n = 2048 if quick else 4096
    a, b = randn(n, n, device=device), randn(n, n, device=device, seed=1)
    synchronised = time_op(lambda: a @ b, sync=synchronizer(device))
    events = event_seconds(lambda: a @ b)
    launch_only = time_op(lambda: a @ b, sync=None)
    torch.cuda.synchronize()
    facts.update(
        n=n,
        dtype="float32",
        synchronised_ms=synchronised * 1e3,
        cuda_events_ms=events * 1e3,
        unsynchronised_ms=launch_only * 1e3,
        events_over_synchronised=events / synchronised,
        tflops=achieved_tflops(n, n, n, synchronised),
    )
    facts["summary"] = (
        f"{n}^3 GEMM: {synchronised * 1e3:.3g} ms synchronised, {events * 1e3:.3g} ms by events, "
        f"{launch_only * 1e3:.3g} ms unsynchronised"
    )
    if not 0.5 <= events / synchronised <= 2:
        raise StepFailed(
            f"time_op with torch.cuda.synchronize measured {synchronised * 1e3:.3g} ms but CUDA events "
            f"{events * 1e3:.3g} ms: they should agree within a factor of 2"
        )
    if launch_only >= synchronised:
        raise StepFailed(
            f"without synchronising, time_op measured {launch_only * 1e3:.3g} ms, not less than the "
            f"synchronised {synchronised * 1e3:.3g} ms: the launch should return before the GEMM ends"
        )


def profile_step(facts: dict, quick: bool) -> None:
    device = cuda_device()
    from infra_lib.kernels.profiling import dominant_op, profile_op, self_times

    n = 1024 if quick else 2048
    a, b = randn(n, n, device=device), randn(n, n, device=device, seed=1)
    prof = profile_op(lambda: a @ b, device)
    clock, times = self_times(prof)
    kernels = sorted((name for name, us in times.items() if us > 0), key=times.__getitem__, reverse=True)
    dominant = dominant_op(prof)
    facts.update(
        n=n, clock=clock, dominant=dominant, kernels=[{"name": k, "device_self_us": times[k]} for k in kernels[:8]]
    )
    if clock != "device":
        raise StepFailed(
            "the profile holds no GPU time: CUDA kernels were not recorded (is CUPTI, which "
            "torch.profiler reads them through, available to this process?)"
        )
    if dominant.startswith("aten::"):
        raise StepFailed(f"the dominant entry by device self time is the op {dominant!r}, not a kernel")
    compiled_triton(facts)  # a kernel of the course's own shows up under its Python name
    from infra_lib.kernels.softmax import softmax

    x = randn(256, 1000, device=device)
    _, triton_times = self_times(profile_op(lambda: softmax(x), device))
    facts["triton_kernels"] = sorted(name for name, us in triton_times.items() if us > 0)
    facts["summary"] = f"dominant: {dominant[:50]}; triton: {', '.join(facts['triton_kernels'])[:40]}"
    if "softmax_kernel" not in facts["triton_kernels"]:
        raise StepFailed(
            f"the course's Triton softmax ran but no kernel named softmax_kernel took device time: "
            f"{facts['triton_kernels']}"
        )


# --- the model and the engine on the GPU --------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a length counts), or None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def model_step(facts: dict, quick: bool) -> None:
    device = cuda_device()
    from infra_lib.model import greedy_decode, load_default, prompt_ids

    start = time.perf_counter()
    loaded = load_default()
    facts["load_s"] = round(time.perf_counter() - start, 2)
    tokenizer, new_tokens = loaded.tokenizer, 12 if quick else 24
    prompt = prompt_ids(tokenizer, PROMPT)
    on_gpu = copy.deepcopy(loaded.model).to(device)
    tokens = {
        "cpu": greedy_decode(loaded.model, prompt, new_tokens, stop_id=tokenizer.eos_id),
        "cuda": greedy_decode(on_gpu, prompt, new_tokens, stop_id=tokenizer.eos_id),
    }
    with on_gpu.using_backend("triton"):
        tokens["cuda.triton"] = greedy_decode(on_gpu, prompt, new_tokens, stop_id=tokenizer.eos_id)
    # The model as its GGUF file stores it (Q4_1 linears): decode steps through the fused 4-bit GEMV.
    from infra_lib.kernels.gemv_q4 import use_fused_q4
    from infra_lib.model.quant import load_gguf_q4_1

    q4_1 = load_gguf_q4_1().model.to(device)
    tokens["cuda.q4_1"] = greedy_decode(q4_1, prompt, new_tokens, stop_id=tokenizer.eos_id)
    use_fused_q4(q4_1)
    tokens["cuda.q4_1.fused"] = greedy_decode(q4_1, prompt, new_tokens, stop_id=tokenizer.eos_id)
    facts.update(
        prompt=PROMPT,
        tokens=tokens,
        answer=tokenizer.decode(tokens["cuda"], skip_special=True),
        cuda_first_difference_from_cpu=first_difference(tokens["cuda"], tokens["cpu"]),
        triton_first_difference_from_torch=first_difference(tokens["cuda.triton"], tokens["cuda"]),
        fused_q4_first_difference_from_stored=first_difference(tokens["cuda.q4_1.fused"], tokens["cuda.q4_1"]),
    )
    facts["summary"] = f"{len(tokens['cuda'])} tokens: {facts['answer'][:50]!r}"
    for name, key in (
        ("cuda against cpu", "cuda_first_difference_from_cpu"),
        ("the triton backend against torch on cuda", "triton_first_difference_from_torch"),
        ("the fused 4-bit GEMV against the stored Q4_1 path", "fused_q4_first_difference_from_stored"),
    ):
        if facts[key] is not None:
            raise StepFailed(f"greedy tokens differ, {name}, from token {facts[key]} on: {tokens}")


def engine_step(facts: dict, quick: bool) -> None:
    device = cuda_device()
    from infra_lib.model import SamplingParams, greedy_decode, load_default, prompt_ids
    from infra_lib.serving import LLM, LLMEngine, SchedulerConfig

    loaded = load_default()
    model = copy.deepcopy(loaded.model).to(device)
    prompts = [prompt_ids(loaded.tokenizer, p) for p in ENGINE_PROMPTS]
    new_tokens = 6 if quick else 16
    params = SamplingParams(max_new_tokens=new_tokens, stop_ids=())
    # A budget of 32 tokens a step cuts the longer prompts into prefill chunks beside running decodes.
    config = SchedulerConfig(block_size=16, num_blocks=64, max_num_batched_tokens=32)
    tokens, seconds = {}, {}
    for backend in ("torch", "triton"):
        start = time.perf_counter()
        engine = LLMEngine.from_model(model, config=config, attention_backend=backend)
        tokens[backend] = [o.token_ids for o in LLM(engine=engine).generate(prompts, params, use_tqdm=False)]
        seconds[backend] = round(time.perf_counter() - start, 3)
    alone = [greedy_decode(model, p, new_tokens) for p in prompts]
    facts.update(
        prompt_tokens=[len(p) for p in prompts],
        new_tokens=new_tokens,
        seconds=seconds,
        tokens=tokens,
        triton_equals_torch=tokens["triton"] == tokens["torch"],
        # informative: batch composition can change a GPU's rounding, so this may differ without a bug
        torch_equals_greedy_decode_alone=tokens["torch"] == alone,
    )
    facts["summary"] = (
        f"{len(prompts)} requests x {new_tokens} tokens; triton == torch: {facts['triton_equals_torch']}"
        f"; == greedy alone: {facts['torch_equals_greedy_decode_alone']}"
    )
    if not facts["triton_equals_torch"]:
        raise StepFailed(
            f"the engine's tokens differ between attention backends: torch {tokens['torch']}, triton {tokens['triton']}"
        )


# --- training: a collective over NCCL ------------------------------------------------------------------


def nccl_all_reduce_worker(rank: int, world_size: int, numel: int, seed: int) -> dict:
    """A ``run_workers`` worker on GPU ``rank``: ``dist.all_reduce`` and the course's ring, checked against the sum."""
    import torch.distributed as dist

    from infra_lib.training.collectives import ring_all_reduce

    torch.cuda.set_device(rank)
    draws = [torch.randn(numel, generator=torch.Generator().manual_seed(seed + r)) for r in range(world_size)]
    expected = torch.stack(draws).sum(0)
    result = {"device": torch.cuda.get_device_name(rank), "backend": dist.get_backend()}
    for name, reduce in (("all_reduce", dist.all_reduce), ("ring_all_reduce", ring_all_reduce)):
        tensor = draws[rank].cuda()
        reduce(tensor)
        torch.cuda.synchronize()
        result[f"{name}_max_abs_diff"] = (tensor.cpu() - expected).abs().max().item()
    return result


def nccl_step(facts: dict, quick: bool) -> None:
    cuda_device()
    import torch.distributed as dist

    from infra_lib.training.launcher import run_workers

    facts["nccl_available"] = dist.is_nccl_available()
    if not facts["nccl_available"]:
        raise StepFailed("this torch was built without NCCL (torch.distributed.is_nccl_available() is False)")
    facts["nccl"] = nccl_version()
    world = min(2, torch.cuda.device_count())  # NCCL takes one rank per GPU
    numel = 1 << (16 if quick else 22)
    facts.update(world_size=world, numel=numel)
    facts["ranks"] = run_workers(nccl_all_reduce_worker, world, (numel, SEED), timeout_s=120, backend="nccl")
    worst = max(r[key] for r in facts["ranks"] for key in ("all_reduce_max_abs_diff", "ring_all_reduce_max_abs_diff"))
    facts["summary"] = f"{world} rank(s), backend {facts['ranks'][0]['backend']}, worst max |diff| {worst:.2g}"
    if worst > 1e-4 * world:
        raise StepFailed(f"an all-reduce over NCCL is off the sum by up to {worst:.3g}: {facts['ranks']}")
