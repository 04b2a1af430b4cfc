"""The script ``torchrun`` runs for chapter 18: ``elastic.train_loop`` on every rank, a rank that SIGKILLs itself
once, and the group restarted from the last checkpoint.

    python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --max-restarts 1 \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-id JOB \\
        -m infra_lib.training.elastic_train --out DIR --steps 24 --every 5 --kill-rank 1 --kill-step 13

``torchrun``'s agent starts one process per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of
the c10d store it hosts, and ``TORCHELASTIC_RESTART_COUNT``: how many times it has restarted the group). When a
rank dies the agent stops the others and, while restarts are left, starts the whole group again; every rank
then loads its file ``DIR/ckpt/rank{r}.pt`` and goes on. Rank ``--kill-rank`` kills itself during step
``--kill-step`` of the first life only. Each rank appends its steps and events to ``DIR/rank{r}.jsonl`` (every
life) and writes ``DIR/rank{r}.json`` (the final digest and the last life's losses) when it finishes.

``run_elastic`` launches that job with a time-out and reports what it left: the logs, the number of lives, and
every process torchrun started, checked gone afterwards. ``lost_work`` reads the logs: steps recomputed and the
seconds they and the restart cost. ``run_forked`` plays the same job on ranks forked from the calling process,
restarted as torchrun restarts them, in a fraction of torchrun's start-up (lab 18's check runs a learner's
checkpoint functions that way); ``uninterrupted`` is the job never killed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]


GIVE_UP = 3  # the exit code of a rank whose save or load raised GiveUp: the job stops, no restart


class GiveUp(Exception):
    """Raised by a save or load passed to ``run_forked`` to end the job at once (a restart would fail the same way)."""


@functools.cache
def _warm() -> None:
    """Import what a rank needs (AdamW's first use imports torch's compiler: seconds) once, before forking, so no
    rank pays for it; torch's global generator is left as it was."""
    import torch
    import torch.distributed  # noqa: F401

    from infra_lib.training.elastic import make_run

    state = torch.get_rng_state()
    make_run(0)
    torch.set_rng_state(state)


def _forked_rank(rank: int, life: int, job: dict, folder: Path, save, load) -> None:
    """One rank of one life, in a forked process; always leaves through ``os._exit``."""
    code = 1
    log = None
    try:
        fd = os.open(folder / f"rank{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        import torch
        import torch.distributed as dist

        from infra_lib.training.elastic import JsonlLog, StoreGroup, digest, make_run, train_loop

        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(life)  # as torchrun tells its ranks
        log = JsonlLog(folder / f"rank{rank}.jsonl", rank=rank, life=life)
        world = job["world"]
        # The ranks meet through a file, not a socket: the grader's sandbox, where a learner's checkpoint is
        # graded on these ranks, has no network.
        store = dist.FileStore(str(folder / f"store-{life}"), world)
        store.set_timeout(timedelta(seconds=20))
        group = StoreGroup(store, rank, world)
        run = make_run(job["seed"], rank, world)
        kill = next((step for lf, r, step in job.get("kills", ()) if lf == life and r == rank), None)
        train_loop(run, job["steps"], job["every"], folder / f"rank{rank}.pt", save, load, log, kill, group)
        log({"event": "done", "digest": digest(*run.model.parameters())})
        code = 0
    except GiveUp:
        code = GIVE_UP
    except BaseException:  # noqa: BLE001 - a survivor whose peer died, or the loop's own refusal
        if log is not None:
            log({"event": "crash", "text": traceback.format_exc().strip().splitlines()[-1][:300]})
    finally:
        os._exit(code)


def run_forked(job: dict, folder: str | os.PathLike, save=None, load=None, timeout_s: float = 60.0) -> dict:
    """The elastic job on ranks forked from this process, restarted as ``torchrun`` restarts them: when a rank
    dies the others are killed and the whole group started again, until every rank finishes.

    ``job``: ``world``, ``steps``, ``every``, ``seed`` and ``kills``, (life, rank, step) triples (life 0 is the
    first). ``save``/``load`` default to the course's; forked children take them as they are, closures
    included. Each rank logs to ``folder/rank{r}.jsonl`` (read it with ``read_jsonl``); returns the exit codes of
    every life and whether ``timeout_s`` ran out (every rank is then killed). A rank exiting with ``GIVE_UP``
    ends the job. Nothing is left running when it returns.
    """
    import multiprocessing

    from infra_lib.training.elastic import load_checkpoint, save_checkpoint

    if job["world"] < 1 or job["steps"] < 0 or job["every"] < 1:
        raise ValueError(f"the job needs world >= 1, steps >= 0, every >= 1; got {job}")
    save, load = save or save_checkpoint, load or load_checkpoint
    _warm()
    ctx = multiprocessing.get_context("fork")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    codes, timed_out = [], False
    for life in range(len(job.get("kills", ())) + 2):
        procs = [
            ctx.Process(target=_forked_rank, args=(rank, life, job, folder, save, load), daemon=True)
            for rank in range(job["world"])
        ]
        try:
            for p in procs:
                p.start()
            while any(p.exitcode is None for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a rank died: stop the others, as the agent does
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.01)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
        codes.append([p.exitcode for p in procs])
        if timed_out or all(c == 0 for c in codes[-1]) or GIVE_UP in codes[-1]:
            break
    return {"codes": codes, "timed_out": timed_out}


def uninterrupted(world: int, steps: int, every: int, seed: int = 0) -> list[dict]:
    """The elastic job never killed, on forked ranks: per rank its step records and final digest."""
    from infra_lib.training.elastic import read_jsonl

    with tempfile.TemporaryDirectory(prefix="uninterrupted-") as folder:
        played = run_forked({"world": world, "steps": steps, "every": every, "seed": seed}, folder)
        if played["codes"][-1] != [0] * world:
            raise RuntimeError(f"the uninterrupted job failed: exit codes {played['codes']}")
        logs = [read_jsonl(Path(folder) / f"rank{rank}.jsonl") for rank in range(world)]
    return [
        {
            "records": [r for r in log if "event" not in r],
            "digest": next(r["digest"] for r in log if r.get("event") == "done"),
        }
        for log in logs
    ]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for rank{r}.jsonl, rank{r}.json and ckpt/")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=5, help="save a checkpoint after every N-th step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself at --kill-step")
    parser.add_argument("--kill-step", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    import torch
    import torch.distributed as dist

    from infra_lib.training.elastic import JsonlLog, digest, load_checkpoint, make_run, save_checkpoint, train_loop

    args = parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)  # the ranks share this machine's cores
    out = Path(args.out)
    log = JsonlLog(out / f"rank{rank}.jsonl", rank=rank, life=life, pid=os.getpid())
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        run = make_run(args.seed, rank, world_size)
        (out / "ckpt").mkdir(parents=True, exist_ok=True)
        kill = args.kill_step if (life == 0 and rank == args.kill_rank) else None
        records = train_loop(
            run, args.steps, args.every, out / "ckpt" / f"rank{rank}.pt", save_checkpoint, load_checkpoint, log, kill
        )
        result = {"rank": rank, "life": life, "digest": digest(*run.model.parameters())}
        result["losses"] = {r["step"]: r["loss"] for r in records}
        (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    finally:
        dist.destroy_process_group()


@dataclass
class ElasticRun:
    """What one ``torchrun`` job left: its exit code and output, every rank's log and final result, and the
    processes it started (``leftover``: those still alive once it exited, which must be none)."""

    returncode: int
    output: str
    logs: dict[int, list[dict]]
    results: dict[int, dict]
    pids_seen: set[int] = field(default_factory=set)
    leftover: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    command: list[str] = field(default_factory=list)

    @property
    def lives(self) -> int:
        """How many times the group was started (1 + torchrun's restarts)."""
        return 1 + max((r.get("life", 0) for log in self.logs.values() for r in log), default=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _family(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def run_elastic(
    out_dir: str | os.PathLike,
    steps: int = 24,
    every: int = 5,
    kill_rank: int = 1,
    kill_step: int = 13,
    nproc: int = 2,
    max_restarts: int = 1,
    seed: int = 0,
    timeout_s: float = 180.0,
) -> ElasticRun:
    """Run the elastic job under ``torchrun`` (c10d rendezvous on 127.0.0.1) and wait for it.

    Every process torchrun starts is noted while it runs; past ``timeout_s`` all of them are killed and
    ``WorkerError`` raised. ``leftover`` lists those still alive after torchrun exited.
    """
    import psutil

    from infra_lib.training.elastic import read_jsonl
    from infra_lib.training.launcher import WorkerError

    if nproc < 1 or max_restarts < 0:
        raise ValueError(f"nproc must be >= 1 and max_restarts >= 0, got {nproc}, {max_restarts}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", f"--rdzv-id={uuid.uuid4().hex[:12]}",
        "-m", "infra_lib.training.elastic_train",
        "--out", str(out), "--steps", str(steps), "--every", str(every), "--seed", str(seed),
        "--kill-rank", str(kill_rank), "--kill-step", str(kill_step),
    ]  # fmt: skip
    # Each life's ranks get a store of their own: with the agent's store shared across restarts (torch's default
    # since 2.5) a restarted rank can read the address a dead rank published (pytorch/pytorch issue 135712).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True, env=env)
        seen: dict[int, psutil.Process] = {}
        try:
            while proc.poll() is None:
                seen.update({p.pid: p for p in _family(proc.pid)})
                if time.perf_counter() - started > timeout_s:
                    raise WorkerError(f"the elastic job did not finish within {timeout_s} s; every process was stopped")
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                seen.update({p.pid: p for p in _family(proc.pid)})
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for p in seen.values():
                try:
                    p.kill()  # nothing, when torchrun stopped its workers as it should
                except psutil.Error:
                    pass
            psutil.wait_procs(list(seen.values()), timeout=5)
        wall_s = time.perf_counter() - started
        output.seek(0)
        text = output.read()
    leftover = [pid for pid, p in seen.items() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    logs = {r: read_jsonl(out / f"rank{r}.jsonl") for r in range(nproc)}
    results = {
        r: json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc) if (out / f"rank{r}.json").exists()
    }
    return ElasticRun(proc.returncode, text, logs, results, {proc.pid, *seen}, leftover, wall_s, command)


def lost_work(logs: dict[int, list[dict]]) -> dict:
    """What the first kill cost, from the ranks' logs: the step it struck, the last checkpoint before it, the
    steps trained again (the killed one included), and the seconds lost: ``work_lost_s`` from the end of that
    checkpoint to the kill (work that had to be done again), ``restart_s`` from the kill to the first step of
    the next life (the launcher noticing, stopping the survivors, starting the group again, loading)."""
    records = sorted((r for log in logs.values() for r in log), key=lambda r: r.get("t", r.get("t0", 0.0)))
    kill = next((r for r in records if r.get("event") == "killed"), None)
    if kill is None:
        raise ValueError("no rank was killed in these logs")
    life = kill["life"]
    saved = [r for r in records if r.get("event") == "checkpoint" and r["life"] == life and r["step"] < kill["step"]]
    checkpoint_step = max((r["step"] for r in saved), default=0)
    checkpoint_t = max((r["t"] for r in saved if r["step"] == checkpoint_step), default=None)
    if checkpoint_t is None:  # no checkpoint yet: the whole life is lost, from its first step
        checkpoint_t = min(r["t0"] for r in records if r["life"] == life and "t0" in r)
    again = [r for r in records if r["life"] == life + 1 and "t0" in r]
    if not again:
        raise ValueError(f"the group never trained again after the kill in life {life}")
    redone = sorted({r["step"] for r in again if r["step"] <= kill["step"]})
    resumed_t = min(r["t0"] for r in again)
    return {
        "kill_step": kill["step"],
        "checkpoint_step": checkpoint_step,
        "steps_recomputed": len(redone),
        "work_lost_s": kill["t"] - checkpoint_t,
        "restart_s": resumed_t - kill["t"],
        "time_lost_s": resumed_t - checkpoint_t,
    }


if __name__ == "__main__":
    main()
