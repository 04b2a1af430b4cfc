"""Lab 17 task 1, at scale: the learner's ``PrefixRouter`` and the course's ``PrefixAwarePolicy`` each route a
seeded chat workload onto simulated replicas (``infra_lib.ops.router_sim``), and the runs are compared on
what a prefix-aware router is for: the prefix-cache hit rate, and the balance of the requests over the
replicas. Exact choices are the rules checks' business; here a router passes when its hit rate is within
``HIT_MARGIN`` of the course's and no replica serves more than ``(1 + slack) / N + SHARE_MARGIN`` of the
requests (N the replicas that stay alive)."""

from __future__ import annotations

import random

from grading.checks.lab17.task1_router_rules import ROUTER_REFERENCE
from grading.checks.lab17.tasks import ROUTING_SECTION, TASKS
from grading.registry import Check, Mismatch, ReferenceFailed, register

HIT_MARGIN = 0.05  # the learner's hit rate may be this much below the course's
SHARE_MARGIN = 0.05  # above (1 + slack) / N: the most of the requests one replica may serve

HIT_HINT = (
    "the point of the prefix policy is to send a request where its prefix is already cached: the replica that was "
    "sent the longest run of the request's leading hashes, within the load bound. A hit rate near a least-loaded "
    "router's means the match is not deciding: check that observe remembers every hash of the request for the "
    f"replica chosen, and that choose compares the replicas' leading matches ({ROUTING_SECTION})"
)
SHARE_HINT = (
    "a hot prefix (one system prompt that every request starts with) matches the replica that served it first, "
    "and without the load bound every request goes there: a replica whose load exceeds (1 + slack) times the mean "
    "load of the replicas in rotation must not be chosen for its cache"
)
INVALID_HINT = (
    "a replica whose load is None has left the rotation (its process died): choose never returns it, and returns "
    "the index (an int) of a replica whose load is a number"
)


def _case(rng: random.Random, *, num_system_prompts: int, failures: bool) -> dict:
    n_replicas = rng.choice([3, 4]) if not failures else 4
    return {
        "workload": {
            "num_conversations": 36,
            "turns": 4,
            "seed": rng.randrange(10**6),
            "num_system_prompts": num_system_prompts,
        },
        "n_replicas": n_replicas,
        "slack": 0.5,
        "sim": {
            "concurrency": 3 * n_replicas,
            "cache_blocks": 256,
            "seed": rng.randrange(10**6),
            "failures": {str(rng.randrange(n_replicas)): float(rng.randint(1200, 2400))} if failures else {},
        },
    }


def shared_prefix_case(rng: random.Random) -> dict:
    return _case(rng, num_system_prompts=3, failures=False)


def hot_prefix_case(rng: random.Random) -> dict:
    return _case(rng, num_system_prompts=1, failures=False)


def replica_dies_case(rng: random.Random) -> dict:
    return _case(rng, num_system_prompts=rng.choice([1, 2]), failures=True)


def drive_workload(router_class, case: dict) -> dict:
    """One simulated run of the case's workload through a new router: the hit rates, the requests per replica and
    the peak loads; or the choice the simulation refused."""
    from infra_lib.ops.router_sim import InvalidChoice, simulate_routing, token_chat_workload

    if not callable(router_class):
        raise TypeError(f"check(...) needs your PrefixRouter class, got a {type(router_class).__name__}")
    conversations = token_chat_workload(**case["workload"])
    sim = {**case["sim"], "failures": {int(r): at for r, at in case["sim"]["failures"].items()}}
    try:
        run = simulate_routing(router_class(slack=case["slack"]), conversations, case["n_replicas"], **sim)
    except InvalidChoice as exc:
        return {"invalid": str(exc)[:400]}
    return {
        "invalid": None,
        "hit_rate": run.hit_rate,
        "ideal_hit_rate": run.ideal_hit_rate,
        "requests_per_replica": list(run.requests_per_replica),
        "max_share": run.max_share,
        "peak_loads": list(run.peak_loads),
    }


def describe_case(case: dict) -> str:
    workload, sim = case["workload"], case["sim"]
    prompts = (
        "one system prompt shared by every request"
        if workload["num_system_prompts"] == 1
        else (f"{workload['num_system_prompts']} system prompts")
    )
    dies = "".join(f", replica {r} dies at time {at:g}" for r, at in sim["failures"].items())
    return (
        f"{workload['num_conversations']} conversations of {workload['turns']} turns over {prompts} (workload seed "
        f"{workload['seed']}), {case['n_replicas']} replicas with {sim['cache_blocks']} cached blocks each, "
        f"{sim['concurrency']} users, slack {case['slack']}{dies}"
    )


def share_bound(case: dict) -> float:
    alive = case["n_replicas"] - len(case["sim"]["failures"])
    return (1 + case["slack"]) / alive + SHARE_MARGIN


def compare_workload(got: dict, expected: dict, case: dict) -> Mismatch | None:
    where = describe_case(case)
    if expected["invalid"]:
        raise ReferenceFailed(f"the course's router made an invalid choice: {expected['invalid']}")
    if got["invalid"]:
        return Mismatch(
            "your router chose a replica out of rotation", f"on {where}: {got['invalid']}", hint=INVALID_HINT
        )
    if got["hit_rate"] < expected["hit_rate"] - HIT_MARGIN:
        return Mismatch(
            f"your router's prefix-cache hit rate is more than {HIT_MARGIN:g} below the course's",
            f"on {where}: your hit rate {got['hit_rate']:.3f}, the course's {expected['hit_rate']:.3f} (one cache "
            f"holding everything: {expected['ideal_hit_rate']:.3f}); requests per replica: yours "
            f"{got['requests_per_replica']}, the course's {expected['requests_per_replica']}",
            hint=HIT_HINT,
        )
    if got["max_share"] > share_bound(case):
        return Mismatch(
            f"one replica served more than (1 + slack) / N + {SHARE_MARGIN:g} of the requests",
            f"on {where}: requests per replica {got['requests_per_replica']} (largest share {got['max_share']:.3f}, "
            f"the bound {share_bound(case):.3f}; the course's {expected['requests_per_replica']}); peak loads "
            f"{got['peak_loads']}",
            hint=SHARE_HINT,
        )
    return None


def _parts(make) -> dict:
    return dict(
        task=TASKS[1], reference=ROUTER_REFERENCE, make_inputs=make, drive=drive_workload, compare=compare_workload
    )


register(
    Check(
        check_id="lab17.router_shared_prefix",
        **_parts(shared_prefix_case),
        hint=HIT_HINT,
    )
)

register(
    Check(
        check_id="lab17.router_hot_prefix",
        **_parts(hot_prefix_case),
        hint=SHARE_HINT,
    )
)

register(
    Check(
        check_id="lab17.router_replica_dies",
        **_parts(replica_dies_case),
        hint=INVALID_HINT + "; forget(replica) is called when it dies, and its requests are sent again",
    )
)
