"""Where the course's parts are: the repository root, its packages, and the labs its instructor
notebooks define. Every other module imports these from here.

Standard library only: the command line imports it to build its help without loading torch.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# What a graded kernel sees of the course and what a Gradescope bundle carries: the library and the
# grader. The course's tooling (the command line, the site, releases...) stays out of both.
GRADER_PACKAGES = ("infra_lib", "grading")
PACKAGES = (*GRADER_PACKAGES, "course_tools")  # every package of the course, the tooling on top
DEFAULT_SOURCE = REPO_ROOT / "solutions"  # the instructor notebooks (nbgrader's source directory)
UNREADABLE = "unreadable notebook"  # the failure reason of every check of a notebook that cannot be read


def lab_ids(source_dir: str | Path = DEFAULT_SOURCE) -> list[str]:
    """The labs that have an instructor notebook ``<source_dir>/<lab>/<lab>.ipynb``, sorted."""
    return sorted(p.parent.name for p in Path(source_dir).glob("*/*.ipynb") if p.stem == p.parent.name)
