"""What chapter 17 states in prose, held to the library: the section titles the lab's feedback links to,
the KV handoff's bytes and the GPU arithmetic of when the split pays, tensor-parallel decode's estimate,
the routing simulator's figures, the published figures it cites, and the serve command it shows."""

from __future__ import annotations

import math

import pytest
from test_lesson_claims import assigned_literal, lesson_text

from course_tools.cli import build_parser
from infra_lib.hardware.kv_cache import MODELS, model_kv_bytes_per_token
from infra_lib.hardware.specs import get_accelerator
from infra_lib.model.config import LlamaConfig
from infra_lib.ops.router_sim import simulate_routing, token_chat_workload
from infra_lib.serving import moe, tensor_parallel_decode
from infra_lib.serving.router import POLICIES, PrefixAwarePolicy, make_policy
from infra_lib.serving.tensor_parallel_decode import tp_decode_estimate

SECTIONS = (
    "1 · Replicas behind a router",
    "2 · Routing by prefix, within a load bound",
    "3 · A replica dies mid-run",
    "4 · Prefill and decode on separate workers",
    "5 · The KV handoff: its bytes, its time, and when the split pays",
    "6 · Tensor-parallel decode",
    "7 · Experts across processes",
)
H100 = get_accelerator("H100 SXM")
SMOLLM2 = LlamaConfig(49152, 576, 30, 9, 3, 64, 1536, 100000.0, 1e-5, 2048, tie_embeddings=True)
LLAMA3_70B = LlamaConfig(128256, 8192, 80, 64, 8, 128, 28672, 500000.0, 1e-5, 8192, tie_embeddings=False)


@pytest.fixture(scope="module")
def text() -> str:
    return lesson_text("17")


def test_chapter_17_has_the_sections_the_lab_links_to_in_order(text):
    places = [text.find(f"## {title} ") for title in SECTIONS]
    assert all(place >= 0 for place in places), [t for t, p in zip(SECTIONS, places) if p < 0]
    assert places == sorted(places), "the sections are out of order"


def test_chapter_17_runs_two_replicas_and_shows_the_serve_command_the_cli_accepts(text):
    assert assigned_literal("17", "REPLICAS") == 2
    assert "infra-lab serve --replicas 2 --router prefix --port 8000" in text
    args = build_parser().parse_args(["serve", "--replicas", "2", "--router", "prefix", "--port", "8000"])
    assert (args.replicas, args.router, args.port) == (2, "prefix", 8000)


def test_the_handoff_bytes_are_chapter_02s_formula(text):
    per_token = model_kv_bytes_per_token(MODELS["SmolLM2-135M"], "fp32")
    assert per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert "2 (K and V) x 30 layers x 3 KV heads x 64 x 4 bytes (fp32) = 46,080 bytes" in text
    assert "a prompt of 474 tokens ships 30 blocks of 16 = 480 slots" in text
    assert math.ceil(474 / 16) == 30


def test_the_gpu_handoff_arithmetic_is_recomputed_from_the_spec_tables(text):
    nvlink, rdma, mfu, prompt = H100.interconnect_gbps / 2 * 1e9, 50e9, 0.5, 4096
    assert nvlink == 450e9 and H100.bf16_dense_tflops == 989

    def handoff(name: str) -> tuple[float, float, float, float]:
        spec = MODELS[name]
        kv = model_kv_bytes_per_token(spec, "bf16") * prompt
        prefill = 2 * spec.n_params * prompt / (H100.peak_flops("bf16") * mfu)
        return kv, kv / nvlink, kv / rdma, prefill

    kv, over_nvlink, over_rdma, prefill = handoff("Llama-3-8B")
    assert model_kv_bytes_per_token(MODELS["Llama-3-8B"], "bf16") == 128 * 2**10
    stated = (
        f"a 4,096-token prompt's KV cache is {kv / 1e6:.0f} MB, {over_nvlink * 1e3:.1f} ms over NVLink and "
        f"{over_rdma * 1e3:.1f} ms over RDMA, against a prefill of about {prefill * 1e3:.0f} ms: "
        f"{over_nvlink / prefill:.1%} and {over_rdma / prefill:.1%}"
    )
    assert stated in text, stated
    kv2, _, over_rdma2, prefill2 = handoff("Llama-2-7B")
    assert kv2 == 4 * kv and prefill2 < prefill, "four times the bytes for slightly less compute"
    assert f"{over_rdma2 * 1e3:.0f} ms over RDMA, {over_rdma2 / prefill2:.0%} of its prefill" in text
    assert f"one RDMA port costs {over_rdma2 / prefill2:.0%} of its prefill" in text


def test_the_tensor_parallel_arithmetic_is_tp_decode_estimates(text):
    small = tp_decode_estimate(SMOLLM2, 2, H100.bandwidth_bytes_per_s, 6e-6)
    assert f"rank 0 holds {small['rank_layer_share']:.0%} of each layer's weights" in text
    assert f"SmolLM2's layers are {small['layer_bytes'] / 1e6:.0f} MB each in bf16" in text
    assert f"reads one in about {small['layer_bytes'] / H100.bandwidth_bytes_per_s * 1e6:.0f} µs" in text
    assert f"the {2 * 6} µs of its two all-reduces" in text
    assert f"about {round(1 / small['tp_speedup'])} times slower" in text.replace("five", "5")
    big = {world: tp_decode_estimate(LLAMA3_70B, world, H100.bandwidth_bytes_per_s, 6e-6) for world in (2, 8)}
    assert f"A 70B model's layers are {big[2]['layer_bytes'] / 1e9:.1f} GB" in text
    saved_ms = big[2]["layer_bytes"] / 2 / H100.bandwidth_bytes_per_s * 1e3
    assert 0.2 < saved_ms < 0.3 and "halving one saves a quarter of a millisecond" in text
    assert f"from {big[8]['one_gpu_s'] * 1e3:.0f} ms to about {big[8]['tp_s'] * 1e3:.0f} ms" in text
    assert big[8]["one_gpu_bytes"] > H100.hbm_bytes, "the 70B model does not fit one H100"


def test_the_measured_figures_quoted_are_the_modules_own(text):
    """Full runs the chapter quotes by date are the ones the library's docstrings record."""
    tp_doc, moe_doc = " ".join(tensor_parallel_decode.__doc__.split()), " ".join(moe.__doc__.split())
    assert "122 ms against 58 ms unsplit, 59-61% of it inside the 60 all-reduces" in tp_doc
    assert "a TP=2 step took 122 ms against 58 ms unsplit, with 59-61% of it inside the all-reduces" in text
    assert "about 120 µs each" in tp_doc and "about 120 µs each" in text
    assert "Gaussian 1.05" in moe_doc and "SmolLM2 embedding rows 1.32 53.4% 15.9% 1.9% 0%" in moe_doc
    assert "an imbalance of 1.05 for Gaussian tokens and 1.32 for embedding rows" in text
    assert "lost 15.9% of their slots at C = 1.0, 1.9% at 1.25, none at 2.0" in text


def test_the_simulated_routing_figures_are_the_simulators(text):
    sim = assigned_literal("17", "SIM")
    assert sim == {"conversations": 96, "turns": 6, "replicas": 8, "users": 32}

    def run(policy, system_prompts: int):
        conversations = token_chat_workload(
            sim["conversations"], sim["turns"], seed=0, num_system_prompts=system_prompts
        )
        return simulate_routing(policy, conversations, sim["replicas"], concurrency=sim["users"], seed=0)

    three = {name: run(make_policy(name), 3) for name in POLICIES}
    stated = (
        f"the prefix policy (slack 0.5) hits {three['prefix'].hit_rate:.1%} of the blocks it looks up, next to the "
        f"{three['prefix'].ideal_hit_rate:.1%} of one cache holding everything, where round robin hits "
        f"{three['round-robin'].hit_rate:.1%} and least outstanding {three['least-loaded'].hit_rate:.1%}"
    )
    assert stated in text, stated
    ratio = three["prefix"].mean_latency / three["round-robin"].mean_latency
    assert 0.62 < ratio < 0.7 and "its mean latency is about two thirds of round robin's" in text
    hot, round_robin = run(PrefixAwarePolicy(slack=8), 1), run(make_policy("round-robin"), 1)
    assert hot.max_share == 1.0 and "the busiest replica serves 100% of the requests" in text
    assert f"the mean latency {hot.mean_latency / round_robin.mean_latency:.1f} times round robin's" in text
    assert f"even its hit rate falls to {hot.hit_rate:.1%}" in text


def test_the_published_figures_are_cited_as_published(text):
    for cited in (
        "DistServe (Zhong et al., OSDI 2024)",
        "serving 4.48x more requests, or meeting a 10.2x tighter SLO, while keeping over 90% of requests",
        "Mooncake (Qin et al., FAST 2025, best paper)",
        "59% to 498% more effective request capacity",
        "Kimi handled 115% more requests on A800 clusters and 107% more on H800 clusters",
    ):
        assert cited in text, cited
