"""Where a class's shared folders live, in one place: the course's id and nbgrader's exchange.

The instructor's nbgrader (``course_tools/nbgrader_config.py``), every learner's nbgrader on the
class's JupyterHub (``jupyter_config/hub_learner/nbgrader_config.py``) and the hub itself
(:mod:`course_tools.hub`, which shows the exchange inside each learner's sandbox) read them from here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nbgrader.exchange.default.submit import ExchangeSubmit

from grading.course import REPO_ROOT

COURSE_ID = "infra-course"
COURSE_ROOT_ENV = "INFRA_COURSE_ROOT"  # the instructor's course folder, when not this checkout
EXCHANGE_ENV = "INFRA_EXCHANGE_ROOT"  # nbgrader's exchange, when not <course>/exchange


def course_root() -> Path:
    """The instructor's course folder: ``$INFRA_COURSE_ROOT``, else this checkout."""
    return Path(os.environ.get(COURSE_ROOT_ENV) or REPO_ROOT)


def exchange_root() -> Path:
    """nbgrader's exchange: ``$INFRA_EXCHANGE_ROOT``, else ``exchange/`` in the course folder."""
    return Path(os.environ.get(EXCHANGE_ENV) or course_root() / "exchange")


def place_feedback(lab_id: str, grades: Path, submissions: Path, out: Path) -> tuple[list[str], list[str]]:
    """Put each learner's ``feedback.html`` from the course's grader (``grades/<lab>/<learner>/``)
    where ``nbgrader release_feedback`` takes it: ``out/<learner>/<lab>/<lab>.html``, beside the
    ``timestamp.txt`` and ``submission_secret.txt`` of the submission ``nbgrader collect`` put in
    ``submissions/<learner>/<lab>/`` (the exchange names each learner's feedback after them, so only
    that learner's ``nbgrader fetch_feedback`` finds it).

    Returns (learners placed, "learner: why not" for each learner left out).
    """
    placed, skipped = [], []
    if not Path(grades).is_dir():
        raise FileNotFoundError(f"no grades at {grades}: grade the lab first (infra-lab grade --submissions ...)")
    for report in sorted(Path(grades).glob("*/feedback.html")):
        learner = report.parent.name
        submitted = Path(submissions) / learner / lab_id
        needed = [submitted / "timestamp.txt", submitted / "submission_secret.txt"]
        missing = [path.name for path in needed if not path.is_file()]
        if missing:
            skipped.append(f"{learner}: {submitted} has no {' or '.join(missing)} (not collected by nbgrader collect)")
            continue
        target = Path(out) / learner / lab_id
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(report, target / f"{lab_id}.html")
        for path in needed:
            shutil.copyfile(path, target / path.name)
        placed.append(learner)
    return placed, skipped


class PrivateSubmit(ExchangeSubmit):
    """nbgrader's submit, with the submission readable by its learner alone (and the instructor, who
    is root on the class's hub): nbgrader's own makes it readable by every user who learns its
    folder's name. The learners' nbgrader on the hub uses it (``jupyter_config/hub_learner``)."""

    def set_perms(self, dest, fileperms, dirperms):
        super().set_perms(dest, fileperms & 0o700, dirperms & 0o700)
