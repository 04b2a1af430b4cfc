"""Lab 18 task 3: ``LoRALinear(base, rank, alpha)``, a frozen linear layer plus a trainable low-rank update, with
``forward``, ``merge`` and ``unmerge``.

Every case builds a seeded ``nn.Linear`` and an input, wraps the layer, records what the wrapper holds at the start
(the shapes of ``lora_A`` and ``lora_B``, how far B is from zero, the output against the base's), then writes seeded
values into A and B and drives one behaviour: the output; the gradients of A, B and the input, and which parameters
require gradients; or merge, merge again, unmerge, unmerge again, with the weight and the output after each. The
driver also computes, from the inputs alone, what the usual mistakes would give (the update scaled by alpha, or
not scaled); the comparison reads those from the reference's side and names the mistake the learner's data matches.
"""

from __future__ import annotations

import random

from grading.checks.common import array_mismatch, reference
from grading.checks.lab18.tasks import LORA_SECTION, TASKS
from grading.registry import Check, Mismatch, register

TOLERANCE = {"float32": 1e-5, "float64": 1e-10}  # outputs and gradients: atol = rtol
RESTORE = {"float32": 1e-6, "float64": 1e-12}  # unmerge gives back the weight within this (absolute)

SHAPE_HINT = (
    "lora_A takes the input down to rank numbers and lora_B takes them back up to the output: A is "
    "[rank, in_features] and B [out_features, rank], both nn.Parameters in the base weight's dtype and device, so "
    f"that their product has the base weight's shape ({LORA_SECTION})"
)
INIT_HINT = (
    "B starts at zero, so the adapted layer starts exactly equal to the base layer and the fine-tune begins from "
    "the model it adapts; A starts random (were both zero, no gradient would ever reach either)"
)
SCALE_ALPHA_HINT = (
    "the update is scaled by alpha / rank, not by alpha: dividing by the rank keeps the update's size the same "
    "when the rank changes, so one alpha (and one learning rate) serves every rank"
)
SCALE_MISSING_HINT = "the update is multiplied by the scale alpha / rank before it is added to the base's output"
OUTPUT_HINT = (
    "the output is the base layer's output, its bias included, plus the scaled update: the input through A, "
    "then through B, for every leading dimension of the input"
)
FROZEN_HINT = (
    "the base layer is frozen: its weight and bias do not require gradients, so backward reaches only lora_A and "
    "lora_B and the optimizer sees those two alone (the point of LoRA: the gradients and the optimizer state of a "
    "sliver of the model)"
)
GRAD_HINT = (
    "let autograd differentiate the forward: the gradients of A, B and the input follow from an output computed "
    "with differentiable tensor operations (no in-place change of A or B, no detach, no torch.no_grad)"
)
MERGE_SCALE_HINT = (
    "merge folds in the update exactly as the forward applies it, the scale alpha / rank included: the merged "
    "layer's output must equal the unmerged one's"
)
MERGE_WEIGHT_HINT = "merge adds the scaled update (the product of B and A) to base.weight; the bias is left alone"
MERGED_FORWARD_HINT = (
    "once merged, base.weight already holds the update: a merged layer's forward is the base layer alone, and "
    "adding the update again counts it twice"
)
TWICE_HINT = (
    "the layer remembers whether the update is in the weight: merge on a merged layer, and unmerge on an unmerged "
    "one, change nothing"
)
UNMERGE_HINT = (
    "unmerge takes out exactly what merge put in, so base.weight comes back as it was (to rounding) and the "
    "forward adds the update itself again"
)
FLAG_HINT = "the attribute merged is True after merge and False after unmerge (False when the layer is made)"
ERRORS_HINT = "LoRALinear(base, rank, alpha) refuses a rank below 1 and an alpha of 0 or less with ValueError"


def _case(rng: random.Random, d_in: int, d_out: int, rank: int, alpha: float, bias: bool, lead, dtype="float32"):
    return {
        "in": d_in,
        "out": d_out,
        "rank": rank,
        "alpha": alpha,
        "bias": bias,
        "lead": list(lead),
        "dtype": dtype,
        "seed": rng.randrange(10**6),
    }


def lora_cases(rng: random.Random) -> list[dict]:
    """A small layer with a bias, SmolLM2's key projection (576 -> 192) at rank 8, and an odd one."""
    return [
        _case(rng, 24, 40, 4, 8.0, True, [3, rng.randint(2, 5)]),
        _case(rng, 576, 192, 8, 16.0, False, [2, rng.randint(3, 7)]),
        _case(rng, 17, 9, 3, rng.choice([5.0, 7.0]), True, [rng.randint(2, 5)]),
    ]


def lora_merge_cases(rng: random.Random) -> list[dict]:
    """``lora_cases`` with a 96 -> 64 layer for SmolLM2's: the merge check records every weight five times."""
    return [
        _case(rng, 24, 40, 4, 8.0, True, [3, rng.randint(2, 5)]),
        _case(rng, 96, 64, 8, 16.0, False, [2, rng.randint(3, 7)]),
        _case(rng, 17, 9, 3, rng.choice([5.0, 7.0]), True, [rng.randint(2, 5)]),
    ]


def lora_edge_cases(rng: random.Random) -> list[dict]:
    """float64, rank 1, no bias, the rank equal to the smaller side, a 1-D and a 4-D input."""
    return [
        _case(rng, 10, 6, 1, 2.0, True, [5], "float64"),
        _case(rng, 7, 5, 5, 3.0, False, [2, 4], "float64"),
        _case(rng, 12, 20, 2, 1.0, False, [], "float32"),
        _case(rng, 8, 8, 2, 6.0, True, [2, 2, 3], "float64"),
    ]


def lora_refusal_cases(rng: random.Random) -> dict:
    """The edge cases, and the arguments to refuse."""
    return {"cases": lora_edge_cases(rng), "refuse": [[0, 4.0], [-2, 4.0], [2, 0.0], [2, -1.0]]}


def build(case: dict):
    """The case's base layer (seeded, in its dtype), input x, seeded A and B, and an output weighting w."""
    import torch
    from torch import nn

    dtype = getattr(torch, case["dtype"])
    generator = torch.Generator().manual_seed(case["seed"])
    base = nn.Linear(case["in"], case["out"], bias=case["bias"]).to(dtype)
    with torch.no_grad():
        bound = case["in"] ** -0.5
        base.weight.copy_((torch.rand(base.weight.shape, generator=generator, dtype=dtype) * 2 - 1) * bound)
        if base.bias is not None:
            base.bias.copy_((torch.rand(base.bias.shape, generator=generator, dtype=dtype) * 2 - 1) * bound)
    x = torch.randn(*case["lead"], case["in"], generator=generator, dtype=dtype)
    a = torch.randn(case["rank"], case["in"], generator=generator, dtype=dtype) * bound
    b = torch.randn(case["out"], case["rank"], generator=generator, dtype=dtype) * 0.5
    w = torch.randn(*case["lead"], case["out"], generator=generator, dtype=dtype)
    return base, x, a, b, w


def _variants(base, x, a, b, case: dict) -> dict:
    """What the usual mistakes give, from the inputs alone: outputs and merged weights with the update scaled by
    alpha / rank (right), by alpha, or not at all."""
    import torch.nn.functional as F

    update = F.linear(F.linear(x, a), b)
    product = b @ a
    scales = {"right": case["alpha"] / case["rank"], "alpha": case["alpha"], "unscaled": 1.0}
    with_bias = F.linear(x, base.weight, base.bias)
    return {
        "outputs": {name: (with_bias + s * update).tolist() for name, s in scales.items()},
        "weights": {name: (base.weight + s * product).tolist() for name, s in scales.items()},
        "twice": (base.weight + 2 * scales["right"] * product).tolist(),
        "under": (base.weight - scales["right"] * product).tolist(),
        "base_output": with_bias.tolist(),
        "base_weight": base.weight.tolist(),
    }


def _wrap(implementation, case: dict, record: dict):
    """The learner's layer around the case's base with the seeded A and B written in, or None with what went
    wrong recorded (an error, the shapes, the start)."""
    import torch

    base, x, a, b, w = build(case)
    layer = _run(lambda: implementation(base, case["rank"], case["alpha"]), "LoRALinear(base, rank, alpha)", record)
    if layer is None:
        return None
    parts = {name: getattr(layer, name, None) for name in ("lora_A", "lora_B")}
    record["is_module"] = isinstance(layer, torch.nn.Module)
    record["base_kept"] = getattr(layer, "base", None) is base
    record["shapes"] = {n: list(p.shape) if isinstance(p, torch.nn.Parameter) else None for n, p in parts.items()}
    record["dtypes"] = {
        n: str(p.dtype).split(".")[-1] if isinstance(p, torch.Tensor) else None for n, p in parts.items()
    }
    if record["shapes"] != {"lora_A": [case["rank"], case["in"]], "lora_B": [case["out"], case["rank"]]}:
        return None
    if not record["is_module"] or not record["base_kept"]:
        return None
    record["init_A_abs_max"] = float(parts["lora_A"].detach().abs().max())
    record["init_B_abs_max"] = float(parts["lora_B"].detach().abs().max())
    record["merged_at_start"] = getattr(layer, "merged", None)
    with torch.no_grad():
        out = _run(lambda: layer(x), "forward", record)
        if out is None:
            return None
        record["init_output"] = out.tolist()
        parts["lora_A"].copy_(a)
        parts["lora_B"].copy_(b)
    return layer, base, x, a, b, w


def _run(step, what: str, record: dict):
    """``step()``'s result, or None with the error recorded under ``what``."""
    try:
        return step()
    except (NotImplementedError, MemoryError):
        raise
    except Exception as exc:  # the learner's code may raise anything
        record["error"] = f"{what} raised {type(exc).__name__}: {exc}"[:300]
        return None


def _drive_each(implementation, cases: list[dict], fill) -> list[dict]:
    """One record per case: how the learner's layer starts (``_wrap``), then ``fill(record, case, *built)``."""
    records = []
    for case in cases:
        record: dict = {}
        records.append(record)
        built = _wrap(implementation, case, record)
        if built is not None:
            fill(record, case, *built)
    return records


def _fill_forward(record: dict, case: dict, layer, base, x, a, b, w) -> None:
    import torch

    record["mistakes"] = _variants(base, x, a, b, case)
    with torch.no_grad():
        out = _run(lambda: layer(x), "forward", record)
    if out is not None:
        record["output"] = out.tolist()


def _fill_grads(record: dict, case: dict, layer, base, x, a, b, w) -> None:
    record["trainable"] = sorted(n for n, p in layer.named_parameters() if p.requires_grad)
    x = x.clone().requires_grad_(True)
    _run(lambda: (layer(x) * w).sum().backward(), "forward and backward", record)
    if "error" not in record:
        grads = {"A": layer.lora_A.grad, "B": layer.lora_B.grad, "x": x.grad}
        record["grads"] = {n: g.tolist() if g is not None else None for n, g in grads.items()}
        record["base_grads"] = [n for n, p in base.named_parameters() if p.grad is not None]


MERGE_SEQUENCE = ("forward", "merge", "merge", "unmerge", "unmerge")


def _fill_merge(record: dict, case: dict, layer, base, x, a, b, w) -> None:
    """After each call of ``MERGE_SEQUENCE``: base.weight, base.bias, the output and ``merged``."""
    import torch

    record["mistakes"] = _variants(base, x, a, b, case)
    seen = record["seen"] = []
    with torch.no_grad():
        for action in MERGE_SEQUENCE:
            if action != "forward":
                _run(lambda: getattr(layer, action)(), f"{action}()", record)
            out = _run(lambda: layer(x), f"forward after {action}", record) if "error" not in record else None
            if out is None:
                break
            seen.append(
                {
                    "weight": layer.base.weight.tolist(),
                    "bias": layer.base.bias.tolist() if layer.base.bias is not None else None,
                    "output": out.tolist(),
                    "merged": getattr(layer, "merged", None),
                }
            )


def drive_forward(implementation, cases: list[dict]) -> list[dict]:
    return _drive_each(implementation, cases, _fill_forward)


def drive_grads(implementation, cases: list[dict]) -> list[dict]:
    return _drive_each(implementation, cases, _fill_grads)


def drive_merge(implementation, cases: list[dict]) -> list[dict]:
    return _drive_each(implementation, cases, _fill_merge)


def drive_refusals(implementation, inputs: dict) -> dict:
    import torch

    refused = []
    for rank, alpha in inputs["refuse"]:
        base = torch.nn.Linear(6, 4)
        try:
            implementation(base, rank, alpha)
            refused.append("accepted")
        except (NotImplementedError, MemoryError):
            raise
        except ValueError:
            refused.append("ValueError")
        except Exception as exc:  # the learner's code may raise anything
            refused.append(type(exc).__name__)
    return {"refused": refused, "merge": drive_merge(implementation, inputs["cases"])}


# --- comparisons ----------------------------------------------------------------------------------------------


def _describe(case: dict) -> str:
    return (
        f"a {case['dtype']} nn.Linear({case['in']}, {case['out']}, bias={case['bias']}) with rank={case['rank']}, "
        f"alpha={case['alpha']:g}, x of shape {[*case['lead'], case['in']]}"
    )


def _near(got, expected, atol: float) -> bool:
    import numpy as np

    try:
        g, e = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return g.shape == e.shape and bool(np.allclose(g, e, atol=atol, rtol=atol))


def _wrap_mismatch(mine: dict, case: dict, where: str) -> Mismatch | None:
    """What is wrong with the layer as made: an error, A and B's shapes, the base not kept, their start."""
    if "shapes" not in mine:
        return Mismatch(
            "LoRALinear(base, rank, alpha) raised an error", f"on {where}: {mine.get('error')}", hint=SHAPE_HINT
        )
    want = {"lora_A": [case["rank"], case["in"]], "lora_B": [case["out"], case["rank"]]}
    if mine["shapes"] != want:
        transposed = {"lora_A": want["lora_A"][::-1], "lora_B": want["lora_B"][::-1]}
        swapped = {"lora_A": want["lora_B"], "lora_B": want["lora_A"]}
        what = "lora_A or lora_B has the wrong shape"
        if mine["shapes"] in (transposed, swapped):
            what = "lora_A and lora_B are " + ("transposed" if mine["shapes"] == transposed else "swapped")
        return Mismatch(
            what,
            f"on {where}: got {mine['shapes']} (None: missing, or not an nn.Parameter), expected {want}",
            hint=SHAPE_HINT,
        )
    if not mine["is_module"]:
        return Mismatch("LoRALinear must be an nn.Module", f"on {where}", hint=SHAPE_HINT)
    if not mine["base_kept"]:
        return Mismatch(
            "the layer must keep the nn.Linear it was given as self.base (the same object, not a copy)", f"on {where}"
        )
    if mine["dtypes"] != {"lora_A": case["dtype"], "lora_B": case["dtype"]}:
        return Mismatch(
            "lora_A and lora_B must take the base weight's dtype", f"on {where}: got {mine['dtypes']}", hint=SHAPE_HINT
        )
    if mine["merged_at_start"] is not False:
        return Mismatch(
            "a new layer's merged must be False", f"on {where}: got {mine['merged_at_start']!r}", hint=FLAG_HINT
        )
    if mine["init_B_abs_max"] != 0.0:
        return Mismatch(
            "lora_B is not zero when the layer is made, so the adapted layer does not start equal to the base",
            f"on {where}: the largest |B| is {mine['init_B_abs_max']:.3g}",
            hint=INIT_HINT,
        )
    if not mine["init_A_abs_max"] > 0:
        return Mismatch("lora_A is all zeros when the layer is made", f"on {where}", hint=INIT_HINT)
    if "init_output" not in mine:
        return Mismatch("forward raised an error", f"on {where}: {mine.get('error')}", hint=OUTPUT_HINT)
    return None


def _start_mismatch(mine: dict, theirs: dict, case: dict, where: str) -> Mismatch | None:
    """The made layer's output must be the base layer's (B is zero: a difference is the forward's)."""
    tolerance = TOLERANCE[case["dtype"]]
    found = array_mismatch(
        mine["init_output"],
        theirs["init_output"],
        "a new layer's output (B still zero) differs from the base layer's",
        where,
        tolerance,
        tolerance,
    )
    return Mismatch(found.what, found.detail, hint=OUTPUT_HINT) if found else None


def _output_mismatch(output, theirs: dict, case: dict, where: str, what: str, hint: str) -> Mismatch | None:
    """``output`` against the right one; names the scaling mistake it matches."""
    tolerance = TOLERANCE[case["dtype"]]
    outputs = theirs["mistakes"]["outputs"]
    if _near(output, outputs["right"], tolerance):
        return None
    if _near(output, outputs["alpha"], tolerance):
        return Mismatch(f"{what}: the update is scaled by alpha", f"on {where}", hint=SCALE_ALPHA_HINT)
    if _near(output, outputs["unscaled"], tolerance):
        return Mismatch(f"{what}: the update is not scaled", f"on {where}", hint=SCALE_MISSING_HINT)
    if _near(output, theirs["mistakes"]["base_output"], tolerance):
        return Mismatch(f"{what}: it is the base layer's output alone", f"on {where}", hint=hint)
    found = array_mismatch(output, outputs["right"], what, where, tolerance, tolerance)
    return Mismatch(found.what, found.detail, hint=hint) if found else None


def _each(got, expected, cases):
    if type(got) is not list or len(got) != len(cases):
        raise ValueError(f"the check recorded {len(got) if type(got) is list else got!r} cases, not {len(cases)}")
    return zip(got, expected, cases)


def compare_forward(got, expected, cases: list[dict]) -> Mismatch | None:
    for mine, theirs, case in _each(got, expected, cases):
        where = _describe(case)
        found = _wrap_mismatch(mine, case, where) or _start_mismatch(mine, theirs, case, where)
        if found is not None:
            return found
        if "output" not in mine:
            return Mismatch("forward raised an error", f"on {where}: {mine.get('error')}", hint=OUTPUT_HINT)
        found = _output_mismatch(mine["output"], theirs, case, where, "forward's output differs", OUTPUT_HINT)
        if found is not None:
            return found
    return None


def compare_grads(got, expected, cases: list[dict]) -> Mismatch | None:
    for mine, theirs, case in _each(got, expected, cases):
        where = _describe(case)
        found = _wrap_mismatch(mine, case, where)
        if found is not None:
            return found
        if mine["trainable"] != ["lora_A", "lora_B"]:
            return Mismatch(
                "the parameters that require gradients must be lora_A and lora_B alone",
                f"on {where}: got {mine['trainable']}",
                hint=FROZEN_HINT,
            )
        if "grads" not in mine:
            return Mismatch("forward and backward raised an error", f"on {where}: {mine.get('error')}", hint=GRAD_HINT)
        if mine["base_grads"]:
            return Mismatch(
                "backward reached the base layer", f"on {where}: {mine['base_grads']} got gradients", hint=FROZEN_HINT
            )
        tolerance = TOLERANCE[case["dtype"]]
        for name, label in (("A", "lora_A"), ("B", "lora_B"), ("x", "the input")):
            if mine["grads"][name] is None:
                return Mismatch(f"no gradient reached {label}", f"on {where}", hint=GRAD_HINT)
            found = array_mismatch(
                mine["grads"][name],
                theirs["grads"][name],
                f"the gradient of {label} differs",
                where,
                tolerance,
                tolerance,
            )
            if found is not None:
                return Mismatch(found.what, found.detail, hint=GRAD_HINT)
    return None


def _merged_mismatch(step: dict, index: int, theirs: dict, case: dict, where: str) -> Mismatch | None:
    """The state after the first (index 1) or the second (index 2) merge()."""
    tolerance, weights = TOLERANCE[case["dtype"]], theirs["mistakes"]["weights"]
    after = "after merge()" + (" twice" if index == 2 else "")
    if step["merged"] is not True:
        return Mismatch(f"merged is {step['merged']!r} {after}", f"on {where}", hint=FLAG_HINT)
    right = _near(step["weight"], weights["right"], tolerance)
    if not right and index == 2 and _near(step["weight"], theirs["mistakes"]["twice"], tolerance):
        return Mismatch("a second merge() added the update again", f"on {where}", hint=TWICE_HINT)
    if not right and any(_near(step["weight"], weights[k], tolerance) for k in ("unscaled", "alpha")):
        return Mismatch(
            f"the merged weight holds the update without its scale alpha / rank ({after})",
            f"on {where}",
            hint=MERGE_SCALE_HINT,
        )
    found = array_mismatch(
        step["weight"], weights["right"], f"base.weight is wrong {after}", where, tolerance, tolerance
    )
    if found is not None:
        return Mismatch(found.what, found.detail, hint=MERGE_WEIGHT_HINT)
    if not _near(step["output"], theirs["mistakes"]["outputs"]["right"], tolerance):
        return Mismatch(
            f"the forward {after} differs from the unmerged forward", f"on {where}", hint=MERGED_FORWARD_HINT
        )
    return None


def _unmerged_mismatch(step: dict, index: int, theirs: dict, case: dict, where: str) -> Mismatch | None:
    """The state after the first (index 3) or the second (index 4) unmerge()."""
    tolerance, restore = TOLERANCE[case["dtype"]], RESTORE[case["dtype"]]
    after = "after merge() twice and unmerge()" + (" twice" if index == 4 else "")
    if step["merged"] is not False:
        return Mismatch(f"merged is {step['merged']!r} {after}", f"on {where}", hint=FLAG_HINT)
    if index == 4 and _near(step["weight"], theirs["mistakes"]["under"], tolerance):
        return Mismatch("a second unmerge() took the update out again", f"on {where}", hint=TWICE_HINT)
    found = array_mismatch(
        step["weight"], theirs["mistakes"]["base_weight"], f"base.weight is not restored {after}", where, restore
    )
    if found is not None:
        return Mismatch(found.what, found.detail, hint=UNMERGE_HINT)
    if not _near(step["output"], theirs["mistakes"]["outputs"]["right"], tolerance):
        return Mismatch(
            f"the forward {after} differs from the forward before merge()", f"on {where}", hint=UNMERGE_HINT
        )
    return None


def compare_merge(got, expected, cases: list[dict]) -> Mismatch | None:
    for mine, theirs, case in _each(got, expected, cases):
        where = _describe(case)
        found = _wrap_mismatch(mine, case, where)
        if found is not None:
            return found
        seen = mine["seen"]
        if not seen:
            return Mismatch("forward raised an error", f"on {where}: {mine.get('error')}", hint=OUTPUT_HINT)
        found = _output_mismatch(seen[0]["output"], theirs, case, where, "forward's output differs", OUTPUT_HINT)
        if found is not None:
            return found
        for index, step in enumerate(seen[1:], start=1):
            if step["bias"] != theirs["seen"][index]["bias"]:
                return Mismatch(f"{MERGE_SEQUENCE[index]}() changed the bias", f"on {where}", hint=MERGE_WEIGHT_HINT)
            check_step = _merged_mismatch if MERGE_SEQUENCE[index] == "merge" else _unmerged_mismatch
            found = check_step(step, index, theirs, case, where)
            if found is not None:
                return found
        if len(seen) < len(MERGE_SEQUENCE):
            return Mismatch(
                "merge, unmerge or forward raised an error", f"on {where}: {mine.get('error')}", hint=TWICE_HINT
            )
    return None


def compare_refusals(got, expected, inputs: dict) -> Mismatch | None:
    for (rank, alpha), outcome in zip(inputs["refuse"], got["refused"]):
        if outcome != "ValueError":
            return Mismatch(
                "LoRALinear accepted or mis-refused an argument it must refuse",
                f"LoRALinear(nn.Linear(6, 4), rank={rank}, alpha={alpha:g}): {outcome}, expected ValueError",
                hint=ERRORS_HINT,
            )
    return compare_merge(got["merge"], expected["merge"], inputs["cases"])


course_lora = reference("infra_lib.model.lora", "LoRALinear")

register(
    Check(
        check_id="lab18.lora_forward",
        task=TASKS[3],
        reference=course_lora,
        make_inputs=lora_cases,
        drive=drive_forward,
        compare=compare_forward,
        hint=OUTPUT_HINT,
    )
)

register(
    Check(
        check_id="lab18.lora_forward_edges",
        task=TASKS[3],
        reference=course_lora,
        make_inputs=lora_edge_cases,
        drive=drive_forward,
        compare=compare_forward,
        hint=OUTPUT_HINT + "; in float64 too, at rank 1, without a bias, for an input with no leading dimension",
    )
)

register(
    Check(
        check_id="lab18.lora_grads",
        task=TASKS[3],
        reference=course_lora,
        make_inputs=lora_cases,
        drive=drive_grads,
        compare=compare_grads,
        hint=FROZEN_HINT,
    )
)

register(
    Check(
        check_id="lab18.lora_grads_edges",
        task=TASKS[3],
        reference=course_lora,
        make_inputs=lora_edge_cases,
        drive=drive_grads,
        compare=compare_grads,
        hint=GRAD_HINT,
    )
)

register(
    Check(
        check_id="lab18.lora_merge",
        task=TASKS[3],
        reference=course_lora,
        make_inputs=lora_merge_cases,
        drive=drive_merge,
        compare=compare_merge,
        hint=UNMERGE_HINT,
    )
)

register(
    Check(
        check_id="lab18.lora_merge_edges",
        task=TASKS[3],
        reference=course_lora,
        make_inputs=lora_refusal_cases,
        drive=drive_refusals,
        compare=compare_refusals,
        hint=TWICE_HINT + "; " + ERRORS_HINT,
    )
)
