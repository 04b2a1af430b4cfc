"""One chat request traced through the server, the engine and the model: layers that add up, right tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import SMOLLM2

from infra_lib.model import SamplingParams, greedy_decode
from infra_lib.ops.request_trace import LAYERS, SUM_TOLERANCE_S, RequestTrace, TracedServer, trace_request
from infra_lib.ops.stage_timers import FORWARD_RANGE, Stopwatch, TimedScheduler, kernel_self_times
from infra_lib.serving import Scheduler, SchedulerConfig, Sequence

# One worker runs the module: the traced request (fixture) then runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("request_trace")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def traces(smollm2):
    """The same request traced with the kernel profiler (its own server), then without (after a warm-up)."""
    profiled = trace_request(smollm2.model, smollm2.tokenizer, MESSAGES, MAX_TOKENS)
    with TracedServer(smollm2.model, smollm2.tokenizer, kv_blocks=64) as server:
        return profiled, server.trace(MESSAGES, MAX_TOKENS, profile_kernels=False)


@SMOLLM2
def test_every_layer_takes_time_and_they_add_up_to_the_client_total(traces):
    profiled, _ = traces
    assert list(profiled.layers) == list(LAYERS)
    assert all(seconds > 0 for seconds in profiled.layers.values()), profiled.layers
    assert abs(profiled.sum_s - profiled.total_s) <= SUM_TOLERANCE_S
    profiled.check()
    assert sum(profiled.fractions().values()) == pytest.approx(profiled.sum_s / profiled.total_s)
    by_layer = profiled.by_runtime_layer()
    assert list(by_layer)[:2] == ["L5a serving", "L5a/L5b serving"] and "L2/L3 kernels" in by_layer
    assert sum(by_layer.values()) == pytest.approx(profiled.sum_s)


@SMOLLM2
def test_kernels_are_aten_ops_inside_the_forward_passes(traces):
    profiled, plain = traces
    ops = profiled.kernel_ops
    assert "aten::mm" in ops and all(name.startswith("aten::") for name in list(ops)[:5]), list(ops)[:5]
    assert sum(ops.values()) == pytest.approx(profiled.layers["kernels"])
    assert profiled.layers["model_python"] > 0  # kernels never exceed the forward pass they sit in
    assert plain.kernel_ops == {} and plain.layers["kernels"] == 0 and plain.layers["profiler"] == 0
    plain.check()


@SMOLLM2
def test_the_traced_request_generates_the_greedy_tokens(traces, smollm2):
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.encode_chat(MESSAGES)
    expected = greedy_decode(smollm2.model, prompt, MAX_TOKENS, stop_id=tokenizer.eos_id)
    for trace in traces:
        assert trace.prompt_ids == prompt
        assert trace.token_ids == expected
        assert trace.text == tokenizer.decode(expected, skip_special=True)
        assert trace.forward_passes == len(expected)  # one step per token: the prefill, then decodes


def test_check_catches_double_counting_and_lost_time():
    layers = dict.fromkeys(LAYERS, 0.01)
    good = RequestTrace(layers, sum(layers.values()), {}, 1, [1], [2], "x", profiled=False)
    good.check()
    with pytest.raises(AssertionError, match="negative"):
        RequestTrace({**layers, "engine_other": -0.005}, 0.095, {}, 1, [1], [2], "x", False).check()
    with pytest.raises(AssertionError, match="add up"):
        RequestTrace(layers, good.total_s + 10 * SUM_TOLERANCE_S, {}, 1, [1], [2], "x", False).check()


def test_kernel_self_times_count_only_ops_inside_forward_ranges():
    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        torch.add(a, a)  # outside any forward range: not counted
        for _ in range(3):
            with torch.profiler.record_function(FORWARD_RANGE):
                torch.mm(a, a)
                torch.relu(a)
    times = kernel_self_times(profile)
    assert "aten::add" not in times
    assert {"aten::mm", "aten::relu"} <= set(times)
    assert all(seconds > 0 for seconds in times.values())
    # the same sums through torch's own (slower) event tree
    reference: dict[str, float] = {}
    stack = [e for e in profile.events() if e.name == FORWARD_RANGE]
    while stack:
        event = stack.pop()
        for child in event.cpu_children:
            reference[child.name] = reference.get(child.name, 0.0) + child.self_cpu_time_total / 1e6
            stack.append(child)
    assert times.keys() == reference.keys()
    assert all(times[k] == pytest.approx(reference[k], abs=1e-6) for k in times)


def test_timed_scheduler_plans_exactly_like_the_scheduler():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, num_blocks=8, block_size=4)
    watch = Stopwatch()
    timed, plain = TimedScheduler(config, watch), Scheduler(config)
    sequences = {}
    for scheduler in (timed, plain):
        sequences[scheduler] = [
            Sequence(i, list(range(1, n + 1)), SamplingParams(max_new_tokens=4), config.block_size)
            for i, n in enumerate((10, 3, 7))
        ]
        for seq in sequences[scheduler]:
            scheduler.add(seq)
    for _ in range(4):
        steps = [timed.schedule(), plain.schedule()]
        assert [(s.seq_id, s.start, s.num_tokens) for s in steps[0].scheduled] == [
            (s.seq_id, s.start, s.num_tokens) for s in steps[1].scheduled
        ]
        for scheduler, out in zip((timed, plain), steps):
            scheduler.commit(out)
            for s in out.scheduled:
                if s.samples:  # what the engine does with a sampled token
                    sequences[scheduler][s.seq_id].append_token(5)
        timed.check_invariants()
    assert watch.count("scheduler") == 3 + 4 + 4 and watch.seconds("scheduler") > 0
