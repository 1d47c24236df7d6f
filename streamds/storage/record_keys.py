"""The names of stored blocks: `block_key` (`streamds.storage.record_store`).

A key is a digest of the store's format version, the shard's identity (its name relative to
the source root, size, manifest checksum, or without one the version the storage gave: a
modification time, an ETag), how the shard is read (format, codec), the block's extent and
the caller's `key` (the tokenizer and its settings) and `upstream` (the settings of the
stages before the cache). A changed file or another key gives another name: nothing stale is
served. A shard with neither a checksum nor a version has no key (None): nothing could tell
its records stale. Names enter with their credentials removed, and only as part of a digest.
"""

from __future__ import annotations

import hashlib
import struct
from urllib.parse import urlsplit, urlunsplit

from ..redact import redact
from .plan import Block
from .record_codec import FORMAT_VERSION
from .shards import Shard

__all__ = ["KEY_DIGITS", "block_key", "check_key", "uncacheable"]

KEY_DIGITS = 32  # hex digits of a block key




def _plain_name(name: str) -> str:
    """`name` without a URL's user information and with its secret query values masked."""
    if "://" in name:
        parts = urlsplit(name)
        name = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path,
                           parts.query, ""))
    return redact(name)


def uncacheable(shard: Shard) -> str | None:
    """Why the records of `shard` cannot be cached (None: they can)."""
    if shard.checksum is None and shard.version is None:
        return ("the storage gives no ETag or modification time and no manifest lists its "
                "checksum, so a changed file could not be told from its cached records")
    return None


def block_key(shard: Shard, block: Block, *, name: str, key: str, upstream: str = ""
              ) -> str | None:
    """The name of `block`'s records in a store: 32 hex digits, or None where `uncacheable`.

    `name`: the shard's name relative to the source root (the same files under another mount
    point find their records); `key`: the user's key (e.g. the tokenizer and its settings);
    `upstream`: the settings of the stages before the cache that change what they yield (the
    error policy, how documents are read). Costs one digest of a few hundred bytes.
    """
    if uncacheable(shard) is not None:
        return None
    content = (f"checksum={shard.checksum}" if shard.checksum is not None
               else f"version={shard.version}")
    parts = (f"format={FORMAT_VERSION}", f"name={_plain_name(name)}", f"size={shard.size}",
             content, f"read={shard.format.name}/{shard.codec}",
             f"block={block.start}:{block.end}", f"key={key}", f"upstream={upstream}")
    digest = hashlib.blake2b(digest_size=KEY_DIGITS // 2)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        digest.update(struct.pack("<Q", len(data)) + data)  # length-prefixed: no ambiguity
    return digest.hexdigest()


def check_key(key: str) -> None:
    if not (isinstance(key, str) and len(key) == KEY_DIGITS
            and all(char in "0123456789abcdef" for char in key)):
        raise ValueError(f"a block key is {KEY_DIGITS} lowercase hex digits, got {key!r}; "
                         "make it with block_key(...)")
