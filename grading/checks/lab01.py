"""Checks for lab 01 (GEMM profiling): FLOP count, timer, dominant op, achieved rate."""

from __future__ import annotations

import random
import statistics
import threading
import time

from grading.checks.common import call_each, number_mismatch, reference, type_mismatch
from grading.registry import Check, Mismatch, register, register_shortcuts

register_shortcuts(
    "lab01",
    [
        "infra_lib.hardware.flops:gemm_flops",
        "infra_lib.hardware.flops:achieved_tflops",
        "infra_lib.timing:time_op",
        "infra_lib.kernels.profiling:dominant_op",
        "infra_lib.kernels.profiling:self_times",
    ],
)


def _reference(name: str):
    return reference("infra_lib.kernels.profiling", name)


# --- task 1: gemm_flops -------------------------------------------------------------------


def _mnk(case) -> str:
    return "m={}, n={}, k={}".format(*case)


def _small_shapes(rng: random.Random) -> list[list[int]]:
    return [[1, 1, 1]] + [[rng.randint(1, 64), rng.randint(1, 64), rng.randint(1, 64)] for _ in range(5)]


def _large_shapes(rng: random.Random) -> list[list[int]]:
    return [
        [rng.choice([4096, 8192]), rng.choice([4096, 8192]), rng.choice([4096, 8192])],
        [1, rng.randint(2000, 9000), rng.randint(2000, 9000)],  # decode: one token, a GEMV
        [rng.randint(100, 999), 1, rng.randint(100, 999)],
        [rng.randint(2, 50), rng.randint(2, 50), 1],
        [0, rng.randint(1, 50), rng.randint(1, 50)],
    ]


_EXACT_COUNT_HINT = (
    "a count of operations is a whole number and must stay exact at any size: a Python int does, a "
    "float rounds every count above 2**53 (an 8192-cube GEMM's is already over 10**12)."
)


def _compare_flops(got, expected, cases) -> Mismatch | None:
    return number_mismatch(got, expected, cases, "gemm_flops returned the wrong count", _mnk, 1e-12) or type_mismatch(
        got, cases, int, "gemm_flops must return the count as an int", _mnk, _EXACT_COUNT_HINT
    )


register(
    Check(
        check_id="lab01.gemm_flops",
        task="lab01 task 1: gemm_flops",
        reference=_reference("gemm_flops"),
        make_inputs=_small_shapes,
        drive=call_each,
        compare=_compare_flops,
        hint="each entry of C is a dot product of length k, one multiply and one add per step, and both count as "
        "operations (the fused multiply-add convention of every datasheet), the first step's add included.",
    )
)

register(
    Check(
        check_id="lab01.gemm_flops_shapes",
        task="lab01 task 1: gemm_flops",
        reference=_reference("gemm_flops"),
        make_inputs=_large_shapes,
        drive=call_each,
        compare=_compare_flops,
        hint="the same count holds for every shape, with no special case: a single row (a decode GEMV), a reduction "
        "of length one, an empty dimension (no work at all) and sizes whose count does not fit in 32 bits, so it "
        "must stay an exact int.",
    )
)


# --- task 2: time_op -------------------------------------------------------------------------


def _timing_plan(rng: random.Random) -> dict:
    # More cold calls than half the timed ones, so that skipping the warm-up moves the
    # median; one slow outlier, so that a mean instead of a median moves it too.
    iters = 5
    timed = [rng.randint(8, 14) for _ in range(iters)]
    timed[rng.randrange(iters)] = 150
    return {"warmup": rng.choice([3, 4]), "iters": iters, "cold_ms": rng.randint(45, 60), "timed_ms": timed}


def _even_timing_plan(rng: random.Random) -> dict:
    """Six timed calls whose two middle ones lie far apart: their mean, the median, is more than 20 ms from
    either of them, so a timer that takes one middle call (the upper or the lower) is told apart."""
    plan = _timing_plan(rng)
    timed = [rng.randint(8, 14) for _ in range(3)] + [rng.randint(60, 70), rng.randint(60, 70), 150]
    rng.shuffle(timed)
    return {**plan, "iters": len(timed), "timed_ms": timed}


def _planned_median_s(plan: dict) -> float:
    return statistics.median(plan["timed_ms"]) / 1000


class _Workload:
    """A stand-in operation whose cost per call is known in advance.

    The first ``warmup`` calls are slow (a cold start); later calls cost ``timed_ms`` in
    turn. With ``asynchronous`` the call only queues its cost, as a GPU launch does, and
    ``sync`` waits for whatever is queued.
    """

    def __init__(self, plan: dict, asynchronous: bool):
        self.plan = plan
        self.asynchronous = asynchronous
        self.calls = 0
        self.queued_s = 0.0
        self.leaked_s = 0.0  # warm-up work still queued when the first timed call started
        self.lock = threading.Lock()

    def cost_s(self, index: int) -> float:
        warmup, timed = self.plan["warmup"], self.plan["timed_ms"]
        if index < warmup:
            return self.plan["cold_ms"] / 1000
        return timed[(index - warmup) % len(timed)] / 1000

    def fn(self) -> None:
        with self.lock:
            if self.calls == self.plan["warmup"]:
                self.leaked_s = self.queued_s
            cost = self.cost_s(self.calls)
            self.calls += 1
            if self.asynchronous:
                self.queued_s += cost
                return
        time.sleep(cost)

    def sync(self) -> None:
        with self.lock:
            queued, self.queued_s = self.queued_s, 0.0
        time.sleep(queued)


# A loaded machine can only lengthen a sleep, so a timer that comes out too long is timed again (at
# most TIMER_ATTEMPTS times in all) and its shortest time is judged. That rescues a right timer that
# was descheduled, and rescues no wrong one: a timer that is too long (a mean, no warm-up) is too long
# on every attempt, and a timer that is too short (no sync) only gets shorter by taking the least.
TIMER_ATTEMPTS = 3
TIMER_SETTLED_S = 0.012  # above the planned median by no more than this: no need to time it again


def _drive_timer(asynchronous: bool):
    def drive(time_op, plan: dict) -> dict:
        runs = []
        for _ in range(TIMER_ATTEMPTS):
            workload = _Workload(plan, asynchronous)
            seconds = time_op(
                workload.fn, warmup=plan["warmup"], iters=plan["iters"], sync=workload.sync if asynchronous else None
            )
            runs.append(
                {"seconds": seconds, "calls": workload.calls, "warmup_leaked_ms": round(workload.leaked_s * 1000, 3)}
            )
            if (
                type(seconds) not in (int, float)
                or workload.calls != plan["warmup"] + plan["iters"]
                or seconds <= _planned_median_s(plan) + TIMER_SETTLED_S
            ):
                break
        last = runs[-1]
        odd = type(last["seconds"]) not in (int, float) or last["calls"] != plan["warmup"] + plan["iters"]
        best = last if odd else min(runs, key=lambda run: run["seconds"])  # an odd attempt is what is judged
        return {**best, "warmup_leaked_ms": max(run["warmup_leaked_ms"] for run in runs), "attempts": len(runs)}

    return drive


def _allowed_overshoot_s(expected: dict, want: float) -> float:
    """How far above the planned median a correct timer may land on this machine right now.

    Sleeps overshoot more on a loaded machine; the reference, timed just before, shows by how
    much. The allowance stays below 20 ms, under the smallest error of a mean (22.4 ms: the
    150 ms outlier with four 8 ms calls, against a 14 ms median) or a skipped warm-up (31 ms).
    """
    reference_overshoot = max(0.0, expected["seconds"] - want)
    return min(0.020, max(0.012, reference_overshoot + 0.008))


def _one_middle_call(plan: dict, seconds: float) -> bool:
    """Whether, with an even number of timed calls, ``seconds`` is one of the two middle calls' costs."""
    ordered = sorted(plan["timed_ms"])
    if len(ordered) % 2:
        return False
    middles = ordered[len(ordered) // 2 - 1 : len(ordered) // 2 + 1]
    return any(abs(seconds * 1000 - m) <= TIMER_SETTLED_S * 1000 for m in middles)


def _compare_timer(got: dict, expected: dict, plan: dict) -> Mismatch | None:
    """Calls must match the reference's; the time must match the plan's median cost.

    The plan, not the reference's own measurement, sets the expected time: a sleep never
    ends early, so a loaded machine can only lengthen both, and by far less than the
    mistakes this check exists for (no warm-up: a cold call's 45-60 ms; a mean: the 150 ms
    outlier spread over five calls; no sync: about 0 ms).
    """
    setting = (
        f"warmup={plan['warmup']}, iters={plan['iters']}, per-call costs {plan['timed_ms']} ms "
        f"after {plan['warmup']} cold calls of {plan['cold_ms']} ms"
    )
    if got["calls"] != expected["calls"]:
        return Mismatch(
            "time_op called fn the wrong number of times",
            f"with {setting}: expected {expected['calls']} calls (warmup + iters), got {got['calls']}",
        )
    seconds = got["seconds"]
    if type(seconds) not in (int, float):
        return Mismatch("time_op must return seconds as a float", f"got {seconds!r:.80}")
    want = _planned_median_s(plan)
    highest = want + _allowed_overshoot_s(expected, want)
    if not want * 0.9 <= seconds <= highest:
        in_milliseconds = want * 900 <= seconds <= highest * 1000
        hint = (
            "the value is about a thousand times the median call: time_op returns seconds, the unit "
            "time.perf_counter() counts in, not milliseconds."
            if in_milliseconds
            else ""
        )
        what = "time_op returned the wrong time"
        if _one_middle_call(plan, seconds):
            what = "time_op returned one of the two middle calls, not the median of an even number of timed calls"
            hint = (
                "with an even number of timed calls there is no single middle call: the median is the mean of the "
                "two middle durations, as statistics.median computes it, not the upper or the lower one."
            )
        return Mismatch(
            what,
            f"with {setting}: expected about {want * 1000:.1f} ms (the median timed call), got {seconds * 1000:.1f} ms",
            hint=hint,
        )
    if got.get("warmup_leaked_ms", 0) > expected.get("warmup_leaked_ms", 0):
        return Mismatch(
            "time_op let work queued during the warm-up leak into the first timed call",
            f"with {setting}: {got['warmup_leaked_ms']:.0f} ms of warm-up work was still queued when the first "
            "timed call started (the median hid it here)",
            hint="a device may still be busy with the warm-up calls' work when timing starts, and the first timed "
            "call then waits for it too: when a sync is given, the warm-up's work must be finished before the first "
            "measurement begins. chapter 01, section “6 · Gotcha 2: stopping the clock before the work is done”.",
        )
    return None


register(
    Check(
        check_id="lab01.time_op_warmup",
        task="lab01 task 2: time_op",
        reference=_reference("time_op"),
        make_inputs=_timing_plan,
        drive=_drive_timer(asynchronous=False),
        compare=_compare_timer,
        hint="the first calls are cold and must stay out of the measurement, and one slow call must not move the "
        "result: the median of the individually timed calls, not a mean or one total, in seconds, with fn called "
        "exactly warmup plus iters times. chapter 01, section “5 · Gotcha 1: the first call is not a typical call”.",
    )
)

register(
    Check(
        check_id="lab01.time_op_sync",
        task="lab01 task 2: time_op",
        reference=_reference("time_op"),
        make_inputs=_even_timing_plan,
        drive=_drive_timer(asynchronous=True),
        compare=_compare_timer,
        hint="fn may only queue work, as a GPU launch does, so a clock stopped when fn returns has timed the launch, "
        "not the work: when a sync is given, every timed call must include the wait for its queued work, and work "
        "queued during warm-up must not leak into the first measurement. chapter 01, section “6 · Gotcha 2: stopping "
        "the clock before the work is done”.",
    )
)


# --- task 3: dominant_op ------------------------------------------------------------------------


def _real_workload(rng: random.Random) -> dict:
    return {"kind": rng.choice(["mm", "bmm"]), "n": rng.choice([256, 320, 384]), "extra_ops": rng.randint(1, 3)}


def _drive_real_profile(dominant_op, spec: dict) -> str:
    """Profile a GEMM next to a few small elementwise ops; the GEMM does >95% of the work."""
    import torch

    from infra_lib.kernels.profiling import profile_op

    n = spec["n"]
    gen = torch.Generator().manual_seed(n)
    batch = () if spec["kind"] == "mm" else (2,)
    a, b = torch.randn(*batch, n, n, generator=gen), torch.randn(*batch, n, n, generator=gen)
    x, bias = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    def step():
        out = torch.matmul(a, b)  # aten::matmul -> aten::mm or aten::bmm
        for _ in range(spec["extra_ops"]):
            x.add_(bias).relu_()
        return out

    prof = profile_op(step, "cpu")
    for _ in range(4):
        # On a busy machine the OS can pause this thread inside a microsecond op for a whole time
        # slice, which then out-times the GEMM: such a profile no longer shows what the workload
        # does, so it is taken again (the reference is driven the same way).
        if _gemm_has_most_self_time(prof):
            break
        prof = profile_op(step, "cpu")
    return dominant_op(prof)


def _gemm_has_most_self_time(prof) -> bool:
    rows = list(prof.key_averages())
    return bool(rows) and max(rows, key=lambda e: e.self_cpu_time_total).key in ("aten::mm", "aten::bmm")


def _synthetic_rows(rng: random.Random, device: bool) -> list[dict]:
    """Profile rows where the largest *total* time and the largest *self* time differ."""
    parent_total = rng.randint(9000, 12000)
    child_self = parent_total - rng.randint(50, 200)
    rows = [
        {"key": "aten::linear", "count": 1, "cpu_total": parent_total + 300, "cpu_self": 40},
        {"key": "aten::addmm", "count": 1, "cpu_total": child_self + 30, "cpu_self": child_self},
        {"key": "aten::gelu", "count": 1, "cpu_total": rng.randint(1500, 2500), "cpu_self": rng.randint(1200, 1400)},
        {"key": "aten::softmax", "count": 2, "cpu_total": rng.randint(800, 1000), "cpu_self": rng.randint(100, 300)},
        {"key": "aten::_softmax", "count": 2, "cpu_total": rng.randint(500, 700), "cpu_self": rng.randint(450, 499)},
        {"key": "aten::empty", "count": 6, "cpu_total": 60, "cpu_self": 60},
    ]
    if device:
        # On a GPU the CPU side only launches; the kernels' device time is what matters,
        # and the kernel with most device time is not the op with most CPU time.
        kernel_us = rng.randint(3000, 5000)
        rows += [
            {"key": "cudaLaunchKernel", "count": 3, "cpu_total": 9000, "cpu_self": 9000},
            {
                "key": "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32",
                "count": 1,
                "cpu_total": 0,
                "cpu_self": 0,
                "device_self": kernel_us,
            },
            {
                "key": "void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>",
                "count": 1,
                "cpu_total": 0,
                "cpu_self": 0,
                "device_self": kernel_us // rng.randint(3, 6),
            },
            {
                "key": "void at::native::softmax_warp_forward<float, float, float, 10, false>",
                "count": 2,
                "cpu_total": 0,
                "cpu_self": 0,
                "device_self": kernel_us // rng.randint(4, 8),
            },
        ]
    rng.shuffle(rows)
    return rows


class SyntheticProfile:
    """Stands in for a ``torch.profiler.profile`` result with chosen times.

    ``key_averages()`` returns real torch ``FunctionEventAvg`` rows in a real ``EventList``,
    so every attribute a learner may read exists and means what it means in torch.
    """

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def key_averages(self, *args, **kwargs):
        from torch.autograd.profiler_util import EventList, FunctionEventAvg

        events = []
        for row in self.rows:
            event = FunctionEventAvg()
            event.key = row["key"]
            event.count = row["count"]
            event.cpu_time_total = row["cpu_total"]
            event.self_cpu_time_total = row["cpu_self"]
            event.device_time_total = row.get("device_self", 0)
            event.self_device_time_total = row.get("device_self", 0)
            events.append(event)
        return EventList(events)


def _drive_synthetic(dominant_op, rows: list[dict]) -> str:
    return dominant_op(SyntheticProfile(rows))


def _compare_names(got, expected, inputs) -> Mismatch | None:
    if got == expected:
        return None
    if type(got) is not str:
        return Mismatch("dominant_op must return the op's name as a str", f"got {got!r:.80}")
    return Mismatch("dominant_op named the wrong op", f"expected {expected!r}, got {got!r}")


register(
    Check(
        check_id="lab01.dominant_op_real",
        task="lab01 task 3: dominant_op",
        reference=_reference("dominant_op"),
        make_inputs=_real_workload,
        drive=_drive_real_profile,
        compare=_compare_names,
        hint="an op's total time includes the ops it calls, so ranking by total crowns the outermost wrapper "
        "(aten::matmul around the GEMM); the op doing the work has the largest self time, and the answer is its "
        "name, a str. chapter 01, section “2 · Where does `a @ b` go?”.",
    )
)

register(
    Check(
        check_id="lab01.dominant_op_self_time",
        task="lab01 task 3: dominant_op",
        reference=_reference("dominant_op"),
        make_inputs=lambda rng: _synthetic_rows(rng, device=False),
        drive=_drive_synthetic,
        compare=_compare_names,
        hint="here the op with the largest total time is a wrapper whose child did nearly all of its work: rank by "
        "the time each op spent in its own code, without the ops it called.",
    )
)

register(
    Check(
        check_id="lab01.dominant_op_device",
        task="lab01 task 3: dominant_op",
        reference=_reference("dominant_op"),
        make_inputs=lambda rng: _synthetic_rows(rng, device=True),
        drive=_drive_synthetic,
        compare=_compare_names,
        hint="a profile that recorded any device time ran on a GPU, where the CPU side only launched the kernels "
        "(its launch calls can out-time every op): rank by device self time then, and by CPU self time only when no "
        "device time was recorded.",
    )
)


# --- task 4: achieved_tflops ----------------------------------------------------------------------


def _rate_cases(rng: random.Random) -> list[list]:
    cases = []
    for _ in range(5):
        m, n, k = (rng.choice([1, 64, 512, 4096, 8192]) for _ in range(3))
        cases.append([m, n, k, rng.uniform(1e-6, 2.0)])
    return cases


def _bad_seconds(rng: random.Random) -> list[list]:
    return [[rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 99), s] for s in (0.0, -rng.uniform(0.001, 1.0))]


def _drive_rejects(achieved_tflops, cases: list[list]) -> list[str]:
    outcomes = []
    for case in cases:
        try:
            value = achieved_tflops(*case)
        except ValueError:
            outcomes.append("ValueError")
        else:
            outcomes.append(f"returned {value!r:.40}")
    return outcomes


def _compare_rejects(got, expected, cases) -> Mismatch | None:
    for case, g, e in zip(cases, got, expected):
        if g != e:
            return Mismatch(
                "achieved_tflops must raise ValueError when seconds <= 0",
                f"on seconds={case[3]!r}: expected {e}, got {g}",
            )
    return None


register(
    Check(
        check_id="lab01.achieved_tflops",
        task="lab01 task 4: achieved_tflops",
        reference=_reference("achieved_tflops"),
        make_inputs=_rate_cases,
        drive=call_each,
        compare=lambda got, expected, cases: number_mismatch(
            got,
            expected,
            cases,
            "achieved_tflops returned the wrong rate",
            lambda c: "m={}, n={}, k={}, seconds={:.3g}".format(*c),
            1e-9,
        ),
        hint="a rate is the GEMM's operation count (task 1's count, multiplies and adds both counted) per second of "
        "the measured time, reported in units of 10^12 FLOP/s; a factor of two or a power of ten is the usual slip. "
        "chapter 01, section “7 · How fast, compared with what?”.",
    )
)

register(
    Check(
        check_id="lab01.achieved_tflops_rejects_bad_time",
        task="lab01 task 4: achieved_tflops",
        reference=_reference("achieved_tflops"),
        make_inputs=_bad_seconds,
        drive=_drive_rejects,
        compare=_compare_rejects,
        hint="a time of zero or less is a measuring bug: raise ValueError instead of returning a rate.",
    )
)
