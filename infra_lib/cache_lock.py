"""One lock file per cache entry, so that processes missing the same entry at once build it once.

Test workers, a lesson and a graded kernel often start at the same moment and all miss the same
cache entry (a parsed model file, a corpus's embeddings). Each would build it, seconds of CPU
apiece. ``held(lock_file)`` makes them take turns: the first builds and writes the entry, the
others wait, then find it written and read it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CACHE_ENV = "INFRA_LIB_CACHE"


def cache_root() -> Path:
    """The folder every infra_lib cache lives under (models, embeddings, the compiled decode step):
    ``$INFRA_LIB_CACHE``, else ``~/.cache/infra_lib``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "infra_lib")


@contextlib.contextmanager
def held(lock_file: Path | None):
    """Hold an exclusive lock on ``lock_file`` (created, with its folder, if missing) for the block.

    Without a lock file (None, a folder that cannot be written, no ``fcntl``) the block runs
    unlocked: the lock saves work, and correctness never depends on it."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        fcntl = None
    handle = None
    if lock_file is not None and fcntl is not None:
        try:
            Path(lock_file).parent.mkdir(parents=True, exist_ok=True)
            handle = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            if handle is not None:
                os.close(handle)
            handle = None
    try:
        yield
    finally:
        if handle is not None:
            os.close(handle)  # closing releases the lock
