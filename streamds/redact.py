"""Credentials out of text: what every message, log record, repr and recorded file goes through.

A URL may carry a secret in two places: its userinfo (``https://user:password@host/``,
``https://TOKEN@host/``) and its query or fragment (a presigned S3 or GCS URL's
``X-Amz-Signature``, CloudFront's ``Policy``, an Azure SAS ``sig``, a ``jwt``, ``hmac`` or
``access_token``). `redact` replaces both with ``***`` wherever a URL appears in a text, so it
applies to a bare URL, a chained one (``simplecache::https://...``) and a message or a foreign
exception's text alike; text without such URLs comes back unchanged. A Hugging Face token
(``hf_...``) is masked wherever it stands.

The userinfo is everything between ``scheme://`` and the last ``@`` of the authority, whatever
characters it holds (a quote, an unescaped ``@``); where the authority reads ``user:x`` with
``x`` no port, a password with an unescaped ``/`` runs on to the ``@``. A query value is
hidden by where it sits or by what it looks like: the value of a parameter whose name
(case-insensitively) contains one of `SECRET_PARTS` or is one of `SECRET_NAMES`, and any value
that looks like a key or a signature (`looks_secret`: long, mixed letters and digits, high
entropy), whatever its name. Short ordinary values (``part=1``, ``split=train``, a date) stay
readable: hiding a harmless value costs a little detail in a message, showing a secret is
never right.

`storage_options` values are never formatted into text by streamds (only their names are).

The storage libraries log the URLs they were given (fsspec's HTTP filesystem at DEBUG, decoded:
a password's ``%27`` shows as ``'``), so `guard_source`, called where streamds reads a source,
puts a `RedactingFilter` on their loggers and tells it the literal secrets of that source (its
userinfo, its secret query values, the secret-named string values of its storage options):
a filter on a logger sees the records logged on that logger, which is where these are. This
module imports nothing from streamds: every layer may use it.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import traceback
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

__all__ = [
    "SECRET_NAMES",
    "SECRET_PARTS",
    "STORAGE_LOGGERS",
    "RedactingFilter",
    "describe_error",
    "guard_loggers",
    "guard_source",
    "looks_secret",
    "redact",
    "safe_cause",
    "scrubbed",
]

MASK = "***"
SECRET_PARTS = ("token", "signature", "secret", "passw", "credential", "apikey", "api_key",
                "api-key", "accesskey", "access_key", "auth", "session", "jwt", "hmac",
                "bearer", "policy", "sign", "private", "cookie", "ticket")
SECRET_NAMES = frozenset({"sig", "key", "k", "pwd", "pass", "googleaccessid", "code", "sas",
                          "x-amz-security-token", "x-goog-credential", "x-goog-signature"})

# scheme://: where a URL's authority starts
_SCHEME = re.compile(r"(?i)\b[a-z][a-z0-9+.\-]*://")
# the authority's "user:x" with x no port (empty, or digits): a password ran past a "/"
_NOT_A_PORT = re.compile(r"^[^:\[]*:(?!\d*$).+$")
# ?name=value, &name=value, ;name=value or #name=value: the value runs to the next separator
# or space; a quote ends it only where the quoted text ends (before a space, ")", "," ...)
_PARAM = re.compile(
    r"""([?&;#])([^=&;#\s'"<>?]+)=((?:[^&;#\s'"<>]|['"](?![\s),\]}>:;]|$))*)""")
# a Hugging Face access token, wherever it stands (a header echoed in an error, a message)
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{16,}")
_RUN = re.compile(r"[A-Za-z0-9+/]{16,}")  # a run of base64 characters as long as a key
_SECRET_BITS = 3.0  # Shannon entropy per character from which such a value looks random
_LITERAL_MIN = 4  # characters of a known secret that the log filter replaces wherever it shows


def looks_secret(value: str) -> bool:
    """Whether a query value looks like a key, token or signature whatever its name: it holds
    a run of 16 or more base64 characters mixing letters and digits at high entropy (a JWT's
    parts, a base64 or hex digest, an access key id), not words, numbers, dates or file names
    (``train-00001-of-00010.jsonl``: short runs)."""
    for run in _RUN.findall(value):
        if any(c.isdigit() for c in run) and any(c.isalpha() for c in run):
            counts = Counter(run)
            bits = -sum(n / len(run) * math.log2(n / len(run)) for n in counts.values())
            if bits >= _SECRET_BITS:
                return True
    return False


def _secret_name(name: str) -> bool:
    lowered = name.lower()
    return lowered in SECRET_NAMES or any(part in lowered for part in SECRET_PARTS)


def _mask_param(match: re.Match[str]) -> str:
    separator, name, value = match.groups()
    if not value or not (_secret_name(name) or looks_secret(unquote(value))):
        return match.group(0)
    return f"{separator}{name}={MASK}"


def _userinfo_end(text: str, start: int) -> int:
    """Where the userinfo of the URL whose authority begins at `start` ends (the index of
    its "@"), or -1 when the URL has none. The URL runs to the first space."""
    space = re.search(r"\s", text[start:])
    url = text[start : start + space.start()] if space else text[start:]
    slash = url.find("/")
    authority = url if slash < 0 else url[:slash]
    if "@" in authority:
        return start + authority.rfind("@")  # a password may hold an unescaped "@"
    if slash < 0 or not _NOT_A_PORT.match(authority):
        return -1  # "host/path@v1", "host:8080/a@b": no userinfo
    first = url.find("@", slash)  # "user:pa/ss@host/...": the password holds a "/"
    if first < 0:
        return -1
    after = url.find("/", first)
    return start + url.rfind("@", 0, len(url) if after < 0 else after)


def _mask_userinfo(text: str) -> str:
    parts, done = [], 0
    for match in _SCHEME.finditer(text):
        if match.start() < done:
            continue  # inside userinfo already masked
        end = _userinfo_end(text, match.end())
        if end >= 0:
            parts += [text[done : match.end()], MASK]
            done = end
    return "".join(parts) + text[done:] if parts else text


def redact(text: str) -> str:
    """`text` with every URL's userinfo and secret query values replaced by ``***``.

    >>> redact("source 'https://me:pw@host/a.jsonl?X-Amz-Signature=abc&part=1' failed")
    "source 'https://***@host/a.jsonl?X-Amz-Signature=***&part=1' failed"
    """
    if "hf_" in text:
        text = _HF_TOKEN.sub(f"hf_{MASK}", text)
    if "@" not in text and "=" not in text:
        return text  # the common case: a local path or a message without URLs
    if "@" in text:
        text = _mask_userinfo(text)
    if "://" in text or "?" in text or "#" in text:
        text = _PARAM.sub(_mask_param, text)
    return text


def _secrets_of(url: str) -> set[str]:
    """The literal secrets a URL carries: its userinfo (and password), as written and
    percent-decoded, and the values `redact` hides in its query."""
    found: set[str] = set()
    for match in _SCHEME.finditer(url):
        end = _userinfo_end(url, match.end())
        if end >= 0:
            userinfo = url[match.end() : end]
            found |= {userinfo, userinfo.partition(":")[2]}
    for _separator, name, value in _PARAM.findall(url):
        if value and (_secret_name(name) or looks_secret(unquote(value))):
            found.add(value)
    return {form for secret in found for form in (secret, unquote(secret))
            if len(form) >= _LITERAL_MIN}


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


# the loggers of the storage libraries that log URLs as they were given (and their children)
STORAGE_LOGGERS = ("fsspec", "fsspec.http", "fsspec.asyn", "fsspec.cached", "fsspec.caching",
                   "fsspec.generic", "fsspec.local", "fsspec.mapping", "fsspec.prefetcher",
                   "fsspec.reference", "fsspec.sftp", "webhdfs", "s3fs", "gcsfs", "adlfs",
                   "aiohttp.client", "aiohttp.internal", "huggingface_hub")


class RedactingFilter(logging.Filter):
    """Redacts a record's message and its exception's text (keeps every record): by `redact`,
    then every known secret (`remember`) wherever it shows, however the library spelled the
    URL around it."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._known: tuple[str, ...] = ()  # longest first: a secret holding another

    def remember(self, secrets: Iterable[str]) -> None:
        with self._lock:
            known = set(self._known) | {s for s in secrets if len(s) >= _LITERAL_MIN}
            self._known = tuple(sorted(known, key=len, reverse=True))

    def clean(self, text: str) -> str:
        text = redact(text)
        for secret in self._known:
            if secret in text:
                text = text.replace(secret, MASK)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.clean(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            # formatters print a cached exc_text instead of formatting exc_info again
            record.exc_text = self.clean(
                "".join(traceback.format_exception(*record.exc_info))).rstrip("\n")
        return True


_FILTER = RedactingFilter()


def guard_loggers(names: tuple[str, ...] = STORAGE_LOGGERS) -> None:
    """Put the one `RedactingFilter` on each logger named and on its children made so far
    (once; safe to call again)."""
    existing = [name for name in logging.Logger.manager.loggerDict
                if name.startswith(tuple(f"{parent}." for parent in names))]
    for name in (*names, *existing):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def _option_secrets(options: Mapping[str, Any]) -> Iterable[str]:
    """String values of secret-named options, nested ones too (client_kwargs' headers)."""
    for name, value in options.items():
        if isinstance(value, Mapping):
            yield from _option_secrets(value)
        elif isinstance(value, str) and _secret_name(str(name)):
            yield value.partition(" ")[2] or value  # "Bearer TOKEN": the token too
            yield value


def guard_source(items: Iterable[str], options: Mapping[str, Any] | None = None) -> None:
    """Before a source is read: the storage loggers redacted (`guard_loggers`), and the
    filter told the literal secrets of `items` (URLs) and of `options` (the string values of
    secret-named storage options), so a library's record that spells them differently from
    a URL (decoded, in a header, alone) is redacted too."""
    secrets = {secret for item in items for secret in _secrets_of(item)}
    secrets |= set(_option_secrets(options or {}))
    if secrets:
        _FILTER.remember(secrets)
    guard_loggers()
