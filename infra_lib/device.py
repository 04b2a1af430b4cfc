"""One device picker for the whole course, and the matching synchronise call."""

from __future__ import annotations

from collections.abc import Callable

import torch

KNOWN_DEVICES = ("auto", "cpu", "cuda", "mps")


def available_devices() -> list[str]:
    """The device types this machine can run torch on, best first."""
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    found.append("cpu")
    return found


def pick_device(preference: str = "auto") -> torch.device:
    """Return the torch device to use.

    Args:
        preference: "auto" (the best available: cuda, then mps, then cpu) or a device
            string such as "cpu", "cuda" or "cuda:1".

    Raises:
        ValueError: the preference names an unknown or unavailable device.
    """
    if not isinstance(preference, str):
        raise ValueError(f"DEVICE must be a string such as 'auto' or 'cpu', got {preference!r}")
    if preference == "auto":
        return torch.device(available_devices()[0])
    kind = preference.split(":")[0]
    if kind not in KNOWN_DEVICES:
        raise ValueError(f"unknown device {preference!r}; use one of {', '.join(KNOWN_DEVICES)}")
    if kind not in available_devices():
        raise ValueError(
            f"device {preference!r} is not available on this machine "
            f"(available: {', '.join(available_devices())}); set DEVICE='auto'"
        )
    return torch.device(preference)


def synchronizer(device: torch.device | str) -> Callable[[], None] | None:
    """The call that waits until all queued work on ``device`` has finished.

    CPU work runs synchronously in torch, so there is nothing to wait for: returns None.
    """
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.synchronize
    if kind == "mps":
        return torch.mps.synchronize
    return None


def describe(device: torch.device | str) -> str:
    """A one-line human description of a device, e.g. 'cpu (2 threads)' or a GPU name."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        return "mps: Apple GPU"
    return f"cpu ({torch.get_num_threads()} torch threads)"
