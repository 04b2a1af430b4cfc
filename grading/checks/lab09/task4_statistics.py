"""Lab 09 task 4, statistically: what the acceptance rule emits over thousands of runs against the target's
exact distributions, the classic mistakes fitted when it differs, and its use of the generator it is given."""

from __future__ import annotations

import math
import random

from grading.checks.common import outcome, reference
from grading.checks.lab09.task4_acceptance import ACCEPT_HINT, as_step
from grading.checks.lab09.tasks import SPEC, TASKS
from grading.registry import Check, Mismatch, register

# the distribution of what the rule emits

_DRAWS = 6000


_FAIL_P = 1e-6  # a correct rule fails a statistic this rarely


_FITS_P = 1e-3  # a mistake's own distribution "fits" the learner's counts above this


def _normalised(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def _row(rng: random.Random, vocab: int, zeros: int = 0, sharp: bool = False) -> list[float]:
    weights = [rng.uniform(0.2, 1.0) for _ in range(vocab)]
    if sharp:
        weights[rng.randrange(vocab)] += 6.0
    for i in rng.sample(range(vocab), zeros):
        weights[i] = 0.0
    return [round(x, 6) for x in _normalised(weights)]


def _towards(rng: random.Random, p: list[float], closeness: float) -> list[float]:
    """A draft row: a mix of ``p`` and a random row (``closeness`` 1 gives ``p`` itself)."""
    noise = _row(rng, len(p))
    return [round(x, 6) for x in _normalised([closeness * a + (1 - closeness) * b for a, b in zip(p, noise)])]


def _distribution_case(rng: random.Random, label: str, p: list[list[float]], q: list[list[float]]) -> dict:
    return {"label": label, "p": p, "q": q, "draws": _DRAWS, "seed": rng.randrange(10**6)}


def _distribution_cases(rng: random.Random) -> list[dict]:
    vocab = rng.randint(6, 8)
    close_p = [_row(rng, vocab) for _ in range(3)]
    far_p = [_row(rng, vocab, sharp=True) for _ in range(2)]
    far_q = []
    for row in far_p[:1]:  # the draft prefers the tokens the target likes least
        order = sorted(range(vocab), key=lambda i: row[i])
        weights = [0.0] * vocab
        for rank, i in enumerate(order):
            weights[i] = 2.0 ** (-rank)
        far_q.append([round(x, 6) for x in _normalised(weights)])
    zero_p = [_row(rng, vocab, zeros=2) for _ in range(4)]
    cases = [
        _distribution_case(
            rng, "a draft close to the target, gamma=2", close_p, [_towards(rng, row, 0.7) for row in close_p[:2]]
        ),
        _distribution_case(rng, "a draft that prefers the target's least likely tokens, gamma=1", far_p, far_q),
        _distribution_case(
            rng,
            "a draft with mass on tokens the target never picks (p = 0), gamma=3",
            zero_p,
            [_row(rng, vocab) for _ in range(3)],
        ),
    ]
    half_q, half_p = [], []
    for _ in range(2):  # the draft proposes half the tokens, each twice as often as the target: p / q = 1/2
        proposed = set(rng.sample(range(vocab), vocab // 2))
        weights = _normalised([rng.uniform(0.5, 1.0) if i in proposed else 0.0 for i in range(vocab)])
        others = _normalised([0.0 if i in proposed else rng.uniform(0.5, 1.0) for i in range(vocab)])
        half_q.append([round(w, 6) for w in weights])
        half_p.append([round(w / 2 + o / 2, 6) for w, o in zip(weights, others)])
    half_p.append(_row(rng, vocab))
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
    soft_p = [_row(rng, vocab) for _ in range(4)]
    one_hot_q = []
    for _row_p in soft_p[:3]:  # a deterministic draft (prompt lookup) under a sampling target
        token = rng.randrange(vocab)
        one_hot_q.append([1.0 if i == token else 0.0 for i in range(vocab)])
    same_p = [_row(rng, vocab) for _ in range(3)]
    missing_q = [_row(rng, vocab, zeros=3) for _ in range(2)]  # the target's tokens the draft never proposes
    sharp_p = [_row(rng, vocab, sharp=True) for _ in range(5)]
    return [
        _distribution_case(rng, "a one-hot draft (prompt lookup) under a sampling target, gamma=3", soft_p, one_hot_q),
        _distribution_case(
            rng,
            "a draft whose first row equals the target's, gamma=2",
            same_p,
            [list(same_p[0]), _towards(rng, same_p[1], 0.5)],
        ),
        _distribution_case(
            rng,
            "a draft that never proposes some of the target's tokens (q = 0), gamma=2",
            [_row(rng, vocab) for _ in range(3)],
            missing_q,
        ),
        _distribution_case(
            rng,
            "a sharp target and a draft close to it, gamma=4",
            sharp_p,
            [_towards(rng, row, 0.85) for row in sharp_p[:4]],
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


# the exact distributions the rule (or a classic mistake) produces, in this process


def _residual(p_row, q_row):
    import torch

    residual = torch.clamp(p_row - q_row, min=0)
    return residual / residual.sum() if residual.sum() > 0 else p_row


def _rule_model(p, q, accept: str = "ratio", resample: str = "residual", bonus: str = "p") -> dict:
    """Exact distributions of a rule's statistics on fixed rows p [gamma + 1, V] and q [gamma, V]:
    the acceptance probability of each position, each emitted position, the first resample."""
    import torch

    gamma = q.shape[0]
    p = p / p.sum(-1, keepdim=True)
    q = q / q.sum(-1, keepdim=True) if gamma else q
    betas, emitted, first_resample = [], [], None
    for i in range(gamma):
        ratio = torch.where(q[i] > 0, torch.clamp(p[i] / torch.where(q[i] > 0, q[i], 1.0), max=1.0), 0.0)
        swapped = torch.where(p[i] > 0, torch.clamp(q[i] / torch.where(p[i] > 0, p[i], 1.0), max=1.0), 1.0)
        keep = {
            "ratio": ratio,
            "reversed": torch.where(q[i] > 0, 1 - ratio, 0.0),
            "always": torch.ones_like(ratio),
            "p": p[i],
            "deterministic": (p[i] >= q[i]).double(),
            "swapped": swapped,
        }[accept]
        accepted = q[i] * keep
        beta = float(accepted.sum())
        residual = _residual(p[i], q[i])
        replacement = {
            "residual": residual,
            "p": p[i],
            "reversed": _residual(q[i], p[i]),
            "argmax": torch.nn.functional.one_hot(residual.argmax(), p.shape[1]).double(),
        }[resample]
        betas.append(min(beta, 1.0))
        emitted.append(accepted + (1 - beta) * replacement)
        if i == 0:
            first_resample = replacement
    last = {
        "p": p[gamma],
        "argmax": torch.nn.functional.one_hot(p[gamma].argmax(), p.shape[1]).double(),
        "previous": p[gamma - 1] if gamma else p[gamma],
    }[bonus]
    emitted.append(last)
    lengths = []
    reach = 1.0
    for beta in betas:
        lengths.append(reach * (1 - beta))
        reach *= beta
    lengths.append(reach)
    return {
        "lengths": torch.tensor(lengths, dtype=torch.float64),
        "emitted": emitted,
        "resampled_first": first_resample,
    }


def _shared_draw_lengths(p, q):
    """The distribution of accepted draft tokens per step when one uniform u decides every draft token
    of a step: at least k are kept when u is below each of the first k ratios min(1, p/q), drafts
    drawn independently from their rows of q."""
    import itertools

    import torch

    gamma = q.shape[0]
    options = []  # per position: (probability the draft proposes x, x's acceptance ratio)
    for i in range(gamma):
        ratio = torch.clamp(p[i] / torch.where(q[i] > 0, q[i], 1.0), max=1.0)
        options.append([(float(q[i, x]), float(ratio[x])) for x in range(q.shape[1]) if float(q[i, x]) > 0])
    reach = [1.0]  # reach[k]: the chance that at least k draft tokens are kept
    for k in range(1, gamma + 1):
        reach.append(
            sum(
                math.prod(chance for chance, _ in combo) * min(ratio for _, ratio in combo)
                for combo in itertools.product(*options[:k])
            )
        )
    return torch.tensor([reach[k] - reach[k + 1] for k in range(gamma)] + [reach[gamma]], dtype=torch.float64)


# (the change from the correct rule, what the learner did and what to do instead)
_MISTAKES = (
    (
        {"resample": "p"},
        (
            "at a rejection you drew the replacement from p: draw it from max(0, p - q), normalised. "
            "Drawing from p gives the draft's tokens a second chance, so the output leans towards the "
            "draft's favourite tokens"
        ),
    ),
    (
        {"resample": "reversed"},
        (
            "at a rejection you drew from max(0, q - p): the replacement comes from the "
            "target's excess over the draft, max(0, p - q), normalised"
        ),
    ),
    (
        {"resample": "argmax"},
        (
            "at a rejection you took the argmax of max(0, p - q): draw the replacement at random "
            "from it, in proportion to its (normalised) weights"
        ),
    ),
    (
        {"accept": "reversed"},
        (
            "you keep a draft token when u > p(x) / q(x) (or reject it when u < p(x) / q(x)): "
            "keep it when u < p(x) / q(x), so that a token the target likes at least as much as "
            "the draft is always kept"
        ),
    ),
    (
        {"accept": "swapped"},
        (
            "you keep a draft token with probability min(1, q(x) / p(x)), the ratio upside down: "
            "keep it with probability min(1, p(x) / q(x)), so that a token the target wants at least "
            "as much as the draft is always kept, and one the draft over-proposes is kept only in "
            "the proportion p(x) / q(x)"
        ),
    ),
    (
        {"accept": "always"},
        (
            "every draft token is accepted, whatever the target thinks: keep draft token x with "
            "probability min(1, p(x) / q(x))"
        ),
    ),
    (
        {"accept": "p"},
        ("you keep a draft token with probability p(x): the acceptance probability is min(1, p(x) / q(x))"),
    ),
    (
        {"accept": "deterministic"},
        (
            "you keep a draft token when p(x) >= q(x), without a random draw: keep it with "
            "probability min(1, p(x) / q(x)), decided by a uniform random draw of its own"
        ),
    ),
    (
        {"bonus": "argmax"},
        (
            "when every draft token is accepted you took the argmax of p[gamma]: draw the bonus "
            "token at random from p[gamma], as the target would sample it"
        ),
    ),
    (
        {"bonus": "previous"},
        (
            "when every draft token is accepted you drew the bonus token from p[gamma - 1]: it "
            "comes from p[gamma], the target's row after the last draft token"
        ),
    ),
)


def chi_square_p_value(counts, probs) -> float:
    """P-value of Pearson's chi-square test of ``counts`` against ``probs``; 0 when a cell of
    probability 0 was observed. Cells expecting fewer than 5 are pooled into one."""
    import torch

    counts = torch.as_tensor(counts, dtype=torch.float64)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    total = float(counts.sum())
    if total == 0:
        return 1.0
    if float(counts[probs <= 1e-12].sum()) > 0:
        return 0.0
    expected = probs * total
    small = (expected < 5) & (probs > 1e-12)
    observed = torch.cat([counts[~small & (probs > 1e-12)], counts[small].sum().reshape(1)])
    expected = torch.cat([expected[~small & (probs > 1e-12)], expected[small].sum().reshape(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    if observed.numel() < 2:
        return 1.0
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(observed.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


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
    model = _rule_model(p, q)
    value, name, counts, probs = _worst(record, model)
    if value >= _FAIL_P:
        return None
    fitting = []
    for change, message in _MISTAKES:
        mistake = _rule_model(p, q, **change)
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
        and chi_square_p_value(record["lengths"], _shared_draw_lengths(p, q)) > _FITS_P
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


# every draw from the generator: the same seed gives the same steps, whatever the global generator holds

_REPEATS = 200  # steps per run: a rule that draws anything from elsewhere changes some of them


def _generator_cases(rng: random.Random) -> list[dict]:
    vocab = rng.randint(6, 8)
    cases = []
    for gamma in (1, 3):
        p = [_row(rng, vocab) for _ in range(gamma + 1)]
        cases.append(
            {
                "label": f"a draft close to the target, gamma={gamma}, vocabulary of {vocab} tokens",
                "p": p,
                "q": [_towards(rng, row, 0.6) for row in p[:gamma]],
                "seed": rng.randrange(10**6),
                "global_seeds": rng.sample(range(10**6), 2),
            }
        )
    return cases


def _drive_generator(rule, cases: list[dict]) -> list[dict]:
    """Per case, two runs of the same steps with a generator seeded alike, torch's global generator
    seeded differently before each: what each run returned, and whether it left the global state as it
    found it. The kernel's own global state is restored afterwards."""
    import torch

    results = []
    for case in cases:
        p, q = torch.tensor(case["p"]), torch.tensor(case["q"])
        gamma, vocab = q.shape[0], p.shape[1]
        draft_gen = torch.Generator().manual_seed(case["seed"])
        drafts = torch.stack(
            [torch.multinomial(q[i], _REPEATS, replacement=True, generator=draft_gen) for i in range(gamma)], dim=1
        ).tolist()
        runs = []
        with torch.random.fork_rng(devices=[]):
            for global_seed in case["global_seeds"]:
                torch.manual_seed(global_seed)
                before = torch.get_rng_state()
                generator = torch.Generator().manual_seed(case["seed"] + 1)
                steps, problem = [], ""
                for draft in drafts:
                    item = outcome(rule, p.clone(), q.clone(), list(draft), generator)
                    if item[0] == "raised":
                        problem = f"raised {item[1]}"
                        break
                    accepted, token, problem = as_step(item[1], vocab)
                    if problem:
                        break
                    steps.append([accepted, token])
                runs.append(
                    {
                        "steps": steps,
                        "problem": problem,
                        "global_untouched": bool(torch.equal(before, torch.get_rng_state())),
                    }
                )
        results.append({"runs": runs})
    return results


def _compare_generator(got, expected, cases):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g in zip(cases, got):
        where = (
            f"{case['label']}, {_REPEATS} steps with a generator seeded alike, torch's global generator "
            f"seeded {case['global_seeds'][0]} before the first run and {case['global_seeds'][1]} before "
            "the second"
        )
        if type(g) is not dict or len(g.get("runs", [])) != 2:
            return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
        first, second = g["runs"]
        for run in (first, second):
            if run["problem"]:
                return Mismatch(
                    f"accept_or_resample {run['problem'].split(':')[0]}", f"on {where}: your function {run['problem']}"
                )
        if not (first["global_untouched"] and second["global_untouched"]):
            return Mismatch(
                "your rule drew from torch's global random generator although it was given a generator",
                f"on {where}: torch's global generator state changed while your rule ran; a speculative "
                "run seeded through its generator is then not reproducible",
            )
        if first["steps"] != second["steps"]:
            step = next(i for i, (a, b) in enumerate(zip(first["steps"], second["steps"])) if a != b)
            return Mismatch(
                "the same generator seed gave different steps in two runs",
                f"on {where}: step {step} returned {first['steps'][step]} in the first run and "
                f"{second['steps'][step]} in the second; every random draw must come from the generator "
                "passed in",
            )
    return None


register(
    Check(
        check_id="lab09.accept_own_generator",
        task=TASKS[4],
        reference=reference(SPEC, "accept_or_resample"),
        make_inputs=_generator_cases,
        drive=_drive_generator,
        compare=_compare_generator,
        hint=(
            "a seeded run must be reproducible: every random draw of the rule, the uniform test of each "
            "draft token, the replacement and the bonus, comes from the generator passed in, so that the "
            "same generator seed gives the same steps whatever state torch's global generator (or any "
            "other source of randomness) is in, and the global generator is left as it was."
        ),
    )
)
