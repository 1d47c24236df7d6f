"""Credentials out of text: what every message, log record, repr and recorded file goes through.

A URL may carry a secret in two places: its userinfo (``https://user:password@host/``,
``https://TOKEN@host/``) and query parameters that sign or authorise the request (a presigned
S3 or GCS URL's ``X-Amz-Signature``/``X-Amz-Credential``/``Signature``/``GoogleAccessId``, an
Azure SAS ``sig``, ``token``, ``access_token``, ``key``, ``api_key``, ``password`` ...).
A Hugging Face token (``hf_...``) is masked wherever it stands. `redact` replaces both with
``***`` wherever a URL appears in a text, so it applies to a bare
URL, a chained one (``simplecache::https://...``) and a message or a foreign exception's text
alike; text without such URLs comes back unchanged. A parameter counts as secret when its name
(case-insensitively) contains one of `SECRET_PARTS`, or is one of `SECRET_NAMES`: hiding a
harmless parameter costs a little detail in a message, showing a secret is never right.

`storage_options` values are never formatted into text at all (only their names are), so they
need no rule here. This module imports nothing from streamds: every layer may use it.

streamds' own messages are redacted where they are made. The storage libraries log the URLs
they were given (fsspec's HTTP filesystem, at DEBUG, password and signature included), so
`guard_loggers` puts a `RedactingFilter` on their loggers: a filter on a logger sees the
records logged on that logger, which is where these are.
"""

from __future__ import annotations

import logging
import re
import traceback

__all__ = [
    "SECRET_NAMES",
    "SECRET_PARTS",
    "STORAGE_LOGGERS",
    "RedactingFilter",
    "describe_error",
    "guard_loggers",
    "redact",
    "safe_cause",
    "scrubbed",
]

MASK = "***"
SECRET_PARTS = ("token", "signature", "secret", "passw", "credential", "apikey", "api_key",
                "api-key", "accesskey", "access_key", "auth", "session")
SECRET_NAMES = frozenset({"sig", "key", "pwd", "pass", "googleaccessid", "code", "sas",
                          "x-amz-security-token", "x-goog-credential", "x-goog-signature"})

# scheme://userinfo@ : up to the last "@" before the path (a password may hold an unescaped
# "@"); "host/path@v1" has a "/" before the "@", so it is no userinfo
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^/?#\s'\"<>]+)@")
# a Hugging Face access token, wherever it stands (a header echoed in an error, a message)
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{16,}")
# ?name=value or &name=value (or ;): the value runs to the next separator, space or quote
_PARAM = re.compile(r"([?&;])([^=&;#\s'\"<>?]+)=([^&;#\s'\"<>]*)")


def _secret_name(name: str) -> bool:
    lowered = name.lower()
    return lowered in SECRET_NAMES or any(part in lowered for part in SECRET_PARTS)


def _mask_param(match: re.Match[str]) -> str:
    separator, name, value = match.groups()
    if not value or not _secret_name(name):
        return match.group(0)
    return f"{separator}{name}={MASK}"


def redact(text: str) -> str:
    """`text` with every URL's userinfo and secret query values replaced by ``***``.

    >>> redact("source 'https://me:pw@host/a.jsonl?X-Amz-Signature=abc&part=1' failed")
    "source 'https://***@host/a.jsonl?X-Amz-Signature=***&part=1' failed"
    """
    if "hf_" in text:
        text = _HF_TOKEN.sub(f"hf_{MASK}", text)
    if "@" not in text and "=" not in text:
        return text  # the common case: a local path or a message without URLs
    text = _USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    if "://" in text or "?" in text:
        text = _PARAM.sub(_mask_param, text)
    return text


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions a traceback of it would show (causes and contexts)."""
    seen: list[BaseException] = []
    link: BaseException | None = err
    while link is not None and all(link is not other for other in seen):
        seen.append(link)
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    return seen


def safe_cause(err: BaseException) -> BaseException | None:
    """`err` when no exception of its chain shows a credential in its text, else None.

    For ``raise New(...) from safe_cause(err)``: a traceback prints the text of every
    exception of the chain, and fsspec and aiohttp put the URL they were given (userinfo and
    signature included) into theirs; such a chain is cut, and the new message carries the
    cause's text through `describe_error` instead.
    """
    for link in _chain(err):
        text = str(link)
        if redact(text) != text:
            return None
    return err


def scrubbed(err: Exception) -> Exception:
    """`err` as an error of its nearest built-in class (FileNotFoundError, PermissionError,
    OSError, ValueError ...) with its text redacted, for a foreign error whose chain shows a
    credential (`safe_cause` is None): ``raise scrubbed(err) from None``."""
    builtin = next(cls for cls in type(err).__mro__ if cls.__module__ == "builtins")
    args = [redact(arg) if isinstance(arg, str) else arg for arg in err.args]
    if isinstance(err, OSError) and err.strerror is not None:
        args = [err.errno, redact(err.strerror)]  # (the file name, a URL, left out)
    try:
        return builtin(*args)
    except Exception:  # a class whose arguments are not its text
        return builtin(redact(str(err)))


def describe_error(err: BaseException) -> str:
    """``Type: text`` of `err`, redacted: a foreign error's words for a message."""
    text = redact(str(err))
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# the loggers of the storage libraries that log URLs as they were given
STORAGE_LOGGERS = ("fsspec", "fsspec.http", "fsspec.cached", "fsspec.reference", "s3fs",
                   "gcsfs", "adlfs", "aiohttp.client", "aiohttp.internal", "huggingface_hub")


class RedactingFilter(logging.Filter):
    """Redacts a record's message and its exception's text (keeps every record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            # formatters print a cached exc_text instead of formatting exc_info again
            record.exc_text = redact("".join(traceback.format_exception(*record.exc_info))
                                     ).rstrip("\n")
        return True


_FILTER = RedactingFilter()


def guard_loggers(names: tuple[str, ...] = STORAGE_LOGGERS) -> None:
    """Put the one `RedactingFilter` on each logger named (once; safe to call again)."""
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
