"""One device picker for the whole course, and the matching synchronise call.

Every answer comes from the backend registry (``infra_lib.backends``): one ``Backend`` per device
kind says whether this machine has it, how to wait for it and how to name it. A new kind of
accelerator joins the course by registering a backend, not by adding branches here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infra_lib.backends import backend_names, get_backend

KNOWN_DEVICES = ("auto", *backend_names())


def available_devices() -> list[str]:
    """The device types this machine can run torch on, best first."""
    from infra_lib.backends import available_backends

    return [backend.name for backend in available_backends()]


def pick_device(preference: str = "auto") -> torch.device:
    """Return the torch device to use.

    Args:
        preference: "auto" (the best available: cuda, then npu, then mps, then cpu) or a device
            string such as "cpu", "cuda" or "cuda:1".

    Raises:
        ValueError: the preference names an unknown or unavailable device.
    """
    if not isinstance(preference, str):
        raise ValueError(f"DEVICE must be a string such as 'auto' or 'cpu', got {preference!r}")
    if preference == "auto":
        return torch.device(available_devices()[0])
    kind = preference.split(":")[0]
    if kind not in backend_names():
        raise ValueError(f"unknown device {preference!r}; use one of {', '.join(('auto', *backend_names()))}")
    reason = get_backend(kind).unavailable_reason()
    if reason is not None:
        raise ValueError(
            f"device {preference!r} is not available on this machine "
            f"(available: {', '.join(available_devices())}); set DEVICE='auto'. Why: {reason}"
        )
    return torch.device(preference)


def _kind(device: torch.device | str) -> str:
    return device.type if isinstance(device, torch.device) else str(device).split(":")[0]


def synchronizer(device: torch.device | str) -> Callable[[], None] | None:
    """The call that waits until all queued work on ``device`` has finished.

    CPU work runs synchronously in torch, so there is nothing to wait for: returns None.
    """
    kind = _kind(device)
    if kind not in backend_names():
        return None
    return get_backend(kind).synchronizer()


def describe(device: torch.device | str) -> str:
    """A one-line human description of a device, e.g. 'cpu (2 threads)' or a GPU name."""
    kind = _kind(device)
    if kind not in backend_names():
        return str(device)
    return get_backend(kind).describe(device)
