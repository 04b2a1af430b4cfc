"""KV-cache memory waste: contiguous reservation against paged blocks, replayed on one seeded trace.

A backlog of requests, with prompt and output lengths drawn from long-tailed lognormal
distributions (at most MAX_CONTEXT tokens in all), is served from one fixed KV budget by:

* contiguous, max context: each sequence reserves MAX_CONTEXT slots in one extent when admitted,
  as a server must when it cannot know how long an answer will be;
* contiguous, exact: each sequence reserves exactly its final length (prompt + output) when
  admitted, as if the server knew every answer's length: the best an up-front reservation can do;
* paged, block size 1, 16 and 256: infra_lib's ``BlockPool``; a sequence takes one more block when
  its last block is full, and gives all of them back when it finishes.

Contiguous extents are placed first-fit in one address space, so holes open between them as
sequences finish. Every step, each running sequence writes one token, waiting requests are
admitted in order while memory allows (the admission step writes the whole prompt), and a
sequence holding prompt + output tokens finishes and frees its memory. A paged sequence that
needs a block when none is free preempts the most recently admitted sequence, which gives its
blocks back and later recomputes its tokens, as vLLM does. Only the books are kept, no tensors:
the result is the same on every machine, and the device only goes into the JSON.

Per allocator the result has:

* ``token_fraction``: of the slots sequences held, the fraction holding a token, over all steps
  (sum of tokens / sum of slots held); ``waste_fraction`` is the rest, split in ``held``;
* ``arena``: the whole budget while requests wait: tokens, ``reserved`` (held for tokens the
  sequence will write later), ``internal_fragmentation`` (held, never written),
  ``external_fragmentation`` (free, and enough in total for the next request, but in no single
  hole it fits) and ``free`` (too little for the next request);
* concurrency: sequences running at once while requests wait (mean and peak), and steps to
  serve the whole backlog.

Usage:
    python benchmarks/kv_waste.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import math
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from benchmark_cli import benchmark_main

from infra_lib.hardware.probes import machine_info
from infra_lib.serving import BlockPool, blocks_needed

SEED = 0
MAX_CONTEXT = 2048
BLOCK_SIZES = (1, 16, 256)
PROMPT_MEDIAN, PROMPT_SIGMA = 80, 1.2  # lognormal: median tokens and the log's standard deviation
OUTPUT_MEDIAN, OUTPUT_SIGMA = 220, 0.8
WATERMARK = 0.01  # paged admission keeps this fraction of blocks free for running sequences to grow into
FREE, TOKEN, RESERVED, NEVER_WRITTEN = 0, 1, 2, 3  # what one slot of the arena holds (slot_states)


@dataclass(frozen=True)
class Request:
    prompt_len: int
    output_len: int

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(eq=False)
class Sequence:
    """One request being served: ``tokens`` positions written, in ``blocks`` or an extent at ``start``."""

    request_id: int
    request: Request
    tokens: int = 0
    generated: int = 0  # output tokens written before a preemption; recomputed on readmission
    held: int = 0  # slots held
    start: int = -1
    blocks: list[int] = field(default_factory=list)


def make_trace(num_requests: int, seed: int = SEED, max_context: int = MAX_CONTEXT) -> list[Request]:
    """Requests with lognormal prompt and output lengths, each at most ``max_context`` tokens in all."""
    rng = random.Random(seed)
    trace = []
    for _ in range(num_requests):
        prompt = min(max_context - 1, max(1, round(rng.lognormvariate(math.log(PROMPT_MEDIAN), PROMPT_SIGMA))))
        output = min(max_context - prompt, max(1, round(rng.lognormvariate(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA))))
        trace.append(Request(prompt, output))
    return trace


class ContiguousAllocator:
    """One extent per sequence, ``reservation(request)`` slots long, placed first-fit in ``capacity`` slots."""

    def __init__(self, name: str, capacity: int, reservation: Callable[[Request], int]):
        self.name, self.capacity, self.reservation, self.block_size = name, capacity, reservation, None
        self.extents: dict[int, tuple[int, int]] = {}  # request id -> (start, length)

    def holes(self) -> list[tuple[int, int]]:
        """Free runs ``(start, length)`` in address order."""
        holes, cursor = [], 0
        for start, length in sorted(self.extents.values()):
            if start > cursor:
                holes.append((cursor, start - cursor))
            cursor = start + length
        if cursor < self.capacity:
            holes.append((cursor, self.capacity - cursor))
        return holes

    def free_slots(self) -> int:
        return self.capacity - sum(length for _, length in self.extents.values())

    def _first_fit(self, size: int) -> int | None:
        return next((start for start, length in self.holes() if length >= size), None)

    def can_admit(self, seq: Sequence, tokens: int) -> bool:
        return self._first_fit(self.reservation(seq.request)) is not None

    def fits_if_compacted(self, seq: Sequence) -> bool:
        return self.reservation(seq.request) <= self.free_slots()

    def admit(self, seq: Sequence, tokens: int) -> None:
        size = self.reservation(seq.request)
        seq.start, seq.held, seq.tokens = self._first_fit(size), size, tokens
        self.extents[seq.request_id] = (seq.start, size)

    def grow(self, seq: Sequence) -> bool:
        """Room for one more token: always, the reservation covers the final length."""
        seq.tokens += 1
        return True

    def release(self, seq: Sequence) -> None:
        del self.extents[seq.request_id]
        seq.start, seq.held = -1, 0

    def slot_ranges(self, seq: Sequence) -> list[tuple[int, int]]:
        """``(first slot, positions)`` runs holding the sequence's positions in order."""
        return [(seq.start, seq.held)]

    def check_invariants(self) -> None:
        cursor = 0
        for start, length in sorted(self.extents.values()):
            if start < cursor or length < 1:
                raise AssertionError(f"extent at {start} of {length} slots overlaps the one before (ends at {cursor})")
            cursor = start + length
        if cursor > self.capacity:
            raise AssertionError(f"extents reach slot {cursor}, past the arena's {self.capacity}")


class PagedAllocator:
    """Blocks from a ``BlockPool``, taken one at a time as a sequence's last block fills."""

    def __init__(self, capacity: int, block_size: int):
        self.name, self.block_size = f"paged, block size {block_size}", block_size
        self.pool = BlockPool(capacity // block_size, block_size)
        self.capacity = self.pool.num_blocks * block_size
        self.watermark = max(1, round(WATERMARK * self.pool.num_blocks))

    def free_slots(self) -> int:
        return self.pool.num_free * self.block_size

    def can_admit(self, seq: Sequence, tokens: int) -> bool:
        return blocks_needed(tokens, self.block_size) + self.watermark <= self.pool.num_free

    def fits_if_compacted(self, seq: Sequence) -> bool:
        return False  # any free block fits anywhere: free memory is never stranded in holes

    def admit(self, seq: Sequence, tokens: int) -> None:
        seq.blocks = self.pool.allocate(blocks_needed(tokens, self.block_size))
        seq.tokens, seq.held = tokens, len(seq.blocks) * self.block_size

    def grow(self, seq: Sequence) -> bool:
        """Room for one more token: a new block when the last one is full; False when none is free."""
        if seq.tokens == seq.held:
            if self.pool.num_free == 0:
                return False
            seq.blocks += self.pool.allocate(1)
            seq.held += self.block_size
        seq.tokens += 1
        return True

    def release(self, seq: Sequence) -> None:
        self.pool.free(list(reversed(seq.blocks)))
        seq.blocks, seq.held = [], 0

    def slot_ranges(self, seq: Sequence) -> list[tuple[int, int]]:
        return [(b * self.block_size, self.block_size) for b in seq.blocks]

    def check_invariants(self) -> None:
        self.pool.check_invariants()


def make_allocators(capacity: int, block_sizes=BLOCK_SIZES, max_context: int = MAX_CONTEXT) -> list:
    """The five allocators of the comparison, each over ``capacity`` slots."""
    return [
        ContiguousAllocator("contiguous, max context", capacity, lambda request: max_context),
        ContiguousAllocator("contiguous, exact length", capacity, lambda request: request.final_len),
        *(PagedAllocator(capacity, b) for b in block_sizes),
    ]


def slot_states(allocator, running: list[Sequence]) -> list[int]:
    """What each slot of the arena holds now: FREE, TOKEN, RESERVED (written later) or NEVER_WRITTEN."""
    states = [FREE] * allocator.capacity
    for seq in running:
        position = 0
        for first, count in allocator.slot_ranges(seq):
            for slot in range(first, first + count):
                states[slot] = (
                    TOKEN if position < seq.tokens else RESERVED if position < seq.request.final_len else NEVER_WRITTEN
                )
                position += 1
    return states


def replay(trace: list[Request], allocator, on_step: Callable | None = None) -> dict:
    """Serve the whole backlog; ``on_step(step, allocator, running, waiting)`` sees each step's state."""
    waiting = deque(Sequence(i, request) for i, request in enumerate(trace))
    running: list[Sequence] = []
    sums = dict.fromkeys(("tokens", "held", "reserved", "internal_fragmentation"), 0)
    arena = dict.fromkeys(("tokens", "reserved", "internal_fragmentation", "external_fragmentation", "free"), 0)
    step = saturated_steps = running_while_saturated = peak_running = preemptions = recomputed = 0
    while waiting or running:
        for seq in list(running):  # decode: every running sequence writes one more token, oldest first
            while seq.held and not allocator.grow(seq):  # a preempted sequence holds nothing
                victim = running.pop()  # the most recently admitted gives its memory back
                victim.generated = victim.tokens - victim.request.prompt_len
                allocator.release(victim)
                waiting.appendleft(victim)
                preemptions += 1
        while waiting:  # admit in order while memory allows; prefill writes prompt (+ recomputed tokens)
            seq = waiting[0]
            tokens = seq.request.prompt_len + seq.generated
            if not allocator.can_admit(seq, tokens):
                if not running:
                    raise RuntimeError(
                        f"request {seq.request_id} ({seq.request}) never fits in "
                        f"{allocator.capacity} slots with {allocator.name}: give it more memory"
                    )
                break
            allocator.admit(waiting.popleft(), tokens)
            recomputed += seq.generated
            running.append(seq)

        step_held = {
            "tokens": sum(s.tokens for s in running),
            "held": sum(s.held for s in running),
            "reserved": sum(min(s.held, s.request.final_len) - s.tokens for s in running),
            "internal_fragmentation": sum(max(0, s.held - s.request.final_len) for s in running),
        }
        for key, value in step_held.items():
            sums[key] += value
        peak_running = max(peak_running, len(running))
        if waiting:  # saturated: memory, not the backlog, limits how many sequences run
            saturated_steps += 1
            running_while_saturated += len(running)
            free = allocator.capacity - step_held["held"]
            stranded = free if allocator.fits_if_compacted(waiting[0]) else 0
            for key in ("tokens", "reserved", "internal_fragmentation"):
                arena[key] += step_held[key]
            arena["external_fragmentation"] += stranded
            arena["free"] += free - stranded
        if on_step is not None:
            on_step(step, allocator, running, waiting)
        for seq in running:
            if seq.tokens == seq.request.final_len:
                allocator.release(seq)
        running = [s for s in running if s.held]
        step += 1

    held = max(sums["held"], 1)
    arena_total = max(saturated_steps * allocator.capacity, 1)
    return {
        "name": allocator.name,
        "block_size": allocator.block_size,
        "capacity_slots": allocator.capacity,
        "token_fraction": sums["tokens"] / held,
        "waste_fraction": 1 - sums["tokens"] / held,
        "held": {key: sums[key] / held for key in ("tokens", "reserved", "internal_fragmentation")},
        "arena": {key: value / arena_total for key, value in arena.items()},
        "saturated_steps": saturated_steps,
        "mean_running_saturated": running_while_saturated / max(saturated_steps, 1),
        "peak_running": peak_running,
        "steps": step,
        "output_tokens_per_step": sum(r.output_len for r in trace) / step,
        "preemptions": preemptions,
        "recomputed_tokens": recomputed,
    }


def summarise(values: list[int]) -> dict:
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "max": ordered[-1],
    }


def plan(quick: bool) -> dict:
    """Backlog size and KV budget (in token slots, a multiple of MAX_CONTEXT and of every block size)."""
    return (
        {"num_requests": 400, "kv_budget_tokens": 16 * MAX_CONTEXT}
        if quick
        else {"num_requests": 2000, "kv_budget_tokens": 64 * MAX_CONTEXT}
    )


def run_kv_waste(device, quick: bool) -> dict:
    settings = plan(quick)
    trace = make_trace(settings["num_requests"])
    results = [replay(trace, allocator) for allocator in make_allocators(settings["kv_budget_tokens"])]
    baseline = results[0]
    for row in results:
        row["concurrency_vs_max_context"] = row["mean_running_saturated"] / baseline["mean_running_saturated"]
        row["throughput_vs_max_context"] = row["output_tokens_per_step"] / baseline["output_tokens_per_step"]
    return {
        "benchmark": "kv_waste",
        "machine_info": machine_info(device),
        "seed": SEED,
        "flags": {
            "quick": quick,
            "device": str(device),
            **settings,
            "max_context": MAX_CONTEXT,
            "block_sizes": list(BLOCK_SIZES),
            "watermark": WATERMARK,
            "prompt_lognormal": {"median": PROMPT_MEDIAN, "sigma": PROMPT_SIGMA},
            "output_lognormal": {"median": OUTPUT_MEDIAN, "sigma": OUTPUT_SIGMA},
        },
        "trace": {
            "prompt": summarise([r.prompt_len for r in trace]),
            "output": summarise([r.output_len for r in trace]),
            "final": summarise([r.final_len for r in trace]),
        },
        "allocators": results,
    }


def format_table(result: dict) -> str:
    flags, trace = result["flags"], result["trace"]
    lines = [
        (
            f"{flags['num_requests']} requests (mean prompt {trace['prompt']['mean']:.0f}, mean output "
            f"{trace['output']['mean']:.0f} tokens), KV budget {flags['kv_budget_tokens']:,} token slots, "
            f"max context {flags['max_context']}"
        ),
        f"{'allocator':26s} {'tokens/held':>11s} {'ext. frag':>9s} {'running':>8s} {'peak':>5s} {'vs max':>7s} "
        f"{'steps':>6s} {'preempt':>7s}",
    ]
    for row in result["allocators"]:
        lines.append(
            f"{row['name']:26s} {row['token_fraction']:11.1%} {row['arena']['external_fragmentation']:9.1%} "
            f"{row['mean_running_saturated']:8.1f} {row['peak_running']:5d} "
            f"{row['concurrency_vs_max_context']:6.1f}x {row['steps']:6d} {row['preemptions']:7d}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "kv_waste", run_kv_waste, format_table)


if __name__ == "__main__":
    sys.exit(main())
