"""What the checks on tensors share (tasks 1 to 6): the module of the attention references, and seeded tensors
as plain data."""

from __future__ import annotations

ATTENTION = "infra_lib.model.attention"  # where causal_mask, repeat_kv and cached_attention live


def tensor_list(value, who: str) -> list:
    """A learner's tensor as nested lists of floats; ``who`` names the function that returned it."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{who} must return a torch.Tensor, got {type(value).__name__}")
    return value.detach().double().tolist()


def seeded(seed: int, *shape):
    """A normal tensor of this shape, the same for the same seed."""
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
