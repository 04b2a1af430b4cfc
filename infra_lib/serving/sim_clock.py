"""A simulated clock: scheduling experiments without running the model.

What a step costs depends on its shape, not on the tokens' values. A linear model captures
the parts that matter:

    cost = fixed                                   (launch, Python, sampling: every step pays it)
         + per_prefill_token * prefill_tokens      (weights applied to each prompt token: compute)
         + per_decode_seq    * decode_seqs         (one row per decoding sequence)
         + kv_read_per_token * context_tokens      (keys and values attention reads)

``calibrate(model)`` times real steps of the ``ModelRunner`` on this machine at a few shapes
and fits the four coefficients by least squares. A ``SimulatedRunner`` then stands in for the
model: it emits a dummy token per sampling sequence and advances a ``SimClock`` by the
predicted cost, so the real ``Scheduler`` and ``LLMEngine`` replay hundreds of requests in a
second, deterministically: TTFT, TPOT, throughput and preemptions, with no model at all.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

import numpy as np

from infra_lib.model.model import Llama
from infra_lib.serving.block_pool import BlockPool
from infra_lib.serving.block_table import blocks_needed
from infra_lib.serving.kv_store import PagedKVStore
from infra_lib.serving.model_runner import ModelRunner
from infra_lib.serving.scheduler_output import ScheduledSeq
from infra_lib.serving.sequence import Sequence
from infra_lib.timing import time_op

COEFFICIENTS = ("fixed_s", "per_prefill_token_s", "per_decode_seq_s", "kv_read_per_token_s")


class SimClock:
    """Time that moves only when told to: ``advance(seconds)`` or ``advance_to(t)``."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back {seconds} s")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, float(t))


def step_shape(scheduled) -> tuple[int, int, int]:
    """``(prefill_tokens, decode_seqs, context_tokens)`` of a step's ``ScheduledSeq`` list."""
    prefill = sum(s.num_tokens for s in scheduled if s.kind == "prefill")
    decodes = sum(1 for s in scheduled if s.kind == "decode")
    return prefill, decodes, sum(s.context_len for s in scheduled)


@dataclass(frozen=True)
class StepCostModel:
    """Seconds one engine step takes, linear in the step's shape (see the module docstring).

    ``measurements`` holds the calibration points ``(prefill_tokens, decode_seqs, context_tokens,
    seconds)`` when the model came from ``calibrate``.
    """

    fixed_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    kv_read_per_token_s: float
    measurements: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        bad = {name: getattr(self, name) for name in COEFFICIENTS if not getattr(self, name) >= 0}
        if bad:
            raise ValueError(f"step-cost coefficients must be >= 0 seconds, got {bad}")

    def cost(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (
            self.fixed_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_seq_s * decode_seqs
            + self.kv_read_per_token_s * context_tokens
        )

    def step_cost(self, scheduled) -> float:
        """Cost of a step given its ``ScheduledSeq`` list (or a ``SchedulerOutput``'s ``scheduled``)."""
        return self.cost(*step_shape(scheduled))

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in COEFFICIENTS}


class SimulatedRunner:
    """The engine's runner without a model: a dummy token per sampling sequence, time from a cost model.

    A request's output length is its ``max_new_tokens`` (the dummy token stops nothing), so a
    workload fixes every request's prompt and output length in advance.

    Args:
        cost_model: seconds per step.
        clock: the clock to advance (a new ``SimClock`` by default); the engine reads the same one.
        token_id: the token every step emits.
        max_position: the context limit the engine enforces.
    """

    def __init__(
        self, cost_model: StepCostModel, clock: SimClock | None = None, token_id: int = 0, max_position: int = 1 << 20
    ):
        self.cost_model, self.clock = cost_model, clock or SimClock()
        self.token_id, self.max_position = token_id, max_position

    def run(self, batch) -> dict[int, int]:
        self.clock.advance(self.cost_model.step_cost([s for _, s in batch]))
        return {seq.seq_id: self.token_id for seq, s in batch if s.samples}


def calibration_shapes(max_context: int = 256) -> list[list[tuple[int, int]]]:
    """Steps to time, each a list of ``(start, num_tokens)`` per sequence: prefills of several
    lengths, a chunk late in a long prompt, decode batches at short and long contexts, and a mix
    (for ``max_context=256``: prefills of 16, 64 and 128 tokens, decodes of 1, 4 and 8 sequences)."""
    if max_context < 16:
        raise ValueError(f"max_context must be at least 16 tokens, got {max_context}")
    quarter, chunk = max_context // 4, max_context // 8
    steps = [[(0, n)] for n in (max_context // 16, quarter, max_context // 2)] + [[(max_context - chunk, chunk)]]
    for batch in (1, 4, 8):
        for context in (max_context // 16, max_context):
            steps.append([(context - 1, 1)] * batch)
    steps.append([(0, quarter)] + [(max_context // 2 - 1, 1)] * 4)
    return steps


def calibrate(
    model: Llama,
    *,
    block_size: int = 16,
    max_context: int = 256,
    iters: int = 3,
    shapes: list[list[tuple[int, int]]] | None = None,
    seed: int = 0,
) -> StepCostModel:
    """Fit a ``StepCostModel`` to real ``ModelRunner`` steps timed on this machine.

    Each step shape (default ``calibration_shapes(max_context)``) runs on random token ids through a
    scratch paged store and is timed with ``time_op``, ``iters`` rounds over all shapes (median per
    shape). The fit is least squares
    on relative error (a 20 ms decode step matters as much as a 500 ms prefill), with coefficients
    kept non-negative by dropping the most negative one and fitting the rest again, until none is.
    Other work on the machine while it runs inflates the times: calibrate on a quiet machine.
    """
    if max_context > model.config.max_position:
        raise ValueError(f"max_context {max_context} exceeds the model's context {model.config.max_position}")
    shapes = shapes or calibration_shapes(max_context)
    rng = random.Random(seed)
    per_step = [sum(blocks_needed(start + n, block_size) for start, n in step) for step in shapes]
    pool = BlockPool(max(per_step), block_size)
    weight = model.embed_tokens.weight
    runner = ModelRunner(
        model, PagedKVStore.for_model(model.config, pool.num_blocks, block_size, weight.dtype, weight.device)
    )
    batches = []
    for step in shapes:
        batch = []
        for i, (start, n) in enumerate(step):
            seq = Sequence(i, [rng.randrange(model.config.vocab_size) for _ in range(start + n)], block_size=block_size)
            seq.block_table.blocks = pool.allocate(blocks_needed(start + n, block_size))
            seq.num_computed_tokens = start
            kind = "prefill" if n > 1 or start == 0 else "decode"
            batch.append((seq, ScheduledSeq(i, n, start, kind, True)))
        for seq, _ in batch:  # the next step may reuse the blocks: their contents do not change the timing
            pool.free(seq.block_table.blocks)
        batches.append(batch)
    # Rounds over all shapes, not iters of one shape in a row: a burst of other load on the machine
    # then spoils one sample of many shapes (the median drops it) instead of every sample of one.
    samples = [[] for _ in batches]
    for round_index in range(iters):
        for batch, times in zip(batches, samples):
            times.append(time_op(lambda batch=batch: runner.run(batch), warmup=int(round_index == 0), iters=1))
    rows = [step_shape([s for _, s in batch]) for batch in batches]
    seconds = [statistics.median(times) for times in samples]
    coefficients = fit_step_costs(rows, seconds)
    return StepCostModel(*coefficients, measurements=tuple((*r, s) for r, s in zip(rows, seconds)))


def fit_step_costs(shapes: list[tuple[int, int, int]], seconds: list[float]) -> list[float]:
    """Non-negative least squares (relative error) of ``seconds`` on ``[1, prefill, decodes, context]``."""
    x = np.array([[1.0, *shape] for shape in shapes]) / np.array(seconds)[:, None]
    y = np.ones(len(seconds))
    active = list(range(4))
    while True:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            break
        del active[int(np.argmin(solution))]  # the most negative coefficient goes, the rest are refitted
    coefficients = [0.0] * 4
    for a, c in zip(active, solution):
        coefficients[a] = float(c)
    return coefficients
