"""What the checks of the tasks under one training step (the autograd engine and its ops, AdamW) share.
Cases are plain data (a seed, a shape, a dtype); the tensors are made from them on each side, the same
way, by ``randn``. A result is recorded as its values, dtype and shape (``record``), and compared by
``tensor_problem``, which names the classic mistake a wrong result matches. While a learner's piece
runs, the torch function that would do the task for it refuses to (``NoTorchAutograd``, ``NoTorchAdam``)."""

from __future__ import annotations

from grading.checks.common import array_mismatch
from grading.registry import Mismatch


def randn(seed: int, shape: list[int], dtype: str, scale: float = 1.0):
    """Seeded normal values of ``shape`` times ``scale``, drawn in float64, in ``dtype``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=generator, dtype=torch.float64) * scale).to(getattr(torch, dtype))


def record(value) -> dict:
    """A returned tensor as its values, dtype and shape; anything else as its type's name."""
    import torch

    if isinstance(value, torch.Tensor):
        return {
            "values": value.detach().double().tolist(),
            "dtype": str(value.dtype).replace("torch.", ""),
            "shape": list(value.shape),
        }
    return {"type": type(value).__name__}


def tolerance_for(dtype: str, expected, tight: bool = False) -> tuple[float, float]:
    """(atol, rtol): rounding of float32 or float64, scaled to the largest expected value. ``tight``
    for values that a step changes only a little (a weight after an update): no relative part."""
    import numpy as np

    top = float(np.abs(np.asarray(expected, dtype=np.float64)).max()) if np.size(expected) else 1.0
    if tight:
        return (4e-6 if dtype == "float32" else 1e-12) * max(top, 1e-300), 0.0
    return (2e-6 * max(top, 1e-30), 1e-4) if dtype == "float32" else (1e-12 * max(top, 1e-300), 1e-9)


def tensor_problem(
    name: str,
    got: dict,
    want: dict,
    where: str,
    variants,
    what: str,
    tight: bool = False,
    noun: str = "the returned tensor",
    why_as_hint: bool = False,
) -> Mismatch | None:
    """Shape, dtype, then values of one recorded tensor (``noun``); a value mismatch (``what``) names the
    first variant (a classic mistake, computed in float64 on the same inputs) that the result matches:
    in the detail, or as the hint (``why_as_hint``: a hidden check shows its hint, never its detail)."""
    import numpy as np

    pairs = list(variants.items()) if isinstance(variants, dict) else variants
    if "values" not in got:
        return Mismatch(f"{name} must return a torch tensor", f"on {where}: got a {got.get('type')}")
    if got["shape"] != want["shape"]:
        note = next((why for why, value in pairs if list(np.shape(value)) == got["shape"]), "")
        detail = f"on {where}: expected shape {want['shape']}, got {got['shape']}"
        if why_as_hint:
            return Mismatch(f"{noun} from {name} has the wrong shape", detail, hint=note)
        return Mismatch(f"{noun} from {name} has the wrong shape", detail + (f"; {note}" if note else ""))
    if got["dtype"] != want["dtype"]:
        return Mismatch(
            f"{noun} from {name} has the wrong dtype",
            f"on {where}: expected {want['dtype']} (the inputs' dtype), got {got['dtype']}; make new "
            "tensors with the inputs' dtype (torch.zeros_like, or dtype=x.dtype)",
        )
    atol, rtol = tolerance_for(want["dtype"], want["values"], tight)
    problem = array_mismatch(got["values"], want["values"], what, where, atol=atol, rtol=rtol)
    if problem is None:
        return None
    for why, value in pairs:
        if np.shape(value) == tuple(got["shape"]) and np.allclose(got["values"], value, atol=atol, rtol=rtol):
            if why_as_hint:
                return Mismatch(problem.what, problem.detail, hint=why)
            return Mismatch(problem.what, f"{problem.detail}; {why}")
    return problem


def raised_or_none(name: str, kind: str, value, where: str) -> Mismatch | None:
    """The mismatch for a recorded outcome that is not a dict of values (``name`` raised, or malformed)."""
    if kind == "raised":
        return Mismatch(f"{name} raised an exception", f"on {where}: your code raised {value}")
    if kind != "value" or type(value) is not dict:
        return Mismatch("the check recorded a malformed result", f"on {where}: {value!r:.80}")
    return None


def torch_equal(a, b) -> bool:
    """The two tensors hold the same values (``torch.equal``) as a plain bool."""
    import torch

    return bool(torch.equal(a, b))


class _Refused:
    """For the length of a drive, some of torch's functions refuse to run (``targets``: (module, name) pairs),
    raising ``MESSAGE``; they are restored afterwards."""

    MESSAGE = ""

    def targets(self) -> list[tuple]:
        raise NotImplementedError

    def __enter__(self):
        def refuse(*args, **kwargs):
            raise RuntimeError(self.MESSAGE)

        self.saved = [(module, name, getattr(module, name)) for module, name in self.targets() if hasattr(module, name)]
        for owner, name, _ in self.saved:
            setattr(owner, name, refuse)
        return self

    def __exit__(self, *exc):
        for owner, name, original in self.saved:
            setattr(owner, name, original)
        return False


class NoTorchAutograd(_Refused):
    """The autograd tasks ask for the engine and the backward of each op themselves: ``Tensor.backward``,
    ``torch.autograd.backward`` and ``torch.autograd.grad`` all reach torch's engine through one function,
    replaced here (also where an answer imported ``grad`` by name)."""

    MESSAGE = (
        "lab05 tasks 1 to 4 ask for the backward formula itself, in tensor ops, and the engine that runs it: "
        "torch.autograd (requires_grad, .backward(), torch.autograd.grad) is not part of an answer"
    )

    def targets(self) -> list[tuple]:
        import torch.autograd
        import torch.autograd.graph

        return [(torch.autograd, "_engine_run_backward"), (torch.autograd.graph, "_engine_run_backward")]


class NoTorchAdam(_Refused):
    """For the length of a drive, torch's own Adam and AdamW refuse to run: the task is the update itself."""

    MESSAGE = (
        "lab05 asks for the update itself (adamw_update, and ZeroAdamW's step): torch.optim.AdamW is what it is "
        "compared with, not part of an answer"
    )

    def targets(self) -> list[tuple]:
        import importlib

        adam, adamw = (importlib.import_module(f"torch.optim.{name}") for name in ("adam", "adamw"))
        # The module-level functions that Adam.step and AdamW.step call (the classes' own step is
        # re-wrapped by torch when an optimizer is made, so it is left alone).
        return [(adam, name) for name in ("adam", "_single_tensor_adam", "_multi_tensor_adam", "_fused_adam")] + [
            (adamw, "adamw")
        ]
