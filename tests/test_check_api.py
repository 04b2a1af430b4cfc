"""The check API: registry, interactive verdicts, recording under the grader, plain data only."""

from __future__ import annotations

import json
import random
import statistics
import time

import pytest

from grading import check
from grading.check import RECORD_ENV, SEED_ENV, Outcome, drive, judge, to_plain
from grading.checks.lab01 import SyntheticProfile
from grading.registry import ReferenceFailed, all_checks, get_check, seed_for
from infra_lib.kernels import profiling


def _reference_for(check_id: str):
    return get_check(check_id).reference()


@pytest.mark.parametrize("lab", sorted({check_id.split(".")[0] for check_id in all_checks()}))
def test_every_check_passes_its_own_reference(lab):
    """Every check of a lab, driven with its own reference (one test per lab, so that the labs run side
    by side)."""
    check_ids = [check_id for check_id in all_checks() if check_id.split(".")[0] == lab]
    assert check_ids
    for check_id in check_ids:
        check(check_id, _reference_for(check_id))


def _not_implemented_stub(registered, folder):
    """What an untouched lab answer is: a function raising the task's NotImplementedError, or,
    for a Triton kernel task, a ``@triton.jit`` kernel with the reference's parameters doing so."""
    reference = registered.reference()

    def stub(*args, **kwargs):
        raise NotImplementedError(registered.task)

    if isinstance(reference, tuple):  # a check of several functions together: a stub for each
        return tuple(stub for _ in reference)
    if isinstance(reference, dict):  # several named functions together: a stub under each name
        return {name: stub for name in reference}
    if not (hasattr(reference, "arg_names") and hasattr(reference, "run")):  # not a Triton kernel
        return stub
    import importlib.util

    from infra_lib.kernels.triton_env import load_triton

    load_triton()
    name = registered.task.rsplit(": ", 1)[1]
    params = ", ".join(f"{p}: tl.constexpr" if p.startswith("BLOCK") else p for p in reference.arg_names)
    path = folder / f"stub_{name}.py"  # Triton reads a kernel's source from its file
    path.write_text(
        f"import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef {name}({params}):\n"
        f"    raise NotImplementedError({registered.task!r})\n"
    )
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_every_check_fails_a_not_implemented_stub_with_its_message(tmp_path):
    for check_id, registered in all_checks().items():
        stub = _not_implemented_stub(registered, tmp_path)
        with pytest.raises(AssertionError) as info:
            check(check_id, stub)
        assert f"NotImplementedError: {registered.task}" in str(info.value)
        assert "hint:" in str(info.value)


def test_failure_message_says_what_differed_on_what_input_and_hints():
    with pytest.raises(AssertionError) as info:
        check("lab01.gemm_flops", lambda m, n, k: m * n * k)
    text = str(info.value)
    assert "lab01.gemm_flops failed [lab01 task 1: gemm_flops]" in text
    assert "on m=1, n=1, k=1: expected 2, got 1" in text
    assert "hint:" in text


def test_unknown_check_lists_the_known_ones():
    with pytest.raises(KeyError, match="lab01.gemm_flops"):
        check("lab01.no_such_check", lambda: None)


def _median_no_sync(fn, *, warmup, iters, sync):
    for _ in range(warmup):
        fn()
    durations = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)


def _mean_timer(fn, *, warmup, iters, sync):
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if sync is not None:
        sync()
    return (time.perf_counter() - start) / iters


def _no_warmup(fn, *, warmup, iters, sync):
    durations = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)


def _right_timer(fn, *, warmup, iters, sync):
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    return _no_warmup(fn, warmup=0, iters=iters, sync=sync)


@pytest.mark.parametrize(
    "check_id, wrong",
    [
        ("lab01.time_op_sync", _median_no_sync),
        ("lab01.time_op_warmup", _mean_timer),
        ("lab01.time_op_sync", _mean_timer),
        ("lab01.time_op_warmup", _no_warmup),
    ],
)
def test_timer_checks_catch_the_classic_mistakes(check_id, wrong):
    with pytest.raises(AssertionError, match="time_op"):
        check(check_id, wrong)


@pytest.mark.parametrize("check_id", ["lab01.time_op_warmup", "lab01.time_op_sync"])
def test_a_right_timer_descheduled_once_still_passes_and_a_wrong_one_still_fails(check_id):
    """A busy machine lengthens every sleep of one timing (here: 60 ms added to each timed call of
    the first attempt); the check times again and judges the shortest, so the right timer passes.
    A timer that is wrong on every attempt (a mean) still fails, after the same retries."""
    attempts = []

    def descheduled_once(fn, *, warmup, iters, sync):
        attempts.append(1)
        if len(attempts) > 1:
            return _right_timer(fn, warmup=warmup, iters=iters, sync=sync)
        return _right_timer(fn, warmup=warmup, iters=iters, sync=sync) + 0.060

    check(check_id, descheduled_once)
    assert len(attempts) >= 2, "the disturbed timing was accepted without being timed again"

    mean_calls = []

    def mean_counted(fn, *, warmup, iters, sync):
        mean_calls.append(1)
        return _mean_timer(fn, warmup=warmup, iters=iters, sync=sync)

    with pytest.raises(AssertionError, match="wrong time"):
        check(check_id, mean_counted)
    assert len(mean_calls) == 3  # timed three times, too long each time


def test_profile_checks_catch_total_time_and_cpu_only():
    def by_total(prof):
        return max(prof.key_averages(), key=lambda e: e.cpu_time_total).key

    def cpu_only(prof):
        return max(prof.key_averages(), key=lambda e: e.self_cpu_time_total).key

    for check_id in ("lab01.dominant_op_real", "lab01.dominant_op_self_time"):
        with pytest.raises(AssertionError, match="wrong op"):
            check(check_id, by_total)
    check("lab01.dominant_op_self_time", cpu_only)
    with pytest.raises(AssertionError, match="wrong op"):
        check("lab01.dominant_op_device", cpu_only)


def test_real_profile_check_is_robust_across_seeds():
    """The reference names the GEMM on every seeded workload, so the check never flakes."""
    registered = get_check("lab01.dominant_op_real")
    for seed in range(8):
        spec = registered.inputs(seed)
        name = registered.drive(profiling.dominant_op, spec)
        assert name == ("aten::mm" if spec["kind"] == "mm" else "aten::bmm"), (seed, spec, name)


def test_synthetic_profile_uses_real_torch_rows():
    rows = [{"key": "a", "count": 2, "cpu_total": 10, "cpu_self": 4}]
    (event,) = SyntheticProfile(rows).key_averages()
    assert (event.key, event.count, event.self_cpu_time_total, event.cpu_time_total) == ("a", 2, 4, 10)
    assert event.self_device_time_total == 0


def test_seeds_give_different_inputs_per_check_and_per_seed():
    registered = get_check("lab01.gemm_flops")
    assert registered.inputs(1) == registered.inputs(1)
    assert registered.inputs(1) != registered.inputs(2)
    assert seed_for(5, "lab01.a") != seed_for(5, "lab01.b")


def test_to_plain_refuses_objects_that_could_fake_equality():
    class AlwaysEqual(int):
        def __eq__(self, other):
            return True

    with pytest.raises(TypeError, match="plain Python"):
        to_plain(AlwaysEqual(3))
    with pytest.raises(TypeError):
        to_plain({1: 2})
    import numpy as np
    import torch

    assert to_plain((np.int64(3), torch.tensor([1.5, 2.0]))) == [3, [1.5, 2.0]]


def test_judge_reports_learner_errors_and_malformed_data():
    registered = get_check("lab01.gemm_flops")
    inputs = registered.inputs(0)
    expected = drive(registered, registered.reference(), inputs)
    verdict = judge(registered, Outcome(error="ZeroDivisionError: x"), expected, inputs)
    assert not verdict.passed and "ZeroDivisionError" in verdict.what
    verdict = judge(registered, Outcome(data="oops"), expected, inputs)
    assert not verdict.passed
    assert judge(registered, expected, expected, inputs).passed


def test_a_comparison_that_finds_the_reference_wrong_is_never_the_learners_fault():
    """A comparison raising ReferenceFailed stops the grading as the course's fault; any other error it raises is
    the learner's malformed data."""
    import dataclasses

    registered = get_check("lab01.gemm_flops")
    inputs = registered.inputs(0)
    expected = drive(registered, registered.reference(), inputs)

    def reference_wrong(got, want, case):
        raise ReferenceFailed("the course's side disagrees with itself")

    with pytest.raises(ReferenceFailed, match="disagrees with itself"):
        judge(dataclasses.replace(registered, compare=reference_wrong), expected, expected, inputs)


def test_recording_mode_writes_data_and_never_judges(tmp_path, monkeypatch, capsys):
    record = tmp_path / "answers.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "1234")
    check("lab01.gemm_flops", lambda m, n, k: 0)  # wrong, yet no AssertionError: the grader judges
    check("lab01.gemm_flops", lambda m, n, k: 2 * m * n * k)
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    inputs = get_check("lab01.gemm_flops").inputs(1234)
    assert rows[0] == {"check_id": "lab01.gemm_flops", "data": [0] * len(inputs), "error": None, "kind": None}
    assert rows[1]["data"] == [2 * m * n * k for m, n, k in inputs]
    assert "recorded" in capsys.readouterr().out


def _recorded(tmp_path, monkeypatch, check_id, implementation, timeout="60"):
    record = tmp_path / "answers.jsonl"
    record.unlink(missing_ok=True)
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "99")
    monkeypatch.setenv("INFRA_LAB_CHECK_TIMEOUT", timeout)
    check(check_id, implementation)
    return json.loads(record.read_text().splitlines()[-1])


def test_calling_the_reference_is_recorded_as_a_shortcut(tmp_path, monkeypatch):
    row = _recorded(tmp_path, monkeypatch, "lab01.gemm_flops", profiling.gemm_flops)
    assert row["kind"] == "reference shortcut" and "infra_lib.hardware.flops.gemm_flops" in row["error"]
    wrapped = _recorded(
        tmp_path, monkeypatch, "lab01.achieved_tflops", lambda m, n, k, s: profiling.gemm_flops(m, n, k) / s / 1e12
    )
    assert wrapped["kind"] == "reference shortcut"


def test_a_class_registered_as_reference_stands_for_all_its_methods(tmp_path, monkeypatch):
    """A pool that keeps a private reference BlockPool and forwards to it is a shortcut."""
    import infra_lib.serving.block_pool as block_pool

    class Forwarding:
        def __init__(self, num_blocks, block_size):
            self.args, self.inner = (num_blocks, block_size), None

        def _pool(self):
            if self.inner is None:  # built late, after the driver looked at the new object
                self.inner = block_pool.BlockPool(*self.args)
            return self.inner

        def __getattr__(self, name):
            return getattr(self._pool(), name)

    row = _recorded(tmp_path, monkeypatch, "lab07.allocate", Forwarding)
    assert row["kind"] == "reference shortcut" and "BlockPool.__init__" in row["error"]


def test_a_slow_answer_is_stopped_by_the_check_time_limit(tmp_path, monkeypatch):
    """An answer that waits is stopped by the wall-time limit (three times the processor-time one)."""

    def slow(m, n, k):
        try:
            time.sleep(30)
        except Exception:  # cannot swallow the grader's time-out
            pass
        return 0

    started = time.monotonic()
    row = _recorded(tmp_path, monkeypatch, "lab01.gemm_flops", slow, timeout="0.5")
    assert row["kind"] == "time-out" and time.monotonic() - started < 5
    assert "still running after 1.5 s" in row["error"] and "waits" in row["error"], row


def _patient_wall_clock(monkeypatch) -> None:
    """A wall-time limit far above the processor-time one: on a machine busy with other jobs a thread
    may get a third of a core or less, and these tests are about processor time."""
    import importlib

    monkeypatch.setattr(importlib.import_module("grading.check"), "WALL_FACTOR", 30)


def test_a_busy_answer_is_stopped_by_its_processor_time(tmp_path, monkeypatch):
    _patient_wall_clock(monkeypatch)

    def busy(m, n, k):
        total = 0
        while True:
            try:
                total += 1
            except Exception:
                pass

    started = time.monotonic()
    row = _recorded(tmp_path, monkeypatch, "lab01.gemm_flops", busy, timeout="0.5")
    assert row["kind"] == "time-out" and "0.5 s of processor time" in row["error"], row
    assert time.monotonic() - started < 15


def test_time_spent_waiting_is_not_counted_as_the_answers(tmp_path, monkeypatch):
    """A check is limited by the processor time its code uses: an answer that waits a while (as on a
    machine busy with other jobs) but computes little is not a time-out, up to the wall-time limit."""
    _patient_wall_clock(monkeypatch)
    waited = []

    def patient(m, n, k):
        if not waited:  # the check calls it once per input
            time.sleep(0.8)
            waited.append(1)
        return 2 * m * n * k

    row = _recorded(tmp_path, monkeypatch, "lab01.gemm_flops", patient, timeout="0.5")
    assert row["kind"] is None and row["error"] is None, row


def test_removing_the_call_monitor_is_tampering(tmp_path, monkeypatch):
    from infra_lib.hardware import flops

    def sneaky(m, n, k):
        flops.gemm_flops.__code__ = (lambda m, n, k: 2 * m * n * k).__code__  # the monitor's stand-in, gone
        return flops.gemm_flops(m, n, k)

    original = flops.gemm_flops.__code__
    try:
        assert _recorded(tmp_path, monkeypatch, "lab01.gemm_flops", sneaky)["kind"] == "tampering detected"
    finally:
        flops.gemm_flops.__code__ = original


def test_the_call_monitor_taxes_no_other_call_and_leaves_the_reference_as_it_was(tmp_path, monkeypatch):
    """No profile hook runs during a check (the Triton interpreter's millions of calls would pay for
    it); the reference's own body is back after the check, and a call from another thread is seen."""
    import sys
    import threading

    from infra_lib.hardware import flops

    original = flops.gemm_flops.__code__
    seen = {}

    def honest(m, n, k):
        seen["profile"] = sys.getprofile()
        return 2 * m * n * k

    assert _recorded(tmp_path, monkeypatch, "lab01.gemm_flops", honest)["kind"] is None
    assert seen["profile"] is None
    assert flops.gemm_flops.__code__ is original and flops.gemm_flops(2, 3, 4) == 48

    def threaded(m, n, k):
        out = []
        worker = threading.Thread(target=lambda: out.append(flops.gemm_flops(m, n, k)))
        worker.start()
        worker.join()
        return out[0]

    row = _recorded(tmp_path, monkeypatch, "lab01.gemm_flops", threaded)
    assert row["kind"] == "reference shortcut" and "gemm_flops" in row["error"], row
    assert flops.gemm_flops.__code__ is original


def test_an_answer_decorated_like_a_reference_is_not_taken_for_it(tmp_path, monkeypatch):
    """lab06's reference greedy_decode is wrapped by ``@torch.no_grad()``, whose wrapper code every
    function so decorated shares: the learner's own decorated answer is not the reference."""
    import torch

    @torch.no_grad()
    def mask(t, s, device=None):
        return torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)

    row = _recorded(tmp_path, monkeypatch, "lab06.causal_mask_prefill", mask)
    assert row["kind"] is None and row["error"] is None, row

    from infra_lib.model import generation

    @torch.no_grad()
    def forwarding(*args, **kwargs):
        return generation.greedy_decode(*args, **kwargs)

    row = _recorded(tmp_path, monkeypatch, "lab06.greedy_decode", forwarding)
    assert row["kind"] == "reference shortcut" and "generation.greedy_decode" in row["error"], row


def test_memory_errors_are_reported_as_the_memory_limit(tmp_path, monkeypatch):
    def hungry(m, n, k):
        raise MemoryError("simulated")

    assert _recorded(tmp_path, monkeypatch, "lab01.gemm_flops", hungry)["kind"] == "memory limit"


def test_hidden_message_hides_inputs_and_expected_values():
    registered = get_check("lab01.gemm_flops_shapes")
    inputs = registered.inputs(random.Random(3).randrange(1 << 30))
    expected = drive(registered, registered.reference(), inputs)
    verdict = judge(registered, Outcome(data=[1] * len(inputs)), expected, inputs)
    hidden = verdict.message(registered, hidden=True)
    visible = verdict.message(registered, hidden=False)
    assert "expected" in visible and "expected" not in hidden
    assert str(expected.data[0]) not in hidden


def test_an_answer_that_raised_is_judged_without_running_the_reference(monkeypatch):
    """An untouched (or crashing) answer gets its verdict at once, interactively and in the grader:
    the reference, which may run the real model, runs only when there is data to compare."""
    import dataclasses

    from grading import registry
    from grading.grader import evaluate
    from grading.notebook import CheckCall, TestCell

    original = get_check("lab01.gemm_flops")
    calls = []

    def counted_reference():
        calls.append(1)
        return original.reference()

    monkeypatch.setitem(
        registry._REGISTRY, "lab01.gemm_flops", dataclasses.replace(original, reference=counted_reference)
    )

    def stub(m, n, k):
        raise NotImplementedError("lab01 task 1: gemm_flops")

    with pytest.raises(AssertionError, match="not started yet"):
        check("lab01.gemm_flops", stub)
    cell = TestCell(
        "test_task1_gemm_flops", 2.0, [CheckCall("lab01.gemm_flops", False)], index=6, answer="task1_gemm_flops"
    )
    [result] = evaluate(
        [cell],
        {"lab01.gemm_flops": [Outcome(error="NotImplementedError: lab01 task 1: gemm_flops", kind="error")]},
        0,
        {},
        {},
    )
    assert result.score == 0 and "not started yet" in result.checks[0].message
    assert calls == [], "the reference ran although no answer produced data"

    check("lab01.gemm_flops", lambda m, n, k: 2 * m * n * k)
    [result] = evaluate([cell], {"lab01.gemm_flops": [Outcome(data=[2])]}, 0, {}, {})
    assert len(calls) == 2 and result.score == 0, "data is compared with the reference's"


_METHOD_SHORTCUT = r"""
import sys, tempfile
from pathlib import Path

from grading import tamper
from grading.call_monitor import CallMonitor
from grading.registry import all_checks, register_shortcuts, resolve_target, shortcut_functions, shortcut_modules

register_shortcuts("lab98", ["infra_lib.ops.llmops:RolloutPolicy.judge",
                             "infra_lib.model.config:LlamaConfig.from_hf_dict"])
all_checks()
assert "torch" not in sys.modules and "infra_lib.ops.llmops" not in sys.modules, "registering imported the target"

from infra_lib.model.config import LlamaConfig
from infra_lib.ops.llmops import Rollout, RolloutPolicy

assert shortcut_functions("lab98") == [RolloutPolicy.judge, LlamaConfig.__dict__["from_hf_dict"].__func__]
modules, names = shortcut_modules("lab98")
assert names == {"judge", "from_hf_dict"}, names
assert not {"infra_lib.ops.llmops", "infra_lib.model.config"} & modules, modules  # the classes stay importable
called = ("from infra_lib.ops.llmops import RolloutPolicy\n\n"
          "def verdict(p, a, b):\n    return RolloutPolicy.judge(p, a, b)[0]\n")
assert [f.kind for f in tamper.scan(called, modules, names)] == [tamper.SHORTCUT]
helper = "from infra_lib.ops.llmops import RolloutPolicy\n\ndef share(r):\n    return r.share\n"
assert tamper.scan(helper, modules, names) == []

monitor = CallMonitor(shortcut_functions("lab98"))
monitor.start()
try:
    try:
        RolloutPolicy().judge([], [])
    except Exception:
        pass
finally:
    monitor.stop()
assert monitor.hits == ["infra_lib.ops.llmops.RolloutPolicy.judge"], monitor.hits

from grading.hidden_reference import STUB_MESSAGE, hidden_files

shown = hidden_files("lab98", Path(tempfile.mkdtemp()))
source = Path(sys.modules["infra_lib.ops.llmops"].__file__).resolve()
stub = shown[source].read_text()
assert STUB_MESSAGE.format(name="infra_lib.ops.llmops.RolloutPolicy.judge", lab="lab98") in stub
assert stub.count("raise RuntimeError(") == source.read_text().count("raise RuntimeError(") + 1  # judge alone
assert len(stub.splitlines()) == len(source.read_text().splitlines())
for bad in ("infra_lib.ops.llmops", "infra_lib.ops.llmops:RolloutPolicy.judge.x", "infra_lib.ops.llmops:1x"):
    try:
        register_shortcuts("lab97", [bad])
    except ValueError:
        continue
    raise AssertionError(f"{bad!r} was accepted")
try:
    resolve_target("infra_lib.ops.llmops:Rollout.share")
except TypeError as error:
    assert "property" in str(error), error
else:
    raise AssertionError("a property was taken for a method")
print("ok")
"""


def test_a_shortcut_can_name_one_method_of_a_class_resolved_only_when_used():
    """ "module:Class.method" names that method alone (plain or class method): registering it imports
    nothing, the call monitor and the static scan flag it and not the class's other methods, and the
    sandbox's stub replaces its body alone."""
    import subprocess
    import sys

    from grading.course import REPO_ROOT

    done = subprocess.run(
        [sys.executable, "-c", _METHOD_SHORTCUT], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
