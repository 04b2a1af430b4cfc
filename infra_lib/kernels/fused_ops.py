"""Fused operations that graph passes put in place of several nodes.

``add_relu(a, b)`` computes ``relu(a + b)`` as one call: it allocates one tensor for the
sum and applies the ReLU to it in place, where eager PyTorch allocates two. A pass that
rewrites ``relu(add(a, b))`` (see ``fx_passes.fuse_add_relu``) inserts it as one graph node.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["add_relu"]


@torch.fx.wrap
def add_relu(a, b) -> torch.Tensor:
    """``relu(a + b)`` in one call; ``a`` and ``b`` broadcast like ``a + b`` (either may be a number).

    ``torch.fx.wrap`` keeps it one node when code in this module is traced. Code elsewhere
    that calls it and is traced with ``torch.fx.symbolic_trace`` must call
    ``torch.fx.wrap("add_relu")`` at its own top level (or trace with
    ``torch.fx.Tracer(autowrap_functions=(add_relu,))``), or the trace records its add and relu.
    """
    return (a + b).relu_()
