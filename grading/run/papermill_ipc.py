"""Executing a notebook with papermill, its kernel reached over Unix sockets."""

from __future__ import annotations

from pathlib import Path

from nbformat import NotebookNode


def run_with_papermill(source: str | Path, out: str | Path, **kwargs) -> NotebookNode:
    """``papermill.execute_notebook`` with the kernel on Unix sockets (IPC transport).

    Over TCP the kernel manager picks free ports and the kernel binds them a moment later; with
    several kernels and servers starting side by side another process can take a port in
    between and the kernel dies before it answers. Socket files cannot be taken that way. They
    are named relative to the working directory, which papermill makes the same for the kernel
    and for this process (it changes into ``cwd`` while the notebook runs), so pass ``cwd``.

    The kernel starts the usual way, as a learner's does, unless the caller arranged otherwise
    (:func:`grading.run.warm.run_lesson` forks ``python3`` kernels from a template; the grader's
    child names its own sandboxed kernelspec).
    """
    if kwargs.get("cwd") is None:
        raise ValueError("run_with_papermill needs cwd: the kernel's sockets are files in it")
    import papermill
    from traitlets.config import Config

    config = Config(kwargs.pop("config", None) or {})
    config.KernelManager.transport = "ipc"
    return papermill.execute_notebook(str(source), str(out), config=config, **kwargs)
