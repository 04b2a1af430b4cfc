"""Lab 15's checks on kernels a learner might write.

Each usual mistake is the course's answer with one idea taken out (one line replaced), written to a
file so that Triton can read its source. It must lose exactly the checks listed for it, all of its
own task (a check launches one task's kernel, so other tasks' checks never meet it), and each lost
kernel check must carry the hint written for that mistake; a check that runs the kernel inside a
model gives its own hint. A Python stand-in for a kernel, and a kernel that sends its scores
through memory, score zero on the checks they cheat. The SmolLM2 check is left out (it loads the model,
then runs 30 layers in the interpreter per kernel): the small decoder's checks stand in for it.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import re
from dataclasses import dataclass

import pytest

pytest.importorskip("triton", reason="Triton ships wheels for Linux only")

import torch  # noqa: E402
from conftest import REPO, answer_cells  # noqa: E402

from grading.check import INTERACTIVE_SEED, TRAFFIC, Outcome, drive, judge  # noqa: E402
from grading.checks.lab15 import kernel_checks  # noqa: E402
from grading.checks.lab15 import task1_online_softmax as task1  # noqa: E402
from grading.checks.lab15 import task2_flash_attention as task2  # noqa: E402
from grading.checks.lab15 import task3_paged_decode as task3  # noqa: E402
from grading.checks.lab15 import task4_q4_gemv as task4  # noqa: E402
from grading.registry import all_checks, get_check  # noqa: E402
from infra_lib.kernels.triton_env import interpreter_active, load_triton  # noqa: E402

load_triton()

SOLUTION = REPO / "solutions" / "lab15_serving_kernels" / "lab15_serving_kernels.ipynb"
ANSWERS = {
    1: "task1_online_softmax_kernel",
    2: "task2_flash_attention_kernel",
    3: "task3_paged_decode_kernel",
    4: "task4_q4_gemv_kernel",
}
SLOW = {"lab15.flash_in_smollm2"}
IN_A_MODEL = {"lab15.flash_in_tiny_model", "lab15.paged_in_tiny_model"}
needs_interpreter = pytest.mark.skipif(not interpreter_active(), reason="traffic is counted in the interpreter")
_count = itertools.count()


def variant(tmp_path, task: int, replacements=()):
    """The course's answer to ``task`` with each (old, new) replacement made, as a Triton kernel."""
    source = answer_cells(SOLUTION)[ANSWERS[task]]
    for old, new in replacements:
        assert source.count(old) == 1, f"the answer to task {task} no longer holds {old!r}"
        source = source.replace(old, new)
    path = tmp_path / f"lab15_variant_{next(_count)}.py"
    path.write_text("import math\n\nimport torch\nimport triton\nimport triton.language as tl\n\n\n" + source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, ANSWERS[task].split("_", 1)[1])


@functools.cache
@functools.lru_cache(maxsize=None)
def _reference(check_id: str):
    registered = get_check(check_id)
    inputs = registered.inputs(INTERACTIVE_SEED)
    return inputs, drive(registered, registered.reference(), inputs)


def verdict(check_id: str, kernel):
    inputs, expected = _reference(check_id)
    registered = get_check(check_id)
    return judge(registered, drive(registered, kernel, inputs), expected, inputs)


def task_checks(task: int) -> list[str]:
    return sorted(
        c for c, registered in all_checks().items() if registered.task == kernel_checks.TASKS[task] and c not in SLOW
    )


@dataclass(frozen=True)
class Mistake:
    name: str
    task: int
    replacements: tuple[tuple[str, str], ...]
    loses: frozenset[str]
    hint: str


_MASK_SCORES = "        scores = tl.where(seen, scores"
_NEW_MAX = "        new_max = tl.maximum(row_max, tl.max(scores, axis=1))\n"
_FIRST_WALK = 'x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf"))\n        new_max'
MISTAKES = [
    Mistake(
        "softmax sum not rescaled",
        1,
        (("row_sum = row_sum * tl.exp(row_max - shift) + ", "row_sum = row_sum + "),),
        frozenset({"lab15.softmax_long_rows", "lab15.softmax_extreme_values", "lab15.softmax_two_passes"}),
        task1.SOFTMAX_RESCALE_HINT,
    ),
    Mistake(
        "softmax masked after the max",
        1,
        (
            (_FIRST_WALK, "x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0)\n        new_max"),
            (
                "        shift = tl.where(",
                '        x = tl.where(cols < n_cols, x, float("-inf"))\n        shift = tl.where(',
            ),
        ),
        frozenset({"lab15.softmax_extreme_values"}),
        task1.SOFTMAX_MASK_HINT,
    ),
    Mistake(
        "flash accumulator not rescaled",
        2,
        (("acc = acc * shrink[:, None] + tl.dot(p, v)", "acc = acc + tl.dot(p, v)"),),
        frozenset(
            {"lab15.flash_odd_shapes", "lab15.flash_extreme_scores", "lab15.flash_block_shapes", "lab15.flash_traffic"}
        ),
        task2.FLASH_RESCALE_HINT,
    ),
    Mistake(
        "flash causal mask on the wrong diagonal",
        2,
        (("(keys[None, :] <= s - t + rows[:, None])", "(keys[None, :] <= rows[:, None])"),),
        frozenset(
            {
                "lab15.flash_odd_shapes",
                "lab15.flash_extreme_scores",
                "lab15.flash_block_shapes",
                "lab15.flash_traffic",
                "lab15.flash_in_tiny_model",
            }
        ),
        task2.FLASH_DIAGONAL_HINT,
    ),
    Mistake(
        "flash masked after the max",
        2,
        ((_NEW_MAX, ""), (_MASK_SCORES, _NEW_MAX + _MASK_SCORES)),
        frozenset({"lab15.flash_extreme_scores"}),
        task2.FLASH_MASK_HINT,
    ),
    Mistake(
        "flash GQA heads mapped by modulo",
        2,
        (("kv_head = head // group", "kv_head = head % (n_heads // group)"),),
        frozenset({"lab15.flash_odd_shapes", "lab15.flash_block_shapes", "lab15.flash_in_tiny_model"}),
        task2.FLASH_GQA_HINT,
    ),
    Mistake(
        "paged block table read with the wrong stride",
        3,
        (("tables_ptr + seq * stride_table + i", "tables_ptr + seq + i"),),
        frozenset({"lab15.paged_ragged", "lab15.paged_layouts", "lab15.paged_in_place"}),
        task3.PAGED_TABLE_HINT,
    ),
    Mistake(
        "paged off by one in the last partial block",
        3,
        (("i * BLOCK_SIZE + slots < length", "i * BLOCK_SIZE + slots <= length"),),
        frozenset({"lab15.paged_ragged", "lab15.paged_layouts", "lab15.paged_in_place"}),
        task3.PAGED_LAST_BLOCK_HINT,
    ),
    Mistake(
        "gemv nibbles swapped",
        4,
        (("low = (byte & 15)", "low = (byte >> 4)"), ("high = (byte >> 4)", "high = (byte & 15)")),
        frozenset({"lab15.gemv_q4_odd_shapes", "lab15.gemv_q4_reads_packed"}),
        task4.GEMV_NIBBLE_HINT,
    ),
]


@pytest.mark.filterwarnings(
    "ignore:overflow encountered",
    "ignore:invalid value encountered",
    "ignore:divide by zero encountered",
    "ignore:All-NaN slice encountered",
)
@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_a_usual_mistake_loses_its_own_checks_with_the_hint_written_for_it(mistake, tmp_path):
    kernel = variant(tmp_path, mistake.task, mistake.replacements)
    verdicts = {check_id: verdict(check_id, kernel) for check_id in task_checks(mistake.task)}
    lost = {check_id for check_id, v in verdicts.items() if not v.passed}
    assert lost == mistake.loses, {c: verdicts[c].what for c in lost}
    for check_id in lost:
        wanted = "" if check_id in IN_A_MODEL else mistake.hint  # "": the check's own hint
        assert verdicts[check_id].hint == wanted, (check_id, verdicts[check_id].what, verdicts[check_id].hint)


class HostSoftmax:
    """A stand-in with a kernel's surface whose launch computes torch.softmax on the host."""

    arg_names = kernel_checks.SIGNATURES["online_softmax_kernel"]

    def run(self, *args, **kwargs):
        raise AssertionError("never launched through run")

    def __getitem__(self, grid):
        def launch(out, x, n_cols, in_row_stride, out_row_stride, BLOCK):
            out.copy_(torch.softmax(x, dim=1))

        return launch


def host_softmax(out_ptr, in_ptr, n_cols, in_row_stride, out_row_stride, BLOCK):
    out_ptr.copy_(torch.softmax(in_ptr, dim=1))


@pytest.mark.parametrize("stand_in", [HostSoftmax(), host_softmax], ids=["object", "function"])
def test_a_host_softmax_standing_in_for_the_kernel_scores_zero(stand_in):
    for check_id in task_checks(1):
        result = verdict(check_id, stand_in)
        assert not result.passed and result.kind == "error", check_id
        assert "must be a Triton kernel" in result.what


def host_flash(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, *args, **kwargs):
    """Attention on the host, through torch, with the kernel's pointers taken as tensors."""
    group = q_ptr.shape[1] // k_ptr.shape[1]
    k, v = k_ptr.repeat_interleave(group, dim=1), v_ptr.repeat_interleave(group, dim=1)
    out_ptr.copy_(torch.nn.functional.scaled_dot_product_attention(q_ptr, k, v, is_causal=True))


def host_paged(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, *args, **kwargs):
    """Host code in the kernel's place: whatever it would compute, the check must refuse it unlaunched."""
    raise AssertionError("never launched: the check refuses a stand-in before it runs")


def host_gemv(*args, **kwargs):
    """The same for the GEMV task."""
    raise AssertionError("never launched: the check refuses a stand-in before it runs")


@pytest.mark.parametrize(
    "task, stand_in", [(2, host_flash), (3, host_paged), (4, host_gemv)], ids=["flash", "paged", "gemv"]
)
def test_a_host_function_standing_in_for_each_later_kernel_scores_zero(task, stand_in):
    """Every check of the flash, paged and GEMV tasks (the ones inside a model included) refuses a
    Python function in place of the kernel, before it runs."""
    for check_id in task_checks(task):
        result = verdict(check_id, stand_in)
        assert not result.passed and result.kind == "error", check_id
        assert "must be a Triton kernel" in result.what, (check_id, result.what)


_SPILL = """
        spill = (out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_ot
                 + (keys - start)[None, :] * stride_od)
        kept = row_ok[:, None] & ((keys - start)[None, :] < head_dim)
        tl.store(spill, scores, mask=kept)
        scores = tl.where(kept, tl.load(spill, mask=kept, other=0.0), scores)
"""


@needs_interpreter
def test_a_kernel_that_sends_its_scores_through_memory_fails_only_the_traffic_check(tmp_path):
    """Its only writable memory is its outputs: it stores every score tile into out (overwritten by the
    result at the end) and reads it back. The values are right; the bytes are not."""
    kernel = variant(tmp_path, 2, (("  # masked before the max\n", "\n" + _SPILL.lstrip("\n")),))
    verdicts = {check_id: verdict(check_id, kernel) for check_id in task_checks(2) if check_id not in IN_A_MODEL}
    assert {c for c, v in verdicts.items() if not v.passed} == {"lab15.flash_traffic"}
    traffic = verdicts["lab15.flash_traffic"]
    assert traffic.kind == TRAFFIC and traffic.what.startswith("flash_attention_kernel loads more bytes")


def test_the_kernel_signatures_are_the_reference_kernels():
    for task in ANSWERS:
        reference = get_check(task_checks(task)[0]).reference()
        assert list(reference.arg_names) == kernel_checks.SIGNATURES[kernel_checks.TASKS[task].rsplit(" ", 1)[1]]


def test_the_online_softmax_reference_equals_torch_on_every_case():
    for check_id in ("lab15.softmax_long_rows", "lab15.softmax_extreme_values"):
        inputs, expected = _reference(check_id)
        for case, result in zip(inputs, expected.data):
            want = torch.softmax(task1.logits(case).double(), dim=1)
            assert torch.allclose(torch.tensor(result["out"], dtype=torch.float64), want, atol=1e-6), case


def test_the_softmax_driver_lays_out_strided_rows_on_the_kernels_device(monkeypatch):
    """A padded case's rows keep their gaps where the kernel runs: the driver moves the logits to the
    device first and lays out the rows there (moving a tensor with gaps to a GPU makes it contiguous),
    so the in_row_stride and out_row_stride launched are the ones the case describes."""
    launched = []

    def record_launch(kernel, grid, args, meta, inputs=None):
        launched.append(args)
        return {"interpreted": True, "violations": [], "written_inputs": []}

    monkeypatch.setattr(task1, "launch", record_launch)
    monkeypatch.setattr(task1, "to_device", lambda *tensors: tuple(t.contiguous() for t in tensors))  # as .to(gpu)
    inputs = get_check("lab15.softmax_long_rows").inputs(INTERACTIVE_SEED)
    task1.drive_softmax(task1.REFERENCE(), inputs)
    padded = [(case, args) for case, args in zip(inputs, launched) if case["pad"] and case["out_pad"]]
    assert padded, "softmax_long_rows should hold a case with padded rows"
    for case, (out, x, n_cols, in_row_stride, out_row_stride) in padded:
        assert (n_cols, in_row_stride, out_row_stride) == (
            case["cols"],
            case["cols"] + case["pad"],
            case["cols"] + case["out_pad"],
        )
        assert x.stride(0) == in_row_stride and out.stride(0) == out_row_stride


@needs_interpreter
def test_the_traffic_budgets_are_the_lessons_formulas():
    from infra_lib.kernels.flash_attention import flash_attention_bytes
    from infra_lib.kernels.gemv_q4 import q4_matmul_bytes
    from infra_lib.kernels.paged_decode import paged_decode_bytes

    inputs, expected = _reference("lab15.softmax_two_passes")
    for case, result in zip(inputs, expected.data):
        elements = case["rows"] * case["cols"] * 4
        assert (result["bytes_loaded"], result["bytes_stored"]) == (2 * elements, elements)
    inputs, expected = _reference("lab15.flash_traffic")
    for case, result in zip(inputs, expected.data):
        formula = flash_attention_bytes(
            case["batch"],
            case["heads"],
            case["t"],
            case["s"],
            case["head_dim"],
            causal=case["causal"],
            block_m=case["blocks"][0],
        )
        assert (result["bytes_loaded"], result["bytes_stored"]) == (formula["loaded"], formula["stored"])
    inputs, expected = _reference("lab15.gemv_q4_reads_packed")
    for case, result in zip(inputs, expected.data):
        formula = q4_matmul_bytes(case["m"], case["n"], case["k"], case["group"], block_m=16, block_n=case["block_n"])
        assert (result["bytes_loaded"], result["bytes_stored"]) == (formula["loaded"], formula["stored"])
    inputs, expected = _reference("lab15.paged_in_place")
    for case, result in zip(inputs, expected.data):
        formula = paged_decode_bytes(
            case["lengths"], case["heads"], case["kv_heads"], case["head_dim"], case["block_size"]
        )
        assert (result["bytes_loaded"], result["bytes_stored"]) == (formula["loaded"], formula["stored"])


_OVER_READ = ("key_ok = keys < last", "key_ok = keys < s")  # masks the keys at s instead of at the block's end


@needs_interpreter
@pytest.mark.parametrize("seed", [INTERACTIVE_SEED, 1, 2, 3])
def test_a_kernel_reading_keys_past_its_query_blocks_last_fails_the_traffic_check_on_any_seed(tmp_path, seed):
    """Its values are right, but each query block reads its last key block up to s, past its own last
    visible key. With t = s and square tiles the two bounds coincide; a chunk of several query blocks on
    top of cached keys, and BLOCK_N > BLOCK_M, tell them apart. The check run in the lab and the grader's
    runs of it (other seeds) both fail it, naming the shape; the reference passes on the same inputs."""
    kernel = variant(tmp_path, 2, (_OVER_READ,))
    registered = get_check("lab15.flash_traffic")
    inputs = registered.inputs(seed)
    expected = drive(registered, registered.reference(), inputs)
    assert judge(registered, drive(registered, registered.reference(), inputs), expected, inputs).passed
    result = judge(registered, drive(registered, kernel, inputs), expected, inputs)
    assert not result.passed and result.kind == TRAFFIC, (result.what, result.detail)
    assert result.what.startswith("flash_attention_kernel loads more bytes")
    shape = re.search(
        r"q \[\d+, \d+, (\d+), \d+\], k and v \[\d+, \d+, (\d+), \d+\].*BLOCK_M=(\d+), BLOCK_N=(\d+)", result.detail
    )
    assert shape, result.detail
    t, s, block_m, block_n = map(int, shape.groups())
    assert t < s or block_n > block_m, result.detail
    first_three = inputs[:3]  # the cases the check had before: t = s with square tiles, or a single query block
    assert judge(
        registered,
        drive(registered, kernel, first_three),
        drive(registered, registered.reference(), first_three),
        first_three,
    ).passed


@needs_interpreter
def test_the_over_reading_kernel_loses_only_the_traffic_check(tmp_path):
    kernel = variant(tmp_path, 2, (_OVER_READ,))
    verdicts = {check_id: verdict(check_id, kernel) for check_id in task_checks(2) if check_id not in IN_A_MODEL}
    assert {c for c, v in verdicts.items() if not v.passed} == {"lab15.flash_traffic"}


_OWN_STRIDES = {  # (task, replacement, the one check that must fail)
    "flash out assumed contiguous": (
        2,
        (
            "tl.store(out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_ot + dims[None, :] * "
            "stride_od,",
            "tl.store(out_ptr + ((batch * n_heads + head) * t + rows[:, None]) * head_dim + dims[None, :],",
        ),
        "lab15.flash_block_shapes",
    ),
    "flash q's dims assumed contiguous": (
        2,
        ("rows[:, None] * stride_qt + dims[None, :] * stride_qd", "rows[:, None] * stride_qt + dims[None, :]"),
        "lab15.flash_block_shapes",
    ),
    "paged out at q's strides": (
        3,
        (
            "tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh",
            "tl.store(out_ptr + seq * stride_qb + heads[:, None] * stride_qh",
        ),
        "lab15.paged_layouts",
    ),
    "gemv y rows assumed N long": (
        4,
        ("y_ptr + rows[:, None] * stride_ym", "y_ptr + rows[:, None] * N"),
        "lab15.gemv_q4_odd_shapes",
    ),
    "gemv packed rows assumed K // 2 long": (
        4,
        ("cols[None, :] * stride_pn", "cols[None, :] * (K // 2)"),
        "lab15.gemv_q4_odd_shapes",
    ),
    "gemv scale rows assumed K // GROUP long": (
        4,
        ("cols * stride_sn", "cols * (K // GROUP)"),
        "lab15.gemv_q4_odd_shapes",
    ),
}


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("name", list(_OWN_STRIDES))
def test_a_kernel_that_ignores_a_tensors_own_strides_fails_with_a_hint_about_strides(name, tmp_path):
    """The text says each tensor comes with its own strides (out's, y's, the packed bytes' and the
    scales' included): a kernel that assumes a contiguous layout, or another tensor's strides, fails the
    check whose inputs have rows padded or a strided head dimension, and the hint names the strides."""
    task, replacement, loses = _OWN_STRIDES[name]
    kernel = variant(tmp_path, task, (replacement,))
    verdicts = {check_id: verdict(check_id, kernel) for check_id in task_checks(task) if check_id not in IN_A_MODEL}
    assert {c for c, v in verdicts.items() if not v.passed} == {loses}, {c: v.what for c, v in verdicts.items()}
    assert "own" in verdicts[loses].hint and "stride" in verdicts[loses].hint, verdicts[loses].hint


_TOLERANCE = re.compile(
    r"\*\*atol = ([0-9.e-]+), rtol = ([0-9.e-]+)\*\*\s+in\s+Triton's\s+interpreter\s+and\s+"
    r"\*\*atol = ([0-9.e-]+), rtol = ([0-9.e-]+)\*\*\s+compiled\s+on\s+a\s+GPU"
)


def test_the_lab_states_the_tolerances_the_checks_use():
    """Each task's text states, in one sentence of a fixed form, the atol and rtol of its value checks in
    the interpreter and compiled; they are the check module's own numbers (the SmolLM2 logits' included)."""
    from grading.notebook import read_notebook

    texts = {
        cell.metadata["nbgrader"]["grade_id"]: cell.source
        for cell in read_notebook(SOLUTION).cells
        if cell.cell_type == "markdown"
    }
    stated = {
        "task1_md": "online_softmax_kernel",
        "task2_md": "flash_attention_kernel",
        "task3_md": "paged_decode_kernel",
        "task4_md": "q4_gemv_kernel",
        "task2_model_md": None,
    }
    for grade_id, kernel in stated.items():
        found = _TOLERANCE.findall(texts[grade_id])
        assert len(found) == 1, f"{grade_id} should state its tolerances once, in the fixed form"
        tolerance = kernel_checks.TOLERANCES[kernel] if kernel else kernel_checks.MODEL_LOGITS
        assert tuple(map(float, found[0])) == (tolerance.atol, tolerance.rtol, tolerance.gpu_atol, tolerance.rtol), (
            grade_id,
            found[0],
            tolerance,
        )


TRAFFIC_CHECKS = {
    "lab15.softmax_two_passes": "online_softmax_kernel",
    "lab15.flash_traffic": "flash_attention_kernel",
    "lab15.paged_in_place": "paged_decode_kernel",
    "lab15.gemv_q4_reads_packed": "q4_gemv_kernel",
}


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_each_traffic_check_holds_the_stated_tolerances_against_a_compiled_reference():
    """A sandboxed learner's kernel runs interpreted; a grader where Triton compiles has a compiled reference
    (its bytes counted in the interpreter all the same). An output off by just under the stated compiled atol
    + rtol x |reference| passes each traffic check, its bytes within the budget, and one off by just over
    fails it: the same numbers as the value checks, never a looser relative part."""
    import numpy as np

    for check_id, name in TRAFFIC_CHECKS.items():
        registered = get_check(check_id)
        inputs, expected = _reference(check_id)
        reference = [{**r, "interpreted": False} for r in expected.data]
        tolerance = kernel_checks.TOLERANCES[name]
        last = len(reference) - 1
        for factor, passes in ((0.9, True), (1.1, False)):
            shifted = []
            for i, r in enumerate(expected.data):
                out = np.asarray(r["out"], dtype=np.float64)
                moved = out + factor * (tolerance.gpu_atol + tolerance.rtol * np.abs(out))
                shifted.append({**r, "out": moved.tolist() if i == last else r["out"]})
            result = judge(registered, Outcome(data=shifted), Outcome(data=reference), inputs)
            assert result.passed is passes, (check_id, factor, result.what, result.detail)
            if not passes:
                assert result.what.startswith(f"{name}'s `") and "differs from the reference" in result.what, (
                    check_id,
                    result.what,
                )


def test_the_answers_the_text_forbids_are_refused_before_they_run():
    """The text's rules on what an answer may use: the course's kernels and tl.softmax are shortcuts."""
    from grading.registry import shortcut_modules
    from grading.tamper import SHORTCUT, scan

    modules, names = shortcut_modules("lab15")
    for source in (
        "p = tl.softmax(scores)",
        "from infra_lib.kernels.flash_attention import flash_attention_kernel",
        "import infra_lib.kernels.paged_decode",
        "from infra_lib.kernels.gemv_q4 import q4_kernel",
        "from infra_lib.kernels.softmax import softmax_kernel",
        "from grading.checks import lab15",
    ):
        found = scan(source, modules, names, {"tl", "triton", "torch", "math"})
        assert found, source
        assert found[0].kind == SHORTCUT or "grading" in source, (source, found)


def _lab_cells() -> dict[str, str]:
    from grading.notebook import read_notebook

    return {cell.metadata["nbgrader"]["grade_id"]: cell.source for cell in read_notebook(SOLUTION).cells}


def test_the_labs_own_cells_import_nothing_from_the_checks_and_launch_the_blocks_task_1_states():
    """The lab's cells (not the answers, not the tests) use public modules only, and the demonstration
    launches the online softmax with a BLOCK the text allows (16 or 32)."""
    cells = _lab_cells()
    own = {
        grade_id: source
        for grade_id, source in cells.items()
        if grade_id not in ANSWERS.values() and not grade_id.startswith("test_")
    }
    for grade_id, source in own.items():
        assert "grading.checks" not in source, f"{grade_id} imports from grading/checks"
    launches = re.findall(r"online_softmax\([^()]*?,\s*(\d+)\)", cells["use_kernels"])
    default = re.search(r"def online_softmax\(x: torch.Tensor, block: int = (\d+)\)", cells["launchers"])
    assert launches and default and {int(b) for b in [*launches, default.group(1)]} <= {16, 32}
    assert "16 or 32 in the checks" in cells["task1_md"]


def test_the_bonus_states_the_bytes_per_weight_its_storage_takes():
    """Task 4's text: half a byte per weight plus the scale's share, 0.625 with groups of 32 and 0.5625
    with 64: what QuantLinear(bits=4) stores for those groups."""
    from infra_lib.model.quant import QuantLinear, weight_bytes

    text = " ".join(_lab_cells()["task4_md"].split())
    stated = re.search(r"([0-9.]+) bytes with groups of 32 \(([0-9.]+) with groups of 64\)", text)
    assert stated, "task 4's text should give the bytes per weight for groups of 32 and 64"
    weight = torch.randn(64, 128)
    for group, figure in zip((32, 64), stated.groups()):
        assert float(figure) == weight_bytes(QuantLinear(weight, bits=4, group_size=group)) / weight.numel()


def test_the_reference_kernels_are_the_librarys_and_no_check_module_defines_a_kernel():
    """The learner edition ships the check modules: none of them holds a kernel that solves a task. The
    references live in infra_lib.kernels, where the sandbox shows the graded kernel their stubs."""
    import ast

    from grading.hidden_reference import targets

    references = {check.reference.target for check_id, check in all_checks().items() if check_id.startswith("lab15.")}
    assert references == {
        "infra_lib.kernels.softmax:online_softmax_kernel",
        "infra_lib.kernels.flash_attention:flash_attention_kernel",
        "infra_lib.kernels.paged_decode:paged_decode_kernel",
        "infra_lib.kernels.gemv_q4:q4_gemv_kernel",
    }
    assert references <= set(targets("lab15"))
    for path in sorted((REPO / "grading" / "checks").rglob("*.py")):
        jitted = [
            node.name
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)
        ]
        assert not jitted, f"{path.name} defines the kernels {jitted}"


@pytest.mark.parametrize("n_cols, block", [(1, 16), (37, 16), (100, 32)])
def test_the_reference_online_softmax_walks_rows_longer_than_its_block(n_cols, block):
    from infra_lib.kernels.softmax import online_softmax_kernel

    x = torch.randn(3, n_cols + 5, generator=torch.Generator().manual_seed(n_cols))[:, :n_cols] * 30
    out = torch.full((3, n_cols), -7.0)
    online_softmax_kernel[(3,)](out, x, n_cols, x.stride(0), out.stride(0), BLOCK=block)
    torch.testing.assert_close(out, torch.softmax(x, dim=1), atol=1e-6, rtol=1e-5)
