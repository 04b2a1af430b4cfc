"""The first Triton kernel: out = x + y, one program per BLOCK elements, the last block masked."""

from __future__ import annotations

import torch

from infra_lib.kernels.triton_env import load_triton, require_same_device, require_tensor

triton, tl = load_triton()

ADD_BLOCK = 1024


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """Program p adds elements [p * BLOCK, (p + 1) * BLOCK); lanes past n_elements do nothing."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=inside)
    y = tl.load(y_ptr + offsets, mask=inside)
    tl.store(out_ptr + offsets, x + y, mask=inside)


def add(x: torch.Tensor, y: torch.Tensor, *, block: int = ADD_BLOCK) -> torch.Tensor:
    """x + y elementwise, for contiguous tensors of one shape, dtype and device.

    Args:
        block: elements per program, a power of two.
    """
    require_tensor("x", x)
    require_tensor("y", y)
    require_same_device(x=x, y=y)
    if x.shape != y.shape:
        raise ValueError(
            f"x has shape {list(x.shape)} but y has {list(y.shape)}; this kernel does not broadcast: "
            "expand and .contiguous() the smaller one first"
        )
    if x.dtype != y.dtype:
        raise TypeError(f"x is {x.dtype} but y is {y.dtype}; convert one, e.g. y.to(x.dtype)")
    for name, t in (("x", x), ("y", y)):
        if not t.is_contiguous():
            raise ValueError(
                f"{name} is not contiguous (strides {list(t.stride())}); the kernel reads flat memory: "
                f"pass {name}.contiguous()"
            )
    if type(block) is not int or block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block!r}")
    out = torch.empty_like(x)
    n = x.numel()
    add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return out
