"""Lab 17 task 1, the rules: the learner's ``PrefixRouter`` and the course's ``PrefixAwarePolicy`` driven through
the same scripts of ``observe`` / ``choose`` / ``forget`` calls, every choice compared.

A script is plain data: the router's options and a list of calls, with hashes as short labels (sent as
``bytes``). ``["choose", hashes, loads]`` records what ``choose`` returned or raised and whether it changed its
arguments; ``["route", hashes, loads]`` does the same, then ``observe``s the request on the replica chosen,
as the router does. On the first difference the comparison replays the script with its own small model of
the contract (what each replica was sent, the load bound, the cursor) to describe the situation and name
the rule the choice broke.
"""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.lab17.tasks import ROUTING_SECTION, TASKS
from grading.registry import Check, Mismatch, register

ROUTER_REFERENCE = reference("infra_lib.serving.router", "PrefixAwarePolicy")
DEFAULTS = {"slack": 0.5, "max_outstanding": None, "max_hashes": 65536}

HINTS = {
    "longest": "a replica's match is the number of the request's LEADING hashes it was sent, counted from the first "
    "and stopping at the first one it was not sent (hashes are chained: a later one stands for the whole prefix "
    "before it); among the replicas within the load bound the longest match wins",
    "bound": "a replica is within the load bound when its load is at most (1 + slack) times the mean load of the "
    f"replicas in rotation (those whose load is not None), and below max_outstanding when one is set; only "
    f"replicas within the bound compete on their match, however long the match of one over it ({ROUTING_SECTION})",
    "all_over": "when every replica in rotation is over the bound (all at max_outstanding), the cache gives way to "
    "the load: the least loaded of all of them serves, ties in turn",
    "least_loaded": "on equal matches (no match anywhere included), the least loaded replica wins",
    "tie": "equal match and equal load go in turn: to the first tied replica at or after the cursor, in index order "
    "wrapping round, where the cursor is the replica after the one this router chose last (a new router starts at "
    "replica 0; observe and forget do not move it)",
    "rotation": "a replica whose load is None is out of rotation: it is never chosen, and the mean load of the bound "
    "is taken over the others only; when every load is None, choose raises NoReplicaAvailable",
    "forget": "forget(replica) drops everything the router remembers of that replica: once it comes back, it "
    "matches nothing it was sent before",
    "memory": "the router remembers at most max_hashes distinct hashes: past that, the hash sent least recently is "
    "forgotten first (observing a hash again makes it the most recent; choose does not)",
    "arguments": "choose must not modify its arguments: the router keeps using both lists after the call",
    "errors": "the constructor refuses a negative slack, a max_outstanding below 1 and a max_hashes below 1 with "
    "ValueError; observe and forget accept any replica index, and forget of a replica never observed does nothing",
}


# --- driving a router -------------------------------------------------------------------------------


def _hashes(labels: list[str]) -> list[bytes]:
    return [label.encode() for label in labels]


def _call(fn, *args) -> list:
    """["value", an int], ["returned", what it was], or ["raised", type name, is NoReplicaAvailable]."""
    from infra_lib.serving.router import NoReplicaAvailable

    try:
        value = fn(*args)
    except (NotImplementedError, MemoryError):
        raise
    except Exception as exc:  # the learner's code may raise anything
        return ["raised", type(exc).__name__, isinstance(exc, NoReplicaAvailable)]
    if type(value) is int:
        return ["value", value]
    return ["returned", f"a {type(value).__name__} ({value!r:.40})"]


def _status(fn, *args) -> str:
    """ "ok", or "raised" and the error's type (what a call that returns nothing did)."""
    result = _call(fn, *args)
    return f"raised {result[1]}" if result[0] == "raised" else "ok"


def _make(router_class, options: dict) -> tuple[object, list]:
    """(the router, ["made"]) or (None, ["raised", type name, is NoReplicaAvailable])."""
    from infra_lib.serving.router import NoReplicaAvailable

    try:
        return router_class(**options), ["made"]
    except (NotImplementedError, MemoryError):
        raise
    except Exception as exc:  # the learner's code may raise anything
        return None, ["raised", type(exc).__name__, isinstance(exc, NoReplicaAvailable)]


def _play(router, op: list) -> dict:
    """One call of a script on ``router``: what choose returned (and whether it changed its arguments), or whether
    observe or forget raised."""
    kind = op[0]
    if kind == "observe":
        return {"observe": _status(router.observe, _hashes(op[1]), op[2])}
    if kind == "forget":
        return {"forget": _status(router.forget, op[1])}
    hashes, loads = _hashes(op[1]), list(op[2])
    kept = (list(hashes), list(loads))
    step = {"result": _call(router.choose, hashes, loads)}
    step["modified"] = (hashes, loads) != kept
    chosen = step["result"]
    if kind == "route" and chosen[0] == "value" and 0 <= chosen[1] < len(loads):  # the router observes its choice
        step["observe"] = _status(router.observe, _hashes(op[1]), chosen[1])
    return step


def drive_scripts(router_class, scripts: list[dict]) -> list[dict]:
    """Each script on a new router: how it was made, then what each call did (``_play``)."""
    if not callable(router_class):
        raise TypeError(f"check(...) needs your PrefixRouter class, got a {type(router_class).__name__}")
    results = []
    for script in scripts:
        router, made = _make(router_class, {**DEFAULTS, **script["options"]})
        steps = [] if router is None else [_play(router, op) for op in script["ops"]]
        results.append({"made": made, "steps": steps})
    return results


# --- the comparison's own model of the contract, to describe a situation -------------------------------


def _replayed(script: dict, step: int, choices: dict[int, int], forgets: bool = True, bounded: bool = True):
    """The course's router after the script's calls before ``step``, each route observed on the replica the course
    chose (``choices``: call -> replica); without its forgets, or with a memory that never fills, on request."""
    from infra_lib.serving.router import PrefixAwarePolicy

    options = {**DEFAULTS, **script["options"]}
    router = PrefixAwarePolicy(**{**options, "max_hashes": options["max_hashes"] if bounded else 10**9})
    for index, op in enumerate(script["ops"][:step]):
        if op[0] == "observe":
            router.observe(_hashes(op[1]), op[2])
        elif op[0] == "forget" and forgets:
            router.forget(op[1])
        elif op[0] == "route" and index in choices:
            router.observe(_hashes(op[1]), choices[index])
    return router


def situation(script: dict, step: int, choices: dict[int, int]) -> dict:
    """The state before call ``step`` of ``script``: the loads, the replicas within the bound, the cursor, and each
    replica's match as the contract remembers it (and as a router that never forgot, or never evicted, would)."""
    op = script["ops"][step]
    labels, loads = op[1], op[2]
    routers = {
        "contract": _replayed(script, step, choices),
        "no_forget": _replayed(script, step, choices, forgets=False),
        "unbounded": _replayed(script, step, choices, bounded=False),
    }
    live = [i for i, load in enumerate(loads) if load is not None]
    cursor = 0
    for index, earlier in enumerate(script["ops"][:step]):
        if earlier[0] in ("choose", "route") and index in choices:
            cursor = (choices[index] + 1) % len(earlier[2])
    return {
        "labels": labels,
        "loads": loads,
        "mean": sum(loads[i] for i in live) / len(live) if live else 0.0,
        "within": routers["contract"].within_bound(loads) if live else [],
        "cursor": cursor,
        "matches": {
            name: [router.match_length(_hashes(labels), i) for i in range(len(loads))]
            for name, router in routers.items()
        },
        "options": {**DEFAULTS, **script["options"]},
    }


def describe(script: dict, step: int, state: dict) -> str:
    options = state["options"]
    shown = [
        f"replica {i}: load {load}" + ("" if load is None else f", match {state['matches']['contract'][i]}")
        for i, load in enumerate(state["loads"])
    ]
    bound = (1 + options["slack"]) * state["mean"]
    cap = "" if options["max_outstanding"] is None else f", max_outstanding {options['max_outstanding']}"
    return (
        f"script '{script['name']}' (slack {options['slack']}{cap}, max_hashes {options['max_hashes']}), call "
        f"{step + 1} of {len(script['ops'])}: choose({state['labels']}, {state['loads']}); "
        + "; ".join(shown)
        + f"; the bound (1 + slack) x mean = {bound:g}, replicas within it {state['within']}; the cursor at "
        f"replica {state['cursor']}"
    )


def rule_broken(state: dict, got: list, expected: list) -> str:
    """Which rule a choice that differs from the reference's broke (the key of its hint)."""
    loads, within, matches = state["loads"], state["within"], state["matches"]
    if expected[0] == "raised" or got[0] != "value" or not 0 <= got[1] < len(loads) or loads[got[1]] is None:
        return "rotation"
    chosen, wanted = got[1], expected[1]
    if matches["no_forget"][chosen] > matches["contract"][chosen]:
        return "forget"
    if matches["unbounded"][chosen] > matches["contract"][chosen]:
        return "memory"
    if not within:
        return "all_over"
    if chosen not in within:
        return "bound"
    if matches["contract"][chosen] != matches["contract"][wanted]:
        return "longest"
    return "tie" if loads[chosen] == loads[wanted] else "least_loaded"


def _shown(result: list) -> str:
    if result[0] == "value":
        return f"replica {result[1]}"
    if result[0] == "raised":
        return f"raised {result[1]}"
    return f"returned {result[1]}"


def compare_scripts(got, expected, scripts: list[dict]) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch("the check recorded the wrong number of scripts")
    for script, mine, theirs in zip(scripts, got, expected):
        if mine["made"] != theirs["made"]:
            options = {**DEFAULTS, **script["options"]}
            want = "a router" if theirs["made"] == ["made"] else f"{theirs['made'][1]}"
            have = "a router" if mine["made"] == ["made"] else _shown(mine["made"])
            return Mismatch(
                "PrefixRouter(...) did not accept or refuse its options as the contract says",
                f"on PrefixRouter(**{options}): expected {want}, got {have}",
                hint=HINTS["errors"],
            )
        choices = {i: s["result"][1] for i, s in enumerate(theirs["steps"]) if s.get("result", [""])[0] == "value"}
        for step, (op, mine_step, their_step) in enumerate(zip(script["ops"], mine["steps"], theirs["steps"])):
            mismatch = _step_mismatch(script, step, op, mine_step, their_step, choices)
            if mismatch is not None:
                return mismatch
    return None


def _step_mismatch(script, step, op, mine: dict, theirs: dict, choices) -> Mismatch | None:
    if op[0] in ("observe", "forget"):
        if mine != theirs:
            return Mismatch(
                f"PrefixRouter.{op[0]} raised an error",
                f"on script '{script['name']}', call {step + 1}: {op[0]}{tuple(op[1:])}",
                hint=HINTS["errors"],
            )
        return None
    state = situation(script, step, choices)
    where = describe(script, step, state)
    if mine["result"] != theirs["result"]:
        rule = rule_broken(state, mine["result"], theirs["result"])
        return Mismatch(
            f"PrefixRouter.choose returned another replica than the contract's ({rule.replace('_', ' ')} rule)",
            f"on {where}: expected {_shown(theirs['result'])}, got {_shown(mine['result'])}",
            hint=HINTS[rule],
        )
    if mine["modified"]:
        return Mismatch("PrefixRouter.choose modified its arguments", f"on {where}", hint=HINTS["arguments"])
    if mine.get("observe") != theirs.get("observe"):
        return Mismatch("PrefixRouter.observe raised an error", f"after {where}", hint=HINTS["errors"])
    return None


# --- the scripts -------------------------------------------------------------------------------------


def _chain(name: str, n: int) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


def rule_scripts(rng: random.Random) -> list[dict]:
    """One script per rule of the contract, its labels and loads moved by the seed."""
    a = rng.choice("abc")
    busy = rng.randint(4, 6)  # over the bound of [1, busy, 1, 2 + ...]
    scripts = [
        {
            "name": "the longest leading match wins",
            "options": {},
            "ops": [
                ["observe", _chain(a, 3), 1],
                ["observe", _chain(a, 1), 2],
                ["observe", _chain(a, 2), 3],
                ["choose", _chain(a, 4), [0, 0, 0, 0]],
                ["observe", _chain(a, 5)[1:], 0],
                ["choose", _chain(a, 5), [0, 0, 0, 0]],
            ],
        },
        {
            "name": "a match stops at the first hash not sent",
            "options": {},
            "ops": [
                ["observe", ["x1", "x2", "x3"], 0],
                ["observe", ["x0"], 2],
                ["choose", _chain("x", 4), [0, 0, 0, 0]],
            ],
        },
        {
            "name": "the load bound",
            "options": {},
            "ops": [
                ["observe", _chain("c", 4), 1],
                ["choose", _chain("c", 5), [1, busy, 1, 2]],
                ["choose", _chain("c", 5), [2, 3, 2, 1]],
                ["choose", _chain("c", 5), [0, 1, 0, None]],
                ["choose", _chain("c", 5), [3, 3, 3, 3]],
            ],
        },
        {
            "name": "no match anywhere",
            "options": {},
            "ops": [
                ["observe", _chain("d", 2), 0],
                ["choose", _chain("e", 2), [0, 2, 1, 3]],
                ["choose", [], [3, 1, 2, 1]],
                ["choose", [], [3, 1, 2, 1]],
            ],
        },
        {
            "name": "ties go in turn",
            "options": {},
            "ops": [
                ["route", ["f0"], [0, 0, 0, 0]],
                ["route", ["g0"], [0, 0, 0, 0]],
                ["choose", ["h0"], [0, 0, 0, 0]],
                ["choose", ["h0"], [1, 0, 0, 0]],
                ["choose", ["h0"], [0, 0, 0, 0]],
                ["observe", _chain("k", 2), 1],
                ["observe", _chain("k", 2), 3],
                ["choose", _chain("k", 3), [0, 0, 0, 0]],
                ["choose", _chain("k", 3), [0, 0, 0, 0]],
                ["choose", _chain("k", 3), [0, 0, 0, 0]],
            ],
        },
        {
            "name": "replicas out of rotation",
            "options": {},
            "ops": [
                ["observe", _chain("m", 3), 2],
                ["choose", _chain("m", 4), [0, 1, None, 1]],
                ["choose", _chain("m", 1), [None, None, None, 3]],
                ["choose", _chain("m", 1), [None, None, None, None]],
                ["choose", _chain("m", 4), [2, None, 0, 4]],
            ],
        },
        {
            "name": "forget",
            "options": {},
            "ops": [
                ["observe", _chain("n", 3), 1],
                ["observe", _chain("n", 1), 3],
                ["forget", 1],
                ["forget", 2],
                ["choose", _chain("n", 4), [0, 1, 1, 1]],
            ],
        },
        {
            "name": "bounded memory, least recently sent forgotten first",
            "options": {"max_hashes": 4},
            "ops": [
                ["observe", ["r0"], 3],
                ["observe", _chain("p", 3), 0],
                ["observe", ["r0"], 3],
                ["observe", _chain("q", 2), 1],
                ["choose", ["r0", "s1"], [0, 0, 0, 0]],
                ["choose", ["z0"], [0, 0, 0, 0]],
                ["choose", _chain("p", 4), [0, 0, 0, 0]],
            ],
        },
        {
            "name": "max_outstanding",
            "options": {"max_outstanding": 3},
            "ops": [
                ["observe", _chain("t", 2), 1],
                ["choose", _chain("t", 3), [2, 3, 3, 2]],
                ["choose", _chain("t", 3), [3, 3, 4, 3]],
                ["choose", _chain("t", 3), [3, 3, 4, 3]],
            ],
        },
    ]
    return scripts


def _exact_bound(loads: list, slack: float) -> bool:
    """Whether float rounding cannot decide "load <= (1 + slack) x mean" either way: no load sits on a bound that
    is a whole number unless the mean is exact (the checks never ask what rounding would decide)."""
    from fractions import Fraction

    live = [load for load in loads if load is not None]
    bound = (1 + Fraction(slack)) * Fraction(sum(live), len(live))
    return bound not in live or sum(live) % len(live) == 0


def random_scripts(rng: random.Random, count: int = 6, calls: int = 24) -> list[dict]:
    """Random routing on 2 to 5 replicas: requests from a few conversations whose prefixes share their first
    blocks, loads with replicas out of rotation now and then, forgets, and small memories."""
    scripts = []
    for index in range(count):
        n = rng.randint(2, 5)
        slack = rng.choice([0.0, 0.25, 0.5, 1.0])
        options = {"slack": slack, "max_hashes": rng.choice([65536, 65536, 6, 10])}
        if rng.random() < 0.3:
            options["max_outstanding"] = rng.randint(2, 4)
        ops = []
        for _ in range(calls):
            family = rng.randrange(3)
            length = rng.randint(0, 6)
            labels = [f"{family}.{i}" for i in range(length)]
            if length > 2 and rng.random() < 0.3:
                labels[rng.randint(1, length - 1) :] = [f"{family}.{rng.randrange(99)}x{i}" for i in range(2)]
            while True:
                loads = [None if rng.random() < 0.12 else rng.randint(0, 5) for _ in range(n)]
                if any(load is not None for load in loads) and _exact_bound(loads, slack):
                    break
            roll = rng.random()
            if roll < 0.1:
                ops.append(["forget", rng.randrange(n)])
            elif roll < 0.25:
                ops.append(["observe", labels, rng.randrange(n)])
            else:
                ops.append(["route", labels, loads])
        scripts.append({"name": f"random routing {index + 1}", "options": options, "ops": ops})
    return scripts


def edge_scripts(rng: random.Random) -> list[dict]:
    """Options refused, no replica at all, one replica, every replica out of rotation."""
    return [
        {"name": "a negative slack", "options": {"slack": -0.5}, "ops": []},
        {"name": "max_outstanding 0", "options": {"max_outstanding": 0}, "ops": []},
        {"name": "max_hashes 0", "options": {"max_hashes": 0}, "ops": []},
        {
            "name": "slack 0 and a cap",
            "options": {"slack": 0.0, "max_outstanding": rng.randint(2, 3)},
            "ops": [
                ["forget", 0],
                ["observe", ["u0"], 0],
                ["choose", ["u0", "u1"], [1, 1]],
                ["choose", ["u0"], [4, 2]],
                ["choose", ["u0"], [5, 5]],
                ["choose", [], []],
                ["choose", ["u0"], [None]],
                ["choose", ["u0"], [7]],
            ],
        },
        {
            "name": "one replica",
            "options": {},
            "ops": [
                ["route", _chain("w", 3), [0]],
                ["route", _chain("w", 3), [9]],
                ["forget", 0],
                ["choose", _chain("w", 3), [2]],
            ],
        },
    ]


def _parts(make) -> dict:
    return dict(
        task=TASKS[1],
        reference=ROUTER_REFERENCE,
        make_inputs=make,
        drive=drive_scripts,
        compare=compare_scripts,
    )


register(
    Check(
        check_id="lab17.router_rules",
        **_parts(rule_scripts),
        hint="the choice follows the contract's rules in order: replicas out of rotation never compete; of the rest, "
        "those within the load bound compete on the length of their leading match, then on their load, then in "
        f"turn from the cursor ({ROUTING_SECTION}).",
    )
)

register(
    Check(
        check_id="lab17.router_random",
        **_parts(random_scripts),
        hint="if the scripted rules pass, look at what they leave out: slack 0, a small max_hashes, replicas coming "
        "back after a forget, and requests whose prefix parts from another conversation's after a few blocks.",
    )
)

register(
    Check(
        check_id="lab17.router_edges",
        **_parts(edge_scripts),
        hint=HINTS["errors"] + "; a list of loads with one replica, or none at all, follows the same rules",
    )
)
