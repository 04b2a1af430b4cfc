"""One request inside the engine: its tokens, how many have K/V in the cache, and its blocks.

A sequence moves through four states:

    WAITING --admit--> RUNNING --finish--> FINISHED (stop / length / abort)
                          |  ^
                   preempt|  |admit again (recompute every token known so far)
                          v  |
                       PREEMPTED (back at the front of the waiting queue, no blocks)

``token_ids`` is the prompt followed by the generated tokens. ``num_computed_tokens`` counts
the positions whose keys and values are in the KV store, so the work left before the next
token can be sampled is ``num_tokens - num_computed_tokens``: the whole prompt at first (the
prefill, perhaps in chunks), then 1 per step (the decode), and everything again after a
preemption threw the blocks away.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from infra_lib.model.sampling import SamplingParams
from infra_lib.serving.block_table import BlockTable

FINISH_REASONS = ("stop", "length", "abort")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """When things happened to one request, in the engine's clock (seconds), and what it cost.

    Attributes:
        arrival_time: the request entered the engine.
        first_scheduled_time: its first tokens were in a step (None until then).
        first_token_time: its first output token existed.
        finish_time: it finished (stop, length or abort).
        token_times: when each output token existed.
        num_preemptions: times its blocks were taken away and its tokens recomputed.
        num_cached_tokens: prompt tokens found in the prefix cache at its first admission.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        """Time to first token: arrival to the first output token."""
        return float("nan") if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float:
        return float("nan") if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        return float("nan") if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float:
        """Time per output token after the first (mean inter-token gap); nan with fewer than 2 tokens."""
        if len(self.token_times) < 2:
            return float("nan")
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


class Sequence:
    """One request's state in the scheduler.

    Args:
        seq_id: the request id.
        prompt_ids: the prompt's token ids (at least one).
        params: sampling and stopping rules (``max_new_tokens`` bounds the output).
        block_size: slots per KV block (the scheduler's).
        arrival_index: order of arrival; the waiting queue is FCFS in this order.
        arrival_time: clock time of arrival.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_ids: list[int],
        params: SamplingParams = SamplingParams(),
        block_size: int = 16,
        arrival_index: int = 0,
        arrival_time: float = 0.0,
    ):
        if not prompt_ids:
            raise ValueError(f"request {seq_id} has an empty prompt: give it at least one token")
        self.seq_id, self.params = seq_id, params
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.output_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # positions whose K/V are in the store
        self.block_table = BlockTable(block_size)
        self.arrival_index = arrival_index
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = params.generator()  # per-request RNG, survives preemption
        self.metrics = RequestMetrics(arrival_time)
        self.max_tokens = len(self.prompt_ids) + params.max_new_tokens  # the engine may lower it (context)
        self.stop_ids: frozenset[int] = frozenset(params.stop_ids or ())
        self.stop_strings: tuple[str, ...] = ()
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_prompt_tokens}+"
            f"{len(self.output_ids)}, computed={self.num_computed_tokens}, blocks={self.block_table.blocks})"
        )
