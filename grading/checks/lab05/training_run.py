"""The last check of task 6: the learner's three pieces (tasks 4 to 6) plugged into the course's autograd
to train a tiny Llama, whose losses must follow the reference pieces' step by step."""

from __future__ import annotations

import math
import random

from grading.checks.common import is_number
from grading.checks.lab05.pieces import NoTorchAdam
from grading.checks.lab05.task6_adamw_update import TASK
from grading.registry import Check, Mismatch, register

TRAIN_STEPS = 20
PIECES = ("softmax_backward", "rms_norm_backward", "adamw_update")


def reference_pieces() -> dict:
    from infra_lib.training.autograd import rms_norm_backward, softmax_backward
    from infra_lib.training.scratch_train import adamw_update

    return {"softmax_backward": softmax_backward, "rms_norm_backward": rms_norm_backward, "adamw_update": adamw_update}


def _training_inputs(rng: random.Random) -> dict:
    return {"steps": TRAIN_STEPS, "seed": rng.randrange(10**6)}


def _checked(name: str, fn, shapes):
    """``fn`` with its error named, and the shapes of what it returns checked against its inputs'."""

    def call(*args):
        try:
            result = fn(*args)
        except (NotImplementedError, MemoryError):
            raise
        except Exception as exc:  # the learner's code may raise anything
            raise RuntimeError(f"your {name} raised {type(exc).__name__}: {exc}") from None
        shapes(result, *args)
        return result

    return call


def _softmax_shapes(result, probs, grad):
    if getattr(result, "shape", None) != probs.shape:
        raise ValueError(
            f"your softmax_backward returned {getattr(result, 'shape', type(result).__name__)} for "
            f"probs of shape {tuple(probs.shape)}"
        )


def _rms_shapes(result, x, weight, grad, eps):
    if (
        type(result) not in (tuple, list)
        or len(result) != 2
        or getattr(result[0], "shape", None) != x.shape
        or getattr(result[1], "shape", None) != weight.shape
    ):
        shapes = (
            [tuple(getattr(r, "shape", ())) for r in result] if type(result) in (tuple, list) else type(result).__name__
        )
        raise ValueError(
            f"your rms_norm_backward must return (grad_x {tuple(x.shape)}, grad_weight "
            f"{tuple(weight.shape)}); it returned {shapes}"
        )


def _drive_training(pieces, case: dict) -> dict:
    from infra_lib.training.autograd import using_backward
    from infra_lib.training.scratch_train import train_tiny

    if type(pieces) is not dict or set(pieces) != set(PIECES):
        raise TypeError(f"check('lab05.train_tiny', pieces) takes a dict of your {', '.join(PIECES)}")
    grad_norms: list = []
    with (
        NoTorchAdam(),
        using_backward(
            softmax=_checked("softmax_backward", pieces["softmax_backward"], _softmax_shapes),
            rms_norm=_checked("rms_norm_backward", pieces["rms_norm_backward"], _rms_shapes),
        ),
    ):
        losses = train_tiny(
            case["steps"],
            adamw=_checked("adamw_update", pieces["adamw_update"], lambda *args: None),
            seed=case["seed"],
            grad_norms=grad_norms,
        )
    return {"losses": losses, "first_grad_norms": grad_norms[0] if grad_norms else {}}


def _first_gradient_note(got: dict, want: dict) -> str:
    """Which piece the first step's gradients point at (the weights are the same before it)."""
    differ = [
        name
        for name, value in want.items()
        if not (is_number(got.get(name)) and math.isclose(got[name], value, rel_tol=1e-5, abs_tol=1e-12))
    ]
    if not differ:
        return (
            "; the first step's gradients agree with the reference's, so the update differs: your adamw_update (task 6)"
        )
    if "norm.weight" in differ:
        return "; already the final RMSNorm's weight gradient differs: your rms_norm_backward (task 5)"
    top = max((int(name.split(".")[1]) for name in want if name.startswith("layers.")), default=0)
    if f"layers.{top}.mlp.down_proj.weight" in differ:
        return (
            "; already the last MLP's gradients differ, which no softmax lies behind (only the final RMSNorm): "
            "your rms_norm_backward (task 5)"
        )
    return (
        f"; the last layer's MLP gradients agree, its query and key projections' do not ({len(differ)} of "
        f"{len(want)} parameters differ, e.g. {differ[0]}): the attention scores' gradient, your softmax_backward "
        "(task 4)"
    )


def _compare_training(got, expected, case: dict) -> Mismatch | None:
    if type(got) is not dict or type(got.get("losses")) is not list:
        return Mismatch("the check recorded a malformed result", f"got {got!r:.80}")
    losses, want = got["losses"], expected["losses"]
    where = f"train_tiny({case['steps']} steps, seed={case['seed']})"
    for step, (g, e) in enumerate(zip(losses, want), start=1):
        if not (is_number(g) and math.isclose(g, e, rel_tol=1e-5)):
            shown = ", ".join(f"{x:.6f}" if is_number(x) else repr(x) for x in losses[:step])
            return Mismatch(
                f"training with your pieces left the reference's loss curve at step {step}",
                f"on {where}: the first {step - 1} losses agree, then step {step}'s loss is "
                f"{g!r:.12} instead of {e:.10g} (relative tolerance 1e-5); your losses so far: "
                f"[{shown}]" + _first_gradient_note(got.get("first_grad_norms") or {}, expected["first_grad_norms"]),
            )
    if len(losses) != len(want):
        return Mismatch(
            "training with your pieces ran a different number of steps",
            f"on {where}: expected {len(want)} losses, got {len(losses)}",
        )
    return None


register(
    Check(
        check_id="lab05.train_tiny",
        task=TASK,
        reference=lambda: reference_pieces(),
        make_inputs=_training_inputs,
        drive=_drive_training,
        compare=_compare_training,
        hint=(
            "every step of the tiny model's training runs your softmax_backward in each attention, your "
            "rms_norm_backward in each RMSNorm and your adamw_update on each parameter (step counted from "
            "1); their losses must follow the reference pieces' at every step. A piece whose own checks "
            "fail shows here first: fix that task (chapter 05, sections “1 · The chain rule as a graph” "
            "and “2 · One training step, measured: memory, mixed precision, checkpointing”)."
        ),
    )
)
