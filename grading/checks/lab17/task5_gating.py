"""Lab 17 task 5: ``top_k_gating(router_logits, k)``, each token's k experts and their gate weights, on seeded
logits: random ones, integer-valued ones full of ties, k of 1 and of every expert, float64, logits near 10^4, and
the inputs refused with ValueError. The driver also computes, for the comparison's diagnosis, the weights of a
softmax over every expert (read from the reference's side only)."""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.lab17.tasks import MOE_SECTION, TASKS, first_mismatch
from grading.registry import Check, Mismatch, register

ATOL, RTOL = 1e-6, 1e-5

AXIS_HINT = (
    "router_logits is [tokens, n_experts]: each token (row) chooses among the experts (the last axis), so both outputs "
    f"are [tokens, k] ({MOE_SECTION})"
)
ORDER_HINT = "each row lists its k experts from the largest logit to the smallest"
TIES_HINT = (
    "equal logits go to the lower expert index first (a stable order), so every rank routes a token the same way"
)
SOFTMAX_HINT = (
    "the weights are the softmax over the k chosen logits only: each row sums to 1 and the experts left out play no "
    "part (a softmax over every expert, cut to the top k, sums to less than 1)"
)
STABLE_HINT = "logits near 10^4 overflow exp unless each row's softmax is shifted by its largest chosen logit"
DTYPE_HINT = "experts are int64 indices; weights keep the logits' dtype (float64 logits give float64 weights)"
ERRORS_HINT = "router_logits that is not 2-D, or k outside 1..n_experts (or not an integer), raises ValueError"


def _logits(rng: random.Random, tokens: int, experts: int, kind: str = "normal", dtype: str = "float32") -> dict:
    return {"tokens": tokens, "experts": experts, "kind": kind, "dtype": dtype, "seed": rng.randrange(10**6)}


def gating_cases(rng: random.Random) -> list[dict]:
    return [
        {"logits": _logits(rng, 7, 4), "k": 2},
        {"logits": _logits(rng, 5, 8), "k": 3},
        {"logits": _logits(rng, 9, 6, "ties"), "k": 2},
    ]


def gating_edge_cases(rng: random.Random) -> list[dict]:
    return [
        {"logits": _logits(rng, 6, 5), "k": 1},
        {"logits": _logits(rng, 4, 5, "ties"), "k": 5},
        {"logits": _logits(rng, 3, 8, dtype="float64"), "k": 4},
        {"logits": _logits(rng, 1, 4), "k": 2},
        {"logits": _logits(rng, 6, 4, "huge"), "k": 2},
        {"logits": _logits(rng, 4, 4), "k": 0, "refused": True},
        {"logits": _logits(rng, 4, 4), "k": 5, "refused": True},
        {"logits": _logits(rng, 4, 4, "flat"), "k": 2, "refused": True},
    ]


def make_logits(spec: dict):
    import torch

    generator = torch.Generator().manual_seed(spec["seed"])
    shape = (spec["tokens"], spec["experts"])
    if spec["kind"] == "ties":
        values = torch.randint(0, 3, shape, generator=generator).double()
    elif spec["kind"] == "huge":
        values = 1e4 + torch.randn(shape, generator=generator, dtype=torch.float64) * 3
    else:
        values = torch.randn(shape, generator=generator, dtype=torch.float64)
    values = values.to(getattr(torch, spec["dtype"]))
    return values.flatten() if spec["kind"] == "flat" else values


def _drive_one(gating, case: dict) -> dict:
    import torch

    logits = make_logits(case["logits"])
    kept = logits.clone()
    try:
        result = gating(logits, case["k"])
    except (NotImplementedError, MemoryError):
        raise
    except Exception as exc:  # the learner's code may raise anything
        return {
            "kind": "raised",
            "value_error": isinstance(exc, ValueError),
            "error": f"{type(exc).__name__}: {exc}"[:300],
        }
    record = {"kind": "value", "unchanged": torch.equal(logits, kept)}
    if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
        return {**record, "form": f"a {type(result).__name__}"}
    experts, weights = result
    record.update(
        form="ok",
        experts=experts.tolist(),
        experts_shape=list(experts.shape),
        experts_dtype=str(experts.dtype).replace("torch.", ""),
        weights=weights.double().tolist(),
        weights_shape=list(weights.shape),
        weights_dtype=str(weights.dtype).replace("torch.", ""),
    )
    if logits.dim() == 2 and 1 <= case["k"] <= logits.shape[1]:  # the diagnosis: a softmax over every expert
        everything = torch.softmax(logits.double(), dim=-1)
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, : case["k"]]
        record["softmax_of_all"] = everything.gather(1, order).tolist()
    return record


def drive_gating(gating, cases: list[dict]) -> list[dict]:
    if not callable(gating):
        raise TypeError(f"check(...) needs your top_k_gating function, got a {type(gating).__name__}")
    return [_drive_one(gating, case) for case in cases]


def _describe(case: dict) -> str:
    spec = case["logits"]
    kind = {"normal": "random", "ties": "integer (many ties)", "huge": "near 10^4", "flat": "1-D"}[spec["kind"]]
    shape = f"{spec['tokens']} tokens over {spec['experts']} experts"
    return f"top_k_gating of {kind} {spec['dtype']} logits for {shape}, k = {case['k']}"


def _close(a, b) -> bool:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, atol=ATOL, rtol=RTOL))


def _experts_mismatch(got: dict, expected: dict, case: dict, where: str) -> Mismatch | None:
    import numpy as np

    if got["experts_shape"] != expected["experts_shape"] or got["weights_shape"] != expected["weights_shape"]:
        return Mismatch(
            "the outputs have the wrong shape",
            f"on {where}: experts {got['experts_shape']} and weights "
            f"{got['weights_shape']}, expected {expected['experts_shape']} for both",
            hint=AXIS_HINT,
        )
    if got["experts"] == expected["experts"]:
        return None
    logits = make_logits(case["logits"]).double().numpy()
    row = next(i for i, (g, e) in enumerate(zip(got["experts"], expected["experts"])) if g != e)
    mine, want = got["experts"][row], expected["experts"][row]
    detail = f"on {where}: token {row} (logits {np.round(logits[row], 4).tolist()}): expected {want}, got {mine}"
    valid = all(type(e) is int and 0 <= e < logits.shape[1] for e in mine)
    if valid and np.array_equal(logits[row][mine], logits[row][want]):
        return Mismatch("equal logits are not broken toward the lower expert index", detail, hint=TIES_HINT)
    if valid and sorted(mine) == sorted(want):
        return Mismatch("a token's experts are not listed largest logit first", detail, hint=ORDER_HINT)
    return Mismatch("a token's k experts are not those of its k largest logits", detail, hint=AXIS_HINT)


def _case_mismatch(got: dict, expected: dict, case: dict) -> Mismatch | None:
    where = _describe(case)
    if case.get("refused"):
        if got["kind"] == "raised" and got["value_error"]:
            return None
        have = got["error"] if got["kind"] == "raised" else "it returned a result"
        return Mismatch(
            "top_k_gating did not refuse its input with ValueError", f"on {where}: {have}", hint=ERRORS_HINT
        )
    if got["kind"] == "raised":
        return Mismatch("top_k_gating raised an error", f"on {where}: {got['error']}", hint=AXIS_HINT)
    if got["form"] != "ok":
        return Mismatch(
            "top_k_gating must return (experts, weights), two tensors",
            f"on {where}: it returned {got['form']}",
            hint=AXIS_HINT,
        )
    mismatch = _experts_mismatch(got, expected, case, where)
    if mismatch is not None:
        return mismatch
    if not _close(got["weights"], expected["weights"]):
        first = lambda weights: [[round(w, 4) for w in row] for row in weights[:3]]  # noqa: E731
        detail = f"on {where}: expected {first(expected['weights'])}, got {first(got['weights'])} (the first tokens)"
        if _close(got["weights"], expected["softmax_of_all"]):
            return Mismatch("the weights are a softmax over every expert", detail, hint=SOFTMAX_HINT)
        if case["logits"]["kind"] == "huge":
            return Mismatch("the weights are wrong for logits near 10^4", detail, hint=STABLE_HINT)
        return Mismatch("the gate weights differ", detail, hint=SOFTMAX_HINT)
    for name in ("experts_dtype", "weights_dtype"):
        if got[name] != expected[name]:
            return Mismatch(
                f"the {name.split('_')[0]} have the wrong dtype",
                f"on {where}: expected {expected[name]}, got {got[name]}",
                hint=DTYPE_HINT,
            )
    if not got["unchanged"]:
        return Mismatch("top_k_gating changed router_logits", f"on {where}", hint="top_k_gating only reads its input")
    return None


def compare_gating(got, expected, cases: list[dict]) -> Mismatch | None:
    return first_mismatch(got, expected, cases, _case_mismatch)


GATING_REFERENCE = reference("infra_lib.serving.moe", "top_k_gating")

register(
    Check(
        check_id="lab17.top_k_gating",
        task=TASKS[5],
        reference=GATING_REFERENCE,
        make_inputs=gating_cases,
        drive=drive_gating,
        compare=compare_gating,
        hint=AXIS_HINT,
    )
)

register(
    Check(
        check_id="lab17.top_k_gating_edges",
        task=TASKS[5],
        reference=GATING_REFERENCE,
        make_inputs=gating_edge_cases,
        drive=drive_gating,
        compare=compare_gating,
        hint=ERRORS_HINT + "; k = 1 gives weights of 1, and float64 logits float64 weights",
    )
)
