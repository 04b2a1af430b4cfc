"""The exact distributions that the acceptance rule, or one of its classic mistakes, produces on fixed rows of p
and q, and the chi-square test that compares a learner's counts with one of them."""

from __future__ import annotations

import math


def _residual(p_row, q_row):
    import torch

    residual = torch.clamp(p_row - q_row, min=0)
    return residual / residual.sum() if residual.sum() > 0 else p_row


def rule_model(p, q, accept: str = "ratio", resample: str = "residual", bonus: str = "p") -> dict:
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


def shared_draw_lengths(p, q):
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
MISTAKES = (
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
