"""How lab 08's messages describe a scheduler's configuration, a workload and a step's plan."""

from __future__ import annotations


def describe_config(c: dict) -> str:
    """The configuration as the SchedulerConfig(...) that makes it."""
    flags = "".join(
        [
            ", enable_chunked_prefill=False" if not c.get("enable_chunked_prefill", True) else "",
            ", enable_prefix_caching=True" if c.get("enable_prefix_caching") else "",
        ]
    )
    return (
        f"SchedulerConfig(max_num_seqs={c['max_num_seqs']}, max_num_batched_tokens={c['max_num_batched_tokens']}, "
        f"block_size={c['block_size']}, num_blocks={c['num_blocks']}{flags})"
    )


def plan_text(step: dict) -> str:
    """One recorded step: its plan, admissions, preemptions and queues after it."""
    plan = ", ".join(f"seq {i}: {n} {kind}" for i, n, kind in step["scheduled"]) or "nothing"
    moved = "".join(
        [
            f", admitted {step['admitted']}" if step["admitted"] else "",
            f", preempted {step['preempted']}" if step["preempted"] else "",
        ]
    )
    return f"[{plan}]{moved}, running {step['running']}, waiting {step['waiting']}"


def workload_text(run: dict) -> str:
    """A run's configuration and workload."""
    w = run["workload"]
    arrivals = "all at time 0" if not w["rate"] else f"arriving at {w['rate']:g} per second"
    prefix = f", a shared prefix of {w['shared_prefix_len']}" if w.get("shared_prefix_len") else ""
    return (
        f"{describe_config(run['config'])}, {w['n']} requests {arrivals} (prompts of {w['prompt_len'][0]}-"
        f"{w['prompt_len'][1]} tokens{prefix}, outputs of {w['output_len'][0]}-{w['output_len'][1]})"
    )
