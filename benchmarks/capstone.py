"""The capstone's engines side by side: the course's, one built from the instructor's lab answers, one
from answers written the way a learner writes them, and the instructor's with a slow scheduler, on the
same seeded requests in one run.

The learner's engines are assembled exactly as ``infra-lab capstone build`` assembles them (one function
per lab returning its pieces, through ``infra_lib.serving.pieces``): the instructor's from the
instructor's notebooks; the learner-style one from ``tests/learner_style/`` (the model, attention,
pool, batched step, scheduler and engine loop written from the labs' text alone, the plain way: kept
in the tests so that the labs stay passable by it). The slow variant replaces the instructor's scheduler
with one that sleeps 1.6 times the median engine step before each step (about 2.6 times slower): what
lab 16's throughput checks must give partial credit.

Every engine serves the same requests offline (greedy, ``max_tokens`` each) on one torch thread, as lab
16's throughput check does, in rounds that run the engines one after another, so a disturbance hits all
of them; each engine's ratio is the median over the rounds of its tokens per second over the course's in
the same round. Reported per engine: output tokens per second (median), the ratio, whether its tokens
equal the course's, a decode step's time split into scheduler, attention, the rest of the model and the
loop (the fastest of the measured steps), and the throughput checks of lab 16 it would pass (a quarter
and a half of the course's throughput).

Usage:
    python benchmarks/capstone.py [--quick] [--device cpu] [--out PATH]
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info
from infra_lib.model import SamplingParams, load_default
from infra_lib.serving.pieces import assemble, decode_step_profile
from infra_lib.serving.scheduler_output import SchedulerConfig

SEED = 0
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "What is Python?",
    "How many legs does a spider have?",
    "What is the opposite of cold?",
    "Name a planet in the solar system.",
]


def plan(quick: bool) -> dict:
    if quick:
        return {"requests": 2, "max_tokens": 3, "rounds": 1, "max_num_seqs": 2}
    return {"requests": 8, "max_tokens": 24, "rounds": 3, "max_num_seqs": 8}


def instructor_pieces() -> dict:
    """The engine pieces of the instructor's answers to labs 06-08, as the capstone build makes them."""
    from course_tools.capstone import solution_functions

    functions, pieces = solution_functions(), {}
    for lab in ("lab06_kv_cache", "lab07_paged_kv", "lab08_scheduler"):
        pieces.update(functions[lab]())
    return pieces


LEARNER_STYLE = Path(__file__).resolve().parents[1] / "tests" / "learner_style" / "pieces.py"


def learner_style_pieces() -> dict:
    """The engine pieces written the way a learner writes them (``tests/learner_style/pieces.py``)."""
    spec = importlib.util.spec_from_file_location("learner_style_pieces", LEARNER_STYLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.engine_pieces()


def slowed(pieces: dict, factor: float = 1.6) -> dict:
    """``pieces`` with a scheduler that first sleeps ``factor`` times the median work seen between two of its
    calls (one engine step): it follows the machine's load, and a busy moment does not lengthen it much."""
    schedule, state = pieces["schedule"], {"last": None, "gaps": []}

    def slow_schedule(self):
        if state["last"] is not None:
            state["gaps"].append(time.perf_counter() - state["last"])
            time.sleep(factor * statistics.median(state["gaps"]))
        out = schedule(self)
        state["last"] = time.perf_counter()
        return out

    return {**pieces, "schedule": slow_schedule}


def serve_offline(loaded, pieces, p: dict) -> dict:
    config = SchedulerConfig(
        max_num_seqs=p["max_num_seqs"],
        max_num_batched_tokens=256,
        block_size=16,
        num_blocks=128,
        enable_prefix_caching=False,
    )
    engine = assemble(loaded.model, loaded.tokenizer, config, pieces)
    ids = [
        engine.add_request([{"role": "user", "content": q}], SamplingParams(max_new_tokens=p["max_tokens"]))
        for q in QUESTIONS[: p["requests"]]
    ]
    steps = []
    start = time.perf_counter()
    with torch.inference_mode():
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            if engine.steps and engine.steps[-1].output.num_prefill_tokens == 0:  # a step of decodes only
                steps.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - start
    tokens = [engine.output(i).token_ids for i in ids]
    return {
        "tokens_per_s": sum(map(len, tokens)) / seconds,
        "decode_step_ms": 1000 * statistics.median(steps or [0]),
        "tokens": tokens,
    }


def step_profile(loaded, pieces, steps: int) -> dict:
    """One decode step of four sequences split into scheduler, attention, the rest of the model and the
    loop, in ms (the fastest of ``steps`` steps): ``infra_lib.serving.pieces.decode_step_profile``."""
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=256, block_size=16, num_blocks=64, enable_prefix_caching=False
    )
    engine = assemble(loaded.model, loaded.tokenizer, config, pieces)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    return {k: round(v, 2) for k, v in decode_step_profile(engine, prompts, steps).items()}


def run_capstone(device: torch.device, quick: bool) -> dict:
    p = plan(quick)
    loaded = load_default()
    mine = instructor_pieces()
    engines = {"course": None, "instructor's answers": mine, "learner-style answers": learner_style_pieces()}
    engines["slow scheduler"] = slowed(mine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as lab 16's throughput check: many small operations do not wait on a busy thread
    try:
        for pieces in engines.values():
            serve_offline(loaded, pieces, {**p, "max_tokens": 2})  # warm-up
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(p["rounds"]):
            for name, pieces in engines.items():
                runs[name].append(serve_offline(loaded, pieces, p))
        profiles = {name: step_profile(loaded, pieces, 2 if quick else 6) for name, pieces in engines.items()}
    finally:
        torch.set_num_threads(threads)
    course = runs["course"]
    rows = {}
    for name, results in runs.items():
        ratio = statistics.median(r["tokens_per_s"] / c["tokens_per_s"] for r, c in zip(results, course))
        rows[name] = {
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in results), 2),
            "ratio": round(ratio, 3),
            "same_tokens": all(r["tokens"] == course[0]["tokens"] for r in results),
            "decode_step_ms": round(statistics.median(r["decode_step_ms"] for r in results), 2),
            "step_profile_ms": profiles[name],
            "pieces": sorted(engines[name] or {}),
            "passes": {"a quarter (1 point)": ratio >= 0.25, "a half (2 points)": ratio >= 0.5},
        }
    return {
        "benchmark": "capstone",
        "machine_info": machine_info(device),
        "load_average": load_average(),
        "seed": SEED,
        "flags": {
            "quick": quick,
            "device": str(device),
            "model": "SmolLM2-135M-Instruct",
            "slow_factor": 1.6,
            "torch_threads": 1,
            **p,
        },
        "plan": p,
        "engines": rows,
    }


def format_table(result: dict) -> str:
    p = result["plan"]
    lines = [
        f"{p['requests']} requests x {p['max_tokens']} tokens, batch {p['max_num_seqs']}, median of "
        f"{p['rounds']} interleaved round(s), one torch thread",
        f"{'engine':<24}{'tok/s':>8}{'ratio':>8}{'step ms':>9}  same tokens  throughput checks passed",
    ]
    for name, row in result["engines"].items():
        passed = ", ".join(k for k, v in row["passes"].items() if v) or "none"
        lines.append(
            f"{name:<24}{row['tokens_per_s']:>8.2f}{row['ratio']:>8.2f}{row['decode_step_ms']:>9.1f}  "
            f"{str(row['same_tokens']):<11}  {passed}"
        )
    lines.append(
        f"\n{'one decode step, 4 sequences (ms)':<36}{'scheduler':>10}{'attention':>10}{'model':>8}{'loop':>8}"
    )
    for name, row in result["engines"].items():
        prof = row["step_profile_ms"]
        lines.append(
            f"{name:<36}{prof['scheduler']:>10.2f}{prof['attention']:>10.2f}{prof['model']:>8.2f}{prof['loop']:>8.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "capstone", run_capstone, format_table)


if __name__ == "__main__":
    sys.exit(main())
