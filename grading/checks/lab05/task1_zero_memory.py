"""Lab 05 task 1: zero_memory_per_device, the bytes each device holds at each ZeRO stage, with the
recognisable mistakes named."""

from __future__ import annotations

import math
import random

from grading.checks.common import is_number, outcome, reference, unwrap
from grading.registry import Check, Mismatch, register

_ZERO = "infra_lib.training.zero"
TASK = "lab05 task 1: zero_memory_per_device"


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


_DEFAULT_BYTES = {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}


def _zero_case(num_params, num_devices, stage, **bytes_per) -> dict:
    case = {"num_params": num_params, "num_devices": num_devices, "stage": stage}
    if bytes_per:
        case["bytes"] = bytes_per
    return case


def _zero_cases(rng: random.Random) -> list[dict]:
    """The paper's figure, seeded model and cluster sizes, fp32 training, and one device."""
    cases = [_zero_case(7.5e9, 64, stage) for stage in range(4)]  # ZeRO, figure 1
    for stage in range(4):
        params = rng.choice([1.3e9, 6.7e9, 13e9, 70e9, 175e9])
        cases.append(_zero_case(params, rng.choice([8, 16, 128, 1024]), stage))
    fp32 = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}  # fp32 weights and grads, Adam's m and v
    params = rng.choice([124_000_000, 350_000_000, 774_000_000])
    cases += [_zero_case(params, rng.choice([2, 4, 8]), stage, **fp32) for stage in (0, 1, 2, 3)]
    cases += [_zero_case(rng.choice([1.5e9, 3e9]), 1, stage) for stage in (0, 2, 3)]
    return cases


def _zero_edge_cases(rng: random.Random) -> list[dict]:
    """Other byte counts, no parameters, many devices, and invalid arguments (ValueError)."""
    return [
        _zero_case(rng.choice([7e9, 8e9]), 8, 2, param_bytes=2, grad_bytes=4, optimizer_bytes=12),  # fp32 grads
        _zero_case(rng.choice([1e9, 2e9]), 4, 1, param_bytes=4, grad_bytes=4, optimizer_bytes=0),  # plain SGD
        _zero_case(rng.choice([1e9, 2e9]), 4, 3, param_bytes=4, grad_bytes=4, optimizer_bytes=0),
        _zero_case(rng.randrange(10**6, 10**8), rng.randint(3, 7), 2, optimizer_bytes=16),
        _zero_case(0, 16, 3),
        _zero_case(1e12, 4096, rng.choice([1, 2])),
        _zero_case(rng.choice([175e9, 530e9]), 1, 1),
        _zero_case(1e9, 8, 4),
        _zero_case(1e9, 8, -1),
        _zero_case(1e9, 0, 1),
        _zero_case(1e9, -4, 2),
        _zero_case(1e9, 2.5, 1),
        _zero_case(1e9, 8.0, 1),
        _zero_case(-1, 8, 1),
        # A stage is compared by value, as Python compares numbers: 1.0 and True are stage 1, False stage 0;
        # 1.5 and nan are no stage. A num_params of nan is not a count.
        _zero_case(rng.choice([1e9, 2e9]), 8, 1.0),
        _zero_case(rng.choice([1e9, 2e9]), 8, True),
        _zero_case(rng.choice([1e9, 2e9]), 4, False),
        _zero_case(1e9, 8, 1.5),
        _zero_case(1e9, 8, math.nan),
        _zero_case(math.nan, 8, 1),
    ]


def _describe_zero(case: dict) -> str:
    extra = "".join(f", {k}={v:g}" for k, v in case.get("bytes", {}).items())
    return (
        f"zero_memory_per_device(num_params={case['num_params']:g}, num_devices={case['num_devices']!r}, "
        f"stage={case['stage']!r}{extra})"
    )


def _drive_zero(fn, cases: list[dict]) -> list:
    return [outcome(fn, c["num_params"], c["num_devices"], c["stage"], **c.get("bytes", {})) for c in cases]


def _stage_bytes(stage: int, p: float, g: float, k: float, n: float) -> float:
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]


def _zero_note(case: dict, got: float, want: float) -> str:
    """Name the mistake behind a wrong memory figure, when it is a recognisable one."""
    per = {**_DEFAULT_BYTES, **case.get("bytes", {})}
    psi, n, stage = case["num_params"], case["num_devices"], case["stage"]
    p, g, k = (per[name] * psi for name in ("param_bytes", "grad_bytes", "optimizer_bytes"))

    def same(value: float) -> bool:
        return _close(got, value) and not _close(want, value)

    if same(want / 1e9) or same(want / 2**30):
        return "; return bytes, not GB: the table at the end divides by 1e9"
    if case.get("bytes") and same(_stage_bytes(stage, *(_DEFAULT_BYTES[name] * psi for name in _DEFAULT_BYTES), n)):
        return "; that uses the default 2/2/12 bytes: use the param_bytes, grad_bytes and optimizer_bytes passed in"
    if stage == 2 and same((p + g + k) / n):
        return (
            "; at stage 2 the parameters stay whole on every device: only the gradients and the optimizer "
            "state are divided by num_devices (dividing the parameters too is stage 3)"
        )
    if stage == 1 and same(p + (g + k) / n):
        return "; stage 1 shards only the optimizer state: the gradients are sharded from stage 2 on"
    if stage == 1 and same((p + g + k) / n):
        return (
            "; at stage 1 only the optimizer state (optimizer_bytes per parameter) is divided by num_devices: "
            "the parameters and gradients stay whole"
        )
    if stage in (1, 2) and same(_stage_bytes(stage, p, g, p + g + k, n)):
        whole = per["param_bytes"] + per["grad_bytes"] + per["optimizer_bytes"]
        return (
            f"; the optimizer state is optimizer_bytes = {per['optimizer_bytes']:g} bytes per parameter (fp32 "
            f"master weights, momentum, variance); {whole:g} is the whole per-parameter state"
        )
    if same(_stage_bytes(stage, p, 0, k, n)):
        return "; you left out the gradients (grad_bytes per parameter): every stage keeps them, whole or sharded"
    if same(_stage_bytes(stage, 0, g, k, n)):
        return "; you left out the parameters themselves (param_bytes per parameter)"
    if stage > 0 and same(p + g + k):
        return f"; that is stage 0 (nothing sharded): stage {stage} divides part of the state by num_devices"
    for other in range(4):
        if other != stage and same(_stage_bytes(other, p, g, k, n)):
            return (
                f"; that is stage {other}'s figure: stage 0 shards nothing, 1 the optimizer state, 2 the "
                "gradients too, 3 the parameters too"
            )
    if stage > 0 and same(_stage_bytes(stage, p, g, k, 1 / n)):
        return "; you multiplied by num_devices: each device holds 1 / num_devices of a sharded part"
    return ""


def _compare_zero(got, expected, cases: list[dict]) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from zero_memory_per_device, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        (got_kind, value), (want_kind, want) = unwrap(g), unwrap(e)
        where = _describe_zero(case)
        if want_kind == "raised":
            error = str(want).split(":")[0]
            if got_kind == "raised" and str(value).split(":")[0] == error:
                continue
            got_text = f"it raised {value}" if got_kind == "raised" else f"it returned {value!r}"
            return Mismatch(
                f"zero_memory_per_device should raise {error} on an invalid input",
                f"on {where}: {got_text}; raise ValueError for a stage that is not 0, 1, 2 or 3 by "
                "value (1.5 and nan are none of them), num_devices that is not a positive int, or a "
                "num_params that is negative or nan",
            )
        if got_kind == "raised":
            note = (
                "; a stage is compared by value, as `stage in (0, 1, 2, 3)` compares it: 1.0 and True are "
                "stage 1, False stage 0"
                if type(case["stage"]) is not int
                else ""
            )
            return Mismatch(
                "zero_memory_per_device raised an exception on a valid input",
                f"on {where}: expected {want:g} bytes, your code raised {value}{note}",
            )
        if got_kind != "value" or not is_number(value):
            return Mismatch(
                "zero_memory_per_device must return a number of bytes (an int or a float)",
                f"on {where}: got {value!r:.80}",
            )
        if not _close(value, want):
            return Mismatch(
                "zero_memory_per_device returned the wrong number of bytes",
                f"on {where}: expected {want:.6g} bytes ({want / 1e9:.4g} GB), got {value:.6g}"
                + _zero_note(case, value, want),
            )
    return None


_ZERO_HINT = (
    "each ZeRO stage shards one more part of the training state across the devices: stage 0 nothing, "
    "stage 1 the optimizer state, stage 2 the gradients as well, stage 3 the parameters as well; a sharded "
    "part is split among the devices, an unsharded one stays whole on every device. Count each part with "
    "the byte counts passed in and return bytes, not GB (chapter 05, section “6 · ZeRO: sharding the "
    "training state”)."
)

register(
    Check(
        check_id="lab05.zero_memory",
        task=TASK,
        reference=reference(_ZERO, "zero_memory_per_device"),
        make_inputs=_zero_cases,
        drive=_drive_zero,
        compare=_compare_zero,
        hint=_ZERO_HINT,
    )
)
register(
    Check(
        check_id="lab05.zero_memory_edges",
        task=TASK,
        reference=reference(_ZERO, "zero_memory_per_device"),
        make_inputs=_zero_edge_cases,
        drive=_drive_zero,
        compare=_compare_zero,
        hint=_ZERO_HINT + " Other byte counts (optimizer_bytes=0 for plain SGD), no parameters, one device, "
        "stages given as 1.0, True or False (compared by value: stages 1, 1 and 0), and "
        "invalid arguments (a stage that is none of 0 to 3, 1.5 and nan included, a "
        "num_devices that is not a positive int, a num_params that is negative or nan), "
        "which raise ValueError.",
    )
)
