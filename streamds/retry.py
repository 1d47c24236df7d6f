"""Retrying transient storage errors with exponential backoff.

Transient: any OSError except the permanent kinds (missing file, permission, a directory)
and damaged data (`CorruptShardError`), which retrying cannot fix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import CorruptShardError

__all__ = ["DEFAULT_RETRY", "PERMANENT_ERRORS", "RetryPolicy", "is_transient", "retrying"]

log = logging.getLogger(__name__)

# "this file is not there / not allowed": retrying cannot fix these
PERMANENT_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failed read is retried (exponential backoff)."""

    attempts: int = 6
    backoff: float = 0.5  # seconds before the first retry, doubled after each failure
    max_backoff: float = 20.0

    def delay(self, failure: int) -> float:
        return min(self.max_backoff, self.backoff * 2 ** (failure - 1))


DEFAULT_RETRY = RetryPolicy()


def is_transient(err: BaseException) -> bool:
    return (
        isinstance(err, OSError)
        and not isinstance(err, CorruptShardError)
        and not isinstance(err, PERMANENT_ERRORS)
    )


def retrying(call: Callable[[], T], policy: RetryPolicy, what: str) -> T:
    """`call()`, retried on transient OSErrors per `policy`; `what` names it in logs."""
    failures = 0
    while True:
        try:
            return call()
        except OSError as err:
            if not is_transient(err):
                raise
            failures += 1
            if failures >= policy.attempts:
                raise OSError(
                    err.errno, f"{what}: failed {failures} times in a row: {err}"
                ) from err
            delay = policy.delay(failures)
            log.warning("%s failed (%s); retry %d in %.1fs", what, err, failures, delay)
            time.sleep(delay)
