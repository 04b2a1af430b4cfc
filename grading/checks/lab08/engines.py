"""The engines lab 08's checks run, and the scheduler steps they replay.

While lab 08 is graded, the course's ``Scheduler.schedule`` (task 1's reference) and ``LLMEngine.step``
(task 2's) are out of the kernel's reach. So each task's checks run the learner's piece among course
parts that need neither:

- task 1's engines step with ``length_step``, the course's engine step for requests that end at their
  length only (no stop tokens, no stop strings, no text): all that the simulated runs and the small
  random model's runs ask of a step;
- task 2's engines plan with a scheduler that carries out, one step at a time, the actions the reference
  scheduler took in the same run (recorded where the inputs are made): the course's own queues, pool and
  actions, with no planning of the course's in the kernel.
"""

from __future__ import annotations


def length_step(engine) -> list:
    """One engine step for requests that end at their length: schedule, run, append, finish at the length."""
    out = engine.scheduler.schedule()
    batch = engine.begin_step(out)
    if not batch:
        return []
    sampled = engine.runner.run(batch)
    engine.scheduler.commit(out)
    outputs = []
    for seq_id, token in sampled.items():
        seq = engine.sequences[seq_id]
        if seq.stop_ids or seq.stop_strings:
            raise RuntimeError(f"seq {seq_id} has stop tokens or strings: the checks' length-only step cannot serve it")
        seq.append_token(token)
        engine.record_token(seq)
        if seq.num_tokens >= seq.max_tokens:
            engine.finish(seq, "length")
        outputs.append(engine.output(seq_id, [token]))
    return outputs


def length_engine():
    """``LLMEngine`` stepping with ``length_step``."""
    from infra_lib.serving.engine import engine_class

    return engine_class(length_step)


Action = tuple  # ("preempt" | "reserve" | "admit", seq_id, tokens)


def recording(config, steps: list[list[Action]]):
    """The reference scheduler on ``config``, appending each step's actions in order to ``steps``:
    ``("preempt", seq id, 0)``, ``("reserve", seq id, tokens)`` for a running sequence, ``("admit", seq id,
    tokens)``."""
    from infra_lib.serving.scheduler import Scheduler

    class Recorded(Scheduler):
        def schedule(self):
            steps.append([])
            return super().schedule()

        def preempt(self, seq):
            steps[-1].append(("preempt", seq.seq_id, 0))
            super().preempt(seq)

        def reserve(self, seq, num_tokens):
            steps[-1].append(("reserve", seq.seq_id, num_tokens))
            super().reserve(seq, num_tokens)

        def admit(self, seq, num_tokens):
            steps[-1].append(("admit", seq.seq_id, num_tokens))
            super().admit(seq, num_tokens)

    return Recorded(config)


class LeftTheReference(RuntimeError):
    """The run reached a state the reference's recorded step cannot be carried out in."""


def carry_out(scheduler, actions: list[Action]):
    """One recorded step of the reference's, carried out on ``scheduler`` with its own actions; the plan."""
    from infra_lib.serving.scheduler_output import SchedulerOutput

    out = SchedulerOutput(scheduler.num_steps, scheduler.config.max_num_batched_tokens)
    for action, seq_id, num_tokens in actions:
        queue = scheduler.waiting if action == "admit" else scheduler.running
        seq = next((s for s in queue if s.seq_id == seq_id), None)
        if seq is None:
            raise LeftTheReference(
                f"step {out.step} of the reference's run {action}s seq {seq_id}, which is not "
                f"{'waiting' if action == 'admit' else 'running'}: the run left the reference's"
            )
        if action == "preempt":
            scheduler.preempt(seq)
            out.preempted.append(seq_id)
            continue
        if action == "admit":
            out.num_cached_tokens[seq_id] = scheduler.cached_tokens(seq)
            scheduler.admit(seq, num_tokens)
            out.admitted.append(seq_id)
        else:
            scheduler.reserve(seq, num_tokens)
        out.add(seq, num_tokens)
    scheduler.num_steps += 1
    scheduler._scheduled = {s.seq_id: s.num_tokens for s in out.scheduled}
    out.num_running, out.num_waiting = len(scheduler.running), len(scheduler.waiting)
    out.num_free_blocks = scheduler.pool.num_free
    return out


def replaying(config, steps: list[list[Action]]):
    """A scheduler on ``config`` whose every step carries out the next of ``steps``."""
    from infra_lib.serving.scheduler import Scheduler

    class Replayed(Scheduler):
        def schedule(self):
            if self.num_steps >= len(steps):
                raise LeftTheReference(f"the run went on past the reference's {len(steps)} steps")
            return carry_out(self, steps[self.num_steps])

    return Replayed(config)
