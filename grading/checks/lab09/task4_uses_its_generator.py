"""Lab 09 task 4, reproducibly: every draw of the acceptance rule comes from the generator it is given, so that
the same seed gives the same steps whatever torch's global generator holds, and that one is left untouched."""

from __future__ import annotations

import random

from grading.checks.common import outcome, reference
from grading.checks.lab09.probability_rows import random_row, towards
from grading.checks.lab09.task4_acceptance import as_step
from grading.checks.lab09.tasks import SPEC, TASKS
from grading.registry import Check, Mismatch, register

_REPEATS = 200  # steps per run: a rule that draws anything from elsewhere changes some of them


def _generator_cases(rng: random.Random) -> list[dict]:
    vocab = rng.randint(6, 8)
    cases = []
    for gamma in (1, 3):
        p = [random_row(rng, vocab) for _ in range(gamma + 1)]
        cases.append(
            {
                "label": f"a draft close to the target, gamma={gamma}, vocabulary of {vocab} tokens",
                "p": p,
                "q": [towards(rng, row, 0.6) for row in p[:gamma]],
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
