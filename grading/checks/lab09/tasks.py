"""Lab 09's tasks as its checks name them, the modules of their references, and the check of an error a call
must raise."""

from __future__ import annotations

from grading.registry import Mismatch

SPEC = "infra_lib.serving.speculative"


QUANT = "infra_lib.model.quant"


TASKS = {
    1: "lab09 task 1: quantize_int8_groupwise",
    2: "lab09 task 2: dequantize_int8_groupwise",
    3: "lab09 task 3: expected_tokens_per_step",
    4: "lab09 task 4: accept_or_resample",
}


# --- calling the implementation -------------------------------------------------------------------


def expect_raise(name: str, got_kind: str, got_value, want_error: str, where: str) -> Mismatch | None:
    error = want_error.split(":")[0]
    if got_kind == "raised" and str(got_value).split(":")[0] == error:
        return None
    got_text = f"it raised {got_value}" if got_kind == "raised" else "it returned a result"
    return Mismatch(f"{name} should raise {error} on an invalid input", f"on {where}: {got_text}")
