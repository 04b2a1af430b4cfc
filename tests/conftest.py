"""Shared paths and helpers: building learner notebooks from the lab and the solution."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

# Headless plotting and quiet Jupyter for every test and every kernel they start.
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Under pytest-xdist every worker (and every kernel it starts) gets one math thread: two
# workers with two threads each on two cores slow every torch call down many times over.
# Inductor, too, compiles in the process itself: its default pool of compile workers is started
# afresh in every process that compiles (each worker importing torch), several seconds of CPU
# apiece for the few small graphs a test compiles (measured on the decode benchmark: 14 s of
# system time with the pool, 8.5 s without, the same compile time).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from grading.course import REPO_ROOT as REPO  # noqa: E402 (after the thread settings above)

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
SOLUTIONS = sorted(p for p in (REPO / "solutions").glob("*/*.ipynb") if p.stem == p.parent.name)
LABS = sorted(p for p in (REPO / "labs").glob("*/*.ipynb") if p.stem == p.parent.name)
LAB01 = REPO / "labs" / "lab01_gemm" / "lab01_gemm.ipynb"
SOLUTION01 = REPO / "solutions" / "lab01_gemm" / "lab01_gemm.ipynb"


def answer_cells(path: Path) -> dict[str, str]:
    """grade_id -> source of each answer cell of a notebook."""
    from grading.notebook import grade_id, is_solution_cell, read_notebook

    return {grade_id(c): c.source for c in read_notebook(path).cells if is_solution_cell(c)}


def run_cells_after_the_tests(solution: Path, tmp_path: Path) -> dict:
    """Execute a lab's instructor notebook as a learner's kernel would with QUICK, every code cell but the
    parameters, the progress panel and the test cells, each registered in ``linecache`` under a file name
    of its own as IPython registers a cell (so that source-reading code, such as lab 05's ``answer_source``,
    finds it). Returns the namespace the cells ran in; what they printed is the caller's to capture."""
    import linecache

    from grading.notebook import grade_id, read_notebook

    namespace: dict = {"QUICK": True, "DEVICE": "auto"}
    for index, cell in enumerate(read_notebook(solution).cells):
        skipped = grade_id(cell) in ("parameters", "progress") or grade_id(cell).startswith("test")
        if cell.cell_type != "code" or skipped:
            continue
        filename = str(tmp_path / f"cell-{index}.py")
        linecache.cache[filename] = (len(cell.source), None, cell.source.splitlines(keepends=True), filename)
        exec(compile(cell.source, filename, "exec"), namespace)  # noqa: S102 - the course's own notebook
    return namespace


def write_learner_notebook(path: Path, answers: dict[str, str], base: Path = LAB01) -> Path:
    """A copy of the released lab with some answer cells filled in (by grade_id)."""
    from grading.notebook import grade_id, read_notebook

    nb = read_notebook(base)
    for cell in nb.cells:
        if grade_id(cell) in answers:
            cell.source = answers[grade_id(cell)]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def course_copy(course: Path) -> Path:
    """A copy of the course's tracked files in ``course``, sharing the course's installed venv (a link),
    where the README's commands can run as written without touching this checkout."""
    import shutil
    import subprocess

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in filter(None, listed.stdout.split("\0")):
        if (REPO / name).is_file():
            (course / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, course / name)
    (course / ".venv").symlink_to(REPO / ".venv")
    # The copy's venv is the course's own, installed: its stamp is newer than what it was built from.
    installed = (REPO / ".venv" / ".installed").stat().st_mtime
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        os.utime(course / name, (installed - 1, installed - 1))
    # Never let the copy's make rebuild the shared venv (it would install the course from the copy).
    fresh = subprocess.run(["make", "-q", ".venv/.installed"], cwd=course, capture_output=True, text=True)
    assert fresh.returncode == 0, "the copy's make would rebuild the course's venv; run make in the course first"
    return course


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def headless_chromium():
    """Debian's Chromium, headless, through Debian's chromedriver (never a downloaded one)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def parameters_cell(path: Path) -> str:
    """The source of a notebook's one cell tagged ``parameters`` (papermill injects after it)."""
    from grading.notebook import read_notebook

    cells = [c for c in read_notebook(path).cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{path} needs exactly one cell tagged 'parameters'"
    return cells[0].source


def size_for_ci(notebook: Path) -> None:
    """Set ``QUICK = True`` in the parameters cell of a copy of a lab's instructor notebook. nbgrader runs a lab
    as its source says, with no parameters injected; the course's grader injects ``QUICK = True`` for CI, and a
    course copied for a test is sized the same way (QUICK sizes only the cells after the graded ones)."""
    from grading.notebook import read_notebook

    nb = read_notebook(notebook)
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1 and cells[0].source.count("QUICK = False") == 1, f"{notebook}: no QUICK = False to set"
    cells[0].source = cells[0].source.replace("QUICK = False", "QUICK = True")
    nbformat.write(nb, notebook)


def error_outputs(notebook) -> list[str]:
    """``ename: evalue`` of every error output in an executed notebook."""
    return [
        f"cell {i + 1}: {o.get('ename')}: {o.get('evalue')}"
        for i, c in enumerate(notebook["cells"])
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]


@pytest.fixture(scope="session", autouse=True)
def one_template_per_worker():
    """Each test process keeps one warm template (grading.run.warm) and names it in its environment:
    the commands the tests run (infra-lab grade and progress, nbgrader, batch workers) fork their
    kernels from it instead of each starting a template that imports torch again."""
    from grading.run import warm

    current = warm.template()
    if current is not None:
        os.environ.update(current.env())
    yield


@pytest.fixture(scope="session")
def solution_answers() -> dict[str, str]:
    return answer_cells(SOLUTION01)


def run_benchmark(name: str, out: Path) -> dict:
    """Run ``benchmarks/<name>.py --quick`` as a script (exit code 0 required); return its JSON."""
    import json
    import subprocess
    import sys

    # A guard against a hung script, not a speed check: on a slow 2-core machine, in a suite of four
    # workers and with Inductor's cache cold, the decode benchmark's quick run has taken over 300 s.
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout  # the table was printed, then the file written
    data = json.loads(out.read_text())
    assert data["machine_info"]["torch_threads"] >= 1
    assert data["flags"]["quick"] is True and data["seed"] == 0
    return data


# Tests that need the real model. Each worker loads it once (the `smollm2` fixture), in under a
# second from infra_lib's cache of its weights, so these tests spread over the workers freely.
SMOLLM2 = pytest.mark.smollm2


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct loaded through infra_lib (once per test session and worker)."""
    from infra_lib.model import load_default

    return load_default()


@pytest.fixture(scope="session")
def hf_tokenizer():
    """transformers' own tokenizer for the same GGUF file: the reference ours must agree with."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    from infra_lib.model import default_gguf_path

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def solution_namespace(path, **names) -> dict:
    """A lab's instructor answers, run as the notebook runs them: every answer cell in ``names``' namespace."""
    namespace = dict(names)
    for source in answer_cells(path).values():
        exec(source, namespace)
    return namespace


def check_fails(check_id: str, implementation) -> str:
    """The message of ``check(check_id, implementation)``'s failure (it must fail)."""
    from grading.check import check

    with pytest.raises(AssertionError) as info:
        check(check_id, implementation)
    return str(info.value)


# `make test-fast` leaves out tests marked `notebook` or `slow`. Slow ones are found by what they
# use, so a new test that loads the model or grades a notebook is slow without anyone marking it.
SLOW_FIXTURES = {"smollm2", "hf_tokenizer", "minilm", "server", "client", "quick_site", "unexecuted_site", "course"}
SLOW_GROUPS = {"minilm", "site", "progress"}
SLOW_MARKERS = {"smollm2"}
SLOW_MODULES = {
    "test_adversarial",
    "test_browser",
    "test_labs",
    "test_notebooks",
    "test_timing_notes",
    "test_instructor_steps",
}
SLOW_CALLS = (
    "grade_notebook",
    "grade_batch",
    "_grade_class",
    "run_benchmark",
    "run_workers",
    "run_torchrun",
    "execute_notebook",
    '_run("grade',
    '_run("progress',
    '"make"',
)


# The longest tests (minutes on two cores) start first, so that no worker is left finishing one
# alone at the end of the run; pytest-xdist hands out tests in collection order. Names are
# prefixes of test ids, longest first; a group starts with its first test.
LONGEST_FIRST = (
    # First, so that the corpus it embeds into the shared cache is there when chapter 12 runs.
    "tests/test_rag.py::test_relevant_chunks_contain_the_evidence_or_else_overlap_it",
    "tests/test_adversarial.py::test_nbgrader_on_the_corpus_gives_the_documented_scores",
    "tests/test_instructor_steps.py::test_the_readme_instructor_steps_grade_a_class",
    # Mostly waiting (time-outs, sleeping processes): it overlaps well with the rest.
    "tests/test_bwrap.py::test_the_corpus_is_graded_exactly_in_bubblewrap_and_leaves_the_course_untouched",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[09_spec_quant]",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[10_serving]",
    "tests/test_labs.py::test_nbgrader_autograde_agrees_with_the_course_grader",
    "tests/test_labs.py::test_solution_runs_top_to_bottom_and_scores_full_marks[lab15_serving_kernels]",
    "tests/test_labs.py::test_solution_runs_top_to_bottom_and_scores_full_marks[lab16_capstone]",
    "tests/test_capstone.py::test_a_slow_scheduler_keeps_full_correctness_and_is_scored_on_its_measured_ratio",
    "tests/test_labs.py::test_nbgrader_grades_a_lab_as_the_course_grader_does",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[15_serving_kernels]",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[05_training_parallelism]",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[12_rag]",
    "tests/test_model.py::test_decode_benchmark_writes_json",
    "tests/test_disaggregation.py::test_disaggregation_benchmark_writes_every_variant",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[17_serving_beyond_one_engine]",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[18_training_at_scale]",
    "tests/test_model.py::test_decode_profile_benchmark_splits_each_step",
    "tests/test_model.py::test_bf16_and_int8_decode_layouts_stay_within_their_documented_tolerance",
    "tests/test_adversarial.py::test_batch_grading_a_class_with_a_cache",
    "tests/test_training.py::test_data_parallel_follows_the_single_process_trajectory",
    "tests/test_spec_quant.py::test_spec_quant_benchmark_writes_json",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[13_agents]",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[06_request_journey]",
    "tests/test_spec_quant.py::test_sampled_speculative_output_matches_the_target_distribution",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[11_operations]",
    "tests/test_timing_notes.py::test_chapter06_notes_disturbed_batched_decoding",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom[08_continuous_batching]",
    "tests/test_serving_server.py::test_load_with_hundreds_of_streams_some_hanging_up_leaks_nothing",
    "tests/test_check_api.py::test_every_check_passes_its_own_reference",
    "tests/test_labs.py::test_solution_runs_top_to_bottom_and_scores_full_marks[lab09_spec_quant]",
)


def _start_rank(item) -> int:
    return next(
        (rank for rank, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST)
    )


def pytest_collection_modifyitems(config, items):
    import inspect

    items.sort(key=_start_rank)  # stable: every other test keeps its place
    for item in items:
        groups = {mark.args[0] for mark in item.iter_markers("xdist_group") if mark.args}
        module = item.module.__name__ if item.module else ""
        try:
            source = inspect.getsource(item.function)
        except (OSError, TypeError):
            source = ""
        markers = {mark.name for mark in item.iter_markers()}
        if (
            SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
            or SLOW_GROUPS & groups
            or module in SLOW_MODULES
            or SLOW_MARKERS & markers
            or any(call in source for call in SLOW_CALLS)
        ):
            item.add_marker(pytest.mark.slow)


def wait_until_serving(process, port: int, log: Path, what: str = "infra-lab serve", seconds: float = 120) -> None:
    """Wait for a server started as ``process`` to answer /health on ``port``; fail with its log
    if it exits first or does not answer within ``seconds``."""
    import time

    import httpx

    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} did not answer within {seconds:.0f} s"
        time.sleep(0.25)
