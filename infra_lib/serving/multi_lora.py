"""Many LoRA adapters served by one engine, in one batched step (S-LoRA, Sheng et al. 2023; Punica,
Chen et al. 2023).

Merging an adapter into the weights serves one adapter at a time: a second one needs its own copy of
the model. Unmerged, the base weights are shared and each request names its adapter (or none). In a
step every adapted projection then computes

    y = x W^T                                  once, for every row of the batch
    y[rows of a] += s_a (x[rows of a] A_a^T) B_a^T      for each adapter a in the batch

the base product once for all the rows, then each adapter's low-rank delta for its own rows, gathered
by the adapter index of each row. Punica's kernels do the gather on the GPU (BGMV, one adapter per
decode row; SGMV, a segment of rows per adapter for prefill); here torch does it per adapter present,
with ``index_select`` and ``index_add_``.

    LoRAAdapter              one adapter's A, B and scale per layer (from a model trained with apply_lora)
    MultiLoRALinear          a base projection plus every loaded adapter's A and B, per-row deltas
    MultiLoRA                the adapters installed on a model, and which row uses which (``rows``)
    MultiLoRARunner          the course's ModelRunner; each step sets the rows' adapters from its batch
    MultiLoRAEngine          LLMEngine whose ``add_request`` takes ``adapter=`` (a name, or None)
    merged_copy              a copy of the model with one adapter merged: the one-adapter reference
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn

from infra_lib.model.sampling import SamplingParams
from infra_lib.serving.engine import LLMEngine
from infra_lib.serving.kv_store import PagedKVStore
from infra_lib.serving.model_runner import Batch, ModelRunner
from infra_lib.serving.scheduler_output import SchedulerConfig


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter: for each adapted layer (by its name in the model, ``"layers.0.self_attn.q_proj"``)
    ``A`` ``[rank, in]`` and ``B`` ``[out, rank]``, and the scale ``alpha / rank``."""

    name: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float

    @classmethod
    def from_model(cls, model: nn.Module, name: str) -> LoRAAdapter:
        """The adapter of a model wrapped by ``apply_lora`` (its layers unmerged), detached copies."""
        from infra_lib.model.lora import lora_layers

        layers = lora_layers(model)
        if not layers:
            raise ValueError("the model has no LoRA layers: train one with apply_lora first")
        if any(layer.merged for layer in layers.values()):
            raise ValueError("unmerge the model's LoRA layers before taking the adapter out")
        scalings = {float(layer.alpha) / layer.rank for layer in layers.values()}
        if len(scalings) != 1:
            raise ValueError(f"the layers have different scales {sorted(scalings)}: one adapter has one")
        weights = {n: (layer.lora_A.detach().clone(), layer.lora_B.detach().clone()) for n, layer in layers.items()}
        return cls(name, weights, scalings.pop())

    @classmethod
    def random(cls, model: nn.Module, name: str, targets, rank: int, alpha: float, seed: int, std: float = 0.02):
        """An adapter with random A and B (B not zero, so it changes the outputs), for tests and demos."""
        from infra_lib.model.lora import LORA_TARGETS

        generator = torch.Generator().manual_seed(seed)
        weights = {}
        for layer_name, module in model.named_modules():
            if layer_name.rsplit(".", 1)[-1] in targets and isinstance(module, nn.Linear):
                shape_a, shape_b = (rank, module.in_features), (module.out_features, rank)
                like = {"dtype": module.weight.dtype}
                a = torch.randn(shape_a, generator=generator, **like) / module.in_features**0.5
                weights[layer_name] = (a, torch.randn(shape_b, generator=generator, **like) * std)
        if not weights:
            raise ValueError(f"no linear layer of the model is named in {tuple(targets)}; try {LORA_TARGETS}")
        return cls(name, weights, alpha / rank)

    def delta(self, layer_name: str) -> torch.Tensor:
        """The layer's update as a matrix ``[out, in]``: what merging adds to its weight."""
        a, b = self.weights[layer_name]
        return self.scaling * (b @ a)


class MultiLoRALinear(nn.Module):
    """A base ``nn.Linear`` with several adapters loaded; ``rows`` (set by ``MultiLoRA.rows``) gives each
    input row's adapter slot: 0 for none, ``i + 1`` for the i-th loaded adapter."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.adapters: list[tuple[torch.Tensor, torch.Tensor, float] | None] = []
        self.rows: torch.Tensor | None = None  # [rows], LongTensor of slots; None: every row is the base's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.rows is None:
            return out
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])  # [rows, in], [rows, out]
        if self.rows.shape[0] != flat_x.shape[0]:
            raise ValueError(f"{self.rows.shape[0]} adapter slots for {flat_x.shape[0]} rows of input")
        for slot in self.rows.unique().tolist():
            loaded = self.adapters[slot - 1] if slot > 0 else None
            if loaded is None:  # the base's rows, or an adapter that leaves this layer alone
                continue
            a, b, scaling = loaded
            rows = (self.rows == slot).nonzero().squeeze(1)
            low = flat_x.index_select(0, rows) @ a.T  # [rows of this adapter, rank]
            flat_out.index_add_(0, rows, low @ b.T, alpha=scaling)
        return out


class MultiLoRA:
    """Adapters installed on a model: each adapted projection becomes a ``MultiLoRALinear`` holding every
    adapter's A and B for it (the base weights are shared, never changed).

    Args:
        model: the course's ``Llama`` (changed in place; ``remove()`` puts the plain layers back).
        adapters: the adapters, distinct names; requests name them.
    """

    def __init__(self, model: nn.Module, adapters: list[LoRAAdapter]):
        names = [a.name for a in adapters]
        if not adapters or len(set(names)) != len(names) or None in names:
            raise ValueError(f"MultiLoRA needs one or more adapters with distinct names, got {names}")
        self.model, self.adapters = model, list(adapters)
        self.slots = {name: i + 1 for i, name in enumerate(names)}
        modules = dict(model.named_modules())
        self.layers: dict[str, MultiLoRALinear] = {}
        for layer_name in sorted({n for a in adapters for n in a.weights}):
            base = modules.get(layer_name)
            if not isinstance(base, nn.Linear):
                raise ValueError(f"adapter layer {layer_name!r} is not a linear layer of the model")
            layer = MultiLoRALinear(base)
            for adapter in adapters:
                if layer_name not in adapter.weights:
                    layer.adapters.append(None)
                    continue
                a, b = (t.to(base.weight) for t in adapter.weights[layer_name])
                if a.shape[1] != base.in_features or b.shape[0] != base.out_features or a.shape[0] != b.shape[1]:
                    raise ValueError(
                        f"adapter {adapter.name!r}'s {layer_name} has A {list(a.shape)} and B {list(b.shape)}; the "
                        f"layer is {base.out_features} x {base.in_features}"
                    )
                layer.adapters.append((a, b, adapter.scaling))
            self.layers[layer_name] = layer
        for layer_name, layer in self.layers.items():
            parent, _, attribute = layer_name.rpartition(".")
            setattr(modules[parent] if parent else model, attribute, layer)

    def slot(self, adapter: str | None) -> int:
        """The slot of an adapter's name (0 for None, the base model)."""
        if adapter is None:
            return 0
        if adapter not in self.slots:
            raise ValueError(f"no adapter named {adapter!r}; this engine serves {sorted(self.slots)} (or None)")
        return self.slots[adapter]

    @contextlib.contextmanager
    def rows(self, slots: torch.Tensor):
        """Inside the ``with`` block every input row of the adapted layers uses the adapter of its slot
        (``slots`` ``[rows]``, one per flattened row of the input, e.g. one per token of an engine step)."""
        for layer in self.layers.values():
            layer.rows = slots
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.rows = None

    def remove(self) -> None:
        """Put the model's plain linear layers back."""
        modules = dict(self.model.named_modules())
        for layer_name, layer in self.layers.items():
            parent, _, attribute = layer_name.rpartition(".")
            setattr(modules[parent] if parent else self.model, attribute, layer.base)
        self.layers = {}


class MultiLoRARunner(ModelRunner):
    """The course's ``ModelRunner`` over a model with ``MultiLoRA`` installed: each step gives every token
    of the flattened batch the adapter slot of its sequence (``adapter_of[seq_id]``; absent: the base)."""

    def __init__(self, model: nn.Module, store: PagedKVStore, lora: MultiLoRA, attention_backend: str = "torch"):
        super().__init__(model, store, attention_backend)
        self.lora = lora
        self.adapter_of: dict[int, int] = {}

    def forward(self, batch: Batch) -> torch.Tensor:
        slots = [self.adapter_of.get(seq.seq_id, 0) for seq, s in batch for _ in range(s.num_tokens)]
        device = self.model.embed_tokens.weight.device
        with self.lora.rows(torch.tensor(slots, dtype=torch.long, device=device)):
            return super().forward(batch)


class MultiLoRAEngine(LLMEngine):
    """``LLMEngine`` serving several adapters at once: ``add_request(..., adapter="name")``.

    The prefix cache is refused: a block's keys and values depend on the adapter that computed them,
    and the cache knows prompts, not adapters.
    """

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        tokenizer=None,
        config: SchedulerConfig = SchedulerConfig(),
        attention_backend: str = "torch",
        adapters: list[LoRAAdapter] = (),
        **kwargs,
    ) -> MultiLoRAEngine:
        """An engine on ``model`` with ``adapters`` installed (the model is changed in place: serve a copy
        if the plain model is needed elsewhere, or call ``engine.runner.lora.remove()`` after)."""
        if config.enable_prefix_caching:
            raise ValueError(
                "MultiLoRAEngine serves without the prefix cache: cached blocks hold one adapter's keys and "
                "values, and the cache does not know which; set enable_prefix_caching=False"
            )
        weight = model.embed_tokens.weight
        store = PagedKVStore.for_model(model.config, config.num_blocks, config.block_size, weight.dtype, weight.device)
        lora = MultiLoRA(model, list(adapters))
        return cls(MultiLoRARunner(model, store, lora, attention_backend), config, tokenizer, **kwargs)

    def add_request(self, prompt, params: SamplingParams = SamplingParams(), *, adapter: str | None = None, **kwargs):
        """``LLMEngine.add_request`` with the request's adapter: a loaded adapter's name, or None for the base."""
        slot = self.runner.lora.slot(adapter)  # refuse an unknown name before the request is queued
        seq_id = super().add_request(prompt, params, **kwargs)
        self.runner.adapter_of[seq_id] = slot
        return seq_id


@torch.no_grad()
def merged_copy(model: nn.Module, adapter: LoRAAdapter | None) -> nn.Module:
    """A deep copy of ``model`` with ``adapter``'s update added to its weights (None: a plain copy)."""
    merged = copy.deepcopy(model)
    if adapter is not None:
        modules = dict(merged.named_modules())
        for layer_name in adapter.weights:
            modules[layer_name].weight += adapter.delta(layer_name).to(modules[layer_name].weight)
    return merged


def exact_match(model, tokenizer, items: list[dict], max_new_tokens: int = 16) -> tuple[float, list[str]]:
    """The fraction of ``items`` whose greedy answer is exactly ``item["answer"]`` (surrounding spaces aside),
    and the answers: every prompt served at once by the course's engine, so the evaluation runs as serving
    would."""
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, num_blocks=64 * 5)
    engine = LLMEngine.from_model(model, tokenizer, config)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    ids = [engine.add_request(item["prompt"], params) for item in items]
    while engine.has_unfinished():
        engine.step()
    answers = [engine.output(i).text.strip() for i in ids]
    hits = sum(answer == item["answer"] for answer, item in zip(answers, items))
    return hits / len(items), answers
