"""The offline-throughput benchmark (chapter 08): its JSON and the relations its numbers must
satisfy by construction, whatever the machine's speed."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO, SMOLLM2, run_benchmark

sys.path.append(str(REPO / "benchmarks"))
import offline_throughput  # noqa: E402  (a script in benchmarks/, importable once that folder is on the path)

ENGINES = [
    "continuous batching",
    "continuous batching, Q4_1 C step",
    "continuous batching, PyTorch step",
    "continuous batching, model as loaded",
    "static batching",
    "padded static batching",
    "sequential transformers",
]


@SMOLLM2
def test_offline_throughput_benchmark_writes_json(tmp_path):
    result = run_benchmark("offline_throughput", tmp_path / "offline_throughput.json")
    flags, work, bound, engines = result["flags"], result["workload"], result["roofline"], result["engines"]
    assert result["benchmark"] == "offline_throughput" and list(engines) == ENGINES
    assert len(work["prompt_tokens"]) == len(work["output_tokens"]) == flags["num_prompts"]
    low, high = flags["output_len"]
    assert all(low <= n <= high for n in work["output_tokens"])
    assert work["total_output_tokens"] == sum(work["output_tokens"])
    assert work["total_prompt_tokens"] == sum(work["prompt_tokens"])
    assert work["computed_tokens"] == work["total_prompt_tokens"] + work["total_output_tokens"] - flags["num_prompts"]
    assert any("padded" in note for note in result["notes"])
    for row in engines.values():
        # No stop token: every request produced exactly its drawn number of tokens, on every engine.
        assert row["output_token_counts"] == work["output_tokens"]
        assert row["output_tokens"] == work["total_output_tokens"]
        assert row["seconds"] > 0 and row["tokens_per_s"] == pytest.approx(row["output_tokens"] / row["seconds"])
        assert row["fraction_of_roofline"] == pytest.approx(row["tokens_per_s"] / bound["tokens_per_s_upper_bound"])
    continuous, static = engines["continuous batching"], engines["static batching"]
    assert result["continuous_over_static"] == pytest.approx(continuous["tokens_per_s"] / static["tokens_per_s"])
    assert result["continuous_over_sequential"] == pytest.approx(
        continuous["tokens_per_s"] / engines["sequential transformers"]["tokens_per_s"]
    )
    # Refilling freed places never takes more steps than waiting for each static batch to drain.
    assert continuous["steps"] <= static["steps"]
    # The padded batches computed every row until their longest member finished: one generate per batch.
    padded, batch, outputs = engines["padded static batching"], flags["batch"], work["output_tokens"]
    groups = [outputs[i : i + batch] for i in range(0, len(outputs), batch)]
    assert padded["steps"] == len(groups)
    assert padded["computed_output_slots"] == sum(len(g) * max(g) for g in groups) >= work["total_output_tokens"]
    assert result["continuous_over_padded_static"] == pytest.approx(continuous["tokens_per_s"] / padded["tokens_per_s"])
    # The sweep: continuous batching at every batch limit and token budget, each serving the whole backlog.
    sweep = result["sweep"]
    assert [(r["max_num_seqs"], r["max_num_batched_tokens"]) for r in sweep] == [
        (b, t) for b in flags["sweep_batches"] for t in flags["sweep_budgets"]
    ]
    for row in sweep:
        assert row["output_tokens"] == work["total_output_tokens"] and row["steps"] > 0 and row["preemptions"] >= 0
        assert row["tokens_per_s"] == pytest.approx(row["output_tokens"] / row["seconds"])
    # The padded baseline at each swept batch limit, beside that limit's best continuous row.
    assert [r["batch"] for r in result["padded_sweep"]] == flags["sweep_batches"]
    for row in result["padded_sweep"]:
        groups = [outputs[i : i + row["batch"]] for i in range(0, len(outputs), row["batch"])]
        assert row["padded_static_output_tokens"] == work["total_output_tokens"]
        assert row["computed_output_slots"] == sum(len(g) * max(g) for g in groups)
        best = max(r["tokens_per_s"] for r in sweep if r["max_num_seqs"] == row["batch"])
        assert row["continuous_best_tokens_per_s"] == best
        assert row["continuous_over_padded_static"] == pytest.approx(best / row["padded_static_tokens_per_s"])
        assert row["computed_over_kept_slots"] == pytest.approx(
            row["computed_output_slots"] / work["total_output_tokens"]
        )
    assert bound["flops"] == 2 * result["model"]["parameters"] * work["computed_tokens"]
    assert result["peak_gemm"]["peak_gflops"] > 0
    assert bound["seconds_lower_bound"] == pytest.approx(bound["flops"] / (result["peak_gemm"]["peak_gflops"] * 1e9))
    assert bound["tokens_per_s_upper_bound"] == pytest.approx(
        work["total_output_tokens"] / bound["seconds_lower_bound"]
    )
    assert 0 <= result["requests_same_greedy_tokens_as_transformers"] <= flags["num_prompts"]
    # The decode layout is the same fp32 model: every request gets the same greedy tokens as on the model as loaded.
    torch_step = engines["continuous batching, PyTorch step"]
    assert result["requests_same_tokens_in_both_layouts"] == flags["num_prompts"]
    assert result["decode_layout_over_model_as_loaded"] == pytest.approx(
        torch_step["tokens_per_s"] / engines["continuous batching, model as loaded"]["tokens_per_s"]
    )
    # The C step (fp32, this machine builds it) serves the small steps, PyTorch the rest, with the same tokens.
    step = result["native_step"]
    assert step["available"] is True and step["reason"] == "" and step["weights"] == "fp32"
    assert step["native_steps"] > 0 and step["native_steps"] + step["fallback_steps"] == continuous["steps"]
    assert result["requests_same_tokens_native_and_pytorch_step"] == flags["num_prompts"]
    assert result["native_step_over_pytorch_step"] == pytest.approx(
        continuous["tokens_per_s"] / torch_step["tokens_per_s"]
    )
    # The same engine on the GGUF file's Q4_1 blocks: every request its drawn number of tokens (checked
    # above), greedy tokens that may part from fp32's at a near tie (activations rounded to int8)
    q4_1 = engines["continuous batching, Q4_1 C step"]
    assert result["q4_1_over_fp32_native_step"] == pytest.approx(q4_1["tokens_per_s"] / continuous["tokens_per_s"])
    assert 0 <= result["requests_same_tokens_q4_1_and_fp32"] <= flags["num_prompts"]


def test_the_backlog_is_seeded():
    backlog = offline_throughput.make_backlog(10, (4, 9), (1, 5), 1000)
    assert backlog == offline_throughput.make_backlog(10, (4, 9), (1, 5), 1000)
    assert backlog != offline_throughput.make_backlog(10, (4, 9), (1, 5), 1000, seed=1)
    prompts, outputs = backlog
    assert all(4 <= len(p) <= 9 for p in prompts) and all(1 <= n <= 5 for n in outputs)
