"""Which mount a local path is on, from the kernel's mount table.

Read-ahead turns on for paths on network and FUSE mounts (a mounted Drive), and reads from
FUSE mounts bypass the page cache (`ranges.RangeReader(fuse_direct=True)`): see there why.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["on_fuse_mount", "on_remote_mount"]

# filesystem types (as /proc/self/mountinfo names them) whose every request crosses a network
# or a user-space daemon: a Colab Drive is "fuse.drive"-like, sshfs "fuse.sshfs"
_REMOTE_MOUNTS = ("fuse", "nfs", "cifs", "smb", "9p", "ceph", "lustre", "glusterfs", "afs",
                  "davfs", "gcsfuse", "virtiofs")


def _mounts() -> tuple[tuple[str, str], ...]:
    """(mount point, filesystem type) of this machine's mounts, longest point first (read
    afresh: mounts come and go while a program runs)."""
    found = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                after = line.split(" - ", 1)[1].split()
                point = fields[4].replace("\\040", " ")
                found.append((point, after[0] if after else ""))
    except OSError:  # not Linux: no mount table to read
        return ()
    return tuple(sorted(found, key=lambda m: len(m[0]), reverse=True))


def _kind(path: str, mounts: tuple[tuple[str, str], ...]) -> str:
    return next((kind for point, kind in mounts
                 if path == point or path.startswith(point.rstrip("/") + "/")), "")


def _kinds(paths: Iterable[str]) -> Iterable[str]:
    """The filesystem type of each path's mount ("" when not found). A path that lies on a
    remote mount as written is taken as it is: resolving its links there would cost a round
    trip per component."""
    mounts = _mounts()
    for path in paths:
        kind = _kind(os.path.abspath(path), mounts)
        yield kind if kind.startswith(_REMOTE_MOUNTS) else _kind(os.path.realpath(path), mounts)


def on_remote_mount(paths: Iterable[str]) -> bool:
    """Whether any of `paths` is on a network or FUSE mount."""
    return any(kind.startswith(_REMOTE_MOUNTS) for kind in _kinds(paths))


def on_fuse_mount(paths: Iterable[str]) -> bool:
    """Whether any of `paths` is on a FUSE mount."""
    return any(kind == "fuse" or kind.startswith("fuse.") for kind in _kinds(paths))
