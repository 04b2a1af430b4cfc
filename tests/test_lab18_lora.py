"""Lab 18 task 3's checks: the course's LoRALinear and the lab's answer pass them; each usual mistake of a LoRA layer
(the lab's answer with one idea taken out, its source with one line replaced) fails the check that should catch it,
with the hint written for that mistake; an untouched answer fails cleanly, naming the task.

The answer cell is read from the task's cell file until the lab notebook is assembled."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, answer_cells, check_fails

import grading.checks.lab18.task3_lora as lora
from grading import check
from grading.checks.lab18.tasks import LORA_SECTION, TASKS

SOLUTION = REPO / "solutions" / "lab18_resilient_training" / "lab18_resilient_training.ipynb"
SETUP_IMPORTS = "import math\n\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
ANSWER = "task3_lora_linear"
CHECKS = (
    "lab18.lora_forward",
    "lab18.lora_forward_edges",
    "lab18.lora_grads",
    "lab18.lora_grads_edges",
    "lab18.lora_merge",
    "lab18.lora_merge_edges",
)


def variant(*replacements: tuple[str, str]) -> type:
    """The lab's ``LoRALinear``, each (old, new) replacement made in its answer cell, run after the setup imports."""
    source = answer_cells(SOLUTION)[ANSWER]
    for old, new in replacements:
        assert source.count(old) == 1, f"the answer {ANSWER} no longer holds {old!r}"
        source = source.replace(old, new)
    namespace: dict = {}
    exec(compile(SETUP_IMPORTS + source, f"<{ANSWER}>", "exec"), namespace)  # noqa: S102 - the course's own
    return namespace["LoRALinear"]


@pytest.mark.parametrize("check_id", CHECKS)
def test_task3_the_course_layer_and_the_lab_answer_pass(check_id):
    from infra_lib.model.lora import LoRALinear

    check(check_id, LoRALinear)
    check(check_id, variant())


_MERGE_ADD = "self.base.weight.add_(torch.mm(self.lora_B, self.lora_A), alpha=self.scale)"
_UNMERGE_SUB = "self.base.weight.sub_(torch.mm(self.lora_B, self.lora_A), alpha=self.scale)"
_A_EMPTY = "a = torch.empty(rank, in_features, dtype=base.weight.dtype, device=base.weight.device)"
_B_ZEROS = "self.lora_B = nn.Parameter(base.weight.new_zeros(out_features, rank))"
MISTAKES = {
    "a merge that forgets the scaling": (
        "lab18.lora_merge",
        [(_MERGE_ADD, "self.base.weight.add_(torch.mm(self.lora_B, self.lora_A))")],
        lora.MERGE_SCALE_HINT,
    ),
    "the scaling as alpha instead of alpha / rank": (
        "lab18.lora_forward",
        [("self.scale = alpha / rank", "self.scale = alpha")],
        lora.SCALE_ALPHA_HINT,
    ),
    "no scaling at all": (
        "lab18.lora_forward",
        [("self.scale = alpha / rank", "self.scale = 1.0")],
        lora.SCALE_MISSING_HINT,
    ),
    "A and B transposed": (
        "lab18.lora_forward",
        [
            (_A_EMPTY, "a = torch.empty(in_features, rank, dtype=base.weight.dtype)"),
            (_B_ZEROS, "self.lora_B = nn.Parameter(base.weight.new_zeros(rank, out_features))"),
            ("down = x @ self.lora_A.t()", "down = x @ self.lora_A"),
            ("(down @ self.lora_B.t())", "(down @ self.lora_B)"),
        ],
        lora.SHAPE_HINT,
    ),
    "B not zero at the start": (
        "lab18.lora_forward",
        [(_B_ZEROS, "self.lora_B = nn.Parameter(torch.randn(out_features, rank, dtype=base.weight.dtype) * 0.01)")],
        lora.INIT_HINT,
    ),
    "A all zeros at the start": ("lab18.lora_forward", [("a.uniform_(-bound, bound)", "a.zero_()")], lora.INIT_HINT),
    "the bias left out": (
        "lab18.lora_forward",
        [("F.linear(x, self.base.weight, self.base.bias)", "F.linear(x, self.base.weight)")],
        lora.OUTPUT_HINT,
    ),
    "A in float32 whatever the base's dtype": (
        "lab18.lora_forward_edges",
        [(_A_EMPTY, "a = torch.empty(rank, in_features)")],
        lora.SHAPE_HINT,
    ),
    "the base weights left trainable": (
        "lab18.lora_grads",
        [("            p.requires_grad = False", "            pass")],
        lora.FROZEN_HINT,
    ),
    "the update detached from A": (
        "lab18.lora_grads",
        [("down = x @ self.lora_A.t()", "down = x @ self.lora_A.detach().t()")],
        lora.GRAD_HINT,
    ),
    "an unmerge that does not restore": ("lab18.lora_merge", [(_UNMERGE_SUB, "pass")], lora.UNMERGE_HINT),
    "an unmerge that forgets the scaling": (
        "lab18.lora_merge",
        [(_UNMERGE_SUB, "self.base.weight.sub_(torch.mm(self.lora_B, self.lora_A))")],
        lora.UNMERGE_HINT,
    ),
    "a second merge adds the update again": (
        "lab18.lora_merge",
        [("        if self.merged:\n            return\n", "")],
        lora.TWICE_HINT,
    ),
    "a second unmerge takes it out again": (
        "lab18.lora_merge",
        [("        if not self.merged:\n            return\n", "")],
        lora.TWICE_HINT,
    ),
    "the forward adds the update while merged": (
        "lab18.lora_merge",
        [("        if not self.merged:\n            down", "        if True:\n            down")],
        lora.MERGED_FORWARD_HINT,
    ),
    "merged never set": ("lab18.lora_merge", [("        self.merged = True\n", "")], lora.FLAG_HINT),
    "a rank of 0 accepted": (
        "lab18.lora_merge_edges",
        [("if not isinstance(rank, int) or rank <= 0:", "if False:")],
        lora.ERRORS_HINT,
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_task3_each_mistake_fails_its_check_with_its_hint(mistake):
    check_id, replacements, hint = MISTAKES[mistake]
    message = check_fails(check_id, variant(*replacements))
    assert hint in message, message


def test_task3_the_hints_point_to_the_lesson_and_name_no_code():
    assert LORA_SECTION in lora.SHAPE_HINT
    for name in dir(lora):
        if name.endswith("_HINT"):
            hint = getattr(lora, name)
            assert not re.search(r"\.(add_|sub_|mm|matmul|copy_)\(|@ ", hint), (name, hint)


def test_task3_an_untouched_answer_fails_cleanly_naming_the_task():
    """The stub nbgrader leaves (every method's solution removed, its raise kept) fails each check by its task."""
    source = answer_cells(SOLUTION)[ANSWER]
    stub = re.sub(r"[ \t]*### BEGIN SOLUTION.*?### END SOLUTION\n", "", source, flags=re.S)
    assert stub.count("raise NotImplementedError") == 4
    namespace: dict = {}
    exec(compile(SETUP_IMPORTS + stub, "<stub>", "exec"), namespace)  # noqa: S102
    for check_id in ("lab18.lora_forward", "lab18.lora_merge_edges"):
        message = check_fails(check_id, namespace["LoRALinear"])
        assert TASKS[3] in message and "Traceback" not in message, message
