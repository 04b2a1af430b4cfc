"""``check(check_id, implementation)``: the single way lab tests are written.

Interactively (and under nbgrader) both the learner's implementation and the
``infra_lib`` reference are driven here, and a difference raises ``AssertionError`` with
what differed, on what input, and a hint. Under the course's grader (``INFRA_LAB_RECORD``
set), the learner's kernel only records what the learner's code produced, with a
grade-time seed; the comparison runs later in the grader's own process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from grading.readings import not_started_hint
from grading.registry import Check, Mismatch, ReferenceFailed, get_check
from grading.run.sandbox import WALL_FACTOR, waiting  # a check waits as a cell does

RECORD_ENV = "INFRA_LAB_RECORD"
SEED_ENV = "INFRA_LAB_SEED"
CHECK_TIMEOUT_ENV = "INFRA_LAB_CHECK_TIMEOUT"
MAX_PROCESSES_ENV = "INFRA_LAB_MAX_PROCESSES"
INPUTS_ENV = "INFRA_LAB_INPUTS"  # a folder of inputs the grader made, one pickle per check (in bubblewrap)
INTERACTIVE_SEED = 0
_MAX_ERROR_CHARS = 400


# Kinds of outcome besides plain data; the grader reports them as failure reasons.
ERROR = "error"
TIMEOUT = "time-out"
MEMORY = "memory limit"
SHORTCUT = "reference shortcut"
TAMPERING = "tampering detected"
PROCESSES = "process limit"
WRONG = "wrong result"
TRAFFIC = "excess traffic"  # right values, but more bytes moved than the task needs


@dataclass(frozen=True)
class Outcome:
    """What driving one implementation produced: plain data, or the error it raised."""

    data: Any = None
    error: str | None = None
    kind: str | None = None  # None for data; ERROR, TIMEOUT, MEMORY, PROCESSES, SHORTCUT or TAMPERING


class CheckTimeout(BaseException):
    """Raised in the learner's code when a check runs past its time limit.

    A BaseException, so that ``except Exception`` in the learner's code cannot swallow it.
    """


@dataclass(frozen=True)
class Verdict:
    check_id: str
    passed: bool
    what: str = ""
    detail: str = ""
    kind: str = ""  # "passed", "wrong result", "excess traffic", or an Outcome kind
    hint: str = ""  # the comparison's hint for the mistake it found; empty: the check's own

    def message(self, check: Check, *, hidden: bool) -> str:
        """The feedback text; for hidden checks, without inputs, expected values or error text
        (an error message can echo an input), except the stub's own NotImplementedError."""
        if self.passed:
            return f"{self.check_id} passed"
        what = self.what
        stub = _stub_task(what, check) if self.kind == ERROR else None
        if hidden and self.kind == ERROR and stub is None:
            what = what.split(":", 1)[0] + " (the message is hidden: this check's inputs are secret)"
        lines = [f"{self.check_id} failed [{check.task}] ({self.kind or 'failed'})", f"  {what}"]
        if self.detail and not hidden:
            lines.append(f"  {self.detail}")
        # An untouched task gets where to read, not the hint for a wrong answer (that would be a recipe).
        hint = (self.hint or check.hint) if stub is None else not_started_hint(stub, own=stub == check.task)
        lines.append(f"  hint: {hint}")
        return "\n".join(lines)


def _stub_task(what: str, check: Check) -> str | None:
    """The task whose untouched stub raised ``what`` (this check's task or another task of its lab:
    a later task may check an earlier task's function), or None. Safe to show: it holds no input."""
    from grading.registry import all_checks

    lab = check.task.split(" ", 1)[0]
    tasks = {c.task for c in all_checks().values() if c.task.split(" ", 1)[0] == lab}
    return next((task for task in tasks if what == f"your code raised NotImplementedError: {task}"), None)


_PLAIN_SCALARS = (bool, int, float, str, type(None))


def to_plain(value: Any, _depth: int = 0) -> Any:
    """Convert a driver's result to plain JSON-able data, refusing anything else.

    Only exact built-in types pass (a subclass of int could redefine ``==``); numpy and
    torch values are converted through ``tolist()``.
    """
    if _depth > 20:
        raise TypeError("result is nested too deeply")
    if type(value) in _PLAIN_SCALARS:
        return value
    if type(value) in (list, tuple):
        return [to_plain(v, _depth + 1) for v in value]
    if type(value) is dict:
        if not all(type(k) is str for k in value):
            raise TypeError("dict keys must be strings")
        return {k: to_plain(v, _depth + 1) for k, v in value.items()}
    module = type(value).__module__
    if module.startswith("numpy") or module.startswith("torch"):
        tolist = getattr(value, "tolist", None)
        if tolist is not None:
            return to_plain(tolist(), _depth + 1)
    raise TypeError(
        f"returned a {type(value).__module__}.{type(value).__qualname__}; return plain Python numbers, strings or lists"
    )


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text[:_MAX_ERROR_CHARS] + "..." if len(text) > _MAX_ERROR_CHARS else text


def drive(check: Check, implementation: Any, inputs: Any) -> Outcome:
    """Run the check's driver on an implementation; never raises for the implementation's errors."""
    try:
        raw = check.drive(implementation, inputs)
    except CheckTimeout as exc:
        return Outcome(error=str(exc), kind=TIMEOUT)
    except MemoryError as exc:
        return Outcome(error=_error_text(exc), kind=MEMORY)
    except (Exception, SystemExit) as exc:  # the learner's code may raise anything
        text = _error_text(exc)
        if "can't allocate memory" in text or "out of memory" in text.lower():
            return Outcome(error=text, kind=MEMORY)
        return Outcome(error=text, kind=ERROR)
    try:
        return Outcome(data=to_plain(raw))
    except Exception as exc:  # an object that only pretends to be a number, a list...
        return Outcome(error=f"your code {_error_text(exc).split(': ', 1)[-1]}", kind=WRONG)


class _Watch:
    """While a learner's implementation runs: a time limit, and a monitor of calls into the
    reference implementation (a shortcut). Both are per check and in-process: they catch honest
    mistakes and naive shortcuts; the grader's own process and limits are what a determined
    adversary meets.

    The limit is processor time, that of the thread running the check (the learner's Python
    code and the share of any parallel work it takes part in): time spent waiting for a core on
    a busy machine is not the learner's, and a grading run beside other jobs must give the
    verdict a quiet one gives. A check that waits instead of computing (the thread asleep, no
    process it started running or ready to run) is stopped after ``WALL_FACTOR`` times the limit
    of such waiting.
    """

    POLL_S = 0.05

    def __init__(self, lab: str, timeout: float, max_processes: int):
        from grading.call_monitor import CallMonitor
        from grading.registry import shortcut_functions

        self.monitor = CallMonitor(shortcut_functions(lab))
        self.timeout = timeout
        self.max_processes = max_processes
        self._armed = False
        self._spent = False  # the processor-time limit was reached (else the waiting one)

    @staticmethod
    def _children() -> dict:
        import psutil

        try:
            return {p.pid: p for p in psutil.Process().children(recursive=True)}
        except psutil.Error:
            return {}

    def _stop_new_processes(self, before: dict) -> int:
        """Kill the processes the learner's code started during the check; return how many."""
        import psutil

        new = [p for pid, p in self._children().items() if pid not in before]
        for proc in new:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(new, timeout=2)
        return len(new)

    def _alarm(self, signum, frame):
        if not self._armed:  # a signal that arrived as the check ended
            return
        self._armed = False
        if self._spent:
            raise CheckTimeout(f"the check used more than its limit of {self.timeout:g} s of processor time")
        raise CheckTimeout(
            f"the check was still running after {WALL_FACTOR * self.timeout:g} s while using "
            f"little processor time: your code waits (a sleep, a lock, input, a child process?)"
        )

    def _working(self, native_id: int, before: dict) -> bool:
        """Whether the checking thread, or a process the check started, runs or waits for a core."""
        import psutil

        try:
            with open(f"/proc/self/task/{native_id}/stat", encoding="ascii") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("R", "D"):
                    return True
        except (OSError, IndexError):
            pass
        for pid, proc in self._children().items():
            try:
                if pid not in before and proc.status() in (psutil.STATUS_RUNNING, psutil.STATUS_DISK_SLEEP):
                    return True
            except psutil.Error:
                pass
        return False

    def _clock(self, done, clock_id: int, main_thread: int, native_id: int, before: dict) -> None:
        """Watch the checking thread's processor time and its waiting; past a limit, signal that thread."""
        import signal
        import time

        started = time.clock_gettime(clock_id)
        waited, last = 0.0, (time.monotonic(), started)
        while not done.wait(self.POLL_S):
            now, cpu = time.monotonic(), time.clock_gettime(clock_id)
            if cpu - started > self.timeout:
                self._spent = True
                signal.pthread_kill(main_thread, signal.SIGALRM)
                return
            if now - last[0] < 5 * self.POLL_S:
                continue
            if waiting(cpu - last[1], now - last[0], self._working(native_id, before)):
                waited += now - last[0]
            last = (now, cpu)
            if waited > WALL_FACTOR * self.timeout:
                signal.pthread_kill(main_thread, signal.SIGALRM)
                return

    def run(self, check: Check, implementation: Any, inputs: Any) -> Outcome:
        import signal
        import threading
        import time

        before = self._children()
        done = threading.Event()
        thread_id = threading.get_ident()
        clock = threading.Thread(
            target=self._clock,
            args=(done, time.pthread_getcpuclockid(thread_id), thread_id, threading.get_native_id(), before),
            name="check-clock",
            daemon=True,
        )
        previous = signal.signal(signal.SIGALRM, self._alarm)
        self._armed, self._spent = True, False
        clock.start()
        self.monitor.start()
        try:
            outcome = drive(check, implementation, inputs)
        except CheckTimeout as exc:  # the limit was reached as drive() returned, outside its own guard
            outcome = Outcome(error=str(exc), kind=TIMEOUT)
        finally:
            self._armed = False  # from here the alarm raises nothing (no call before this line: no signal runs)
            intact = self.monitor.intact()
            self.monitor.stop()
            done.set()
            clock.join()
            signal.signal(signal.SIGALRM, previous)
            started = self._stop_new_processes(before)
        if started > self.max_processes:
            return Outcome(
                error=f"your code started {started} processes (the limit is {self.max_processes})", kind=PROCESSES
            )
        if self.monitor.hits:
            return Outcome(error=f"your code called the reference {self.monitor.hits[0]}", kind=SHORTCUT)
        if not intact:
            return Outcome(error="your code removed the grader's call monitor", kind=TAMPERING)
        return outcome


def needs_reference(learner: Outcome) -> bool:
    """Whether judging ``learner`` compares data with the reference's: not when the learner's code
    raised, ran out of time or memory, or was stopped (the verdict is then the learner's alone, so
    an untouched lab is judged without running the reference)."""
    return learner.error is None and learner.kind is None


def judge(check: Check, learner: Outcome, expected: Outcome | None, inputs: Any) -> Verdict:
    """Compare the learner's outcome with the reference's, for one check. ``expected`` may be
    None when ``needs_reference(learner)`` is False."""
    if learner.kind == SHORTCUT:
        return Verdict(
            check.check_id, False, learner.error or "your code called the reference implementation", kind=SHORTCUT
        )
    if learner.kind == TAMPERING:
        return Verdict(check.check_id, False, learner.error or "tampering", kind=TAMPERING)
    if learner.kind == TIMEOUT:
        return Verdict(check.check_id, False, f"your code ran too long: {learner.error}", kind=TIMEOUT)
    if learner.kind == PROCESSES:
        return Verdict(check.check_id, False, learner.error or "too many processes", kind=PROCESSES)
    if learner.kind == MEMORY:
        return Verdict(check.check_id, False, f"your code ran out of memory: {learner.error}", kind=MEMORY)
    if learner.kind == WRONG:
        return Verdict(check.check_id, False, learner.error or "wrong result", kind=WRONG)
    if learner.error is not None:
        return Verdict(check.check_id, False, f"your code raised {learner.error}", kind=ERROR)
    if expected is None:
        raise ValueError(f"check {check.check_id}: the learner's data needs the reference's to be judged")
    if expected.error is not None:
        raise RuntimeError(f"the reference failed check {check.check_id}: {expected.error}")
    try:
        mismatch = check.compare(learner.data, expected.data, inputs)
    except ReferenceFailed:
        raise
    except Exception as exc:  # malformed learner data (wrong shapes, types)
        mismatch = Mismatch(f"your result has the wrong form ({type(exc).__name__}: {exc})")
    if mismatch is None:
        return Verdict(check.check_id, True, kind="passed")
    return Verdict(
        check.check_id, False, mismatch.what, mismatch.detail, kind=mismatch.reason or WRONG, hint=mismatch.hint
    )


def _grader_inputs(check_id: str) -> Any:
    """The inputs the grader made for this check, when it made them (a sandboxed kernel, whose view of
    the lab's reference is stubs, cannot make inputs that the reference computes); else None.

    The file is the grader's; what the kernel might do to it changes only its own answers, which
    are compared with the reference on the grader's own copy of the inputs."""
    import pickle

    folder = os.environ.get(INPUTS_ENV)
    path = os.path.join(folder, f"{check_id}.pickle") if folder else None
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def check(check_id: str, implementation: Any) -> None:
    """Check a learner's implementation against the reference.

    Args:
        check_id: a registered check, e.g. "lab01.gemm_flops".
        implementation: the function or class the check exercises.

    Raises:
        AssertionError: interactively, when the implementation's results differ from the
            reference's (the message says what differed, on what input, and a hint).
    """
    registered = get_check(check_id)
    record_path = os.environ.get(RECORD_ENV)
    if record_path:
        seed = int(os.environ.get(SEED_ENV, "0"))
        watch = _Watch(
            check_id.split(".")[0],
            float(os.environ.get(CHECK_TIMEOUT_ENV, "60")),
            int(os.environ.get(MAX_PROCESSES_ENV, "32")),
        )
        inputs = _grader_inputs(check_id)
        outcome = watch.run(registered, implementation, registered.inputs(seed) if inputs is None else inputs)
        line = json.dumps({"check_id": check_id, "data": outcome.data, "error": outcome.error, "kind": outcome.kind})
        with open(record_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        print(f"{check_id}: answer recorded; the grader compares it with the reference")
        return
    inputs = registered.inputs(INTERACTIVE_SEED)
    learner = drive(registered, implementation, inputs)
    expected = drive(registered, registered.reference(), inputs) if needs_reference(learner) else None
    verdict = judge(registered, learner, expected, inputs)
    if not verdict.passed:
        raise AssertionError(verdict.message(registered, hidden=False))
    print(f"\N{CHECK MARK} {check_id} passed")
    from grading.still_checked import STILL_CHECKED

    still = STILL_CHECKED.get(check_id)
    if still:  # a visible check's pass is not the score: say what the grader's hidden checks add
        print(f"  {still}")
