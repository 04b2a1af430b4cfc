"""Lab 09 task 4, statistically: what the acceptance rule emits over thousands of runs against the target's
exact distributions, and the classic mistakes fitted when it differs."""

from __future__ import annotations

import math
import random

from grading.checks.common import outcome, reference
from grading.checks.lab09.probability_rows import normalised, random_row, towards
from grading.checks.lab09.rule_distributions import MISTAKES, chi_square_p_value, rule_model, shared_draw_lengths
from grading.checks.lab09.task4_acceptance import ACCEPT_HINT, as_step
from grading.checks.lab09.tasks import SPEC, TASKS
from grading.registry import Check, Mismatch, register

_DRAWS = 6000  # steps per case
_FAIL_P = 1e-6  # a correct rule fails a statistic this rarely
_FITS_P = 1e-3  # a mistake's own distribution "fits" the learner's counts above this


def _distribution_case(rng: random.Random, label: str, p: list[list[float]], q: list[list[float]]) -> dict:
    return {"label": label, "p": p, "q": q, "draws": _DRAWS, "seed": rng.randrange(10**6)}


def _distribution_cases(rng: random.Random) -> list[dict]:
    vocab = rng.randint(6, 8)
    close_p = [random_row(rng, vocab) for _ in range(3)]
    far_p = [random_row(rng, vocab, sharp=True) for _ in range(2)]
    far_q = []
    for row in far_p[:1]:  # the draft prefers the tokens the target likes least
        order = sorted(range(vocab), key=lambda i: row[i])
        weights = [0.0] * vocab
        for rank, i in enumerate(order):
            weights[i] = 2.0 ** (-rank)
        far_q.append([round(x, 6) for x in normalised(weights)])
    zero_p = [random_row(rng, vocab, zeros=2) for _ in range(4)]
    cases = [
        _distribution_case(
            rng, "a draft close to the target, gamma=2", close_p, [towards(rng, row, 0.7) for row in close_p[:2]]
        ),
        _distribution_case(rng, "a draft that prefers the target's least likely tokens, gamma=1", far_p, far_q),
        _distribution_case(
            rng,
            "a draft with mass on tokens the target never picks (p = 0), gamma=3",
            zero_p,
            [random_row(rng, vocab) for _ in range(3)],
        ),
    ]
    half_q, half_p = [], []
    for _ in range(2):  # the draft proposes half the tokens, each twice as often as the target: p / q = 1/2
        proposed = set(rng.sample(range(vocab), vocab // 2))
        weights = normalised([rng.uniform(0.5, 1.0) if i in proposed else 0.0 for i in range(vocab)])
        others = normalised([0.0 if i in proposed else rng.uniform(0.5, 1.0) for i in range(vocab)])
        half_q.append([round(w, 6) for w in weights])
        half_p.append([round(w / 2 + o / 2, 6) for w, o in zip(weights, others)])
    half_p.append(random_row(rng, vocab))
    return cases + [
        _distribution_case(
            rng,
            "a draft that proposes half the tokens, each twice as often as the target wants it, gamma=2",
            half_p,
            half_q,
        )
    ]


def _distribution_more_cases(rng: random.Random) -> list[dict]:
    vocab = rng.randint(6, 8)
    soft_p = [random_row(rng, vocab) for _ in range(4)]
    one_hot_q = []
    for _row_p in soft_p[:3]:  # a deterministic draft (prompt lookup) under a sampling target
        token = rng.randrange(vocab)
        one_hot_q.append([1.0 if i == token else 0.0 for i in range(vocab)])
    same_p = [random_row(rng, vocab) for _ in range(3)]
    missing_q = [random_row(rng, vocab, zeros=3) for _ in range(2)]  # the target's tokens the draft never proposes
    sharp_p = [random_row(rng, vocab, sharp=True) for _ in range(5)]
    return [
        _distribution_case(rng, "a one-hot draft (prompt lookup) under a sampling target, gamma=3", soft_p, one_hot_q),
        _distribution_case(
            rng,
            "a draft whose first row equals the target's, gamma=2",
            same_p,
            [list(same_p[0]), towards(rng, same_p[1], 0.5)],
        ),
        _distribution_case(
            rng,
            "a draft that never proposes some of the target's tokens (q = 0), gamma=2",
            [random_row(rng, vocab) for _ in range(3)],
            missing_q,
        ),
        _distribution_case(
            rng,
            "a sharp target and a draft close to it, gamma=4",
            sharp_p,
            [towards(rng, row, 0.85) for row in sharp_p[:4]],
        ),
    ]


def _drive_distribution(rule, cases: list[dict]) -> list[dict]:
    """Per case: how many tokens each step accepted, the distribution of each emitted position, the
    token drawn at a rejection of the first draft token, and any malformed or non-prefix step."""
    import torch

    results = []
    for case in cases:
        p, q = torch.tensor(case["p"]), torch.tensor(case["q"])
        gamma, vocab, n = q.shape[0], p.shape[1], case["draws"]
        draft_gen = torch.Generator().manual_seed(case["seed"])
        drafts = (
            torch.stack(
                [torch.multinomial(q[i], n, replacement=True, generator=draft_gen) for i in range(gamma)], dim=1
            ).tolist()
            if gamma
            else [[] for _ in range(n)]
        )
        generator = torch.Generator().manual_seed(case["seed"] + 1)
        lengths = [0] * (gamma + 1)
        emitted = [[0] * vocab for _ in range(gamma + 1)]
        resampled = [0] * vocab
        record = {
            "lengths": lengths,
            "emitted": emitted,
            "resampled_first": resampled,
            "raised": None,
            "malformed": None,
            "not_prefix": None,
            "steps": 0,
        }
        for draft in drafts:
            item = outcome(rule, p.clone(), q.clone(), list(draft), generator)
            if item[0] == "raised":
                record["raised"] = item[1]
                break
            accepted, token, problem = as_step(item[1], vocab)
            if not problem and len(accepted) == gamma and token is None:
                problem = "returned no next token"
            if problem:
                record["malformed"] = {
                    "draft": draft,
                    "problem": problem,
                    "all_accepted": accepted is not None and accepted == draft,
                }
                break
            if accepted != draft[: len(accepted)]:
                record["not_prefix"] = {"draft": draft, "accepted": accepted, "next": token}
                break
            record["steps"] += 1
            lengths[len(accepted)] += 1
            for position, t in enumerate(accepted + [token]):
                emitted[position][t] += 1
            if not accepted:
                resampled[token] += 1
        results.append(record)
    return results


def _statistics(record: dict, model: dict) -> list[tuple[str, list, object]]:
    """(name, observed counts, expected probabilities) for every statistic of one case."""
    stats = [("lengths", record["lengths"], model["lengths"])]
    gamma = len(model["emitted"]) - 1
    for position in range(gamma + 1):
        stats.append((f"position {position}", record["emitted"][position], model["emitted"][position]))
    if gamma:
        stats.append(("resampled_first", record["resampled_first"], model["resampled_first"]))
    return stats


def _worst(record: dict, model: dict) -> tuple[float, str, list, object]:
    worst = (1.0, "", [], None)
    for name, counts, probs in _statistics(record, model):
        value = chi_square_p_value(counts, probs)
        if value < worst[0]:
            worst = (value, name, counts, probs)
    return worst


def _fmt_row(values) -> str:
    return " ".join(f"{float(v):5.3f}" for v in values)


def _table(counts: list, probs, rows: dict) -> str:
    total = sum(counts)
    lines = ["    token:        " + " ".join(f"{i:5d}" for i in range(len(counts)))]
    lines += [f"    {name:13s} " + _fmt_row(values) for name, values in rows.items()]
    lines.append(f"    {'yours':13s} " + _fmt_row([c / total for c in counts]) + f"   ({total} draws)")
    return "\n".join(lines)


def _statistic_text(name: str, gamma: int) -> str:
    if name == "lengths":
        return "the number of draft tokens accepted per step"
    if name == "resampled_first":
        return "the token drawn when the first draft token is rejected"
    position = int(name.split()[1])
    if position == gamma:
        return "the bonus token (drawn after every draft token was accepted)"
    return "the first token of a step" if position == 0 else f"token {position + 1} of a step"


def _describe_distribution(case: dict) -> str:
    return f"{case['label']}, vocabulary of {len(case['p'][0])} tokens, {case['draws']} steps"


def _distribution_problem(case: dict, record: dict) -> Mismatch | None:
    import torch

    where = _describe_distribution(case)
    p, q = torch.tensor(case["p"], dtype=torch.float64), torch.tensor(case["q"], dtype=torch.float64)
    gamma = q.shape[0]
    if type(record) is not dict or "lengths" not in record:
        return Mismatch("the check recorded a malformed result", f"on {where}: {record!r:.80}")
    if record["raised"]:
        return Mismatch(
            f"accept_or_resample raised {str(record['raised']).split(':')[0]}",
            f"on {where}: your code raised {record['raised']}",
        )
    if record["malformed"]:
        bad = record["malformed"]
        if bad["all_accepted"] and "next" in bad["problem"]:
            return Mismatch(
                "when every draft token is accepted, still return a next token: the bonus token, drawn from p[gamma]",
                f"on {where}: with draft {bad['draft']} your function {bad['problem']}",
            )
        return Mismatch(
            "accept_or_resample must return (accepted, next_token): a list of accepted draft token ids "
            "and one token id",
            f"on {where}: with draft {bad['draft']} your function {bad['problem']}",
        )
    if record["not_prefix"]:
        bad = record["not_prefix"]
        return Mismatch(
            "your accepted tokens are not the draft's first tokens: stop at the first rejection (the "
            "draft tokens after it were guessed after a token that is not in the output)",
            f"on {where}: draft {bad['draft']}, your accepted {bad['accepted']}, next {bad['next']}",
        )
    model = rule_model(p, q)
    value, name, counts, probs = _worst(record, model)
    if value >= _FAIL_P:
        return None
    fitting = []
    for change, message in MISTAKES:
        mistake = rule_model(p, q, **change)
        if all(
            float(torch.as_tensor(a).sub(torch.as_tensor(b)).abs().max()) < 1e-12
            for (_, _, a), (_, _, b) in zip(_statistics(record, model), _statistics(record, mistake))
        ):
            continue  # this mistake changes nothing on this case
        if _worst(record, mistake)[0] > _FITS_P:
            fitting.append(message)
    if fitting:
        named = (
            fitting[0]
            if len(fitting) == 1
            else (
                "on this case it fits more than one known mistake: "
                + "; or ".join(f"({i}) {message}" for i, message in enumerate(fitting, start=1))
            )
        )
        return Mismatch(
            f"what your rule emits is not distributed as the target's p: {named}",
            f"on {where}: {_statistic_text(name, gamma)} (chi-square p-value {value:.2g})\n"
            + _detail_table(name, counts, probs, p, q),
        )
    if (
        gamma > 1
        and chi_square_p_value(record["lengths"], model["lengths"]) < _FAIL_P
        and chi_square_p_value(record["lengths"], shared_draw_lengths(p, q)) > _FITS_P
    ):
        return Mismatch(
            "what your rule emits is not distributed as the target's p: one uniform draw decided every "
            "draft token of a step; each judged token needs a uniform draw of its own, independent of the "
            "others, or the acceptances of one step stop being independent",
            f"on {where}: the number of draft tokens accepted per step fits a draw shared by the step "
            f"(chi-square p-value {chi_square_p_value(record['lengths'], model['lengths']):.2g} against "
            "independent draws)\n" + _detail_table("lengths", record["lengths"], model["lengths"], p, q),
        )
    steps = record["steps"]
    if name == "lengths" and record["lengths"][gamma] == 0 and float(model["lengths"][gamma]) * steps > 30:
        return Mismatch(
            "no step accepted all its draft tokens: when every draft token is accepted, return them all "
            "as accepted and draw one more, the bonus token, from p[gamma]",
            f"on {where}: expected about {float(model['lengths'][gamma]) * steps:.0f} of {steps} steps "
            f"to accept all {gamma}\n" + _detail_table(name, counts, probs, p, q),
        )
    if name == "lengths":
        mean = sum(k * c for k, c in enumerate(counts)) / max(steps, 1)
        want = float(sum(k * x for k, x in enumerate(model["lengths"])))
        more = "too many" if mean > want else "too few"
        return Mismatch(
            f"your rule accepts {more} draft tokens: keep draft token x with probability min(1, p(x) / q(x))",
            f"on {where}: {mean:.3f} accepted per step, expected {want:.3f} (sum over positions of the "
            f"chance that all tokens up to it are kept, each kept with probability sum_x min(p, q))\n"
            + _detail_table(name, counts, probs, p, q),
        )
    zero = [i for i, c in enumerate(counts) if c and float(probs[i]) <= 1e-12]
    if zero:
        if name == "resampled_first":
            why = (
                "the replacement is drawn from max(0, p - q), normalised, which is 0 wherever q >= p: a token the "
                "draft already proposes at least as often as the target wants can never be the replacement"
            )
        elif name == f"position {gamma}":
            why = f"the bonus token is drawn from p[{gamma}], the target's row after the last draft token"
        else:
            why = (
                "a draft token with p(x) = 0 must always be rejected, and the replacement from max(0, p - q) "
                "never picks it either"
            )
        return Mismatch(
            f"{_statistic_text(name, gamma)} came out as a token it can never be",
            f"on {where}: token {zero[0]} has probability 0 there, yet your rule emitted it "
            f"{counts[zero[0]]} times; {why}\n" + _detail_table(name, counts, probs, p, q),
        )
    return Mismatch(
        f"{_statistic_text(name, gamma)} is not distributed as it should be",
        f"on {where}: chi-square p-value {value:.2g} (a correct rule stays above {_FAIL_P:g})\n"
        + _detail_table(name, counts, probs, p, q),
    )


def _detail_table(name: str, counts: list, probs, p, q) -> str:
    total = max(sum(counts), 1)
    probs = probs.tolist()
    noise = sum(math.sqrt(x * (1 - x) / total) for x in probs) * math.sqrt(2 / math.pi) / 2
    distance = sum(abs(c / total - x) for c, x in zip(counts, probs)) / 2
    head = f"  total variation distance {distance:.3f} (sampling noise at {total} draws: about {noise:.3f})\n"
    if name == "lengths":
        return head + _table(counts, probs, {"expected": probs}).replace("token:", "accepted:")
    rows = {}
    if name == "resampled_first":
        rows = {"p[0]": p[0].tolist(), "q[0]": q[0].tolist(), "max(0,p-q) n.": probs}
    else:
        position = int(name.split()[1])
        rows = {f"p[{position}]": probs}
        if position < q.shape[0]:
            rows[f"q[{position}]"] = q[position].tolist()
    return head + _table(counts, probs, rows)


def _compare_distribution(got, expected, cases):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        if g == e:  # the same random draws as the reference: the same output
            continue
        problem = _distribution_problem(case, g)
        if problem:
            return problem
    return None


_DISTRIBUTION_HINT = (
    ACCEPT_HINT + " This check runs your rule thousands of times, and each emitted position must "
    "follow the target's distribution there: resampling a rejection from p itself gives the draft's "
    "favourite tokens a second chance, and keeping or rejecting without a random draw skews how "
    "many draft tokens are kept."
)


register(
    Check(
        check_id="lab09.accept_distribution",
        task=TASKS[4],
        reference=reference(SPEC, "accept_or_resample"),
        make_inputs=_distribution_cases,
        drive=_drive_distribution,
        compare=_compare_distribution,
        hint=_DISTRIBUTION_HINT,
    )
)


register(
    Check(
        check_id="lab09.accept_distribution_more",
        task=TASKS[4],
        reference=reference(SPEC, "accept_or_resample"),
        make_inputs=_distribution_more_cases,
        drive=_drive_distribution,
        compare=_compare_distribution,
        hint=_DISTRIBUTION_HINT + " One-hot drafts under a sampling target, a draft row equal to the "
        "target's, tokens the draft never proposes, gamma = 4.",
    )
)
