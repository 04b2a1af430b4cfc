"""Where the course's parts are: the repository root, and the labs its instructor notebooks define.

Standard library only: the command line imports it to build its help without loading torch.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO_ROOT / "solutions"  # the instructor notebooks (nbgrader's source directory)
UNREADABLE = "unreadable notebook"  # the failure reason of every check of a notebook that cannot be read


def lab_ids(source_dir: str | Path = DEFAULT_SOURCE) -> list[str]:
    """The labs that have an instructor notebook ``<source_dir>/<lab>/<lab>.ipynb``, sorted."""
    return sorted(p.parent.name for p in Path(source_dir).glob("*/*.ipynb") if p.stem == p.parent.name)
