"""Retrying transient storage errors with jittered exponential backoff, for minutes.

Transient: any OSError except the permanent kinds (missing file, permission, a directory, a
request the server refuses for good), damaged data (`CorruptShardError`) and a read that
already ran out of retries (`GaveUpError`): retrying cannot fix those. `as_os_error` turns
what remote filesystems raise (aiohttp's HTTP statuses and dropped connections, timeouts)
into these kinds, so one rule decides everywhere. Every text these errors and the retry
warnings carry goes through `streamds.redact`: a URL's credentials never reach a message.
"""

from __future__ import annotations

import errno
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import CorruptShardError
from .redact import describe_error, redact, safe_cause

__all__ = [
    "DEFAULT_RETRY",
    "PERMANENT_ERRORS",
    "GaveUpError",
    "PermanentReadError",
    "RangeNotSupportedError",
    "RetryPolicy",
    "StoppedError",
    "UnreachableError",
    "as_os_error",
    "http_status",
    "is_transient",
    "lookup_error",
    "option_error",
    "retrying",
]

log = logging.getLogger(__name__)


class PermanentReadError(OSError):
    """The storage refused a read for good (an HTTP 4xx other than 404, 403, 408 and 429)."""


class RangeNotSupportedError(PermanentReadError):
    """The server answers a request for part of a file with all of it (no HTTP Range)."""

    def __init__(self, url: str) -> None:
        super().__init__(
            errno.EIO,
            f"{redact(url)}: the server ignores HTTP Range requests (asked for part of the file, "
            "it sends all of it); serve the file from a server that honours Range (object "
            "stores and common web servers do), or download it (e.g. with `curl -O` or "
            "fsspec's `get`) and read the local copy; a dataset made while the server still "
            "honoured Range cut the file into blocks: make the dataset again (it then reads a "
            "file from a server without Range as one stream, by one reader)",
        )


class GaveUpError(OSError):
    """A read still failed after the retry policy's time or attempts ran out."""


class StoppedError(OSError):
    """A read not started, or a failed one not retried, because the reader that wanted its
    bytes closed (a read-ahead's fetch after the reader stopped)."""


class UnreachableError(ConnectionError):
    """No connection to the source's host when the dataset was made (refused, no such host):
    a wrong host or port, or a server that is not running; reported at once, not retried."""


# "this file is not there / not allowed": retrying cannot fix these
PERMANENT_ERRORS = (
    FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
    PermanentReadError, GaveUpError, UnreachableError, StoppedError,
)
_RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how patiently a failed read is retried.

    Waits `backoff` seconds after the first failure, doubling up to `max_backoff`, each wait
    scaled by a random factor in [1 - jitter, 1 + jitter] so that many readers hit by one
    outage do not retry in lockstep. Gives up when a read has failed for `give_up_after`
    seconds in a row (a Drive hiccup can last minutes), or after `attempts` failures in a row
    when that is set. Progress resets both counts.
    """

    attempts: int | None = None
    backoff: float = 0.5
    max_backoff: float = 20.0
    give_up_after: float = 300.0
    jitter: float = 0.25

    def delay(self, failure: int) -> float:
        """The wait before retry number `failure` (1-based)."""
        base = min(self.max_backoff, self.backoff * 2 ** (failure - 1))
        if self.jitter <= 0:
            return base
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)

    def gives_up(self, failures: int, first_failure: float) -> bool:
        """Whether to stop after `failures` in a row, the first at `first_failure`
        (`time.monotonic()`)."""
        if self.attempts is not None and failures >= self.attempts:
            return True
        return time.monotonic() - first_failure >= self.give_up_after


DEFAULT_RETRY = RetryPolicy()


def http_status(err: BaseException) -> int | None:
    """The HTTP status an aiohttp/fsspec error carries, or None."""
    status = getattr(err, "status", None)
    return status if isinstance(status, int) else None


def as_os_error(err: BaseException, url: str) -> BaseException:
    """`err` as the OSError kind that says whether retrying can help; other errors as they are.

    HTTP 404/410 -> FileNotFoundError, 401/403 -> PermissionError, 408/425/429/5xx and lost
    connections -> a transient OSError, any other 4xx -> PermanentReadError, each naming `url`
    (credentials redacted, as in the foreign error's text).
    """
    url = redact(url)
    if isinstance(err, OSError):
        return err
    module = type(err).__module__
    if isinstance(err, ValueError) and "support range requests" in str(err):
        return RangeNotSupportedError(url)  # fsspec's HTTPFile, when a ranged GET came back whole
    status = http_status(err)
    if status is not None and module.startswith(("aiohttp", "fsspec", "requests")):
        what = f"{url}: HTTP {status}"
        if status in (404, 410):
            return FileNotFoundError(errno.ENOENT, f"{what}: the file is gone; make the "
                                     "dataset again from what the server has now")
        if status in (401, 403):
            return PermissionError(errno.EACCES, f"{what}: access denied; check the "
                                   "credentials in storage_options or the URL's signature")
        if status in _RETRY_STATUSES or status >= 500:
            return OSError(errno.EIO, f"{what} ({redact(str(err))})")
        return PermanentReadError(errno.EIO, f"{what}: the server refuses the request "
                                  f"({redact(str(err))})")
    if module.startswith("aiohttp") or isinstance(err, TimeoutError):
        return ConnectionError(errno.ECONNRESET, f"{url}: {type(err).__name__}: "
                               f"{redact(str(err))}")
    return err


def is_transient(err: BaseException) -> bool:
    return (
        isinstance(err, OSError)
        and not isinstance(err, CorruptShardError)
        and not isinstance(err, PERMANENT_ERRORS)
    )


def retrying(call: Callable[[], T], policy: RetryPolicy, what: str, *,
             stop: threading.Event | None = None) -> T:
    """`call()`, retried on transient errors per `policy`; `what` names it in messages.

    Errors come out as `as_os_error` kinds; when the policy gives up, `GaveUpError` says how
    many times and for how long it failed. Once `stop` is set (nobody wants the bytes any
    more), no attempt starts (`StoppedError`) and a failure is raised as it is: a backoff
    wait ends at once, so no request follows the stop.
    """
    failures, first = 0, 0.0
    while True:
        if stop is not None and stop.is_set():
            raise StoppedError(errno.ECANCELED, f"{redact(what)}: not read: its reader closed")
        try:
            return call()
        except Exception as raised:
            err = as_os_error(raised, what)
            if not is_transient(err) or (stop is not None and stop.is_set()):
                if err is raised:
                    raise
                raise err from safe_cause(raised)
            failures += 1
            if failures == 1:
                first = time.monotonic()
            if policy.gives_up(failures, first):
                waited = time.monotonic() - first
                raise GaveUpError(
                    getattr(err, "errno", None) or errno.EIO,
                    f"{redact(what)}: failed {failures} times in a row over {waited:.0f}s: "
                    f"{redact(str(err))}; check the storage, or give the dataset a longer "
                    "retry=streamds.RetryPolicy(give_up_after=...)",
                ) from safe_cause(raised)
            delay = policy.delay(failures)
            log.warning("%s failed (%s); retry %d in %.1fs", redact(what), redact(str(err)),
                        failures, delay)
            if stop is None:
                time.sleep(delay)
            else:
                stop.wait(delay)  # wakes when stopped: the loop's first line then gives up


def lookup_error(what: str, options: dict[str, Any], err: FileNotFoundError) -> Exception:
    """What a failed look at `what` (e.g. "source 'URL'", redacted) means.

    fsspec's HTTP filesystem reports every failure of its HEAD and GET as FileNotFoundError;
    the causes tell a refusal (HTTP 401/403: PermissionError), a server error (retried), a
    connection that could not be made (`UnreachableError`) and a storage option the
    filesystem does not take (TypeError) from a file that is not there.
    """
    for cause in _causes(err):
        status = http_status(cause)
        if status in (404, 410):
            break
        if status is not None:
            return as_os_error(cause, what)
        if isinstance(cause, TypeError) and options:
            return option_error(what, options, cause)
        if _is_connection_failure(cause):
            return UnreachableError(
                errno.ECONNREFUSED, f"{what}: could not connect ({describe_error(cause)}); "
                "check the host and port in the URL and that the server is running"
            )
    return FileNotFoundError(errno.ENOENT, f"{what} does not exist; check the path or URL")


def option_error(what: str, options: dict[str, Any], err: Exception) -> TypeError:
    """A storage option the filesystem does not take (names only: values may be secrets)."""
    return TypeError(
        f"{what}: the filesystem does not take one of storage_options "
        f"{sorted(map(str, options))} ({describe_error(err)}); check the option's name "
        "against the filesystem's documentation (s3fs, gcsfs, aiohttp's client for HTTP)"
    )


def _causes(err: BaseException) -> list[BaseException]:
    """The exceptions `err` was raised from, nearest first."""
    found: list[BaseException] = []
    link = err.__cause__ or err.__context__
    while link is not None and all(link is not seen for seen in found):
        found.append(link)
        link = link.__cause__ or link.__context__
    return found


def _is_connection_failure(err: BaseException) -> bool:
    """Whether `err` says no connection was made (refused, unreachable, no such host)."""
    return type(err).__name__.startswith("ClientConnector") or isinstance(
        err, (ConnectionRefusedError, socket.gaierror)
    )
