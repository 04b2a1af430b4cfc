"""The scheduler: which sequences run in the next step, and how many tokens each computes.

Continuous batching decides per **step** (one forward pass), not per batch of requests. Each
step has a **token budget** (``max_num_batched_tokens``):

1. running sequences first, oldest first: a decode costs 1 token, a sequence still in its
   prefill gets as much of the rest of its prompt as the budget allows (a *chunk*);
2. then new sequences from the waiting queue, in arrival order (FCFS), while the budget,
   ``max_num_seqs`` and the free blocks allow; a prefix-cache hit skips the cached tokens.

Chunked prefill is nothing more than step 2 cutting a prompt at the remaining budget. Blocks
are reserved for exactly the tokens scheduled. When a running sequence cannot get a block,
the most recently admitted running sequence is **preempted**: its blocks are freed, it goes
back to the front of the waiting queue and is recomputed later. A new sequence never causes
a preemption, and a step that preempted admits nobody.
"""

from __future__ import annotations

from collections import deque

from infra_lib.serving.block_pool import BlockPool
from infra_lib.serving.block_table import blocks_needed
from infra_lib.serving.prefix_cache import HashPrefixCache
from infra_lib.serving.scheduler_output import (  # noqa: F401
    ScheduledSeq,
    SchedulerConfig,
    SchedulerOutput,
)
from infra_lib.serving.sequence import Sequence, SequenceStatus


class Scheduler:
    """Two deques of sequences and a block pool; ``schedule()`` plans a step, ``commit()`` books it."""

    def __init__(self, config: SchedulerConfig = SchedulerConfig(), pool: BlockPool | None = None):
        if pool is None:
            cache = HashPrefixCache(config.block_size) if config.enable_prefix_caching else None
            pool = BlockPool(config.num_blocks, config.block_size, cache)
        if (pool.num_blocks, pool.block_size) != (config.num_blocks, config.block_size):
            raise ValueError(
                f"the pool has {pool.num_blocks} blocks of {pool.block_size} but the config says "
                f"{config.num_blocks} of {config.block_size}: build both from the same numbers"
            )
        self.config, self.pool = config, pool
        self.waiting: deque[Sequence] = deque()  # FCFS; a preempted sequence re-enters at the front
        self.running: deque[Sequence] = deque()  # admission order: running[-1] is the newest
        self.num_steps = 0
        self._scheduled: dict[int, int] = {}  # seq_id -> tokens scheduled and not yet committed

    # --- the step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running sequences oldest first, then admissions in arrival order."""
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(self.num_steps, budget)
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                break  # preempted in this step to make room for an older sequence
            if budget == 0:
                out.reasons.append(f"budget exhausted: running seq {seq.seq_id} and later wait a step")
                break
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.make_room(seq, n, out):
                break
            self.reserve(seq, n)
            out.add(seq, n)
            budget -= n
        while self.waiting and not out.preempted:
            seq = self.waiting[0]
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                out.reasons.append(f"{'budget exhausted' if budget == 0 else 'max_num_seqs'}: seq {seq.seq_id} waits")
                break
            cached = self.cached_tokens(seq)
            n = seq.num_tokens - cached
            if n > budget and not self.config.enable_chunked_prefill:
                out.reasons.append(f"prefill of {n} tokens > budget left {budget}: seq {seq.seq_id} waits")
                break
            n = min(n, budget)
            if not self.can_admit(seq, n):
                out.reasons.append(f"out of blocks: seq {seq.seq_id} waits")
                break
            self.admit(seq, n)
            out.admitted.append(seq.seq_id)
            out.num_cached_tokens[seq.seq_id] = cached
            out.add(seq, n)
            budget -= n
        if out.preempted and self.waiting:
            out.reasons.append("a step that preempts admits nobody")
        self.num_steps += 1
        self._scheduled = {s.seq_id: s.num_tokens for s in out.scheduled}
        out.num_running, out.num_waiting, out.num_free_blocks = len(self.running), len(self.waiting), self.pool.num_free
        return out

    def make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until ``seq`` can reserve; False if ``seq`` itself went."""
        while not self.can_reserve(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim.seq_id)
            out.reasons.append(f"out of blocks for seq {seq.seq_id} -> preempted seq {victim.seq_id}")
            if victim is seq:
                return False
        return True

    def commit(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled positions are computed; full blocks join the prefix cache."""
        for s in out.scheduled:
            seq = self._find(s.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted during the step
            seq.num_computed_tokens += s.num_tokens
            full = seq.num_computed_tokens // self.config.block_size
            if self.pool.prefix_cache is not None and full > s.start // self.config.block_size:
                self.pool.cache_blocks(seq.token_ids[: full * self.config.block_size], seq.block_table.blocks[:full])
        self._scheduled = {}

    # --- predicate / action pairs ----------------------------------------------------------------

    def blocks_to_reserve(self, seq: Sequence, num_tokens: int) -> int:
        needed = blocks_needed(seq.num_computed_tokens + num_tokens, self.config.block_size)
        return max(0, needed - len(seq.block_table))

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_to_reserve(seq, num_tokens) <= self.pool.num_free

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for ``seq``'s next ``num_tokens`` positions (a running sequence's table grows)."""
        seq.block_table.blocks += self.pool.allocate(self.blocks_to_reserve(seq, num_tokens))

    def cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose K/V the prefix cache already holds (whole blocks)."""
        return len(self.pool.cached_prefix(seq.token_ids)) * self.config.block_size

    def can_admit(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether blocks for the cached prefix plus ``num_tokens`` more can be found."""
        head = seq.token_ids[: self.cached_tokens(seq) + num_tokens]
        return self.pool.can_allocate_prompt(head)

    def admit(self, seq: Sequence, num_tokens: int) -> None:
        """Move the front of the waiting queue to running, with blocks for its cached prefix plus
        ``num_tokens`` (cache hits are shared, counted as computed)."""
        if not self.waiting or self.waiting[0] is not seq:
            raise ValueError(f"seq {seq.seq_id} is not at the front of the waiting queue (FCFS)")
        cached = self.cached_tokens(seq)
        seq.block_table.blocks, hit = self.pool.allocate_prompt(seq.token_ids[: cached + num_tokens])
        self.waiting.popleft()
        seq.num_computed_tokens, seq.status = hit, SequenceStatus.RUNNING
        if seq.metrics.num_preemptions == 0:  # the first admission
            seq.metrics.num_cached_tokens = hit
        self.running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and put it at the front of the waiting queue (recompute)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    # --- requests coming and going ----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of either queue for good (stop, length, abort), freeing its blocks."""
        (self.running if seq in self.running else self.waiting).remove(seq)
        self._release(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(list(reversed(seq.block_table.blocks)))  # tail first: the shared head lives longest
        seq.block_table.blocks, seq.num_computed_tokens = [], 0
        self._scheduled.pop(seq.seq_id, None)

    def _find(self, seq_id: int) -> Sequence | None:
        return next((s for s in self.running if s.seq_id == seq_id), None)

    # --- checks --------------------------------------------------------------------------------------

    def check_output(self, out: SchedulerOutput) -> None:
        """A step's plan respects the limits: budget, max_num_seqs, each sequence once with >= 1 token,
        none both scheduled and preempted, whole prompts only when chunked prefill is off."""
        cfg = self.config
        if out.num_batched_tokens > cfg.max_num_batched_tokens:
            raise AssertionError(
                f"step {out.step} scheduled {out.num_batched_tokens} tokens, budget {cfg.max_num_batched_tokens}"
            )
        ids = [s.seq_id for s in out.scheduled]
        if len(ids) > cfg.max_num_seqs or len(set(ids)) != len(ids) or any(s.num_tokens < 1 for s in out.scheduled):
            raise AssertionError(
                f"step {out.step} schedules {ids}: at most {cfg.max_num_seqs} distinct sequences, "
                "each with at least one token"
            )
        both = [i for i in ids if i in out.preempted]
        if both:
            raise AssertionError(f"step {out.step} scheduled seq {both} and preempted it in the same step")
        if not cfg.enable_chunked_prefill and not all(s.samples for s in out.scheduled):
            raise AssertionError(f"step {out.step} split a prefill although chunked prefill is off")

    def check_invariants(self) -> None:
        """Limits respected, queues disjoint, every running sequence holds exactly the blocks for its
        computed + scheduled tokens, waiting ones hold none, block counts match the tables, pool sound."""
        cfg = self.config
        if len(self.running) > cfg.max_num_seqs:
            raise AssertionError(f"{len(self.running)} sequences running, max_num_seqs is {cfg.max_num_seqs}")
        ids = [s.seq_id for s in self.running] + [s.seq_id for s in self.waiting]
        if len(set(ids)) != len(ids):
            raise AssertionError(
                f"a sequence is queued twice: running {[s.seq_id for s in self.running]}, "
                f"waiting {[s.seq_id for s in self.waiting]}"
            )
        holders = [0] * self.pool.num_blocks
        for seq in self.running:
            pending = self._scheduled.get(seq.seq_id, 0)
            if seq.status is not SequenceStatus.RUNNING or not 0 <= seq.num_computed_tokens < seq.num_tokens:
                raise AssertionError(f"running {seq} has the wrong status or computed count")
            want = blocks_needed(seq.num_computed_tokens + pending, cfg.block_size)
            if len(seq.block_table) != want:
                raise AssertionError(
                    f"{seq} holds {len(seq.block_table)} blocks; its computed + scheduled tokens need {want}"
                )
            seq.block_table.check_invariants()
            written = seq.block_table.block_indices(seq.num_computed_tokens, seq.num_computed_tokens + pending)
            shared = [seq.block_table.blocks[i] for i in written if self.pool.ref_count(seq.block_table.blocks[i]) != 1]
            if shared:
                raise AssertionError(f"{seq} is about to write blocks {shared}, which are shared")
            for b in seq.block_table.blocks:
                holders[b] += 1
        for seq in self.waiting:
            if (
                seq.status not in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
                or seq.block_table.blocks
                or seq.num_computed_tokens
            ):
                raise AssertionError(f"waiting {seq} must hold no blocks and no computed tokens")
        counts = [self.pool.ref_count(b) for b in range(self.pool.num_blocks)]
        if counts != holders:
            leaked = [b for b in range(self.pool.num_blocks) if counts[b] != holders[b]]
            raise AssertionError(f"blocks {leaked} have reference counts that differ from the tables holding them")
        self.pool.check_invariants()
