"""One interface per kind of device: what the rest of the course asks of an accelerator.

A model runs on a device through four things that differ from vendor to vendor: the torch
device and its synchronise call, the memory it reports, the collective library that joins
processes (gloo, NCCL, HCCL) and the path by which custom kernels reach the chip (Triton on an
NVIDIA GPU, Triton's interpreter on a CPU, Ascend C on an Ascend NPU). A ``Backend`` names
them for one device kind; the registry holds one per kind, and ``infra_lib.device`` picks
devices through it. Porting the course to new hardware means adding a backend here and
rewriting what the code census (``infra_lib.portability``) counts as device-specific.

The NPU backend shows the shape an Ascend port takes. Ascend NPUs reach torch through the
``torch_npu`` plugin, imported only when asked about; without it the backend reports itself
unavailable and says why, and nothing pretends to run on it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

# dtypes a backend is asked about; ``supported_dtypes`` keeps those a tiny matmul accepts.
CANDIDATE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class BackendUnavailable(ValueError):
    """A registered device kind that this machine cannot use; the message says why."""


@dataclass(frozen=True)
class Backend:
    """One kind of device, as the course uses it. Subclasses answer the questions about the machine.

    Attributes:
        name: the torch device type ("cpu", "cuda", "mps", "npu").
        vendor: who makes the devices.
        rank: preference for ``DEVICE="auto"`` (lower wins).
        collective_backend: the ``torch.distributed`` backend for tensors on this device, or None.
        kernel_path: how a custom kernel written for the course reaches this device.
        vendor_libraries: the libraries underneath torch's own operators here.
        plugin: the Python package that brings this device to torch (None: torch itself).
    """

    name: str
    vendor: str
    rank: int
    collective_backend: str | None
    kernel_path: str
    vendor_libraries: str
    plugin: str | None = None

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        """None when this machine can run torch on the device, else what is missing and what to do."""
        raise NotImplementedError

    def require(self) -> None:
        """Raise ``BackendUnavailable`` (with the reason) unless the device is usable."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(f"the {self.name} backend is not available here: {reason}")

    def device(self, index: int | None = None) -> torch.device:
        """The torch device (``index`` for one of several)."""
        self.require()
        return torch.device(self.name if index is None else f"{self.name}:{index}")

    def synchronizer(self) -> Callable[[], None] | None:
        """The call that waits for queued work to finish; None where work runs synchronously."""
        return None

    def synchronize(self) -> None:
        sync = self.synchronizer()
        if sync is not None:
            sync()

    def memory_stats(self) -> dict[str, int]:
        """Bytes: ``total``, ``free`` and ``allocated`` (by this process) on device 0, where known."""
        raise NotImplementedError

    def describe(self, device: torch.device | str | None = None) -> str:
        """One line naming the device, e.g. 'cpu (2 torch threads)' or a GPU's name."""
        raise NotImplementedError

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """The floating dtypes in which a small matmul runs on this device (measured, not claimed)."""
        if not self.is_available():
            return ()
        found = []
        for dtype in CANDIDATE_DTYPES:
            try:
                a = torch.ones(4, 4, dtype=dtype, device=self.device())
                (a @ a).sum().item()
                found.append(dtype)
            except (RuntimeError, TypeError):
                pass
        return tuple(found)

    def summary(self) -> dict[str, str]:
        """The backend's facts as strings, one row of a table."""
        return {
            "name": self.name,
            "vendor": self.vendor,
            "available": "yes" if self.is_available() else "no",
            "collectives": self.collective_backend or "-",
            "kernel path": self.kernel_path,
            "libraries": self.vendor_libraries,
            "plugin": self.plugin or "(torch itself)",
            "why not": self.unavailable_reason() or "",
        }


class CPUBackend(Backend):
    def unavailable_reason(self) -> str | None:
        return None

    def memory_stats(self) -> dict[str, int]:
        import psutil

        memory = psutil.virtual_memory()
        return {
            "total": int(memory.total),
            "free": int(memory.available),
            "allocated": int(psutil.Process().memory_info().rss),
        }

    def describe(self, device=None) -> str:
        return f"cpu ({torch.get_num_threads()} torch threads)"


class CUDABackend(Backend):
    def unavailable_reason(self) -> str | None:
        if torch.cuda.is_available():
            return None
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return "this torch is a CPU-only build (torch.version.cuda is None); install a CUDA build of torch"
        return "torch.cuda.is_available() is False: no NVIDIA GPU or driver is visible to this process"

    def synchronizer(self) -> Callable[[], None] | None:
        return torch.cuda.synchronize

    def memory_stats(self) -> dict[str, int]:
        self.require()
        free, total = torch.cuda.mem_get_info()
        return {"total": int(total), "free": int(free), "allocated": int(torch.cuda.memory_allocated())}

    def describe(self, device=None) -> str:
        return f"cuda: {torch.cuda.get_device_name(device)}"


class MPSBackend(Backend):
    def unavailable_reason(self) -> str | None:
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return None
        return "no Apple-silicon GPU: torch.backends.mps.is_available() is False (MPS exists on macOS only)"

    def synchronizer(self) -> Callable[[], None] | None:
        return torch.mps.synchronize

    def memory_stats(self) -> dict[str, int]:
        self.require()
        total = int(torch.mps.recommended_max_memory())
        allocated = int(torch.mps.current_allocated_memory())
        return {"total": total, "free": total - allocated, "allocated": allocated}

    def describe(self, device=None) -> str:
        return "mps: Apple GPU"


class NPUBackend(Backend):
    """Ascend NPUs through the ``torch_npu`` plugin, which adds ``torch.npu`` when imported."""

    def _torch_npu(self):
        return importlib.import_module("torch_npu")

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("torch_npu") is None:
            return (
                "torch_npu is not installed: Ascend NPUs reach PyTorch through the torch_npu plugin, "
                "which needs Huawei's CANN toolkit and an Ascend driver (install the torch-npu release "
                f"that matches torch {torch.__version__.split('+')[0]} and your CANN version)"
            )
        try:
            self._torch_npu()
        except Exception as exc:  # a broken install says why in its own words
            return f"torch_npu is installed but does not import: {exc!r} (is CANN's set_env.sh sourced?)"
        if not torch.npu.is_available():
            return "torch_npu imported, but torch.npu.is_available() is False: no Ascend NPU or driver is visible"
        return None

    def synchronizer(self) -> Callable[[], None] | None:
        self.require()
        return torch.npu.synchronize

    def memory_stats(self) -> dict[str, int]:
        self.require()
        free, total = torch.npu.mem_get_info()
        return {"total": int(total), "free": int(free), "allocated": int(torch.npu.memory_allocated())}

    def describe(self, device=None) -> str:
        self.require()
        return f"npu: {torch.npu.get_device_name(device)}"


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend, replace: bool = False) -> Backend:
    """Add ``backend`` to the registry under its name (``replace=True`` to swap an existing one)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"expected a Backend, got {type(backend).__name__}")
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"a backend named {backend.name!r} is already registered; pass replace=True to swap it")
    _REGISTRY[backend.name] = backend
    return backend


def unregister_backend(name: str) -> Backend:
    """Remove and return the backend registered as ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"no backend named {name!r} is registered; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY.pop(name)


def backend_names() -> tuple[str, ...]:
    """Every registered device kind, in registration order."""
    return tuple(_REGISTRY)


def get_backend(device: str | torch.device) -> Backend:
    """The backend of a device kind or device string ("cuda", "cuda:1", a ``torch.device``).

    Raises:
        ValueError: no backend is registered for that kind.
    """
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind not in _REGISTRY:
        raise ValueError(f"unknown device {str(device)!r}; registered backends: {', '.join(_REGISTRY)}")
    return _REGISTRY[kind]


def available_backends() -> list[Backend]:
    """The backends this machine can use, most preferred first."""
    return sorted((b for b in _REGISTRY.values() if b.is_available()), key=lambda b: b.rank)


register_backend(
    CPUBackend(
        "cpu",
        "any",
        rank=9,
        collective_backend="gloo",
        kernel_path="Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1), one program at a time in "
        "Python; torch.compile emits C++/OpenMP",
        vendor_libraries="oneDNN, MKL or OpenBLAS under ATen",
    )
)
register_backend(
    CUDABackend(
        "cuda",
        "NVIDIA",
        rank=0,
        collective_backend="nccl",
        kernel_path="Triton compiles kernels to PTX for the GPU; torch.compile (Inductor) emits Triton",
        vendor_libraries="CUDA runtime, cuBLAS, cuDNN, NCCL",
    )
)
register_backend(
    MPSBackend(
        "mps",
        "Apple",
        rank=2,
        collective_backend=None,
        kernel_path="Metal shaders; no Triton backend",
        vendor_libraries="Metal Performance Shaders",
    )
)
register_backend(
    NPUBackend(
        "npu",
        "Huawei Ascend",
        rank=1,
        collective_backend="hccl",
        kernel_path="custom kernels rewritten in Ascend C (formerly TBE) and built by CANN; "
        "an Ascend backend for Triton exists, with tuning of its own",
        vendor_libraries="CANN: ACL runtime, aclnn operators, HCCL",
        plugin="torch_npu",
    )
)
