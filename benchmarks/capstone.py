"""The capstone's engines side by side: the course's, one built from the instructor's lab answers, and
that one with a slow scheduler, on the same seeded requests in one run.

The learner's engine is assembled exactly as ``infra-lab capstone build`` assembles it (the
answer cells of labs 06-09, one function per lab, through ``infra_lib.serving.pieces``), from the
instructor's notebooks. The slow variant replaces its scheduler with one that sleeps 1.6 times the
median engine step before each step (about 2.6 times slower): what lab 16's throughput checks must
give partial credit.

Every engine serves the same requests offline (greedy, ``max_tokens`` each), in rounds that run
the three engines one after another, so a disturbance hits all three; each engine's best round
counts. Reported per engine: output tokens per second, its ratio to the course's engine, whether
its tokens equal the course's, the median decode-step time, and the throughput checks of lab 16
it would pass (a quarter and a half of the course's throughput).

Usage:
    python benchmarks/capstone.py [--quick] [--device cpu] [--out PATH]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.hardware.probes import machine_info
from infra_lib.model import SamplingParams, load_default
from infra_lib.serving.pieces import assemble
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
    from course_tools.capstone import solution_notebook_sources

    namespace: dict = {}
    for source in solution_notebook_sources().values():
        exec(source, namespace)  # noqa: S102 (the course's own solution cells)
    pieces = {}
    for lab in ("lab06_kv_cache", "lab07_paged_kv", "lab08_scheduler"):
        pieces.update(namespace[lab]())
    return pieces


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


def run_capstone(device: torch.device, quick: bool) -> dict:
    p = plan(quick)
    loaded = load_default()
    mine = instructor_pieces()
    engines = {"course": None, "instructor's answers": mine, "slow scheduler": slowed(mine)}
    serve_offline(loaded, mine, {**p, "max_tokens": 2})  # warm-up
    best: dict[str, dict] = {}
    for _ in range(p["rounds"]):
        for name, pieces in engines.items():
            result = serve_offline(loaded, pieces, p)
            if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = result
    course = best["course"]
    rows = {}
    for name, result in best.items():
        ratio = result["tokens_per_s"] / course["tokens_per_s"]
        rows[name] = {
            "tokens_per_s": round(result["tokens_per_s"], 2),
            "ratio": round(ratio, 3),
            "same_tokens": result["tokens"] == course["tokens"],
            "decode_step_ms": round(result["decode_step_ms"], 2),
            "passes": {"a quarter (1 point)": ratio >= 0.25, "a half (2 points)": ratio >= 0.5},
        }
    return {
        "benchmark": "capstone",
        "machine_info": machine_info(device),
        "load_average": load_average(),
        "seed": SEED,
        "flags": {"quick": quick, "device": str(device), "model": "SmolLM2-135M-Instruct", "slow_factor": 1.6, **p},
        "plan": p,
        "engines": rows,
    }


def format_table(result: dict) -> str:
    p = result["plan"]
    lines = [
        f"{p['requests']} requests x {p['max_tokens']} tokens, batch {p['max_num_seqs']}, best of "
        f"{p['rounds']} interleaved round(s)",
        f"{'engine':<22}{'tok/s':>8}{'ratio':>8}{'step ms':>9}  same tokens  throughput checks passed",
    ]
    for name, row in result["engines"].items():
        passed = ", ".join(k for k, v in row["passes"].items() if v) or "none"
        lines.append(
            f"{name:<22}{row['tokens_per_s']:>8.2f}{row['ratio']:>8.2f}{row['decode_step_ms']:>9.1f}  "
            f"{str(row['same_tokens']):<11}  {passed}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "capstone", run_capstone, format_table)


if __name__ == "__main__":
    sys.exit(main())
