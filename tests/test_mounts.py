"""Mounts: read-ahead for network and FUSE mounts, and direct reads on FUSE mounts.

On a FUSE mount the read-ahead threads read with O_DIRECT (through the page cache the kernel
keeps only a few requests in flight, however many threads ask). The last test mounts a real
FUSE filesystem (`testbed.slowfs`) when this machine can.
"""

from __future__ import annotations

import os
from pathlib import Path

import corpus
import pytest

import streamds.storage.mounts as mounts
import streamds.storage.ranges as ranges
from streamds import Storage, StreamingJsonl
from streamds.storage.ranges import RangeReader
from streamds.storage.readahead import on_fuse
from streamds.storage.shards import resolve_shards
from testbed.slowfs import fuse_available, mount

RECORDS = corpus.make_records(2000)


def test_the_mount_table_decides_remote_and_fuse(tmp_path, monkeypatch):
    drive, nfs = tmp_path / "drive", tmp_path / "nfs"
    drive.mkdir()
    nfs.mkdir()
    table = ((str(drive.resolve()), "fuse.drivefs"), (str(nfs.resolve()), "nfs4"), ("/", "ext4"))
    monkeypatch.setattr(mounts, "_mounts", lambda: table)
    assert mounts.on_fuse_mount([str(drive / "a.jsonl")])
    assert mounts.on_remote_mount([str(drive / "a.jsonl")])
    assert not mounts.on_fuse_mount([str(nfs / "a.jsonl")])
    assert mounts.on_remote_mount([str(nfs / "a.jsonl")])
    assert not mounts.on_remote_mount([str(tmp_path / "a.jsonl")])
    link = tmp_path / "link"
    link.symlink_to(drive)  # where the path really is counts
    assert mounts.on_fuse_mount([str(link / "a.jsonl")])
    resolved: list[str] = []
    real_realpath = os.path.realpath
    monkeypatch.setattr(mounts.os.path, "realpath",
                        lambda path: resolved.append(path) or real_realpath(path))
    assert mounts.on_fuse_mount([str(drive / "a.jsonl")])
    assert resolved == []  # on a mount as written: no round trip per component to resolve it


@pytest.mark.parametrize(("start", "end"), [(0, 4096), (1, 70_001), (12_345, 300_000),
                                            (299_990, 400_000)])
def test_direct_reads_give_the_files_bytes_at_any_offset(tmp_path, start, end):
    data = os.urandom(300_000)
    path = tmp_path / "blob"
    path.write_bytes(data)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    try:
        assert ranges._pread_direct(fd, start, end) == data[start:end]
    finally:
        os.close(fd)


def test_readers_on_a_fuse_mount_open_their_files_direct(tmp_path, monkeypatch):
    path = corpus.write(tmp_path / "a.jsonl", RECORDS)
    shard = resolve_shards(path)[0]
    monkeypatch.setattr(mounts, "_mounts", lambda: ((str(tmp_path.resolve()), "fuse"),))
    opened: list[int] = []
    real_open = os.open

    def spy(file, flags, *args):
        opened.append(flags)
        return real_open(file, flags, *args)

    monkeypatch.setattr(ranges.os, "open", spy)
    assert on_fuse([shard])
    direct = RangeReader(fuse_direct=True)
    try:
        assert direct.read(shard, 100, 5000) == path.read_bytes()[100:5000]
    except OSError:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    finally:
        direct.close()
    plain = RangeReader()  # the single-threaded reader keeps the kernel's read-ahead
    plain.read(shard, 0, 10)
    plain.close()
    assert [bool(flags & os.O_DIRECT) for flags in opened] == [True, False]


@pytest.mark.skipif(fuse_available() is not None, reason=f"FUSE: {fuse_available()}")
def test_a_real_fuse_mount_reads_every_record_once_in_order(tmp_path, monkeypatch):
    source = tmp_path / "source"
    source.mkdir()
    corpus.write(source / "a.jsonl", RECORDS[:1000])
    corpus.write(source / "b.jsonl", RECORDS[1000:])
    direct_reads = [0]
    real = ranges._pread_direct

    def counted(fd: int, start: int, end: int) -> bytes:
        direct_reads[0] += 1
        return real(fd, start, end)

    monkeypatch.setattr(ranges, "_pread_direct", counted)
    with mount(source, tmp_path / "mnt", latency=0.001) as mountpoint:
        ds = StreamingJsonl(Path(mountpoint), storage=Storage(block_size=64 << 10))
        assert ds.readahead > 0  # on by default on a mount
        assert [r["id"] for r in ds] == [r["id"] for r in RECORDS]
    assert direct_reads[0] > 0
