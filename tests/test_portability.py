"""Portability: the device registry, the device picker on top of it, the code census, cross-device runs."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
import torch
from conftest import SMOLLM2

from infra_lib.backends import (
    Backend,
    BackendUnavailable,
    CPUBackend,
    available_backends,
    backend_names,
    get_backend,
    register_backend,
    unregister_backend,
)
from infra_lib.cross_device import DeviceRun, compare_runs, greedy_tokens, model_on, run_greedy, score, tiny_llama
from infra_lib.device import KNOWN_DEVICES, available_devices, describe, pick_device, synchronizer
from infra_lib.model import greedy_decode
from infra_lib.portability import (
    CATEGORIES,
    census,
    count_code_lines,
    device_specific_fraction,
    lines_by_package,
    scan_source,
    totals,
)

# --- the registry ------------------------------------------------------------------------------


def test_cpu_backend_is_available_and_answers_every_question():
    cpu = get_backend("cpu")
    assert cpu.is_available() and cpu.unavailable_reason() is None
    assert cpu.device() == torch.device("cpu") and cpu.synchronizer() is None
    cpu.synchronize()  # nothing to wait for, and no error
    stats = cpu.memory_stats()
    assert 0 < stats["allocated"] < stats["total"] and 0 < stats["free"] <= stats["total"]
    assert {torch.float32, torch.bfloat16} <= set(cpu.supported_dtypes())
    assert cpu.collective_backend == "gloo" and "interpreter" in cpu.kernel_path


def test_collective_library_per_vendor():
    assert [get_backend(n).collective_backend for n in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    assert "Triton" in get_backend("cuda").kernel_path and "Ascend C" in get_backend("npu").kernel_path


def test_npu_backend_is_registered_but_unavailable_and_says_torch_npu():
    npu = get_backend("npu:0")
    assert npu.name == "npu" and "npu" in backend_names() and npu.plugin == "torch_npu"
    assert npu.is_available() == (npu.unavailable_reason() is None)
    if importlib.util.find_spec("torch_npu") is not None:  # a machine with the plugin: nothing more to check
        return
    assert not npu.is_available() and "torch_npu is not installed" in npu.unavailable_reason()
    with pytest.raises(BackendUnavailable, match="torch_npu"):
        npu.device()
    with pytest.raises(BackendUnavailable, match="torch_npu"):
        npu.memory_stats()
    assert npu.supported_dtypes() == ()
    assert "npu" not in available_devices() and npu not in available_backends()


def test_npu_backend_imports_its_plugin_lazily_and_reports_a_broken_one(tmp_path, monkeypatch):
    (tmp_path / "torch_npu.py").write_text('raise ImportError("libascendcl.so: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = get_backend("npu").unavailable_reason()
    assert "does not import" in reason and "libascendcl" in reason
    assert "torch_npu" not in sys.modules  # the failed import left nothing behind


def test_unknown_devices_and_registering_a_new_backend():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_backend("tpu")
    assert get_backend(torch.device("cpu")).name == "cpu" and get_backend("cuda:1").name == "cuda"
    with pytest.raises(ValueError, match="already registered"):
        register_backend(CPUBackend("cpu", "any", 9, "gloo", "-", "-"))

    class Unplugged(Backend):
        def unavailable_reason(self):
            return "the unplugged accelerator has no driver here"

    register_backend(Unplugged("unplugged", "nobody", 5, None, "none", "none"))
    try:
        with pytest.raises(ValueError, match="not available.*no driver here"):
            pick_device("unplugged")  # the picker asks the registry, not a fixed list
    finally:
        unregister_backend("unplugged")
    with pytest.raises(ValueError, match="unknown device"):
        pick_device("unplugged")


# --- the device picker, unchanged for its users --------------------------------------------------


def test_pick_device_keeps_its_behaviour_and_messages():
    assert KNOWN_DEVICES[:4] == ("auto", "cpu", "cuda", "mps")
    assert available_devices()[-1] == "cpu"
    assert pick_device().type == available_devices()[0] and pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"unknown device 'tpu'; use one of auto, cpu, cuda, mps"):
        pick_device("tpu")
    with pytest.raises(ValueError, match="DEVICE must be a string"):
        pick_device(0)
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError,
            match=r"device 'cuda' is not available on this machine \(available: .*cpu\); "
            r"set DEVICE='auto'",
        ):
            pick_device("cuda")
    with pytest.raises(ValueError, match="not available.*torch_npu"):
        pick_device("npu")
    assert synchronizer("cpu") is None and synchronizer(torch.device("cpu")) is None
    assert synchronizer("cuda") is torch.cuda.synchronize and synchronizer("meta") is None
    assert describe("cpu") == describe(torch.device("cpu")) == f"cpu ({torch.get_num_threads()} torch threads)"


# --- the census ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_census():
    return {m.path: m for m in census()}


def test_census_of_the_course_finds_kernels_collectives_and_the_device_layer(real_census):
    for path in (
        "kernels/vector_add.py",
        "kernels/softmax.py",
        "kernels/matmul.py",
        "kernels/rmsnorm.py",
        "kernels/triton_env.py",
    ):
        assert real_census[path].category == "kernel", real_census[path]
    for path in ("training/collectives.py", "training/ddp.py", "training/zero.py", "training/launcher.py"):
        assert real_census[path].category == "collective", real_census[path]
    assert real_census["backends.py"].category == "device"
    assert real_census["kernels/profiling.py"].category == "device"
    for path in (
        "serving/scheduler.py",
        "serving/server.py",
        "serving/engine.py",
        "serving/model_runner.py",
        "model/model.py",
        "ops/request_trace.py",
        "device.py",
        "portability.py",
        "kernels/oob.py",
    ):
        assert not real_census[path].device_specific, real_census[path]


def test_census_totals_add_up(real_census):
    modules = list(real_census.values())
    total = totals(modules)
    assert sum(t["modules"] for t in total.values()) == len(modules)
    assert sum(t["lines"] for t in total.values()) == sum(m.lines for m in modules)
    by_package = lines_by_package(modules)
    for category in CATEGORIES:
        assert sum(row[category] for row in by_package.values()) == total[category]["lines"]
    assert by_package["serving"]["kernel"] == 0 and by_package["kernels"]["kernel"] > 0
    assert 0 < device_specific_fraction(modules) < 0.5


SYNTHETIC = {
    "kern/add.py": """
        import triton
        import triton.language as tl

        @triton.jit
        def add_kernel(x, y, n, BLOCK: tl.constexpr):
            pass
        """,
    "kern/wrapper.py": "from .triton_env import load_triton\ntriton, tl = load_triton()\n",
    "dist/ring.py": """
        '''Ring all-reduce; on GPUs this runs over NCCL, on Ascend over HCCL.'''
        from torch import distributed as dist

        def setup():
            dist.init_process_group(backend="gloo")
        """,
    "dev/sync.py": """
        import torch

        def wait(device):
            if device.type == "cuda":
                torch.cuda.synchronize()
            return torch.backends.mps.is_available()
        """,
    "dev/move.py": "def move(x):\n    return x.cuda()\n\nDEFAULT = 'npu:0'\n",
    "app/prose.py": """
        '''This module never touches cuda, nccl or triton: it only talks about them.'''
        # x.cuda() in a comment is not code
        from infra_lib.device import pick_device  # the course's device layer keeps this portable

        def f(x):
            '''Runs on "cuda" too.'''
            return x + 1
        """,
    "mixed.py": "import torch.distributed\nimport triton\nimport torch.cuda\n",
}


@pytest.fixture
def synthetic_tree(tmp_path):
    for name, source in SYNTHETIC.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip())
    return tmp_path


def test_census_classifies_synthetic_modules(synthetic_tree):
    found = {m.path: m for m in census(synthetic_tree)}
    assert {path: m.category for path, m in found.items()} == {
        "kern/add.py": "kernel",
        "kern/wrapper.py": "kernel",
        "dist/ring.py": "collective",
        "dev/sync.py": "device",
        "dev/move.py": "device",
        "app/prose.py": "portable",
        "mixed.py": "kernel",
    }
    assert found["mixed.py"].package == "(top level)" and found["dev/sync.py"].package == "dev"
    sync = [m.what for m in found["dev/sync.py"].markers]
    assert sync == ["'cuda'", "torch.cuda.synchronize", "torch.backends.mps.is_available"]  # one marker per chain
    assert [m.what for m in found["dist/ring.py"].markers] == ["import torch.distributed", "'gloo'"]
    assert [m.line for m in found["dev/move.py"].markers] == [2, 4]
    assert any(m.what.startswith("@triton.jit") for m in found["kern/add.py"].markers)
    assert found["app/prose.py"].lines == 5  # blank lines and comment-only lines are not code


def test_census_errors_name_the_problem(tmp_path):
    (tmp_path / "broken.py").write_text("def f(:\n")
    with pytest.raises(ValueError, match="cannot parse broken.py"):
        census(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        census(tmp_path / "missing")
    with pytest.raises(ValueError, match="empty"):
        device_specific_fraction([])
    assert count_code_lines("x = 1\n\n# note\n  y = 2  # trailing\n") == 2
    found = scan_source("print('xpu:1', 'hccl', 'cudagraph')")
    assert {(m.kind, m.what) for m in found} == {("device", "'xpu:1'"), ("collective", "'hccl'")}


# --- the same model on every device -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoders_follow_the_weights_device_and_dtype(tiny, dtype):
    """generate and greedy_decode make their inputs and KV cache where the weights are, in their dtype."""
    from infra_lib.model.generation import stream
    from infra_lib.model.sampling import SamplingParams

    class Ids:  # a tokenizer stand-in: prompts are token ids already
        eos_id = -1

        def stream_decoder(self, skip_special=True):
            class Decoder:
                def push(self, token):
                    return ""

                def flush(self):
                    return ""

            return Decoder()

    prompt = list(range(3, 20))
    for device in available_devices():
        placed = model_on(tiny, device, dtype)
        tokens = greedy_tokens(placed, prompt, 12)
        assert len(tokens) == 12
        streamed = [e.token_id for e in stream(placed, Ids(), prompt, SamplingParams(max_new_tokens=12))]
        assert streamed == tokens, (device, dtype)


def test_every_available_device_agrees_with_the_cpu(tiny):
    prompt = list(range(3, 20))
    reference = run_greedy(tiny, prompt, 12, "cpu")
    runs = [run_greedy(tiny, prompt, 12, name) for name in available_devices()]
    for agreement in compare_runs(prompt, reference, runs):
        assert agreement.tokens_equal == agreement.tokens_compared == 12, agreement
        assert agreement.first_divergence is None and agreement.max_logit_diff < 1e-3, agreement


def test_dtypes_round_differently_but_keep_the_answer(tiny):
    prompt = list(range(3, 20))
    assert tiny.embed_tokens.weight.dtype == torch.float32
    runs = [run_greedy(tiny, prompt, 12, "cpu", dtype) for dtype in (torch.float32, torch.float64, torch.bfloat16)]
    assert tiny.embed_tokens.weight.dtype == torch.float32  # the copies never touch the original
    agreements = compare_runs(prompt, runs[0], runs[1:])
    assert agreements[0].max_logit_diff == 0.0 and agreements[0].label == "cpu / float32"
    assert 0 < agreements[1].max_logit_diff < 1e-4  # float64: more bits, same math
    assert 1e-4 < agreements[2].max_logit_diff < 0.5  # bfloat16: 8 mantissa bits
    assert agreements[2].argmax_agreement > 0.9


def test_compare_runs_reports_the_first_divergence():
    logits = torch.zeros(5, 4)
    reference = DeviceRun("cpu", "float32", [1, 2, 3], 0.0, logits=logits)
    other = DeviceRun("x", "float32", [1, 2, 0], 0.0, logits=logits + 0.25)
    shorter = DeviceRun("y", "float32", [1, 2], 0.0, logits=logits)
    _, a, b = compare_runs([7, 8], reference, [other, shorter])
    assert (a.tokens_equal, a.first_divergence, a.max_logit_diff) == (2, 2, 0.25)
    assert (b.tokens_compared, b.tokens_equal, b.first_divergence) == (2, 2, 2)
    with pytest.raises(ValueError, match="neither a model nor logits"):
        compare_runs([7], DeviceRun("cpu", "float32", [1], 0.0), [])


def test_model_on_copies_only_when_needed(tiny):
    assert model_on(tiny, "cpu", torch.float32) is tiny
    half = model_on(tiny, "cpu", torch.bfloat16)
    assert half is not tiny and half.embed_tokens.weight.dtype == torch.bfloat16
    assert score(half, [1, 2, 3]).dtype == torch.float32
    with pytest.raises(BackendUnavailable, match="torch_npu"):
        model_on(tiny, "npu", torch.float32)


@SMOLLM2
def test_smollm2_greedy_tokens_match_and_bfloat16_stays_close(smollm2):
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    reference = run_greedy(smollm2.model, prompt, 6, stop_id=tokenizer.eos_id)
    assert reference.token_ids == greedy_decode(smollm2.model, prompt, 6, stop_id=tokenizer.eos_id)
    bf16 = run_greedy(smollm2.model, prompt, 6, dtype=torch.bfloat16, stop_id=tokenizer.eos_id)
    _, agreement = compare_runs(prompt, reference, [bf16])
    assert smollm2.model.embed_tokens.weight.dtype == torch.float32
    assert 0 < agreement.max_logit_diff < 5 and agreement.argmax_agreement > 0.8
