"""Training (L3): one step from scratch, then parallelism on ``torch.distributed`` with the gloo backend,
N processes on one machine.

    autograd.py          reverse-mode automatic differentiation over torch tensors (the contract lab 05's
                         engine meets), the plumbing ops on any such Value class, a Llama's loss with them
    train_step.py        one real training step of a tiny Llama: fp32, bf16 with fp32 masters,
                         activation checkpointing, and where the bytes go
    scratch_train.py     AdamW written out, and a tiny Llama trained through an autograd of the contract
                         (the course's or a learner's) next to torch.autograd and torch's AdamW
    launcher.py          run_workers: spawn a process group, collect results, never leave a process behind;
                         run_torchrun: the same through torchrun, with its report of a failed rank
    torchrun_train.py    the script torchrun runs: lab 05's DDP and ZeroAdamW from answer cells, per rank
    collectives.py       ring all-reduce over send/recv (reduce-scatter, all-gather), bandwidth timing, and
                         BackgroundAllReduce: all-reduces started now, finished on a thread of their own
    ddp.py               data parallelism: DDP with buckets all-reduced from gradient hooks during backward,
                         the bucketed all-reduce after backward, single-process reference
    zero.py              the ZeRO memory calculator (stages 0-3); reduce_scatter and all_gather that end
                         on each rank's own shard, ZeroAdamW (stage 1 over them) and ZeroStage1Adam
    tensor_parallel.py   column- and row-parallel linear layers (Megatron's MLP split)
    pipeline.py          GPipe schedule and the bubble fraction
    fsdp.py              FSDP2 (fully_shard per block) on the course's Llama, its bytes held and sent counted
                         against the ZeRO stage-3 accounting; ZeRO-1 beside it
    checkpointing.py     torch.distributed.checkpoint: sharded saves, blocking or async, loaded at another
                         world size
    elastic.py           a training loop whose checkpoint resumes it bit for bit; the Young/Daly interval and
                         a failure simulation
    elastic_train.py     that loop under torchrun with a rank killed, or on forked ranks restarted as torchrun
                         restarts them
    context_parallel.py  ring attention (contiguous and zigzag, with its ring backward) and Ulysses, over the
                         course's exchange, with their traffic
    lora_finetune.py     a LoRA fine-tune of SmolLM2 on the shipped date task, and its memory against a full one
"""

from infra_lib.training.collectives import DistComm, ThreadComm, ThreadGroup, ring_all_reduce, ring_bytes_sent
from infra_lib.training.launcher import WorkerError, run_workers
from infra_lib.training.pipeline import Slot, bubble_fraction, gpipe_schedule, schedule_bubble
from infra_lib.training.zero import ZeroStage1Adam, shard_bounds, zero_memory_per_device, zero_table

__all__ = [
    "DistComm",
    "Slot",
    "ThreadComm",
    "ThreadGroup",
    "WorkerError",
    "ZeroStage1Adam",
    "bubble_fraction",
    "gpipe_schedule",
    "ring_all_reduce",
    "ring_bytes_sent",
    "run_workers",
    "schedule_bubble",
    "shard_bounds",
    "zero_memory_per_device",
    "zero_table",
]
