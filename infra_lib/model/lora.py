"""LoRA: low-rank adapters on a frozen model's linear layers (Hu et al., 2021).

A frozen projection ``W`` (``[out, in]``) gains a trainable update of rank ``r``:

    y = x W^T + b + (alpha / r) * (x A^T) B^T        A: [r, in], B: [out, r]

Only ``A`` and ``B`` train: ``r * (in + out)`` numbers instead of ``in * out``. ``B`` starts at
zero, so the adapted model starts exactly equal to the base; ``A`` starts as ``nn.Linear`` starts
its weights (Kaiming-uniform), as the paper's code and ``peft`` do. For serving, ``merge()`` folds
``(alpha / r) * B A`` into ``W``: the layer costs what the base costs, and ``unmerge()`` takes the
update out again.

    apply_lora(model, targets, rank, alpha)   wrap a Llama's projections, freeze everything else
    trainable_parameters(model)               what the optimizer sees
    lora_layers / merge_lora / unmerge_lora   the wrapped layers, all merged or unmerged at once
    adapter_state / load_adapter_state        an adapter's A and B alone, by layer name (a few MB)
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ATTENTION_TARGETS + MLP_TARGETS


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``(alpha / rank) * B A``.

    Args:
        base: the linear layer to adapt; it is kept (not copied) as ``self.base`` and frozen.
        rank: the update's rank ``r`` (at least 1).
        alpha: the update's scale numerator: the update is multiplied by ``alpha / rank``, so a
            change of rank does not change how large the update starts out.
        dropout: dropout on the adapter's input only, while training (0: none).

    ``lora_A`` is ``[rank, in_features]``, ``lora_B`` ``[out_features, rank]``, in the base's dtype and
    device. ``merge()`` on a merged layer and ``unmerge()`` on an unmerged one do nothing.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear adapts an nn.Linear, got a {type(base).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout!r}")
        self.base = base.requires_grad_(False)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **like))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.merged = False

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def delta_weight(self) -> torch.Tensor:
        """The update as a matrix, ``[out_features, in_features]``: what ``merge`` adds to the weight."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]``: the base's output plus the scaled update's
        (the update is already inside the base's weight once merged)."""
        out = self.base(x)
        if self.merged:
            return out
        low = F.linear(self.dropout(x), self.lora_A)  # [..., rank]
        return out + self.scaling * F.linear(low, self.lora_B)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into the base weight: the output is unchanged and costs one matmul."""
        if not self.merged:
            self.base.weight += self.delta_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the update out of the base weight again (exact up to rounding: the same update is
        subtracted; 1e-6 of the weight's scale in float32)."""
        if self.merged:
            self.base.weight -= self.delta_weight()
            self.merged = False

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha:g}, merged={self.merged}"
        )


def _target_modules(model: nn.Module, targets) -> list[tuple[str, nn.Module, str]]:
    """``(name, parent, attribute)`` of every module of ``model`` whose attribute name is in ``targets``."""
    found = []
    for parent_name, parent in model.named_modules():
        for attribute, _ in parent.named_children():
            if attribute in targets:
                found.append((f"{parent_name}.{attribute}" if parent_name else attribute, parent, attribute))
    return found


def apply_lora(
    model: nn.Module,
    targets=LORA_TARGETS,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    dropout: float = 0.0,
    lora_class=LoRALinear,
) -> dict[str, nn.Module]:
    """Freeze every parameter of ``model`` and wrap each linear layer named in ``targets`` (by its attribute
    name: ``"q_proj"`` wraps every layer's query projection) in ``lora_class(base, rank, alpha)``, in place.

    ``A`` is drawn under ``torch.manual_seed(seed)`` (the global generator's state is restored after), so
    one seed gives one adapter. ``lora_class`` may be any class with ``LoRALinear``'s constructor (the
    lab's own); ``dropout`` is passed only when it is not 0. Returns the wrapped layers by name.

    Raises:
        ValueError: a target that names no linear layer of the model, or a model already wrapped.
    """
    targets = tuple(targets)
    if not targets:
        raise ValueError("apply_lora needs at least one target, such as 'q_proj'")
    if lora_layers(model):
        raise ValueError("the model already has LoRA layers: apply_lora once per model")
    found = _target_modules(model, targets)
    missing = sorted(set(targets) - {attribute for _, _, attribute in found})
    if missing:
        raise ValueError(f"no module of the model is named {missing}; the projections are {LORA_TARGETS}")
    not_linear = [name for name, parent, attribute in found if not isinstance(getattr(parent, attribute), nn.Linear)]
    if not_linear:
        raise ValueError(f"LoRA adapts linear layers; {not_linear[:3]} are not nn.Linear")
    model.requires_grad_(False)
    wrapped = {}
    options = {"dropout": dropout} if dropout else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, parent, attribute in found:
            layer = lora_class(getattr(parent, attribute), rank, alpha, **options)
            setattr(parent, attribute, layer)
            wrapped[name] = layer
    return wrapped


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRA layers by name (any module with ``lora_A``, ``lora_B`` and ``merge``)."""
    return {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and hasattr(module, "lora_B") and callable(getattr(module, "merge", None))
    }


def trainable_parameters(model: nn.Module) -> int:
    """Numbers the optimizer updates: the parameters with ``requires_grad`` (a shared tensor counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def merge_lora(model: nn.Module) -> None:
    """Merge every LoRA layer of ``model`` into its base weight."""
    for layer in lora_layers(model).values():
        layer.merge()


def unmerge_lora(model: nn.Module) -> None:
    """Take every LoRA layer's update back out of its base weight."""
    for layer in lora_layers(model).values():
        layer.unmerge()


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter alone: ``{"<layer>.lora_A": A, "<layer>.lora_B": B}``, detached copies."""
    state = {}
    for name, layer in lora_layers(model).items():
        state[f"{name}.lora_A"] = layer.lora_A.detach().clone()
        state[f"{name}.lora_B"] = layer.lora_B.detach().clone()
    return state


@torch.no_grad()
def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy an ``adapter_state`` into the model's LoRA layers (unmerged ones: merge after loading).

    Raises:
        ValueError: the state and the model's layers name different layers or shapes, or a layer is merged.
    """
    layers = lora_layers(model)
    expected = {f"{name}.{part}" for name in layers for part in ("lora_A", "lora_B")}
    if set(state) != expected:
        extra, missing = sorted(set(state) - expected), sorted(expected - set(state))
        raise ValueError(f"the adapter does not fit the model: extra {extra[:3]}, missing {missing[:3]}")
    for name, layer in layers.items():
        if layer.merged:
            raise ValueError(f"{name} is merged: unmerge before loading another adapter")
        for part in ("lora_A", "lora_B"):
            target, source = getattr(layer, part), state[f"{name}.{part}"]
            if target.shape != source.shape:
                raise ValueError(
                    f"{name}.{part} is {list(target.shape)} in the model, {list(source.shape)} in the adapter"
                )
            target.copy_(source)


# --- the same adapter in peft ----------------------------------------------------------------------------


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def compare_linear_with_peft(layer: LoRALinear, x: torch.Tensor, seed: int = 0) -> dict[str, float]:
    """``layer`` against ``peft``'s ``lora.Linear`` on a copy of its base with the same A and B: the largest
    absolute difference of the outputs for ``x`` and of the gradients of A, B and x (the loss: the outputs
    weighted by a seeded random tensor, summed)."""
    from peft import LoraConfig, get_peft_model

    holder = nn.Sequential()
    holder.add_module("proj", copy.deepcopy(layer.base))
    config = LoraConfig(r=layer.rank, lora_alpha=layer.alpha, target_modules=["proj"], lora_dropout=0.0)
    twin = get_peft_model(holder, config).base_model.model.proj
    with torch.no_grad():
        twin.lora_A["default"].weight.copy_(layer.lora_A)
        twin.lora_B["default"].weight.copy_(layer.lora_B)
    outputs, grads = [], []
    for module, a, b in (
        (layer, layer.lora_A, layer.lora_B),
        (twin, twin.lora_A["default"].weight, twin.lora_B["default"].weight),
    ):
        x_in = x.detach().clone().requires_grad_(True)
        out = module(x_in)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
        a.grad = b.grad = None
        a_grad, b_grad, x_grad = torch.autograd.grad((out * weights).sum(), (a, b, x_in))
        outputs.append(out)
        grads.append((a_grad, b_grad, x_grad))
    (ga, gb, gx), (ta, tb, tx) = grads
    return {
        "output": _max_difference(*outputs),
        "grad_A": _max_difference(ga, ta),
        "grad_B": _max_difference(gb, tb),
        "grad_x": _max_difference(gx, tx),
    }


def compare_model_with_peft(model: nn.Module, tokens: torch.Tensor) -> dict[str, float]:
    """The course's ``Llama`` with LoRA layers (``apply_lora``, unmerged) against ``transformers``'
    ``LlamaForCausalLM`` holding the same weights with ``peft``'s LoRA on the same projections, A and B
    copied: the largest absolute difference of the logits for ``tokens`` ``[batch, t]``, and of the gradients
    of every A and every B (over all layers) under the next-token cross-entropy."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    from infra_lib.model.loaders import without_init

    layers = lora_layers(model)
    if not layers or any(layer.merged for layer in layers.values()):
        raise ValueError("compare_model_with_peft needs a model with unmerged LoRA layers (apply_lora)")
    first = next(iter(layers.values()))
    fields = {k: v for k, v in model.config.to_hf_dict().items() if k not in ("architectures", "model_type")}
    with without_init():  # every weight is loaded next: no need to draw random ones first
        hf = LlamaForCausalLM(HFConfig(**fields))
    base_state = {
        name.replace(".base.", "."): tensor
        for name, tensor in model.state_dict().items()
        if ".lora_A" not in name and ".lora_B" not in name
    }
    hf.load_state_dict({(k if k == "lm_head.weight" else "model." + k): v for k, v in base_state.items()})
    targets = sorted({name.rsplit(".", 1)[-1] for name in layers})
    config = LoraConfig(r=first.rank, lora_alpha=first.alpha, target_modules=targets, lora_dropout=0.0)
    with warnings.catch_warnings():  # transformers' deprecation notice on a name peft reads
        warnings.simplefilter("ignore", FutureWarning)
        twin = get_peft_model(hf, config)
    twin_modules = dict(twin.base_model.model.model.named_modules())
    pairs = []
    with torch.no_grad():
        for name, layer in layers.items():
            theirs = twin_modules[name]
            theirs.lora_A["default"].weight.copy_(layer.lora_A)
            theirs.lora_B["default"].weight.copy_(layer.lora_B)
            pairs.append((layer, theirs.lora_A["default"].weight, theirs.lora_B["default"].weight))
    model.zero_grad(set_to_none=True)
    logits = []
    for run in (lambda: model(tokens), lambda: twin(input_ids=tokens).logits):
        out = run()
        F.cross_entropy(out[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        logits.append(out)
    return {
        "logits": _max_difference(*logits),
        "grad_A": max(_max_difference(ours.lora_A.grad, a.grad) for ours, a, _ in pairs),
        "grad_B": max(_max_difference(ours.lora_B.grad, b.grad) for ours, _, b in pairs),
    }
