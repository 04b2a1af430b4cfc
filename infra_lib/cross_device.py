"""The same model, the same prompt, on several devices and dtypes: do they agree?

A port is correct when the new device produces what the old one did. For a language model
"what it produced" has two levels, and both are measured here:

- **tokens**: greedy decoding picks the largest logit at every step; the runs agree up to the
  first step where two candidates were so close that rounding swapped them;
- **logits**: every run scores one shared sequence (the prompt and the reference run's tokens)
  in a single forward pass, so the largest absolute difference compares like with like even
  after the tokens have diverged.

Devices and dtypes round differently (other kernels, other summation orders, fewer mantissa
bits), so small logit differences are expected; what a port must not change is the answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from infra_lib.backends import get_backend
from infra_lib.model.generation import greedy_decode
from infra_lib.model.loaders import build_model
from infra_lib.model.model import Llama


@dataclass
class DeviceRun:
    """One greedy run: where, in which dtype, the tokens, and the logits of the shared sequence.

    Attributes:
        logits: float32 on the CPU, ``[len(scored sequence), vocab]``; None until ``compare_runs`` ran.
        model: the placed copy, kept until ``compare_runs`` has scored with it (then None, to free it).
    """

    device: str
    dtype: str
    token_ids: list[int]
    decode_s: float
    logits: torch.Tensor | None = None
    model: Llama | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return f"{self.device} / {self.dtype}"


@dataclass(frozen=True)
class Agreement:
    """How a run compares with the reference run."""

    label: str
    tokens_compared: int
    tokens_equal: int
    first_divergence: int | None  # index of the first differing token; None if all agree
    max_logit_diff: float
    argmax_agreement: float  # fraction of scored positions whose top token is the same


def model_on(model: Llama, device: str | torch.device, dtype: torch.dtype) -> Llama:
    """A copy of ``model`` on ``device`` in ``dtype`` (the original is returned when nothing changes).

    Raises:
        BackendUnavailable: the device kind is registered but not usable here.
    """
    target = get_backend(device).device()
    if ":" in str(device):
        target = torch.device(device)
    weight = model.embed_tokens.weight
    same_device = weight.device.type == target.type and target.index in (None, weight.device.index)
    if same_device and weight.dtype == dtype:
        return model
    copy = build_model(model.config, model.state_dict(), dtype=dtype)
    return copy.to(target)


def greedy_tokens(model: Llama, prompt_ids: list[int], max_new_tokens: int, stop_id: int | None = None) -> list[int]:
    """Greedy decoding with a KV cache on the model's device and in its dtype (``greedy_decode``)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return greedy_decode(model, list(prompt_ids), max_new_tokens, stop_id)


@torch.inference_mode()
def score(model: Llama, sequence: list[int]) -> torch.Tensor:
    """Logits ``[len(sequence), vocab]`` of one forward pass over ``sequence``, as float32 on the CPU."""
    weight = model.embed_tokens.weight
    return model(torch.tensor([sequence], device=weight.device))[0].float().cpu()


def run_greedy(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    stop_id: int | None = None,
) -> DeviceRun:
    """Copy ``model`` to ``device``/``dtype`` (if needed) and decode ``prompt_ids`` greedily there."""
    placed = model_on(model, device, dtype)
    sync = get_backend(device).synchronizer()
    start = time.perf_counter()
    tokens = greedy_tokens(placed, prompt_ids, max_new_tokens, stop_id)
    if sync is not None:
        sync()
    return DeviceRun(str(device), str(dtype).replace("torch.", ""), tokens, time.perf_counter() - start, model=placed)


def compare_runs(prompt_ids: list[int], reference: DeviceRun, others: list[DeviceRun]) -> list[Agreement]:
    """Score the shared sequence (prompt + the reference's tokens) on every run's device and compare.

    Returns one ``Agreement`` per run, the reference first (which agrees with itself exactly).
    """
    sequence = list(prompt_ids) + reference.token_ids
    results = []
    for run in [reference, *others]:
        if run.logits is None:
            if run.model is None:
                raise ValueError(f"run {run.label} has neither a model nor logits: make it with run_greedy")
            run.logits = score(run.model, sequence)
        run.model = None
    for run in [reference, *others]:
        n = min(len(run.token_ids), len(reference.token_ids))
        equal = [a == b for a, b in zip(run.token_ids, reference.token_ids)]
        first = next((i for i, same in enumerate(equal) if not same), None)
        if first is None and len(run.token_ids) != len(reference.token_ids):
            first = n  # one run stopped earlier than the other
        diff = float((run.logits - reference.logits).abs().max())
        argmax = float((run.logits.argmax(-1) == reference.logits.argmax(-1)).float().mean())
        results.append(Agreement(run.label, n, sum(equal), first, diff, argmax))
    return results


def tiny_llama(seed: int = 0) -> Llama:
    """A small Llama with random weights (2 layers, d_model 64, vocab 256): fast on any device."""
    from infra_lib.model.config import LlamaConfig

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position=256,
        tie_embeddings=False,
    )
    torch.manual_seed(seed)
    return Llama(config).eval()
