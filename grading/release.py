"""Generating the learner notebooks in labs/ from the instructor notebooks in solutions/ with nbgrader."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from grading.course import DEFAULT_SOURCE, REPO_ROOT, lab_ids

CONFIG = REPO_ROOT / "grading" / "nbgrader_config.py"
__all__ = ["CONFIG", "generate", "generate_all", "lab_ids"]


def generate(lab_id: str, out_dir: Path, source_dir: Path = DEFAULT_SOURCE) -> Path:
    """Run ``nbgrader generate_assignment`` on one lab in a scratch course directory.

    Returns:
        The folder holding the generated lab (``out_dir/lab_id``), replaced if it existed.
    """
    return generate_all([lab_id], out_dir, source_dir)[0]


def generate_all(labs: list[str], out_dir: Path, source_dir: Path = DEFAULT_SOURCE) -> list[Path]:
    """``generate`` for several labs in one nbgrader run (its start-up, seconds, is paid once).

    Returns:
        The folders holding the generated labs (``out_dir/<lab id>``), in the order given.
    """
    labs = list(dict.fromkeys(labs))
    if not labs:
        return []
    for lab_id in labs:
        source = Path(source_dir) / lab_id
        if not (source / f"{lab_id}.ipynb").is_file():
            raise FileNotFoundError(f"no instructor notebook {source / (lab_id + '.ipynb')}")
    with tempfile.TemporaryDirectory(prefix="release-") as scratch:
        for lab_id in labs:
            shutil.copytree(Path(source_dir) / lab_id, Path(scratch) / "solutions" / lab_id,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        (Path(scratch) / "nbgrader_config.py").write_text(f"load_subconfig({str(CONFIG)!r})\n")
        env = {**os.environ, "INFRA_COURSE_ROOT": scratch}
        # "*" is every assignment in the scratch course: exactly the labs copied above.
        result = subprocess.run(
            [sys.executable, "-m", "nbgrader", "generate_assignment", "*", "--force", "--no-db",
             "--log-level=WARN"],
            cwd=scratch, env=env, capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"nbgrader generate_assignment {' '.join(labs)} failed:\n{result.stdout}\n{result.stderr}")
        targets = []
        for lab_id in labs:
            produced = Path(scratch) / "labs" / lab_id
            if not produced.is_dir():
                raise RuntimeError(f"nbgrader generate_assignment did not produce {lab_id}:\n{result.stderr}")
            target = Path(out_dir) / lab_id
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(produced, target)
            targets.append(target)
    return targets
