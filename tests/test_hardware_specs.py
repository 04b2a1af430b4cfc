"""The accelerator spec table, the memory-bandwidth probe and the roofline benchmark (chapter 02)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import run_benchmark

from infra_lib.hardware.probes import (
    last_level_cache_bytes,
    measure_add_point,
    measure_gemm_point,
    measure_memory_bandwidth,
    place_on_roofline,
)
from infra_lib.hardware.roofline import arithmetic_intensity
from infra_lib.hardware.specs import ACCELERATORS, Accelerator, get_accelerator, to_rows

REQUIRED = ("H100 SXM", "H200 SXM", "B200", "GB300 (per GPU)", "MI300X", "Ascend 910B")
NUMERIC = ("bf16_dense_tflops", "hbm_gb", "hbm_tbps", "interconnect_gbps")


def test_table_has_the_chapters_accelerators():
    assert set(REQUIRED) <= set(ACCELERATORS)
    for name, acc in ACCELERATORS.items():
        assert acc.name == name


@pytest.mark.parametrize("name", sorted(ACCELERATORS))
def test_every_row_is_complete(name):
    acc = ACCELERATORS[name]
    for field in NUMERIC:
        value = getattr(acc, field)
        assert isinstance(value, (int, float)) and value > 0, f"{name}.{field} should be positive, got {value!r}"
    assert acc.fp8_dense_tflops is None or acc.fp8_dense_tflops > 0
    assert acc.source.strip() and acc.interconnect.strip() and acc.vendor.strip()
    # Dense FP8 is about twice dense BF16 on every chip that has it.
    if acc.fp8_dense_tflops is not None:
        assert acc.fp8_dense_tflops == pytest.approx(2 * acc.bf16_dense_tflops, rel=0.02)
    # A ridge point between 100 and 500 FLOP/byte: every current accelerator sits there.
    assert 100 < acc.ridge_point("bf16") < 500


def test_ascend_910b_has_no_fp8():
    acc = get_accelerator("Ascend 910B")
    assert acc.fp8_dense_tflops is None
    with pytest.raises(ValueError, match="no FP8"):
        acc.peak_flops("fp8")


def test_h100_numbers_are_dense_and_its_ridge_point_is_about_295():
    h100 = get_accelerator("H100 SXM")
    assert h100.bf16_dense_tflops == pytest.approx(989, rel=0.01)  # 1,979 "with sparsity" halved
    assert h100.ridge_point("bf16") == pytest.approx(295, rel=0.01)
    assert h100.ridge_point("fp8") == pytest.approx(2 * h100.ridge_point("bf16"), rel=0.01)
    assert h100.hbm_bytes == 80e9 and h100.bandwidth_bytes_per_s == 3.35e12


def test_h200_is_an_h100_with_more_and_faster_memory():
    h100, h200 = get_accelerator("H100 SXM"), get_accelerator("H200 SXM")
    assert h200.bf16_dense_tflops == h100.bf16_dense_tflops
    assert h200.hbm_gb > h100.hbm_gb and h200.hbm_tbps > h100.hbm_tbps
    assert h200.ridge_point() < h100.ridge_point()


def test_rows_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_accelerator("B200").hbm_gb = 1


def test_bad_rows_are_rejected():
    with pytest.raises(ValueError, match="hbm_tbps"):
        Accelerator("X", "V", 100, None, 10, 0, 10, "link", "doc")
    with pytest.raises(ValueError, match="source"):
        Accelerator("X", "V", 100, None, 10, 1, 10, "link", " ")


def test_unknown_accelerator_error_lists_the_names():
    with pytest.raises(KeyError) as info:
        get_accelerator("H800")
    message = str(info.value)
    assert "H800" in message
    for name in REQUIRED:
        assert name in message


def test_to_rows_carries_units_and_ridge_points():
    rows = to_rows()
    assert [row["name"] for row in rows] == list(ACCELERATORS)
    for row in rows:
        for key in ("bf16_dense_tflops", "fp8_dense_tflops", "hbm_gb", "hbm_tbps", "interconnect_gbps", "source"):
            assert key in row
        acc = get_accelerator(row["name"])
        assert row["bf16_ridge_flop_per_byte"] == pytest.approx(acc.bf16_dense_tflops / acc.hbm_tbps)


def test_memory_bandwidth_quick():
    result = measure_memory_bandwidth(quick=True, iters=2)
    assert result["copy_gbps"] > 0 and result["triad_gbps"] > 0
    assert result["bandwidth_gbps"] == max(result["copy_gbps"], result["triad_gbps"])
    assert result["array_mb"] == pytest.approx(64, rel=1e-6)
    assert result["torch_threads"] >= 1 and result["iters"] == 2
    llc = last_level_cache_bytes()
    if llc is not None:
        assert result["llc_mb"] == pytest.approx(llc / 1e6)


def test_memory_bandwidth_rejects_a_bad_size():
    with pytest.raises(ValueError, match="size_mb"):
        measure_memory_bandwidth(size_mb=0)


def test_points_land_on_the_roofline():
    gemv = measure_gemm_point("gemv", 1, 64, 32, iters=2)
    assert gemv["intensity"] == pytest.approx(arithmetic_intensity(1, 64, 32, bytes_per_element=4))
    assert gemv["flops"] == 2 * 64 * 32 and gemv["achieved_gflops"] > 0
    add = measure_add_point("add", 1.0, iters=2)
    assert add["intensity"] == pytest.approx(1 / 12) and add["elements"] == 250_000
    # peak 100 GFLOP/s, 10 GB/s: ridge at 10 FLOP/byte
    placed = place_on_roofline({"intensity": 0.5, "achieved_gflops": 2.5}, peak_gflops=100, bandwidth_gbps=10)
    assert placed["attainable_gflops"] == pytest.approx(5)
    assert placed["fraction_of_roof"] == pytest.approx(0.5) and placed["bound"] == "memory-bound"
    placed = place_on_roofline({"intensity": 50, "achieved_gflops": 80}, peak_gflops=100, bandwidth_gbps=10)
    assert placed["attainable_gflops"] == pytest.approx(100) and placed["bound"] == "compute-bound"


def test_roofline_probe_benchmark_writes_json(tmp_path):
    result = run_benchmark("roofline_probe", tmp_path / "roofline.json")
    peak, bandwidth = result["peak"]["peak_gflops"], result["bandwidth"]["bandwidth_gbps"]
    assert peak > 0 and bandwidth > 0
    assert result["ridge_point_flop_per_byte"] == pytest.approx(peak / bandwidth)
    names = [p["name"] for p in result["points"]]
    assert any("GEMV" in n for n in names) and any("add" in n for n in names) and any("prefill" in n for n in names)
    for p in result["points"]:
        for key in ("name", "kind", "intensity", "achieved_gflops", "attainable_gflops", "fraction_of_roof"):
            assert key in p, f"point {p.get('name')} lacks {key}"
        assert p["kind"] == "elementwise" or {"m", "n", "k"} <= set(p)
        assert p["fraction_of_roof"] > 0
        assert p["attainable_gflops"] == pytest.approx(min(peak, p["intensity"] * bandwidth))
        assert p["fraction_of_roof"] == pytest.approx(p["achieved_gflops"] / p["attainable_gflops"])


def test_bf16_matrix_instructions_reads_the_flags_linux_lists(tmp_path):
    from infra_lib.hardware.probes import bf16_matrix_instructions

    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert bf16_matrix_instructions(str(x86)) == ["AVX512-BF16", "AMX"]
    avx2 = tmp_path / "avx2"
    avx2.write_text("flags\t\t: fpu sse2 avx2 fma\n")
    assert bf16_matrix_instructions(str(avx2)) == []
    arm = tmp_path / "arm"
    arm.write_text("Features\t: fp asimd bf16 i8mm\n")
    assert bf16_matrix_instructions(str(arm)) == ["Arm BF16"]
    assert bf16_matrix_instructions(str(tmp_path / "missing")) == []
