"""Retries with exponential backoff, and a deadline for one node call.

A step that fails for a passing reason (a rate limit, a dropped connection, a slow tool) is
worth trying again, after a pause that grows each time so that a struggling service is not
hammered: ``initial_interval * backoff_factor**i``, capped at ``max_interval``. The policy says
which errors are passing (``retry_on``); anything else is a bug and is raised at once. There is
no jitter here, so the sleeps are exact and testable; a fleet of clients would add some.

A node can also be given a deadline (``with_timeout``): it runs on a worker thread, and if it
is still running when the deadline passes the caller gets ``NodeTimeout``, which a policy may
retry like any other error. Python cannot stop a thread, so the late call keeps running in the
background: nodes with deadlines should be idempotent.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RetryOn = tuple[type[BaseException], ...] | Callable[[BaseException], bool]


class NodeTimeout(TimeoutError):
    """A node ran longer than its ``timeout``."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often, after which errors and with what pauses a node is tried again.

    Attributes:
        max_attempts: tries in all, the first included (1 = no retry).
        initial_interval: seconds to sleep after the first failure.
        backoff_factor: each further sleep is this many times the one before (>= 1).
        max_interval: no sleep is longer than this.
        retry_on: the exception classes worth retrying, or a predicate on the exception.
    """

    max_attempts: int = 3
    initial_interval: float = 0.5
    backoff_factor: float = 2.0
    max_interval: float = 8.0
    retry_on: RetryOn = (Exception,)

    def __post_init__(self):
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        if not self.initial_interval >= 0:
            raise ValueError(f"initial_interval must be >= 0 seconds, got {self.initial_interval}")
        if not self.max_interval >= 0:
            raise ValueError(f"max_interval must be >= 0 seconds, got {self.max_interval}")
        if not self.backoff_factor >= 1:
            raise ValueError(f"backoff_factor must be >= 1 (a pause never shrinks), got {self.backoff_factor}")
        if isinstance(self.retry_on, tuple):
            bad = [c for c in self.retry_on if not (isinstance(c, type) and issubclass(c, BaseException))]
            if bad:
                raise ValueError(f"retry_on must hold exception classes, got {bad!r}")
        elif not callable(self.retry_on):
            raise ValueError(
                "retry_on must be a tuple of exception classes or a predicate(exception) -> bool, "
                f"got {self.retry_on!r}"
            )

    def should_retry(self, error: BaseException) -> bool:
        """Whether ``error`` is one this policy retries."""
        if isinstance(self.retry_on, tuple):
            return isinstance(error, self.retry_on)
        return bool(self.retry_on(error))


def backoff_delays(policy: RetryPolicy) -> list[float]:
    """The sleeps between attempts, in seconds: ``max_attempts - 1`` values, growing geometrically to the cap."""
    return [
        min(policy.initial_interval * policy.backoff_factor**i, policy.max_interval)
        for i in range(policy.max_attempts - 1)
    ]


def call_with_retry(
    fn: Callable[[dict], Any],
    state: dict,
    policy: RetryPolicy | None,
    *,
    sleep: Callable[[float], None] = time.sleep,
    on_attempt: Callable[[int, BaseException | None], None] | None = None,
) -> Any:
    """``fn(state)``, tried again after the errors ``policy`` retries.

    Args:
        fn: the node function.
        state: its argument.
        policy: the retry policy; None means a single attempt.
        sleep: called with each backoff delay (inject a recorder in tests).
        on_attempt: called after each attempt with its number (from 1) and its error (None on success).

    Returns:
        What ``fn`` returned on the first attempt that did not raise.

    Raises:
        The error of an attempt that ``policy`` does not retry, at once; else the last attempt's error.
    """
    delays = backoff_delays(policy) if policy is not None else []
    for attempt in range(1, len(delays) + 2):
        try:
            result = fn(state)
        except Exception as error:  # a BaseException (an interrupt, Ctrl-C) is never retried
            if on_attempt is not None:
                on_attempt(attempt, error)
            if policy is None or attempt > len(delays) or not policy.should_retry(error):
                raise
            sleep(delays[attempt - 1])
        else:
            if on_attempt is not None:
                on_attempt(attempt, None)
            return result
    raise AssertionError("unreachable: the last attempt returns or raises")


def with_timeout(fn: Callable[[dict], Any], seconds: float, name: str = "node") -> Callable[[dict], Any]:
    """``fn`` with a deadline: the wrapped call raises ``NodeTimeout`` if ``fn`` runs longer than ``seconds``.

    The call runs on a daemon thread in a copy of the caller's context (so context variables,
    such as the one ``interrupt`` reads, are seen). An error inside ``fn`` is raised in the caller.
    """
    if not seconds > 0:
        raise ValueError(f"the timeout of node {name!r} must be > 0 seconds, got {seconds}")

    def call(state: dict) -> Any:
        outcome: dict[str, Any] = {}
        context = contextvars.copy_context()

        def target() -> None:
            try:
                outcome["value"] = context.run(fn, state)
            except BaseException as error:  # handed to the caller below
                outcome["error"] = error

        worker = threading.Thread(target=target, name=f"node-{name}", daemon=True)
        worker.start()
        worker.join(seconds)
        if worker.is_alive():
            raise NodeTimeout(
                f"node {name!r} ran longer than its timeout of {seconds} s (the call goes on in "
                "the background; raise the timeout, or make the node faster or idempotent)"
            )
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    return call
