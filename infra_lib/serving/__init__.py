"""Serving (L4/L5): paged KV blocks, copy-on-write, prefix caching, PagedAttention.

    BlockPool          reference-counted blocks, LRU free queue, copy-on-write (block_pool.py)
    PrefixCache        full blocks found by their chained hash or in a radix tree (prefix_cache.py,
                       radix_cache.py)
    BlockTable         a sequence's blocks and its slot mapping (block_table.py)
    PagedKVStore       the K/V tensors, [num_blocks, block_size, n_kv_heads, head_dim] per layer
    PagedKVCache       one sequence's view, the model's KVCache interface (paged_kv.py)
    paged_attention    attention through block tables (paged_attention.py)

Continuous batching (chapter 08): sequence.py, scheduler.py, model_runner.py, engine.py, llm.py,
sim_clock.py, workload.py. The serving system (chapters 10-11): events.py (the engine's request
lifecycle log), observability.py (vLLM-named Prometheus metrics from it), async_engine.py (the
engine on its own thread, fed from asyncio) and server.py (the OpenAI-compatible HTTP server;
import it from ``infra_lib.serving.server``, it pulls in FastAPI). The capstone (chapter 16): pieces.py
assembles an engine with a learner's cached attention, block pool, scheduler step and acceptance
rule in place of the course's, one seam each.

Beyond one engine: router.py (an OpenAI-compatible router over N replica processes,
round-robin, least-loaded or prefix-cache-aware; import it from ``infra_lib.serving.router``, it
pulls in FastAPI) and replicas.py (starting and stopping them); disaggregated.py and
disaggregated_workers.py (prefill and decode in two processes, the prompt's KV blocks handed over
with pack_kv and install_kv over gloo); tensor_parallel_decode.py (SmolLM2 split over ranks by
KV-head groups, row-parallel outputs all-reduced); moe.py (top-k gating with a capacity factor,
experts across processes with all-to-all); multi_lora.py (several LoRA adapters in one engine step,
the base projection once per batch and each row's low-rank delta by its adapter).
"""

from infra_lib.serving.block_pool import BlockAllocator, BlockPool, OutOfBlocks
from infra_lib.serving.block_table import BlockTable, blocks_needed, wasted_slots
from infra_lib.serving.kv_store import PagedKVStore
from infra_lib.serving.paged_attention import gather_kv, paged_attention, paged_cached_attention
from infra_lib.serving.paged_generation import PagedDecode, paged_greedy_decode
from infra_lib.serving.paged_kv import PagedKVCache, PagedLayerCache
from infra_lib.serving.prefix_cache import HashPrefixCache, PrefixCache, block_hash, chained_block_hashes
from infra_lib.serving.radix_cache import RadixPrefixCache

__all__ = [
    "BlockAllocator",
    "BlockPool",
    "BlockTable",
    "HashPrefixCache",
    "OutOfBlocks",
    "PagedDecode",
    "PagedKVCache",
    "PagedKVStore",
    "PagedLayerCache",
    "PrefixCache",
    "RadixPrefixCache",
    "block_hash",
    "blocks_needed",
    "chained_block_hashes",
    "gather_kv",
    "paged_attention",
    "paged_cached_attention",
    "paged_greedy_decode",
    "wasted_slots",
]

# Continuous batching (chapter 08): sequences, the scheduler, the batched model runner, the engine,
# and a simulated clock for scheduling experiments without the model.
from infra_lib.serving.engine import LLMEngine, RequestOutput, StepRecord, WallClock
from infra_lib.serving.events import EngineEvent, EventLog
from infra_lib.serving.llm import LLM
from infra_lib.serving.model_runner import ModelRunner
from infra_lib.serving.scheduler import Scheduler
from infra_lib.serving.scheduler_output import ScheduledSeq, SchedulerConfig, SchedulerOutput
from infra_lib.serving.sequence import RequestMetrics, Sequence, SequenceStatus
from infra_lib.serving.sim_clock import (
    SimClock,
    SimulatedRunner,
    StepCostModel,
    calibrate,
    calibration_shapes,
    fit_step_costs,
    step_shape,
)
from infra_lib.serving.workload import WorkloadRequest, random_workload, replay, summarize

__all__ += [
    "EngineEvent",
    "EventLog",
    "LLM",
    "LLMEngine",
    "ModelRunner",
    "RequestMetrics",
    "RequestOutput",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "SimClock",
    "SimulatedRunner",
    "StepCostModel",
    "StepRecord",
    "WallClock",
    "WorkloadRequest",
    "calibrate",
    "calibration_shapes",
    "fit_step_costs",
    "random_workload",
    "replay",
    "step_shape",
    "summarize",
]
