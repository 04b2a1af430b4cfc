"""Seeded rows of token probabilities, the target's p and the draft's q that task 4's statistical checks run on."""

from __future__ import annotations

import random


def normalised(weights: list[float]) -> list[float]:
    """The weights scaled to sum to 1."""
    total = sum(weights)
    return [w / total for w in weights]


def random_row(rng: random.Random, vocab: int, zeros: int = 0, sharp: bool = False) -> list[float]:
    """A seeded probability row over ``vocab`` tokens: ``zeros`` of them at 0, one far ahead when ``sharp``."""
    weights = [rng.uniform(0.2, 1.0) for _ in range(vocab)]
    if sharp:
        weights[rng.randrange(vocab)] += 6.0
    for i in rng.sample(range(vocab), zeros):
        weights[i] = 0.0
    return [round(x, 6) for x in normalised(weights)]


def towards(rng: random.Random, p: list[float], closeness: float) -> list[float]:
    """A draft row: a mix of ``p`` and a random row (``closeness`` 1 gives ``p`` itself)."""
    noise = random_row(rng, len(p))
    return [round(x, 6) for x in normalised([closeness * a + (1 - closeness) * b for a, b in zip(p, noise)])]
