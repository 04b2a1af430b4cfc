"""Lab 17's checks name the usual mistakes of a prefix-aware router, of the KV handoff's two halves, of a
tensor-parallel MLP and of a top-k gate; a call into the course's reference is a shortcut under the grader; and the
lab's last cells run the answers in the simulator, through a SmolLM2-shaped handoff and on a gloo process group.

Each mistake is the course's answer with one idea taken out (its source with one line replaced), run against the
check that should catch it: the failure must carry the hint written for that mistake."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import REPO, answer_cells, check_fails

from grading import check
from grading.check import RECORD_ENV, SEED_ENV
from grading.checks.lab17 import task1_router_rules as rules
from grading.checks.lab17 import task1_router_workloads as workloads
from grading.checks.lab17 import task2_pack_kv as pack
from grading.checks.lab17 import task3_in_engines as engines
from grading.checks.lab17 import task3_install_kv as install
from grading.checks.lab17 import task4_tp_mlp as tp
from grading.checks.lab17 import task5_gating as gating
from grading.checks.lab17.process_group import setup_names
from grading.registry import get_check

SOLUTION = REPO / "solutions" / "lab17_distributed_serving" / "lab17_distributed_serving.ipynb"
SETUP = setup_names()  # what the lab's setup cell imports


def variant(cell: str, *replacements: tuple[str, str]) -> dict:
    """The namespace of the course's answer ``cell`` with each (old, new) replacement made, run as the lab runs it."""
    source = answer_cells(SOLUTION)[cell]
    for old, new in replacements:
        assert source.count(old) == 1, f"the answer {cell} no longer holds {old!r}"
        source = source.replace(old, new)
    namespace = dict(SETUP)
    exec(compile(source, f"<{cell}>", "exec"), namespace)  # noqa: S102 - the course's own answer, changed
    return namespace


def answers(cell: str, *names: str, replacements=()) -> dict:
    namespace = variant(cell, *replacements)
    return {name: namespace[name] for name in names}


# --- task 1: the router ---------------------------------------------------------------------------------------

_CHOOSE_WITHIN = "            chosen = min(within, key=lambda i: (-match(i), replica_loads[i], (i - self.cursor) % n))"
ROUTER_MISTAKES = {
    "the prefix ignored": (
        (_CHOOSE_WITHIN, "            chosen = min(within, key=lambda i: (replica_loads[i], (i - self.cursor) % n))"),
        "longest",
    ),
    "no load bound": (("if replica_loads[i] <= (1 + self.slack) * mean", "if True"), "bound"),
    "every hash counted, not the leading run": (
        ("                    break\n", "                    continue\n"),
        "longest",
    ),
    "ties to the lowest index": (
        (_CHOOSE_WITHIN, "            chosen = min(within, key=lambda i: (-match(i), replica_loads[i], i))"),
        "tie",
    ),
    "forget does nothing": (("        for h in list(self.sent):", "        for h in []:"), "forget"),
    "a memory without bound": (("        while len(self.sent) > self.max_hashes:", "        while False:"), "memory"),
    "None counted as an idle replica": (
        (
            "live = [i for i, load in enumerate(replica_loads) if load is not None]",
            "live = list(range(len(replica_loads)))\n        replica_loads = [load or 0 for load in replica_loads]",
        ),
        "rotation",
    ),
    "the chosen replica's load counted in the caller's list": (
        (
            "        self.cursor = (chosen + 1) % n\n",
            "        self.cursor = (chosen + 1) % n\n        replica_loads[chosen] += 1\n",
        ),
        "arguments",
    ),
}


@pytest.mark.parametrize("mistake", ROUTER_MISTAKES)
def test_task1_rule_mistakes_are_named(mistake):
    replacement, rule = ROUTER_MISTAKES[mistake]
    router = variant("task1_prefix_router", replacement)["PrefixRouter"]
    message = check_fails("lab17.router_rules", router)
    assert rules.HINTS[rule] in message, message


def test_task1_a_router_that_refuses_nothing_fails_the_edges_by_name():
    router = variant("task1_prefix_router", ("        if slack < 0:", "        if False:"))["PrefixRouter"]
    message = check_fails("lab17.router_edges", router)
    assert "did not accept or refuse its options" in message and rules.HINTS["errors"] in message


def test_task1_workload_mistakes_are_named():
    ignores_prefix = variant("task1_prefix_router", ROUTER_MISTAKES["the prefix ignored"][0])["PrefixRouter"]
    message = check_fails("lab17.router_shared_prefix", ignores_prefix)
    assert "hit rate is more than 0.05 below the course's" in message and workloads.HIT_HINT in message
    unbounded = variant("task1_prefix_router", ROUTER_MISTAKES["no load bound"][0])["PrefixRouter"]
    message = check_fails("lab17.router_hot_prefix", unbounded)
    assert "one replica served more than (1 + slack) / N" in message and workloads.SHARE_HINT in message
    dead = variant("task1_prefix_router", ROUTER_MISTAKES["None counted as an idle replica"][0])["PrefixRouter"]
    message = check_fails("lab17.router_replica_dies", dead)
    assert "chose a replica out of rotation" in message and workloads.INVALID_HINT in message


# --- tasks 2 and 3: the handoff -------------------------------------------------------------------------------

_PACK_INDEX = "    index = torch.tensor(table, dtype=torch.long)"
_PACK_STACK = "torch.stack((k[index], v[index]))"
PACK_MISTAKES = {
    "blocks read in id order": (
        "lab17.pack_kv",
        (_PACK_INDEX, "    index = torch.tensor(sorted(table), dtype=torch.long)"),
        pack.ORDER_HINT,
    ),
    "K and V swapped": ("lab17.pack_kv", (_PACK_STACK, "torch.stack((v[index], k[index]))"), pack.KV_HINT),
    "the tokens sent, not the blocks": (
        "lab17.pack_kv",
        (_PACK_STACK, "torch.stack((k[index].flatten(0, 1)[:num_tokens], v[index].flatten(0, 1)[:num_tokens]))"),
        pack.PARTIAL_HINT,
    ),
    "the unused slots zeroed": (
        "lab17.pack_kv",
        (
            "    _, block_size, n_kv_heads, head_dim = store.k[0].shape",
            "    payload[:, :, -1, num_tokens - (len(table) - 1) * store.block_size :] = 0\n"
            "    _, block_size, n_kv_heads, head_dim = store.k[0].shape",
        ),
        pack.PARTIAL_HINT,
    ),
    "the metadata's ids sorted": ("lab17.pack_kv", ("tuple(table))", "tuple(sorted(table)))"), pack.METADATA_HINT),
    "a payload cast to float32": (
        "lab17.pack_kv_edges",
        ("    return payload, metadata", "    return payload.float(), metadata"),
        pack.DTYPE_HINT,
    ),
    "a repeated id accepted": (
        "lab17.pack_kv_edges",
        ("if len(set(table)) != len(table) or any(", "if any("),
        pack.ERRORS_HINT,
    ),
}


@pytest.mark.parametrize("mistake", PACK_MISTAKES)
def test_task2_mistakes_are_named(mistake):
    check_id, replacement, hint = PACK_MISTAKES[mistake]
    message = check_fails(check_id, variant("task2_pack_kv", replacement)["pack_kv"])
    assert hint in message, message


_ALLOCATE = "    table = pool.allocate(metadata.num_blocks)  # all or nothing: OutOfBlocks leaves the pool as it was"
INSTALL_MISTAKES = {
    "the sender's ids reused": (
        "lab17.install_kv",
        (_ALLOCATE, "    table = list(metadata.source_blocks)"),
        install.SENDER_IDS_HINT,
    ),
    "free blocks written without taking them": (
        "lab17.install_kv",
        (_ALLOCATE, "    table = pool.free_block_ids()[: metadata.num_blocks]"),
        install.POOL_HINT,
    ),
    "K and V swapped": (
        "lab17.install_kv",
        ("store.k[layer][block] = payload[layer, 0, i]", "store.k[layer][block] = payload[layer, 1, i]"),
        install.BYTES_HINT,
    ),
    "blocks taken one by one": (
        "lab17.install_kv_edges",
        (_ALLOCATE, "    table = []\n    for _ in range(metadata.num_blocks):\n        table += pool.allocate(1)"),
        install.REFUSE_HINT,
    ),
    "no layout check": (
        "lab17.install_kv_edges",
        ("    if metadata.layout() != layout:", "    if False:"),
        install.REFUSE_HINT,
    ),
}


@pytest.mark.parametrize("mistake", INSTALL_MISTAKES)
def test_task3_mistakes_are_named(mistake):
    check_id, replacement, hint = INSTALL_MISTAKES[mistake]
    message = check_fails(check_id, variant("task3_install_kv", replacement)["install_kv"])
    assert hint in message, message


@pytest.mark.parametrize(
    ("pack_mistake", "install_mistake", "named"),
    [
        ("K and V swapped", None, "other tokens than one engine"),
        (None, "the sender's ids reused", "could not serve the requests"),
        (None, "free blocks written without taking them", "could not serve the requests"),
    ],
)
def test_task3_the_two_engines_name_what_went_wrong(pack_mistake, install_mistake, named):
    both = {
        "pack_kv": variant("task2_pack_kv", *([PACK_MISTAKES[pack_mistake][1]] if pack_mistake else []))["pack_kv"],
        "install_kv": variant("task3_install_kv", *([INSTALL_MISTAKES[install_mistake][1]] if install_mistake else []))[
            "install_kv"
        ],
    }
    message = check_fails("lab17.handoff_in_engines", both)
    hint = engines.TOKENS_HINT if pack_mistake else engines.ENGINE_HINT
    assert named in message and hint in message, message


def test_task3_blocks_that_never_come_back_are_counted():
    """An install that takes one block more than it uses leaves the decode pool short at the end."""
    leaky = variant("task3_install_kv", (_ALLOCATE, _ALLOCATE + "\n    pool.allocate(1)"))["install_kv"]
    both = {"pack_kv": variant("task2_pack_kv")["pack_kv"], "install_kv": leaky}
    message = check_fails("lab17.handoff_in_engines", both)
    assert "blocks of the decode engine's pool were not returned" in message and engines.POOLS_HINT in message


@pytest.mark.parametrize("seed", [18, 25])
def test_task3_a_request_handed_off_to_a_full_decode_batch_waits_for_a_row(seed):
    """With four requests and rows for three, the fourth handoff can arrive while the decode batch is full: it
    waits, as on the decode worker, and the course's handoff still gives one engine's tokens."""
    chunked = get_check("lab17.handoff_chunked")
    case = chunked.inputs(seed)
    record = engines.drive_engines(engines.course_handoff(), case)
    assert record["waited"] > 0, "this case no longer fills the decode batch: pick another seed"
    assert engines.compare_engines(record, record, case) is None


# --- task 4: the split MLP ------------------------------------------------------------------------------------

_SHARD = (
    "    return MLPShard(mlp.gate_proj.weight[start:end], mlp.up_proj.weight[start:end], "
    "mlp.down_proj.weight[:, start:end])"
)
_FORWARD = "    partial = units @ shard.down.T  # [..., hidden]: this rank's share of the output, a partial sum\n"
_FORWARD += "    return all_reduce(partial)"
TP_MISTAKES = {
    "down split by rows": (
        (
            _SHARD,
            "    rows = shard_bounds(mlp.down_proj.weight.shape[0], world_size, rank)\n"
            "    return MLPShard(mlp.gate_proj.weight[start:end], mlp.up_proj.weight[start:end], "
            "mlp.down_proj.weight[rows[0]:rows[1]])",
        ),
        tp.DOWN_HINT,
    ),
    "gate split, up whole": (
        (
            _SHARD,
            "    return MLPShard(mlp.gate_proj.weight[start:end], mlp.up_proj.weight, "
            "mlp.down_proj.weight[:, start:end])",
        ),
        tp.UP_HINT,
    ),
    "the SiLU after the all-reduce": (
        (
            "    units = F.silu(x @ shard.gate.T) * (x @ shard.up.T)  # [..., this rank's slice of the intermediate]\n"
            + _FORWARD,
            "    return F.silu(all_reduce(((x @ shard.gate.T) * (x @ shard.up.T)) @ shard.down.T))",
        ),
        tp.SILU_HINT,
    ),
    "two all-reduces": (
        (_FORWARD, "    return all_reduce(all_reduce(units @ shard.down.T) / 2)"),
        tp.CALLS_HINT,
    ),
    "the partial returned": (
        (_FORWARD, "    partial = units @ shard.down.T\n    all_reduce(partial)\n    return partial"),
        tp.RETURN_HINT,
    ),
    "the leftover units dropped": (
        (
            "    start, end = shard_bounds(mlp.gate_proj.weight.shape[0], world_size, rank)",
            "    size = mlp.gate_proj.weight.shape[0] // world_size\n    start, end = rank * size, (rank + 1) * size",
        ),
        tp.SPLIT_HINT,
    ),
}


@pytest.mark.parametrize("mistake", TP_MISTAKES)
def test_task4_mistakes_are_named(mistake):
    replacement, hint = TP_MISTAKES[mistake]
    split = answers("task4_tp_mlp", "shard_mlp", "tp_mlp_forward", replacements=[replacement])
    message = check_fails("lab17.tp_mlp", split)
    assert hint in message, message


def test_task4_a_rank_left_waiting_is_named_at_once():
    """Rank 0 calls all_reduce a second time, the others do not: its call fails as soon as they are done, naming
    them, and the others' results stand."""
    results = tp.run_ranks(
        lambda x, rank, all_reduce: all_reduce(all_reduce(x)) if rank == 0 else all_reduce(x),
        [0, 1, 2],
        torch.ones(3),
        3,
    )
    assert [r["calls"] for r in results] == [2, 1, 1]
    assert "waits for ranks [1, 2], which made fewer calls" in results[0]["error"]
    assert results[1]["output"] == [3.0, 3.0, 3.0] == results[2]["output"]


# --- task 5: the gate ------------------------------------------------------------------------------------------

_SORT = "    logits, experts = torch.sort(router_logits, dim=-1, descending=True, stable=True)"
GATING_MISTAKES = {
    "the top k over the tokens": (
        "lab17.top_k_gating",
        (_SORT, "    logits, experts = torch.sort(router_logits, dim=0, descending=True, stable=True)"),
        gating.AXIS_HINT,
    ),
    "a softmax over every expert": (
        "lab17.top_k_gating",
        (
            "    return experts[:, :k], torch.softmax(logits[:, :k], dim=-1)",
            "    return experts[:, :k], torch.softmax(logits, dim=-1)[:, :k]",
        ),
        gating.SOFTMAX_HINT,
    ),
    "ties as torch.topk breaks them": (
        "lab17.top_k_gating",
        (_SORT, "    logits, experts = torch.topk(router_logits, router_logits.shape[1], dim=-1)"),
        gating.TIES_HINT,
    ),
    "an exponential of raw logits": (
        "lab17.top_k_gating_edges",
        (
            "    return experts[:, :k], torch.softmax(logits[:, :k], dim=-1)",
            "    e = logits[:, :k].exp()\n    return experts[:, :k], e / e.sum(-1, keepdim=True)",
        ),
        gating.STABLE_HINT,
    ),
    "k never checked": (
        "lab17.top_k_gating_edges",
        ("not 1 <= k <= router_logits.shape[1]", "False"),
        gating.ERRORS_HINT,
    ),
}


@pytest.mark.parametrize("mistake", GATING_MISTAKES)
def test_task5_mistakes_are_named(mistake):
    check_id, replacement, hint = GATING_MISTAKES[mistake]
    message = check_fails(check_id, variant("task5_top_k_gating", replacement)["top_k_gating"])
    assert hint in message, message


# --- the grader's view, and the last cells ----------------------------------------------------------------------


def test_under_the_grader_a_call_of_the_course_handoff_is_a_shortcut(tmp_path, monkeypatch):
    from infra_lib.serving.disaggregated import pack_kv

    record = tmp_path / "answers.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "3")
    check("lab17.pack_kv", variant("task2_pack_kv")["pack_kv"])
    check("lab17.pack_kv", lambda store, table, n: pack_kv(store, table, n))
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [row["kind"] for row in rows] == [None, "reference shortcut"]
    assert "pack_kv" in rows[1]["error"]


@pytest.mark.slow  # two worker processes start and import torch
def test_the_labs_last_cells_race_the_policies_weigh_a_payload_and_split_the_mlp_over_two_processes(tmp_path, capsys):
    """The cells after the last test (grading never runs them), with QUICK: the learner's router beside the course's
    three policies in the simulator, a SmolLM2-shaped payload through the answers, and the answers' MLP split on a
    gloo group of two processes, equal to the unsplit MLP."""
    from conftest import run_cells_after_the_tests

    run_cells_after_the_tests(SOLUTION, tmp_path)
    out = capsys.readouterr().out
    hit_rates = {}
    for name, rate in re.findall(r" (yours|prefix) +([0-9.]+) ", out):
        hit_rates.setdefault(name, []).append(float(rate))
    assert len(hit_rates["yours"]) == 2 and hit_rates["yours"] == hit_rates["prefix"], out  # the same rules, exactly
    assert "1.12 x, the last block whole" in out and "the same bytes in every layer: True" in out, out
    assert "every rank equals the unsplit MLP to float rounding" in out, out
