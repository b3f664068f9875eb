"""Retrying calls to the Kubernetes API: exponential backoff with jitter, one log line per outage.

Model
-----
Both components talk to the API server through kubernetes_asyncio (the partitioner in
:mod:`partitioner.kubeapi`, the node agent in :class:`node_agent.agent.KubeSpecSource`); this
module holds what they share about failures, and nothing of a client (no kopf, no Kubernetes
package: the contract layer imports neither).

* :class:`Backoff`: how long to wait after the ``n``-th failure in a row: exponential growth up
  to a cap, with jitter so that replicas (or the agents of many nodes) do not retry in lockstep.
* :class:`OutageLog`: an outage is logged as one WARNING when it starts and one INFO when it
  ends, every failure in between at DEBUG (not one line per retry, and no traceback).
* :func:`retry_with_backoff` (tenacity): an awaitable retried until it returns, waiting
  :meth:`Backoff.delay` after each failure and logging through an :class:`OutageLog`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import tenacity

__all__ = ["Backoff", "OutageLog", "retry_with_backoff"]

log = logging.getLogger("gpuslice.kube_retry")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter: how long to wait after the ``n``-th failure in a row.

    ``delay(n) = min(cap_s, initial_s * factor ** (n - 1)) * (1 - jitter * u)``, ``u`` uniform in
    [0, 1): never more than ``cap_s``, and with ``jitter <= 1 - 1 / factor`` never less than the
    previous delay's largest value until the cap is reached (the delays grow).
    """

    initial_s: float = 1.0
    cap_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.cap_s:
            raise ValueError(
                f"backoff needs 0 < initial ({self.initial_s:g}s) <= cap ({self.cap_s:g}s)"
            )
        if self.factor < 1:
            raise ValueError(f"backoff factor must be >= 1, got {self.factor:g}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"backoff jitter must be in [0, 1), got {self.jitter:g}")

    def delay(self, failures: int, u: float) -> float:
        """Seconds to wait after ``failures`` failed attempts in a row (``u``: uniform [0, 1))."""
        if failures < 1:
            raise ValueError(f"a backoff delay follows a failure; got failures={failures}")
        exponent = min(failures - 1, 1000)  # beyond any cap: no float overflow
        base = min(self.cap_s, self.initial_s * self.factor**exponent)
        return base * (1 - self.jitter * u)


class OutageLog:
    """One WARNING when ``what`` starts failing, DEBUG for each further failure, one INFO when
    it succeeds again (not one line per retry)."""

    def __init__(self, what: str, logger: logging.Logger = log) -> None:
        self.what, self.logger = what, logger
        self.failures = 0
        """Failed attempts in a row (0: no outage)."""

    def failed(self, error: BaseException | None, retry_in: float | None = None) -> None:
        """One more failed attempt; ``retry_in``: seconds to the next one, if the caller knows."""
        why = f"{type(error).__name__}: {error}" if error is not None else "unknown error"
        self.failures += 1
        if self.failures == 1:
            self.logger.warning(
                "%s failed, retrying with backoff (further failures are logged at DEBUG "
                "until it succeeds): %s",
                self.what,
                why,
            )
        elif retry_in is None:
            self.logger.debug("%s failed again (attempt %d): %s", self.what, self.failures, why)
        else:
            self.logger.debug(
                "%s failed again (attempt %d), next try in %.1fs: %s",
                self.what,
                self.failures,
                retry_in,
                why,
            )

    def succeeded(self) -> None:
        if self.failures:
            self.logger.info("%s succeeded after %d failed attempt(s)", self.what, self.failures)
        self.failures = 0


async def retry_with_backoff[T](
    attempt: Callable[[], Awaitable[T]],
    what: str,
    *,
    backoff: Backoff | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rand: Callable[[], float] = random.random,
    logger: logging.Logger = log,
) -> T:
    """``attempt()`` until it returns, waiting :meth:`Backoff.delay` after each failure.

    Any :class:`Exception` is retried (cancellation is not); the outage is logged by an
    :class:`OutageLog` named ``what``.  ``sleep`` and ``rand`` are injectable for tests.
    """
    policy = backoff if backoff is not None else Backoff()
    outage = OutageLog(what, logger)

    def wait(state: tenacity.RetryCallState) -> float:
        return policy.delay(state.attempt_number, rand())

    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        retry_in = state.next_action.sleep if state.next_action is not None else 0.0
        outage.failed(error, retry_in)

    retrying = tenacity.AsyncRetrying(
        sleep=sleep,
        wait=wait,
        retry=tenacity.retry_if_exception_type(Exception),
        before_sleep=before_sleep,
        reraise=True,
    )
    result: T = await retrying(attempt)
    outage.succeeded()
    return result
