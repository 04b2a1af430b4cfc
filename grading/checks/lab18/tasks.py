"""Lab 18's tasks as their stubs name them, and the lesson sections its hints point to."""

from __future__ import annotations

TASKS = {
    1: "lab18 task 1: ring_attention_step",
    2: "lab18 task 2: the checkpoint and resume of a training loop",
    3: "lab18 task 3: LoRALinear",
}
_CHAPTER = "chapter 18, section"
FSDP_SECTION = f"{_CHAPTER} “1 · FSDP2: every parameter sharded”"
DCP_SECTION = f"{_CHAPTER} “2 · Distributed checkpoints and a resharded resume”"
RESUME_SECTION = f"{_CHAPTER} “3 · A killed rank, resumed under torchrun”"
INTERVAL_SECTION = f"{_CHAPTER} “4 · How often to checkpoint”"
RING_SECTION = f"{_CHAPTER} “5 · Context parallelism: ring attention”"
ULYSSES_SECTION = f"{_CHAPTER} “6 · Ulysses: all-to-all over heads”"
LORA_SECTION = f"{_CHAPTER} “7 · LoRA: fine-tuning a sliver of the model”"
MULTI_LORA_SECTION = f"{_CHAPTER} “8 · Many adapters in one engine step”"
