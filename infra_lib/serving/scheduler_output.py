"""What a scheduler is configured with and what one step's plan says: plain data.

``SchedulerConfig`` holds the limits of a step and the size of the KV pool. ``SchedulerOutput``
is the plan of one step: the sequences that run with their token counts (a prefill chunk or a
decode), who was admitted or preempted, prefix-cache hits, and the reasons the scheduler
stopped where it did. The runner executes it, plots and lab checks read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infra_lib.serving.sequence import Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step and the size of the KV pool.

    Attributes:
        max_num_seqs: most sequences running at once (the batch's rows).
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        block_size: token slots per KV block.
        num_blocks: blocks in the KV pool.
        enable_chunked_prefill: a prompt may be split over steps; off, it runs whole or waits.
        enable_prefix_caching: admissions reuse full blocks that already hold their prefix.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_blocks: int = 512
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's part of a step: positions ``start .. start + num_tokens - 1``."""

    seq_id: int
    num_tokens: int
    start: int  # num_computed_tokens before the step
    kind: str  # "prefill" (prompt, chunk or recompute) or "decode" (the one newest token)
    samples: bool  # the step reaches the last known token: the next token is sampled

    @property
    def context_len(self) -> int:
        """Keys this sequence's attention reads: every position up to its last new token."""
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs and why. Plain data: tests and plots read it, the runner executes it.

    Attributes:
        step: the step's index (0, 1, ...).
        token_budget: ``max_num_batched_tokens`` (``num_batched_tokens`` is what was used).
        scheduled: the sequences that run, in batch order (running ones oldest first, then admissions).
        admitted: ids moved from waiting to running in this step, in order.
        preempted: ids whose blocks were taken in this step, in order (newest first).
        num_cached_tokens: for each admitted id, the prompt tokens found in the prefix cache.
        reasons: why the scheduler stopped where it did, in words ("budget exhausted: ...",
            "max_num_seqs: ...", "out of blocks for seq 0 -> preempted seq 3", ...).
        num_running, num_waiting, num_free_blocks: the queues and the pool after scheduling.
    """

    step: int
    token_budget: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)  # admitted id -> prefix-cache hit
    reasons: list[str] = field(default_factory=list)
    num_running: int = 0  # after scheduling
    num_waiting: int = 0
    num_free_blocks: int = 0

    def add(self, seq: Sequence, num_tokens: int) -> None:
        """Record that ``seq`` computes its next ``num_tokens`` positions in this step."""
        start = seq.num_computed_tokens
        decode = bool(seq.output_ids) and start == seq.num_tokens - 1
        self.scheduled.append(
            ScheduledSeq(
                seq.seq_id, num_tokens, start, "decode" if decode else "prefill", start + num_tokens == seq.num_tokens
            )
        )

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.kind == "prefill")

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for s in self.scheduled if s.kind == "decode")

    @property
    def num_context_tokens(self) -> int:
        return sum(s.context_len for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def as_dict(self) -> dict:
        """The decisions as JSON-stable plain data (lists, no tuples or int keys): what lab checks compare."""
        return {
            "step": self.step,
            "scheduled": [[s.seq_id, s.num_tokens, s.kind] for s in self.scheduled],
            "admitted": list(self.admitted),
            "preempted": list(self.preempted),
            "num_cached_tokens": [[i, n] for i, n in self.num_cached_tokens.items()],
            "num_batched_tokens": self.num_batched_tokens,
        }
