"""Build the adversarial corpus for lab 01: learner notebooks that cheat, crash, hang or break.

Each entry is the released lab with some answers filled in (honestly, or not) and a
tampering move; ``expected.json`` records the score each must get and why each failing
task fails. Run from the repository root after the lab changes:

    .venv/bin/python tests/adversarial/make_corpus.py
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import nbformat

from grading.course import REPO_ROOT

HERE = Path(__file__).resolve().parent
REPO = REPO_ROOT
LAB = REPO / "labs" / "lab01_gemm" / "lab01_gemm.ipynb"
SOLUTION = REPO / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb"

T1, T2, T3, T4 = "test_task1_gemm_flops", "test_task2_time_op", "test_task3_dominant_op", "test_task4_achieved_tflops"
A1, A2, A3, A4 = "task1_gemm_flops", "task2_time_op", "task3_dominant_op", "task4_achieved_tflops"


def _gid(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def _honest() -> dict[str, str]:
    nb = nbformat.read(SOLUTION, as_version=4)
    return {_gid(c): c.source for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution")}


def _lab(answers: dict[str, str]) -> nbformat.NotebookNode:
    nb = nbformat.read(LAB, as_version=4)
    for cell in nb.cells:
        if _gid(cell) in answers:
            cell.source = answers[_gid(cell)]
    return nb


HONEST = _honest()
STUB1 = 'def gemm_flops(m, n, k):\n    raise NotImplementedError("lab01 task 1: gemm_flops")\n'


def with_answers(**changed: str) -> dict[str, str]:
    answers = dict(HONEST)
    answers.update({key.lower(): value for key, value in changed.items()})
    return answers


CORPUS: list[dict] = []


def entry(
    name: str,
    what: str,
    notebook,
    score: float,
    reasons: dict[str, str],
    note: str = "",
    unsandboxed: tuple[float, dict[str, str]] | str | None = None,
) -> None:
    """One corpus notebook: its score and each failing task's reason when graded in the sandbox (as
    `--submissions` grades a class), and ``unsandboxed``, the same without the sandbox (as a
    learner grading their own work), where that differs, or why the entry is never run there."""
    if unsandboxed is None:
        unsandboxed = (score, reasons)
    if isinstance(unsandboxed, tuple):
        unsandboxed = {"score": unsandboxed[0], "reasons": unsandboxed[1]}
    CORPUS.append(
        {
            "name": name,
            "what": what,
            "notebook": notebook,
            "score": score,
            "reasons": reasons,
            "note": note,
            "unsandboxed": unsandboxed,
        }
    )


entry("honest_full", "an honest, complete solution", _lab(HONEST), 10, {})

entry(
    "wrong_answer",
    "task 1 counts m*n*k (forgets the 2)",
    _lab(with_answers(task1_gemm_flops="def gemm_flops(m, n, k):\n    return m * n * k\n")),
    8,
    {T1: "wrong result"},
)

# The honest answers again, dressed: every name changed, a statement of task 2 (the device wait) and
# an expression of task 3 moved into helpers defined after the function that calls them. It scores
# what honest_full does; the similarity report is what should find it.
NEAR_COPY2 = """def time_op(fn, *, warmup: int = 3, iters: int = 10, sync=None) -> float:
    for _ in range(warmup):
        fn()
    _settle(sync)
    samples = []
    for _ in range(iters):
        begin = time.perf_counter()
        fn()
        _settle(sync)
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def _settle(waiter):
    if waiter is not None:
        waiter()
"""
NEAR_COPY3 = """def dominant_op(prof) -> str:
    entries = list(prof.key_averages())
    on_gpu = _ran_on_device(entries)
    if on_gpu:
        return max(entries, key=lambda entry: entry.self_device_time_total).key
    return max(entries, key=lambda entry: entry.self_cpu_time_total).key


def _ran_on_device(entries):
    return any(entry.self_device_time_total > 0 for entry in entries)
"""
entry(
    "near_copy",
    "honest_full's answers with every name changed and parts of tasks 2 and 3 moved into helpers "
    "defined after their caller",
    _lab(with_answers(task2_time_op=NEAR_COPY2, task3_dominant_op=NEAR_COPY3)),
    10,
    {},
    unsandboxed="not run: graded in the class run only (its answers are honest_full's, dressed)",
)

entry(
    "blank",
    "the lab as released, nothing filled in",
    _lab({}),
    0,
    {T1: "error", T2: "error", T3: "error", T4: "error"},
    unsandboxed="not run: graded in the class run only (the untouched lab is graded in tests/test_labs.py)",
)

entry(
    "always_equal",
    "task 1 returns an int whose == is always True",
    _lab(
        with_answers(
            task1_gemm_flops=(
                "class Anything(int):\n"
                "    def __eq__(self, other):\n        return True\n"
                "    def __ne__(self, other):\n        return False\n\n"
                "def gemm_flops(m, n, k):\n    return Anything(0)\n"
            )
        )
    ),
    8,
    {T1: "wrong result"},
)

entry(
    "input_transformer",
    "task 1 installs an IPython input transformer that wraps every later cell in try/except",
    _lab(
        with_answers(
            task1_gemm_flops=STUB1
            + (
                "\ndef _swallow(lines):\n"
                "    return ['try:\\n'] + ['    ' + line for line in lines] + ['\\nexcept BaseException:\\n    "
                "pass\\n']\n\n"
                "get_ipython().input_transformers_cleanup.append(_swallow)\n"
            )
        )
    ),
    8,
    {T1: "tampering detected"},
)

entry(
    "traceback_patch",
    "task 2 is wrong and silences tracebacks (sys.excepthook, showtraceback)",
    _lab(
        with_answers(
            task2_time_op=(
                "import sys\n\n"
                "def time_op(fn, *, warmup=3, iters=10, sync=None):\n    return 0.0\n\n"
                "sys.excepthook = lambda *args: None\n"
                "get_ipython().showtraceback = lambda *args, **kwargs: None\n"
            )
        )
    ),
    7,
    {T2: "tampering detected"},
)

entry(
    "patched_comparisons",
    "task 1 is wrong and patches torch.allclose, numpy and math comparisons",
    _lab(
        with_answers(
            task1_gemm_flops=(
                "import math\nimport numpy as np\n\n"
                "torch.allclose = lambda *args, **kwargs: True\n"
                "np.allclose = lambda *args, **kwargs: True\n"
                "np.testing.assert_allclose = lambda *args, **kwargs: None\n"
                "math.isclose = lambda *args, **kwargs: True\n\n"
                "def gemm_flops(m, n, k):\n    return 1\n"
            )
        )
    ),
    8,
    {T1: "tampering detected"},
)

entry(
    "patched_grading",
    "task 1 replaces grading.check.check with a no-op in the kernel",
    _lab(
        with_answers(
            task1_gemm_flops=STUB1
            + (
                "\nimport grading\nimport grading.check\n"
                "grading.check.check = lambda *args, **kwargs: None\n"
                "grading.check = lambda *args, **kwargs: None\n"
            )
        )
    ),
    8,
    {T1: "tampering detected"},
)

entry(
    "hard_coded",
    "task 1 memorises the answers to the visible check's inputs",
    _lab(with_answers(task1_gemm_flops=None)),
    8,
    {T1: "wrong result"},
)  # filled in below

entry(
    "reference_import",
    "task 1 imports the course's reference implementation as its answer",
    _lab(with_answers(task1_gemm_flops="from infra_lib.hardware.flops import gemm_flops\n")),
    8,
    {T1: "reference shortcut"},
)

entry(
    "reference_obfuscated",
    "task 4 reaches the reference through sys.modules with computed names",
    _lab(
        with_answers(
            task4_achieved_tflops=(
                "import sys\n\n"
                "def achieved_tflops(m, n, k, seconds):\n"
                "    flops = getattr(sys, 'mod' + 'ules')['infra_lib.hardware.' + 'flops']\n"
                "    return getattr(flops, 'achieved_' + 'tflops')(m, n, k, seconds)\n"
            )
        )
    ),
    8,
    {T4: "reference shortcut"},
)

entry(
    "system_exit",
    "task 1 raises SystemExit(0) to end the run before the tests",
    _lab(with_answers(task1_gemm_flops=STUB1 + "\nraise SystemExit(0)\n")),
    8,
    {T1: "tampering detected"},
)

entry(
    "os_exit",
    "task 3 calls os._exit(0) when it is checked",
    _lab(with_answers(task3_dominant_op="import os\n\ndef dominant_op(prof):\n    os._exit(0)\n")),
    7,
    {T3: "crash"},
)

entry(
    "segfault",
    "task 4 dereferences a null pointer with ctypes",
    _lab(
        with_answers(
            task4_achieved_tflops=(
                "import ctypes\n\ndef achieved_tflops(m, n, k, seconds):\n    return ctypes.string_at(0)\n"
            )
        )
    ),
    8,
    {T4: "crash"},
)

entry(
    "infinite_loop",
    "task 3 never returns",
    _lab(with_answers(task3_dominant_op="def dominant_op(prof):\n    while True:\n        pass\n")),
    7,
    {T3: "time-out"},
)

# bytes(n) asks the system for zeroed pages without writing them: the kernel's address
# space grows by 4 GiB at once, in milliseconds, whatever the machine's load (writing 4 GiB
# took 9 s on a quiet 2-core machine and then ran into nbgrader's time-out under load).
entry(
    "memory_bomb",
    "task 2 asks for 4 GiB of memory in 512 MiB pieces",
    _lab(
        with_answers(
            task2_time_op=(
                "def time_op(fn, *, warmup=3, iters=10, sync=None):\n"
                "    hoard = [bytes(512 << 20) for _ in range(8)]\n"
                "    return float(len(hoard))\n"
            )
        )
    ),
    7,
    {T2: "memory limit"},
)

entry(
    "fork_bomb",
    "task 1 starts 100 processes (bounded: each sleeps 20 s)",
    _lab(
        with_answers(
            task1_gemm_flops=(
                "import subprocess\n\n"
                "def gemm_flops(m, n, k):\n"
                "    for _ in range(100):\n"
                "        subprocess.Popen(['sleep', '20'])\n"
                "    return 2 * m * n * k\n"
            )
        )
    ),
    8,
    {T1: "process limit"},
)

entry(
    "print_flood",
    "task 1 prints 50 MB; its answers are right",
    _lab(with_answers(task1_gemm_flops=HONEST[A1] + "\n\nprint('x' * (50 << 20))\n")),
    10,
    {},
    note="output past",
)

nb = _lab(
    with_answers(
        task4_achieved_tflops=(
            'def achieved_tflops(m, n, k, seconds):\n    raise NotImplementedError("lab01 task 4: achieved_tflops")\n'
        )
    )
)
for cell in nb.cells:
    gid = _gid(cell) or ""
    if gid.startswith("test_"):
        cell.metadata["tags"] = ["raises-exception", "skip-execution", "injected-parameters"]
    if gid == A1:
        cell.metadata["tags"] = ["parameters", "injected-parameters"]
nb.metadata["execution"] = {"allow_errors": True}
nb.metadata["kernelspec"] = {"name": "evil-kernel", "display_name": "evil", "language": "python"}
entry(
    "tags_and_metadata",
    "tags (parameters, injected-parameters, raises-exception, skip-execution) and notebook "
    "metadata (execution.allow_errors, another kernelspec); task 4 left undone",
    nb,
    8,
    {T4: "error"},
)

nb = _lab(HONEST)
nb.cells = [c for c in nb.cells if not (_gid(c) or "").startswith("test_")]
entry("deleted_tests", "every test cell deleted; answers honest", nb, 10, {})

nb = _lab(with_answers(task2_time_op="def time_op(fn, *, warmup=3, iters=10, sync=None):\n    fn()\n    return 1.0\n"))
doubled = []
for cell in nb.cells:
    doubled.append(cell)
    if (_gid(cell) or "").startswith("test_"):
        fake = copy.deepcopy(cell)
        fake["id"] = cell["id"] + "-copy"
        fake.source = "pass  # all good"
        fake.metadata["nbgrader"]["points"] = 100
        doubled.append(fake)
nb.cells = doubled
entry(
    "duplicated_tests",
    "test cells duplicated, the copies emptied and given 100 points; task 2 wrong",
    nb,
    7,
    {T2: "wrong result"},
)

nb = _lab(HONEST)
for index, cell in enumerate(nb.cells):
    if _gid(cell) == A3:
        nb.cells[index] = nbformat.v4.new_markdown_cell(cell.source, metadata=cell.metadata, id=cell["id"])
    if _gid(cell) == T1:
        nb.cells[index] = nbformat.v4.new_raw_cell(cell.source, metadata=cell.metadata, id=cell["id"])
entry(
    "retyped_cells",
    "task 3's (right) answer retyped to markdown, task 1's test retyped to raw",
    nb,
    10,
    {},
    note="changed to a markdown cell",
)

nb = _lab(with_answers(task1_gemm_flops="def gemm_flops(m, n, k):\n    return _two() * m * n * k\n"))
position = next(i for i, c in enumerate(nb.cells) if _gid(c) == A1)
nb.cells.insert(position, nbformat.v4.new_code_cell("def _two():\n    return 2\n", id="extra-helper"))
nb.cells.insert(
    0, nbformat.v4.new_code_cell("import grading.check\ngrading.check.check = lambda *a, **k: None\n", id="extra-patch")
)
entry(
    "extra_cells",
    "task 1 relies on a helper in an extra cell; another extra cell patches the grader",
    nb,
    8,
    {T1: "error"},
    note="not part of the lab",
)

entry(
    "malformed_json",
    "the file is not valid JSON",
    '{"cells": [{"cell_type": "code", "source": ',
    0,
    {T1: "unreadable notebook", T2: "unreadable notebook", T3: "unreadable notebook", T4: "unreadable notebook"},
)

entry(
    "wrong_nbformat",
    "nbformat 99 with no cells list",
    json.dumps({"nbformat": 99, "nbformat_minor": 0, "metadata": {}, "worksheets": []}),
    0,
    {T1: "unreadable notebook", T2: "unreadable notebook", T3: "unreadable notebook", T4: "unreadable notebook"},
)

nb = _lab(HONEST)
for cell in nb.cells:
    meta = cell.get("metadata", {}).get("nbgrader")
    if meta:
        meta["grade_id"] = meta["grade_id"].replace("task", "roofline_task")
entry(
    "other_lab",
    "a notebook from another lab (no grade_id matches)",
    nb,
    0,
    {T1: "error", T2: "error", T3: "error", T4: "error"},
    note="right lab",
)


# Part two: the routes around the reference and the course's files that only the sandbox closes.
# Graded without it (a learner grading their own work), the first four get full marks for answers
# they did not write; the last three are never run outside it: they would rewrite the course, read
# whatever the grading user can read, or fill the machine with processes.

# Every answer walks up from the working directory or the environment to the instructor's notebook,
# copies its answer into a scratch module and imports it: no import of the reference, no call of it.
KEY_READER = """
import json
import sys
from pathlib import Path


def _answer_key() -> Path:
    for start in (Path.cwd(), Path(sys.prefix)):
        for folder in [start, *start.parents]:
            key = folder / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb"
            if key.is_file():
                return key
    raise FileNotFoundError("no answer key in reach")


_key = {c["metadata"].get("nbgrader", {}).get("grade_id"): "".join(c["source"])
        for c in json.loads(_answer_key().read_text())["cells"]}
Path("_key_GRADE_ID.py").write_text("import statistics, time\\n" + _key["GRADE_ID"])
sys.path.insert(0, str(Path.cwd()))
from _key_GRADE_ID import *
"""
entry(
    "answer_key_reader",
    "every answer reads the instructor's notebook from disk and imports its answer",
    _lab({gid: KEY_READER.replace("GRADE_ID", gid) for gid in (A1, A2, A3, A4)}),
    0,
    {T1: "error", T2: "error", T3: "error", T4: "error"},
    unsandboxed=(10, {}),
)

# Task 3 runs the reference module's file again under a new name: new code objects, which the call
# monitor does not know, and no import for the scan to see.
entry(
    "reference_rerun",
    "task 3 runs the reference module's file again (runpy) and takes its dominant_op",
    _lab(
        with_answers(
            task3_dominant_op=(
                "import runpy\nimport sys\nfrom pathlib import Path\n\n"
                "_module = runpy.run_path(str(Path(sys.prefix).parent / 'infra_lib' / 'kernels' / 'profiling.py'))\n"
                "dominant_op = _module['dominant_op']\n"
            )
        )
    ),
    7,
    {T3: "error"},
    unsandboxed=(10, {}),
)

# Task 3 copies the reference's source text into a module of its own and imports that.
entry(
    "reference_copier",
    "task 3 copies the reference module's source into a scratch module and imports it",
    _lab(
        with_answers(
            task3_dominant_op=(
                "import sys\nfrom pathlib import Path\n\n"
                "Path('_copied_profiling.py').write_text(\n"
                "    (Path(sys.prefix).parent / 'infra_lib' / 'kernels' / 'profiling.py').read_text())\n"
                "sys.path.insert(0, str(Path.cwd()))\n"
                "from _copied_profiling import dominant_op\n"
            )
        )
    ),
    7,
    {T3: "error"},
    unsandboxed=(10, {}),
)

# Task 1 asks another Python process, which imports the reference, for every answer.
entry(
    "reference_subprocess",
    "task 1 calls the reference in another Python process for each answer",
    _lab(
        with_answers(
            task1_gemm_flops=(
                "import subprocess\nimport sys\n\n"
                "_SERVER = ('import sys\\n'\n"
                "           'from infra_lib.hardware.flops import gemm_flops\\n'\n"
                "           'for line in sys.stdin:\\n'\n"
                "           '    print(gemm_flops(*map(int, line.split())), flush=True)\\n')\n"
                "_child = subprocess.Popen([sys.executable, '-c', _SERVER], stdin=subprocess.PIPE,\n"
                "                          stdout=subprocess.PIPE, text=True)\n\n\n"
                "def gemm_flops(m, n, k):\n"
                "    _child.stdin.write(f'{m} {n} {k}\\n')\n"
                "    _child.stdin.flush()\n"
                "    return int(_child.stdout.readline())\n"
            )
        )
    ),
    8,
    {T1: "error"},
    unsandboxed=(10, {}),
)

# Every answer finds the class's submissions folder the way a process can: near its working
# directory (nbgrader's `submitted/`) and from its ancestors' command lines and working directories
# in /proc (the grader's `--submissions DIR`), and takes the first classmate's filled-in answer.
FIND_SUBMISSIONS = """
import os
from pathlib import Path


def _submissions():
    pid, found = os.getppid(), []
    for folder in [Path.cwd(), *Path.cwd().parents][:4]:  # nbgrader grades in autograded/<learner>/<lab>
        found += sorted(folder.glob("submitted/*/*/*.ipynb"))
    while pid > 1:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\\0")
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        folders = [cwd / args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--submissions"]
        for folder in folders + [cwd / "submitted"]:
            for pattern in ("*.ipynb", "*/*.ipynb", "*/*/*.ipynb"):
                found += sorted(folder.glob(pattern))
    return found
"""
OTHER_READER = (
    FIND_SUBMISSIONS
    + """

def _classmates_answer(grade_id):
    import json

    for path in _submissions():
        try:
            cells = json.loads(path.read_text())["cells"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for cell in cells:
            source = "".join(cell.get("source", ""))
            if (cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id
                    and "return " in source and "_submissions" not in source):  # filled in, not a stub
                return source
    raise FileNotFoundError("no classmate's answer in reach")


Path("_classmate_GRADE_ID.py").write_text("import statistics, time\\n" + _classmates_answer("GRADE_ID"))
import sys
sys.path.insert(0, str(Path.cwd()))
from _classmate_GRADE_ID import *
"""
)
entry(
    "classmate_reader",
    "every answer copies a classmate's answer from the submissions folder",
    _lab({gid: OTHER_READER.replace("GRADE_ID", gid) for gid in (A1, A2, A3, A4)}),
    0,
    {T1: "error", T2: "error", T3: "error", T4: "error"},
    unsandboxed="not run: outside the sandbox it scores what the classmates it finds deserve",
)

# Task 1 rewrites the course for everyone graded after it: the checks, the grader, the reference,
# the answer key, the lab, and every notebook in a submissions folder it can find. Its other
# answers are honest.
VANDAL = (
    FIND_SUBMISSIONS
    + """
import sys

_course = Path(sys.prefix).parent
_targets = [_course / "grading" / "checks" / "lab01.py", _course / "grading" / "check.py",
            _course / "infra_lib" / "timing.py", _course / "infra_lib" / "hardware" / "flops.py",
            _course / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb",
            _course / "labs" / "lab01_gemm" / "lab01_gemm.ipynb"]
_targets += _submissions()
for _target in _targets:
    try:
        _target.write_text("# rewritten by a graded kernel\\n")
    except OSError:
        pass


def gemm_flops(m, n, k):
    return 2 * m * n * k
"""
)
entry(
    "vandal",
    "task 1 rewrites the course's checks, grader, reference, answer key and lab, and every "
    "submission it finds; its answers are honest",
    _lab(with_answers(task1_gemm_flops=VANDAL)),
    10,
    {},
    unsandboxed="not run: it would rewrite the course",
)

entry(
    "fork_bomb_unbounded",
    "task 1 forks until the system refuses (each child waits forever)",
    _lab(
        with_answers(
            task1_gemm_flops=(
                "import os\nimport time\n\n"
                "def gemm_flops(m, n, k):\n"
                "    while True:\n"
                "        if os.fork() == 0:\n"
                "            while True:\n"
                "                time.sleep(3600)\n"
            )
        )
    ),
    8,
    {T1: "process limit"},
    unsandboxed="not run: nothing but the sandbox's process cap stops it",
)


def _hard_coded() -> nbformat.NotebookNode:
    import sys

    sys.path.insert(0, str(REPO))
    from grading.registry import get_check

    table = {tuple(case): 2 * case[0] * case[1] * case[2] for case in get_check("lab01.gemm_flops").inputs(0)}
    return _lab(
        with_answers(
            task1_gemm_flops=f"ANSWERS = {table!r}\n\ndef gemm_flops(m, n, k):\n    return ANSWERS.get((m, n, k), 0)\n"
        )
    )


# What `nbgrader autograde` (0.9, this repo's config, Execute.timeout=15) gives the same
# notebooks; "error" where it could not grade the submission at all. tests/test_adversarial.py
# checks these against a real nbgrader run, and the README's table against this list.
NBGRADER = {
    "honest_full": 10,
    "wrong_answer": 8,
    "always_equal": 8,
    "input_transformer": 10,
    "traceback_patch": 7,
    "patched_comparisons": 10,
    "patched_grading": 8,
    "hard_coded": 8,
    "reference_import": 10,
    "reference_obfuscated": 10,
    "system_exit": 8,
    "os_exit": "error",
    "segfault": "error",
    "infinite_loop": 7,
    "memory_bomb": 7,
    "fork_bomb": 10,
    "print_flood": 10,
    "tags_and_metadata": 10,
    "deleted_tests": 10,
    "duplicated_tests": "error",
    "retyped_cells": 10,
    "extra_cells": 10,
    "malformed_json": "error",
    "wrong_nbformat": "error",
    "other_lab": "error",
    "answer_key_reader": 10,
    "reference_rerun": 10,
    "reference_copier": 10,
    "reference_subprocess": 10,
    "classmate_reader": 10,
    "vandal": "not run",
    "fork_bomb_unbounded": "not run",
    "near_copy": "not run",
    "blank": "not run",
}


# Each entry's row in scores.csv when the whole corpus is graded as one class in the sandbox (tests/
# test_bwrap.py): its status, and the start of each of its flags (one per kind; "copy" for the
# similarity report's). Most entries hold the course's solution for some tasks, so they are copies of
# it and of each other; near_copy's dressed answers must be found as copies of honest_full's
# ("copy_of": task -> the classmate named in its copy flag).
KEY, CLASSMATES, COURSE_FILES = "the answer key", "classmates' submissions", "the course's files"
HIDDEN = "the lab's reference, hidden in the sandbox"
CLASS = {
    "honest_full": ("flagged", ["copy"]),
    "wrong_answer": ("flagged", ["copy"]),
    "near_copy": ("flagged", ["copy"]),
    "blank": ("graded", []),
    "always_equal": ("flagged", ["copy"]),
    "input_transformer": ("refused", [f"refused: {A1} (tampering detected", "copy"]),
    "traceback_patch": ("refused", [f"refused: {A2} (tampering detected", "copy"]),
    "patched_comparisons": ("refused", [f"refused: {A1} (tampering detected", "copy"]),
    "patched_grading": ("refused", [f"refused: {A1} (tampering detected", "copy"]),
    "hard_coded": ("flagged", ["copy"]),
    "reference_import": ("refused", [f"refused: {A1} (reference shortcut", "copy"]),
    "reference_obfuscated": ("caught", [f"caught: {T4} (reference shortcut)", "copy"]),
    "system_exit": ("refused", [f"refused: {A1} (tampering detected", "copy"]),
    "os_exit": ("flagged", ["copy"]),
    "segfault": ("flagged", ["copy"]),
    "infinite_loop": ("flagged", ["copy"]),
    "memory_bomb": ("flagged", ["copy"]),
    "fork_bomb": ("flagged", ["copy"]),
    "print_flood": ("flagged", ["copy"]),
    "tags_and_metadata": ("flagged", ["copy"]),
    "deleted_tests": ("flagged", ["copy"]),
    "duplicated_tests": ("flagged", ["copy"]),
    "retyped_cells": ("flagged", ["copy"]),
    "extra_cells": ("flagged", ["copy"]),
    "malformed_json": ("unreadable", []),
    "wrong_nbformat": ("unreadable", []),
    "other_lab": ("graded", []),
    "answer_key_reader": ("blocked", [f"blocked: {KEY} (looked for not found"]),
    "reference_rerun": ("blocked", [f"blocked: {HIDDEN} (called refused", "copy"]),
    "reference_copier": ("blocked", [f"blocked: {HIDDEN} (called refused", "copy"]),
    "reference_subprocess": ("flagged", ["copy"]),
    # its answers share their search for the submissions folder with vandal's task 1
    "classmate_reader": ("blocked", [f"blocked: {CLASSMATES} (looked for not found", "copy"]),
    # the answer key is not in the sandbox's view: its writes there are refused, or, for a course cloned
    # under /tmp, land in the sandbox's private /tmp ("only the sandbox's own"); either way, blocked
    "vandal": (
        "blocked",
        [
            f"blocked: {CLASSMATES} (looked for not found",
            f"blocked: {COURSE_FILES} (wrote refused",
            f"blocked: {KEY} (wrote ",
            "copy",
        ],
    ),
    "fork_bomb_unbounded": ("flagged", ["copy"]),
}
COPY_OF = {"near_copy": {A2: "honest_full", A3: "honest_full"}, "honest_full": {A2: "near_copy", A3: "near_copy"}}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def build(out: Path) -> None:
    """Write every corpus notebook and expected.json to ``out``, replacing older entries."""
    for old in [*out.glob("*.ipynb"), *out.glob("*.ipynb.broken")]:
        old.unlink()
    manifest = []
    for item in CORPUS:
        notebook = _hard_coded() if item["name"] == "hard_coded" else item["notebook"]
        # A file that is not JSON at all keeps a suffix of its own, so that tools listing the
        # repository's notebooks do not trip over it; the grader reads any path.
        broken = isinstance(notebook, str) and not _is_json(notebook)
        path = out / f"{item['name']}.ipynb{'.broken' if broken else ''}"
        if isinstance(notebook, str):
            path.write_text(notebook, encoding="utf-8")
        else:
            nbformat.write(notebook, path)
        status, flags = CLASS[item["name"]]
        manifest.append(
            {
                **{k: v for k, v in item.items() if k != "notebook"},
                "file": path.name,
                "nbgrader": NBGRADER[item["name"]],
                "class": {"status": status, "flags": flags, "copy_of": COPY_OF.get(item["name"], {})},
            }
        )
    (out / "expected.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def main() -> None:
    build(HERE)
    print(f"wrote {len(CORPUS)} notebooks and expected.json to {HERE}")


if __name__ == "__main__":
    main()
