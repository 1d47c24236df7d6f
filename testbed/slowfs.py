"""A slow, read-only FUSE mirror of a local folder: the testbed for "data on a mounted drive".

`SlowFS` passes every request through to `source` and adds what a network drive costs:

- `latency` seconds on every metadata request (getattr, which is also the kernel's lookup;
  readdir, open, readlink, statfs) and on every read request;
- `bandwidth` bytes/s shared by all reads (a link: concurrent reads queue for it);
- `eio_every`: every Nth read request fails with EIO (Drive's `[Errno 5]`).

Requests run on libfuse's thread pool (fusepy's default, nothreads=False), so delays overlap
as they would on a real link. The mount is `ro,max_read=131072` with libfuse 2's caching
defaults: no `kernel_cache`, so every open drops the file's cached pages (an epoch never reads
from the previous epoch's page cache); attributes and names are cached for 1 s; no
`direct_io`, so the kernel reads ahead and splits reads into requests of at most 128 KiB.
Remount (a new `mount()`) for a cold start.

    with mount(Path("data"), Path("/mnt/slow"), latency=0.02) as mp:
        records = [json.loads(p.read_bytes()) for p in sorted(mp.rglob("*.json"))]

From the shell (foreground; `fusermount -u MOUNTPOINT` or Ctrl-C ends it):

    python -m testbed.slowfs SOURCE MOUNTPOINT --latency 0.02 --bandwidth 10MB --eio-every 50

`--stats FILE` writes request counters as JSON when the filesystem unmounts: calls per
operation, read request sizes, the most requests (and reads) in flight at once, bytes read
and errors injected.
"""

from __future__ import annotations

import argparse
import ctypes.util
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["SlowFS", "fuse_available", "main", "mount"]

ROOT = Path(__file__).resolve().parent.parent
MAX_READ = 131072  # bytes per read request, the kernel's usual ceiling
DELAYED = frozenset({"getattr", "readdir", "open", "readlink", "statfs"})  # + every read
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def fuse_available() -> str | None:
    """None when this machine can mount a `SlowFS`, else the reason it cannot.

    Checks /dev/fuse, libfuse (2.x, what fusepy loads), fusermount, the right to mount and
    fusepy itself. A container without CAP_SYS_ADMIN passes these and still fails to mount:
    `mount()` then raises with libfuse's message.
    """
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (the fuse kernel module is not loaded or not passed to this container)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if not (os.environ.get("FUSE_LIBRARY_PATH") or ctypes.util.find_library("fuse")):
        return "no libfuse 2 (install libfuse2: apt-get install libfuse2)"
    fusermount = shutil.which("fusermount") or shutil.which("fusermount3")
    if fusermount is None:
        return "no fusermount (install fuse: apt-get install fuse)"
    if os.geteuid() != 0 and not os.stat(fusermount).st_mode & stat.S_ISUID:
        return f"not root and {fusermount} is not setuid: this user cannot mount"
    try:
        import fuse
    except (ImportError, OSError) as err:
        return f"fusepy cannot be loaded ({err}); pip install fusepy"
    if not hasattr(fuse, "Operations"):
        return f"the 'fuse' module at {fuse.__file__} is not fusepy (pip install fusepy)"
    return None


class _Stats:
    """Request counters, updated from libfuse's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.read_sizes: Counter[int] = Counter()
        self.in_flight = self.reads_in_flight = 0
        self.max_in_flight = self.max_reads_in_flight = 0
        self.bytes_read = self.eio_injected = 0

    def enter(self, op: str) -> None:
        with self.lock:
            self.calls[op] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if op == "read":
                self.reads_in_flight += 1
                self.max_reads_in_flight = max(self.max_reads_in_flight, self.reads_in_flight)

    def leave(self, op: str) -> None:
        with self.lock:
            self.in_flight -= 1
            if op == "read":
                self.reads_in_flight -= 1

    def as_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "calls": dict(self.calls),
                "read_sizes": {str(k): v for k, v in sorted(self.read_sizes.items())},
                "max_in_flight": self.max_in_flight,
                "max_reads_in_flight": self.max_reads_in_flight,
                "bytes_read": self.bytes_read,
                "eio_injected": self.eio_injected,
            }


class SlowFS:
    """Read-only passthrough of `source` with a delay per request, a shared bandwidth cap and
    injected EIO. Every delayed request sleeps `latency` (requests overlap); a read then waits
    for its turn on the link, `size / bandwidth` seconds after the previous read's turn.

    fusepy registers only the operations a class defines, so the kernel never sends the
    others (access, opendir, flush: answered by the kernel or libfuse without a round trip).
    """

    use_ns = True  # fusepy: times in nanoseconds

    def __init__(self, source: Path, *, latency: float = 0.02, bandwidth: float | None = None,
                 eio_every: int = 0, stats_path: Path | None = None) -> None:
        if latency < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {latency}")
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s or None (no cap), got {bandwidth}")
        if eio_every < 0:
            raise ValueError(f"eio_every must be >= 0 (0: never), got {eio_every}")
        self.source = Path(source).resolve()
        self.latency = latency
        self.bandwidth = bandwidth
        self.eio_every = eio_every
        self.stats_path = stats_path
        self.stats = _Stats()
        self._reads = 0
        self._link_free = 0.0  # monotonic time the link finishes its queued transfers

    def __call__(self, op: str, *args: Any) -> Any:
        self.stats.enter(op)
        try:
            if op in DELAYED:
                time.sleep(self.latency)
            return getattr(self, op)(*args)
        finally:
            self.stats.leave(op)

    def _real(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
        st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
        return {
            "st_mode": st.st_mode & ~0o222, "st_nlink": st.st_nlink, "st_size": st.st_size,
            "st_uid": st.st_uid, "st_gid": st.st_gid, "st_atime": st.st_atime_ns,
            "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns,
        }

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *sorted(os.listdir(self._real(path)))]

    def readlink(self, path: str) -> str:
        return os.readlink(self._real(path))

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._real(path))
        return {key: getattr(st, key) for key in (
            "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
            "f_favail", "f_namemax")}

    def open(self, path: str, flags: int) -> int:
        from fuse import FuseOSError

        if flags & _WRITE_FLAGS:
            raise FuseOSError(errno.EROFS)
        return os.open(self._real(path), os.O_RDONLY)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        from fuse import FuseOSError

        with self.stats.lock:
            self._reads += 1
            fail = self.eio_every and self._reads % self.eio_every == 0
            self.stats.read_sizes[size] += 1
        time.sleep(self.latency)
        if fail:
            with self.stats.lock:
                self.stats.eio_injected += 1
            raise FuseOSError(errno.EIO)
        data = os.pread(fh, size, offset)
        if self.bandwidth:
            with self.stats.lock:
                now = time.monotonic()
                self._link_free = max(now, self._link_free) + len(data) / self.bandwidth
                done = self._link_free
            time.sleep(max(0.0, done - time.monotonic()))
        with self.stats.lock:
            self.stats.bytes_read += len(data)
        return data

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def destroy(self, path: str) -> None:
        if self.stats_path is not None:
            self.stats_path.write_text(json.dumps(self.stats.as_dict(), indent=1))


def _fusermount() -> str:
    found = shutil.which("fusermount") or shutil.which("fusermount3")
    if found is None:
        raise RuntimeError(fuse_available() or "no fusermount")
    return found


@contextmanager
def mount(source: Path, mountpoint: Path, latency: float = 0.02, bandwidth: float | None = None,
          eio_every: int = 0, *, stats: Path | None = None,
          timeout: float = 15.0) -> Iterator[Path]:
    """Mount a `SlowFS` of `source` at `mountpoint` (made if missing) in a subprocess for the
    `with` block; yields the mountpoint. Unmounts with `fusermount -u` on exit (lazily, then
    by killing the process, if the mount is still busy). `stats`: a file that gets the
    request counters as JSON after the unmount."""
    reason = fuse_available()
    if reason is not None:
        raise RuntimeError(f"FUSE is not usable here: {reason}")
    source, mountpoint = Path(source), Path(mountpoint)
    if not source.is_dir():
        raise ValueError(f"source must be a directory, got {source}")
    mountpoint.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(mountpoint):
        raise RuntimeError(f"{mountpoint} is already a mount point; unmount it first "
                           f"(fusermount -u {mountpoint})")
    command = [sys.executable, "-m", "testbed.slowfs", str(source), str(mountpoint),
               "--latency", repr(latency), "--eio-every", str(eio_every)]
    if bandwidth is not None:
        command += ["--bandwidth", repr(bandwidth)]
    if stats is not None:
        command += ["--stats", str(stats)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

        def output() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")[-3000:]

        deadline = time.monotonic() + timeout
        while not os.path.ismount(mountpoint):
            if process.poll() is not None:
                raise RuntimeError(f"slowfs exited with {process.returncode} before mounting "
                                   f"{mountpoint}:\n{output()}")
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(f"{mountpoint} was not mounted after {timeout} s:\n{output()}")
            time.sleep(0.02)
        try:
            yield mountpoint
        finally:
            _unmount(mountpoint, process)


def _unmount(mountpoint: Path, process: subprocess.Popen) -> None:
    fusermount = _fusermount()
    for attempt in ([fusermount, "-u", str(mountpoint)], [fusermount, "-u", "-z", str(mountpoint)]):
        if subprocess.run(attempt, capture_output=True).returncode == 0:
            try:
                process.wait(timeout=10)
                return
            except subprocess.TimeoutExpired:
                break
        time.sleep(0.2)
    process.kill()
    process.wait()
    if os.path.ismount(mountpoint):  # the process died with the mount still in the table
        subprocess.run([fusermount, "-u", "-z", str(mountpoint)], capture_output=True)


def _size(text: str) -> float:
    units = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}
    lowered = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if lowered.endswith(unit):
            return float(lowered[: -len(unit)]) * units[unit]
    return float(lowered)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--latency", type=float, default=0.02,
                        help="seconds added to every metadata and read request (default 0.02)")
    parser.add_argument("--bandwidth", type=_size,
                        help="bytes/s shared by all reads, e.g. 10MB (default: no cap)")
    parser.add_argument("--eio-every", type=int, default=0,
                        help="every Nth read request fails with EIO (default 0: never)")
    parser.add_argument("--stats", type=Path, help="write request counters here on unmount")
    args = parser.parse_args(argv)
    reason = fuse_available()
    if reason is not None:
        parser.error(f"FUSE is not usable here: {reason}")
    from fuse import FUSE

    ops = SlowFS(args.source, latency=args.latency, bandwidth=args.bandwidth,
                 eio_every=args.eio_every, stats_path=args.stats)
    FUSE(ops, str(args.mountpoint), foreground=True, nothreads=False, ro=True,
         max_read=MAX_READ, fsname=f"slowfs:{ops.source}", subtype="slowfs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
