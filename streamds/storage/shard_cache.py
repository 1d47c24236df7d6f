"""A local write-through cache of remote or mounted shards, shared by every process on a node.

Layout: ``cache_dir/<namespace>/<key>-<name>``, where the namespace is a digest of the
dataset's shard list (per shard its manifest checksum, name and size, or without a manifest
its URL and size: two corpora never collide, and a corpus mounted or served elsewhere finds
its copies) and the key is the shard's checksum (or a digest of its URL and version).
The version is what the storage said identifies the file's content when the dataset was made
(an ETag, a Last-Modified time, a local modification time): a file changed at the same size
gets a new key, never its stale copy; a shard with neither a checksum nor a version is not
cached, since nothing could tell its copy stale. URLs enter only as redacted (`Shard.url`)
and names without their query: no credential reaches a file name. Beside each copy,
``<file>.lock`` (an `fcntl.flock` lock) and, while it is being written, ``<file>.partial-<random>``.

- The first process to find a shard missing takes the shard's lock exclusively (without
  waiting) and becomes its copier: the bytes its readers fetch from the source are written
  through into the partial file as they stream (and read back from it when asked again), and
  a background thread fetches the rest, from the shard's end backwards, so it meets the
  readers rather than racing them: with one reader each byte is fetched about once. Other
  processes keep reading the source meanwhile, so nobody stalls on a download and a node
  downloads each shard about once (their own blocks again, with several workers). The copy is
  checked against the listed size and the manifest's checksum, then renamed into place: a
  partial file is never read as complete.
- A process using a complete copy holds the lock shared until it closes the copy; it checks
  the copy's size, and its checksum once, when it first opens it. A damaged copy is removed
  and the shard is read from the source (and copied again).
- Under `limit` bytes, least-recently-used complete copies are removed to make room; a copy
  whose lock someone holds (a reader using it, a download) is never removed. A shard larger
  than the limit is not cached.

A dead process's lock goes with it; its partial file is removed by the next download of that
shard.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..redact import redact
from .locks import fcntl, remove_if_unused, try_lock
from .shards import Shard

__all__ = ["CLAIMS", "Cache", "ShardCacheSettings", "namespace_of", "pread_full"]

log = logging.getLogger(__name__)

COPY_REQUEST = 8 << 20  # bytes per request while copying a shard into the cache
_LOCK, _PARTIAL = ".lock", ".partial-"

Fetch = Callable[[Shard, int, int], bytes]  # stored bytes [start, end) from the source
_VERIFIED: set[tuple[str, int, int, int]] = set()  # copies whose checksum this process checked


class Source(Protocol):
    """The source's bytes, for a copier thread that outlives the reader that started it."""

    def read(self, shard: Shard, start: int, end: int) -> bytes: ...

    def close(self) -> None: ...


def pread_full(fd: int, start: int, end: int) -> bytes:
    """Bytes [start, end) of the file `fd`, fewer only where it ends."""
    parts, pos = [], start
    while pos < end:
        data = os.pread(fd, end - pos, pos)
        if not data:
            break
        parts.append(data)
        pos += len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _Filling:
    """A shard's partial copy being filled in this process: which bytes it holds so far.

    Readers that looked it up may still use it after the copier is done; the descriptor is
    closed once the last of them is (never while in use: a reused descriptor number would
    hand out another file's bytes).
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._held: list[list[int]] = []  # sorted, disjoint, non-adjacent [start, end)
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False

    def read(self, start: int, end: int) -> bytes | None:
        """Bytes [start, end) from the partial copy if it holds them all, else None."""
        end = min(end, self.size)
        with self._lock:
            if self._closed or not any(s <= start and end <= e for s, e in self._held):
                return None
            self._users += 1
        try:
            return pread_full(self.fd, start, end)
        finally:
            self._release()

    def write(self, start: int, data: bytes) -> None:
        """Keep bytes the source gave for [start, start + len(data))."""
        end = min(start + len(data), self.size)
        with self._lock:
            if self._closed or end <= start:
                return
            self._users += 1
        try:
            os.pwrite(self.fd, memoryview(data)[: end - start], start)
        finally:
            self._release()
        with self._lock:
            apart = [span for span in self._held if span[1] < start or span[0] > end]
            touching = [span for span in self._held if not (span[1] < start or span[0] > end)]
            low = min([start, *(span[0] for span in touching)])
            high = max([end, *(span[1] for span in touching)])
            self._held = sorted([*apart, [low, high]])

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._closed and not self._users:
                os.close(self.fd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if not self._users:
                os.close(self.fd)

    def gaps(self) -> list[tuple[int, int]]:
        """The byte ranges not held yet, last first."""
        with self._lock:
            found, gap_end = [], self.size
            for start, end in reversed(self._held):
                if end < gap_end:
                    found.append((end, gap_end))
                gap_end = start
        if gap_end > 0:
            found.append((0, gap_end))
        return found


class _Claims:
    """Byte ranges of shards that this process's read-ahead has asked the source for and not
    yet received: a copier leaves them to the readers, whose bytes are written through."""

    STALE = 60.0  # seconds without any claim settling, after which a copier ignores claims

    def __init__(self) -> None:
        self._ranges: dict[str, list[tuple[int, int]]] = {}
        self._changed = threading.Condition()

    def add(self, path: str, start: int, end: int) -> None:
        with self._changed:
            self._ranges.setdefault(path, []).append((start, end))

    def remove(self, path: str, start: int, end: int) -> None:
        with self._changed:
            ranges = self._ranges.get(path, [])
            if (start, end) in ranges:  # (not after a fork reset the registry)
                ranges.remove((start, end))
            if not ranges:
                self._ranges.pop(path, None)
            self._changed.notify_all()

    def free_part(self, path: str, gaps: list[tuple[int, int]], most: int
                  ) -> tuple[int, int] | None:
        """Up to `most` bytes at the end of the last unclaimed part of `gaps` (last first);
        None after waiting a while for claims to settle (look at the gaps again)."""
        with self._changed:
            part = self._last_free(path, gaps, most)
            if part is None and not self._changed.wait(self.STALE):
                part = (max(gaps[0][0], gaps[0][1] - most), gaps[0][1])  # claims stuck
            return part

    def _last_free(self, path: str, gaps: list[tuple[int, int]], most: int
                   ) -> tuple[int, int] | None:
        claimed = sorted(self._ranges.get(path, ()), reverse=True)
        for low, high in gaps:
            for start, end in claimed:  # from the last claim down: cut the gap's free top
                if start < high and end > low:
                    if end < high:  # free above this claim
                        low = max(low, end)
                        break
                    high = start
            if high > low:
                return max(low, high - most), high
        return None


CLAIMS = _Claims()
_FILLING: dict[str, _Filling] = {}  # cache path -> the copy this process is filling
_FILLING_LOCK = threading.Lock()


def _forget_fillings() -> None:
    """In a forked child: the copier threads stayed in the parent, and the lock may have
    been held by one of them when the fork happened."""
    global _FILLING_LOCK
    _FILLING_LOCK = threading.Lock()
    _FILLING.clear()
    CLAIMS.__init__()  # in place: other modules hold it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_fillings)


def _name(shard: Shard) -> str:
    """The file name part of the shard's URL (no query: it may hold a signature)."""
    return shard.url.partition("?")[0].rstrip("/").rsplit("/", 1)[-1]


def _identity(shard: Shard, *, versioned: bool = True) -> str:
    """What names a shard's bytes: its manifest checksum and name, else its (redacted) URL and
    the version the storage gave for it (left out of the namespace: one changed file gets a
    new copy, the others keep theirs)."""
    if shard.checksum is not None:
        return f"{shard.checksum}\0{_name(shard)}\0{shard.size}"
    if not versioned:
        return f"{shard.url}\0{shard.size}"
    return f"{shard.url}\0{shard.size}\0{shard.version}"


def _uncheckable(shard: Shard) -> str | None:
    """Why a copy of `shard` could not be told stale (None: it can)."""
    if shard.size is None:
        return "the storage does not give its size"
    if shard.checksum is None and shard.version is None:
        return ("the storage gives no ETag or modification time and no manifest lists its "
                "checksum, so a changed file could not be told from its stale copy")
    return None


def namespace_of(shards: Sequence[Shard]) -> str:
    """A digest of the shard list: what the cache of one dataset is filed under."""
    digest = hashlib.blake2b(digest_size=8)
    for shard in shards:
        digest.update(_identity(shard, versioned=False).encode() + b"\n")
    return digest.hexdigest()


@dataclass(frozen=True)
class ShardCacheSettings:
    """Where and how much to cache: a picklable description (no files open)."""

    directory: str
    limit: int | None  # bytes of complete copies in `directory`, all namespaces; None: no limit
    namespace: str


def _checksum(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh64()
    with path.open("rb") as f:
        while data := f.read(1 << 20):
            digest.update(data)
    return digest.hexdigest()



class Cache:
    """One process's use of a `ShardCacheSettings`: thread-safe; `close()` releases its copies."""

    def __init__(self, spec: ShardCacheSettings, fetch: Fetch,
                 new_source: Callable[[], Source]) -> None:
        if fcntl is None:
            raise OSError(errno.ENOSYS, "cache_dir needs file locks (fcntl), which this system "
                          "lacks; leave cache_dir unset")
        self.spec = spec
        self._fetch = fetch  # the owner's reads of the source
        self._new_source = new_source  # a copier thread's own, closed when the copy ends
        self._root = Path(spec.directory) / spec.namespace
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, int]] = {}  # shard path -> (lock fd, data fd)
        self._refused: set[str] = set()  # shards larger than the limit: never cached
        self._closed = False

    def path_of(self, shard: Shard) -> Path:
        key = hashlib.blake2b(_identity(shard).encode(), digest_size=6).hexdigest()
        return self._root / f"{key}-{_name(shard)}"

    def read(self, shard: Shard, start: int, end: int) -> bytes:
        """Stored bytes [start, end) of `shard`: from its complete copy, else from the source
        (written through into the copy when this process is filling it)."""
        fd = self.local_fd(shard)
        if fd is not None:
            return pread_full(fd, start, end)
        with _FILLING_LOCK:
            filling = _FILLING.get(str(self.path_of(shard)))
        if filling is None:
            return self._fetch(shard, start, end)
        data = filling.read(start, end)
        if data is None:
            data = self._fetch(shard, start, end)
            filling.write(start, data)
        return data

    def local_fd(self, shard: Shard) -> int | None:
        """A descriptor of the shard's complete local copy, or None (read the source; a copy
        is started when nobody is making one)."""
        with self._lock:
            held = self._open.get(shard.path)
            if held is not None:
                return held[1]
            if self._closed or shard.path in self._refused:
                return None
            if (why := _uncheckable(shard)) is not None:  # neither use a copy nor make one
                # warned once per process and dataset (a corpus may have thousands of shards)
                say = log.debug if self._refused else log.warning
                say("%s: not cached: %s; reading the source", shard.url, why)
                self._refused.add(shard.path)
                return None
            with _FILLING_LOCK:
                if str(self.path_of(shard)) in _FILLING:
                    return None
            fd = self._use_copy(shard)
            if fd is None:
                self._start_copy(shard)
            return fd

    def _lock_fd(self, path: Path) -> int:
        self._root.mkdir(parents=True, exist_ok=True)
        return os.open(f"{path}{_LOCK}", os.O_RDWR | os.O_CREAT, 0o644)

    def _use_copy(self, shard: Shard) -> int | None:
        path = self.path_of(shard)
        if not path.exists():
            return None
        lock = self._lock_fd(path)
        if not try_lock(lock, fcntl.LOCK_SH):  # being written or removed right now
            os.close(lock)
            return None
        try:
            problem = self._check(shard, path)
        except FileNotFoundError:  # removed between the look and the lock
            problem = "gone"
        if problem is not None:
            if problem != "gone":
                log.warning("%s: cached copy %s is damaged (%s); reading the source",
                            shard.url, path, problem)
                remove_if_unused(path, lock)
            os.close(lock)
            return None
        fd = os.open(path, os.O_RDONLY)
        os.utime(path)  # most recently used
        self._open[shard.path] = (lock, fd)
        return fd

    def _check(self, shard: Shard, path: Path) -> str | None:
        """What is wrong with `path` as a copy of `shard` (None: nothing). The checksum is
        computed once per process for a given file (inode, size, modification time)."""
        stat = path.stat()
        if shard.size is not None and stat.st_size != shard.size:
            return f"{stat.st_size} bytes, the source has {shard.size}"
        seen = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if shard.checksum is not None and seen not in _VERIFIED:
            if (found := _checksum(path)) != shard.checksum:
                return f"checksum {found}, the manifest says {shard.checksum}"
            _VERIFIED.add(seen)
        return None

    def _start_copy(self, shard: Shard) -> None:
        if self.spec.limit is not None and shard.size > self.spec.limit:
            log.warning("%s: %d bytes is more than cache_limit=%d; not cached",
                        shard.url, shard.size, self.spec.limit)
            self._refused.add(shard.path)
            return
        path = self.path_of(shard)
        lock = self._lock_fd(path)
        if not try_lock(lock, fcntl.LOCK_EX):  # another process is copying it
            os.close(lock)
            return
        partial = Path(f"{path}{_PARTIAL}{secrets.token_hex(4)}")
        try:
            for stale in path.parent.glob(f"{path.name}{_PARTIAL}*"):
                stale.unlink(missing_ok=True)  # left by a process that died copying
            if path.exists() and self._check(shard, path) is None:
                filling = None  # completed by someone between our look and the lock
            else:
                self._make_room(shard.size)
                filling = _Filling(os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644),
                                   shard.size)
        except OSError as err:  # called under self._lock
            self._give_up(shard, partial, lock, err, locked=True)
            return
        if filling is not None:
            with _FILLING_LOCK:
                _FILLING[str(path)] = filling
        # not a daemon: a DataLoader worker whose epoch ends waits for its copies to finish
        threading.Thread(target=self._complete, args=(shard, path, partial, lock, filling),
                         daemon=False, name="streamds-cache").start()

    def _complete(self, shard: Shard, path: Path, partial: Path, lock: int,
                  filling: _Filling | None) -> None:
        """Fetch what the readers have not into `partial`, from the end backwards; check it,
        rename it to `path` and keep using it (shared lock)."""
        try:
            if filling is not None:
                source = self._new_source()
                try:
                    while gaps := filling.gaps():
                        part = CLAIMS.free_part(shard.path, gaps, COPY_REQUEST)
                        if part is not None:
                            filling.write(part[0], source.read(shard, *part))
                finally:
                    source.close()
                os.fsync(filling.fd)
                problem = self._check(shard, partial)
                if problem is not None:
                    raise OSError(errno.EIO, f"the copy has {problem}")
                os.replace(partial, path)
                stat = path.stat()  # checked above under its partial name
                if shard.checksum is not None:
                    _VERIFIED.add((str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns))
            fcntl.flock(lock, fcntl.LOCK_SH)  # complete: from now on only in use
            with self._lock:
                if self._closed:
                    os.close(lock)
                else:
                    self._open[shard.path] = (lock, os.open(path, os.O_RDONLY))
        except BaseException as err:  # a failed copy costs only speed: the source is read
            self._give_up(shard, partial, lock, err)
        finally:
            if filling is not None:
                with _FILLING_LOCK:
                    _FILLING.pop(str(path), None)
                filling.close()

    def _give_up(self, shard: Shard, partial: Path, lock: int, err: BaseException, *,
                 locked: bool = False) -> None:
        log.warning("%s: copying into the cache failed (%s); reading the source", shard.url,
                    redact(str(err)))
        partial.unlink(missing_ok=True)
        os.close(lock)
        if locked:
            self._refused.add(shard.path)
            return
        with self._lock:
            self._refused.add(shard.path)

    def _make_room(self, needed: int) -> None:
        """Remove least-recently-used complete copies nobody uses until `needed` more bytes
        fit under the limit."""
        limit = self.spec.limit
        if limit is None:
            free = shutil.disk_usage(self._root).free
            if needed > free:
                raise OSError(errno.ENOSPC, f"{needed} bytes do not fit in {self._root}")
            return
        copies = []
        for entry in Path(self.spec.directory).glob("*/*"):
            name = entry.name
            if name.endswith(_LOCK) or _PARTIAL in name or not entry.is_file():
                continue
            stat = entry.stat()
            copies.append((stat.st_mtime, stat.st_size, entry))
        used = sum(size for _, size, _ in copies)
        for _, size, entry in sorted(copies):
            if used + needed <= limit:
                return
            lock = os.open(f"{entry}{_LOCK}", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if remove_if_unused(entry, lock):
                    used -= size
            finally:
                os.close(lock)
        if used + needed > limit:
            raise OSError(errno.ENOSPC, f"cache_limit={limit} bytes: {used} are in use and "
                          f"{needed} more do not fit")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            held, self._open = list(self._open.values()), {}
        for lock, fd in held:
            os.close(fd)
            os.close(lock)  # releases the shared lock


