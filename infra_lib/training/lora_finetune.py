"""A short supervised fine-tune of SmolLM2 with LoRA, on a task the course ships.

The task (``data/date_tasks.jsonl``, written by this module from a seed): dates in two directions,
each an exact-match task with one right answer.

    to_iso      "Write 5 March 2021 as an ISO date."   -> "2021-03-05"
    from_iso    "Write 2021-03-05 in words."           -> "5 March 2021"

Each task has 240 training items and 60 held-out ones (no date in both). The instruct model answers in
sentences, or with the wrong date; the fine-tune teaches it the answer and the form, and the held-out
items measure two things before and after: the greedy answer's exact match, and the mean log-likelihood
per answer token (teacher-forced, the end-of-turn token included).

    load_date_items / encode_items      the items, as (prompt ids, answer ids + end of turn)
    answer_loss / mean_answer_log_likelihood      cross-entropy on the answer tokens only
    finetune                            seeded AdamW steps on the trainable parameters
    training_memory                     bytes of parameters, gradients and optimizer state, as allocated

The evaluation by the engine, ``exact_match``, is serving's: it lives in ``infra_lib.serving.multi_lora``.

Regenerate the data with ``python -m infra_lib.training.lora_finetune``.
"""

from __future__ import annotations

import calendar
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

DATA_DIR = Path(__file__).resolve().parent / "data"
DATE_TASKS = DATA_DIR / "date_tasks.jsonl"
TASKS = ("to_iso", "from_iso")
SPLITS = ("train", "test")
MONTHS = tuple(calendar.month_name[1:])
_ORDINAL = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd", 31: "st"}


def _spoken(day: int, month: int, year: int, form: int) -> str:
    """A date in one of three spoken forms: "5 March 2021", "March 5, 2021", "the 5th of March 2021"."""
    name = MONTHS[month - 1]
    if form == 0:
        return f"{day} {name} {year}"
    if form == 1:
        return f"{name} {day}, {year}"
    return f"the {day}{_ORDINAL.get(day, 'th')} of {name} {year}"


def make_date_items(seed: int = 0, per_task: int = 300, test_items: int = 60) -> list[dict]:
    """The two tasks' items, ``{"task", "split", "prompt", "answer"}``: ``per_task`` distinct dates per task
    (years 1900-2099), the last ``test_items`` of each held out."""
    if not 0 < test_items < per_task:
        raise ValueError(f"test_items must lie in 1..{per_task - 1}, got {test_items}")
    rng = random.Random(seed)
    items = []
    for task in TASKS:
        dates: set[tuple[int, int, int]] = set()
        while len(dates) < per_task:
            year, month = rng.randint(1900, 2099), rng.randint(1, 12)
            dates.add((year, month, rng.randint(1, calendar.monthrange(year, month)[1])))
        ordered = sorted(dates)
        rng.shuffle(ordered)
        for index, (year, month, day) in enumerate(ordered):
            iso = f"{year:04d}-{month:02d}-{day:02d}"
            if task == "to_iso":
                prompt, answer = f"Write {_spoken(day, month, year, rng.randrange(3))} as an ISO date.", iso
            else:
                prompt, answer = f"Write {iso} in words.", _spoken(day, month, year, 0)
            split = "test" if index >= per_task - test_items else "train"
            items.append({"task": task, "split": split, "prompt": prompt, "answer": answer})
    return items


def write_date_items(path: Path = DATE_TASKS, seed: int = 0) -> Path:
    """Write ``make_date_items(seed)`` as JSON lines (the shipped file is seed 0)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(item) + "\n" for item in make_date_items(seed)), encoding="utf-8")
    return path


def load_date_items(task: str, split: str, path: Path = DATE_TASKS) -> list[dict]:
    """The shipped items of one task and split, in file order."""
    if task not in TASKS or split not in SPLITS:
        raise ValueError(f"task must be one of {TASKS} and split one of {SPLITS}, got {task!r}, {split!r}")
    lines = path.read_text(encoding="utf-8").splitlines()
    return [item for item in map(json.loads, lines) if item["task"] == task and item["split"] == split]


@dataclass(frozen=True)
class Example:
    """One item as token ids: the chat prompt, and the answer followed by the end-of-turn token."""

    prompt_ids: list[int]
    answer_ids: list[int]


def encode_items(tokenizer, items: list[dict]) -> list[Example]:
    """The items as the engine sees them: the prompt in the chat template, the answer closed by end of turn."""
    from infra_lib.model.generation import prompt_ids

    return [
        Example(prompt_ids(tokenizer, item["prompt"]), tokenizer.encode(item["answer"]) + [tokenizer.eos_id])
        for item in items
    ]


def _final_hidden(model, tokens: torch.Tensor) -> torch.Tensor:
    """The normed last hidden states ``[batch, t, d]`` of the course's ``Llama`` (its forward without the
    output projection, which the loss applies to the answer positions only)."""
    t = tokens.shape[1]
    x = model.embed_tokens(tokens)
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    for layer in model.layers:
        x = layer(x, cos, sin, None, model.attention_fn)
    return model.norm(x)


def answer_loss(model, examples: list[Example]) -> tuple[torch.Tensor, int]:
    """The summed cross-entropy of every answer token given what precedes it, and how many there are.

    The sequences are padded on the right (causal attention never looks right, so the padding changes
    nothing before it); only the positions that predict an answer token go through the output projection.
    """
    if not examples:
        raise ValueError("answer_loss needs at least one example")
    sequences = [e.prompt_ids + e.answer_ids for e in examples]
    width = max(len(s) for s in sequences) - 1  # the last token is only ever a target
    device = model.embed_tokens.weight.device
    tokens = torch.tensor([s[:-1] + [0] * (width - len(s) + 1) for s in sequences], device=device)
    rows, cols, targets = [], [], []
    for row, e in enumerate(examples):
        start = len(e.prompt_ids) - 1  # this position's output predicts the first answer token
        rows += [row] * len(e.answer_ids)
        cols += range(start, start + len(e.answer_ids))
        targets += e.answer_ids
    hidden = _final_hidden(model, tokens)[rows, cols]  # [answer tokens, d]
    logits = model.lm_head(hidden).float()
    return F.cross_entropy(logits, torch.tensor(targets, device=device), reduction="sum"), len(targets)


@torch.no_grad()
def mean_answer_log_likelihood(model, examples: list[Example], batch_size: int = 16) -> float:
    """The mean log-probability per answer token (end of turn included), teacher-forced: 0 is perfect."""
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        loss, n = answer_loss(model, examples[start : start + batch_size])
        total, count = total + float(loss), count + n
    return -total / count


@dataclass
class FinetuneRun:
    """What ``finetune`` did: the mean loss per answer token at each step, and the seconds it took."""

    losses: list[float]
    seconds: float
    trainable: int


def finetune(
    model: nn.Module,
    examples: list[Example],
    steps: int,
    batch_size: int = 8,
    lr: float = 2e-3,
    seed: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
) -> FinetuneRun:
    """``steps`` AdamW steps on the model's trainable parameters (those with ``requires_grad``), each on
    ``batch_size`` examples drawn without replacement by a seeded shuffle (reshuffled every epoch).

    Pass an ``optimizer`` to continue a run (or to measure its state after); by default a new AdamW
    (no weight decay) over the trainable parameters.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got steps={steps}, batch_size={batch_size}")
    if len(examples) < batch_size:
        raise ValueError(f"{len(examples)} examples cannot fill a batch of {batch_size}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters: apply_lora first, or unfreeze some")
    optimizer = optimizer or torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    losses = []
    was_training = model.training
    model.train()
    start = time.perf_counter()
    try:
        for _ in range(steps):
            if len(order) < batch_size:
                order = torch.randperm(len(examples), generator=generator).tolist()
            batch, order = [examples[i] for i in order[:batch_size]], order[batch_size:]
            loss, count = answer_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            (loss / count).backward()
            optimizer.step()
            losses.append(loss.item() / count)
    finally:
        model.train(was_training)
    return FinetuneRun(losses, time.perf_counter() - start, sum(p.numel() for p in trainable))


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes a training step holds besides activations, counted from the tensors that exist."""

    parameters: int  # every parameter, frozen or not (a tied table once)
    gradients: int  # the .grad tensors
    optimizer_state: int  # every tensor in the optimizer's state (AdamW: step, exp_avg, exp_avg_sq)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def training_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainingMemory:
    """What ``model`` and ``optimizer`` hold now (after a step, the gradients and the state exist)."""
    params = list(model.parameters())  # parameters() yields a shared tensor once
    grads = sum(p.grad.nbytes for p in params if p.grad is not None)
    state = sum(
        value.nbytes for per_param in optimizer.state.values() for value in per_param.values() if torch.is_tensor(value)
    )
    return TrainingMemory(sum(p.nbytes for p in params), grads, state)


if __name__ == "__main__":
    print(f"wrote {write_date_items()}")
