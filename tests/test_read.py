"""The read stage through its seam: `read_lines` over a fake `Opener` of in-memory bytes.

The fake serves the decoded bytes of one shard from any offset, counts opens and reads, and
raises injected errors on chosen reads, so line alignment at block edges and the retry loop
are tested without files.
"""

from __future__ import annotations

import io
import logging
import tarfile
from collections.abc import Callable, Iterator

import corpus
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamds import CorruptShardError, Storage, StreamingJsonl
from streamds.retry import is_transient
from streamds.storage.plan import Block
from streamds.storage.ranges import RangeReader
from streamds.storage.read import RetryPolicy, read_lines
from streamds.storage.shards import Shard

NO_WAIT = RetryPolicy(backoff=0)


def eio() -> OSError:
    return OSError(5, "Input/output error")


class FakeFile(io.RawIOBase):
    """`storage.data` from `offset` on, one `storage.read_hook` call per read."""

    def __init__(self, storage: FakeStorage, offset: int) -> None:
        self._storage = storage
        self._pos = offset

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        self._storage.before_read(self)
        end = len(self._storage.data) if size is None or size < 0 else self._pos + size
        data = self._storage.data[self._pos : end]
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class FakeStorage:
    """An `Opener` over in-memory decoded bytes.

    `fail_reads` numbers reads across all opens (1-based) that raise `error()` instead.
    """

    def __init__(
        self,
        data: bytes,
        *,
        fail_reads: set[int] | frozenset[int] = frozenset(),
        error: Callable[[], Exception] = eio,
    ) -> None:
        self.data = data
        self.fail_reads = set(fail_reads)
        self.error = error
        self.opens: list[int] = []  # the offset of every open
        self.reads = 0
        self.failed = 0  # injected errors raised

    def __call__(self, shard: Shard, offset: int, end: int | None = None) -> FakeFile:
        self.opens.append(offset)
        return FakeFile(self, offset)

    def before_read(self, file: FakeFile) -> None:
        self.reads += 1
        if self.reads in self.fail_reads:
            self.failed += 1
            raise self.error()


def shard_of(data: bytes, fmt: str = "jsonl") -> Shard:
    return Shard(url=f"memory://shard.{fmt}", path="shard", size=len(data), format=fmt, codec=None)


def file_lines(data: bytes) -> list[tuple[int, bytes]]:
    """(offset, line) of every line of `data`; a final line without a newline counts."""
    lines: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end
        lines.append((pos, data[pos:end]))
        pos = end + 1
    return lines


def blocks_at(cuts: list[int]) -> list[Block]:
    """Blocks [0, a), [a, b), ..., [z, None) of one shard."""
    starts = [0, *cuts]
    return [Block(0, start, end) for start, end in zip(starts, [*cuts, None], strict=True)]


def read_block(
    data: bytes,
    block: Block,
    opener: FakeStorage,
    *,
    read_size: int,
    resume_at: int | None = None,
    retry: RetryPolicy = NO_WAIT,
    block_id: int = 0,
) -> Iterator[tuple[int, bytes]]:
    """(offset, line) pairs `read_lines` yields for `block`, checking each chunk's shape."""
    next_offset = None
    chunks = read_lines(
        shard_of(data), block, block_id, resume_at=resume_at, opener=opener, retry=retry,
        read_size=read_size,
    )
    for chunk in chunks:
        assert chunk.block == block_id
        assert len(chunk.offsets) == len(chunk.lines) + 1
        assert next_offset is None or chunk.offsets[0] == next_offset
        next_offset = chunk.offsets[-1]
        yield from zip(chunk.offsets[:-1], chunk.lines, strict=True)


def read_blocks(data: bytes, blocks: list[Block], opener: FakeStorage, **options) -> list:
    return [pair for block in blocks for pair in read_block(data, block, opener, **options)]


line = st.binary(max_size=12).map(lambda b: b.replace(b"\n", b""))
line_text = st.lists(line, max_size=30).flatmap(
    lambda lines: st.sampled_from([b"\n".join(lines), b"\n".join(lines) + b"\n"])
)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[bytes, list[int], int]:
    """(data, block cuts, read size)."""
    data = draw(line_text)
    cuts = draw(st.lists(st.integers(1, max(1, len(data))), max_size=8, unique=True))
    return data, sorted(cuts) if data else [], draw(st.integers(1, 16))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_consecutive_blocks_yield_every_line_once_with_its_offset(layout):
    data, cuts, read_size = layout
    lines = read_blocks(data, blocks_at(cuts), FakeStorage(data), read_size=read_size)
    assert lines == file_lines(data)


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_resume_at_a_line_yields_the_rest_of_its_block(layout, draw):
    data, cuts, read_size = layout
    block = draw.draw(st.sampled_from(blocks_at(cuts)))
    owned = read_blocks(data, [block], FakeStorage(data), read_size=read_size)
    if not owned:
        return
    index = draw.draw(st.integers(0, len(owned) - 1))
    storage = FakeStorage(data)
    rest = list(read_block(data, block, storage, read_size=read_size, resume_at=owned[index][0]))
    assert rest == owned[index:]
    assert storage.opens == [owned[index][0]]  # no re-alignment: it opens at the line


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_transient_errors_are_retried_without_loss_or_repeats(layout, draw):
    data, cuts, read_size = layout
    blocks = blocks_at(cuts)
    clean = FakeStorage(data)
    expected = read_blocks(data, blocks, clean, read_size=read_size)
    fail_reads = draw.draw(st.sets(st.integers(1, clean.reads), min_size=1, max_size=5))
    flaky = FakeStorage(data, fail_reads=fail_reads)
    assert read_blocks(data, blocks, flaky, read_size=read_size) == expected
    assert flaky.failed >= 1  # the first injected error is always reached
    assert len(flaky.opens) == len(clean.opens) + flaky.failed  # one reopen per error
    # every open is at a line start, or just before a block to find its first line
    line_starts = {0, len(data)} | {offset for offset, _ in expected}
    aligning = {block.start - 1 for block in blocks if block.start > 0}
    assert set(flaky.opens) <= line_starts | aligning


def test_retry_reopens_at_the_first_line_not_yet_yielded():
    data = b"".join(b"%03d\n" % i for i in range(100))  # 4-byte lines
    storage = FakeStorage(data, fail_reads={4})
    lines = list(read_block(data, Block(0, 0, None), storage, read_size=10))
    assert lines == file_lines(data)
    # reads 1-3 delivered 30 bytes, i.e. 7 whole lines (28 bytes): reopen at line 8
    assert storage.opens == [0, 28]


@pytest.mark.parametrize(
    "error", [FileNotFoundError, PermissionError, IsADirectoryError], ids=lambda e: e.__name__
)
def test_permanent_errors_are_not_retried(error):
    data = b'{"a": 1}\n' * 50
    storage = FakeStorage(data, fail_reads={2}, error=lambda: error(2, "gone"))
    with pytest.raises(error):
        list(read_block(data, Block(0, 0, None), storage, read_size=16))
    assert len(storage.opens) == 1


def test_corrupt_data_is_not_retried():
    data = b'{"a": 1}\n' * 50
    storage = FakeStorage(
        data, fail_reads={2}, error=lambda: CorruptShardError("bad frame", url="x", offset=9)
    )
    with pytest.raises(CorruptShardError, match="bad frame"):
        list(read_block(data, Block(0, 0, None), storage, read_size=16))
    assert len(storage.opens) == 1


def test_retry_gives_up_after_attempts():
    data = b'{"a": 1}\n' * 50
    storage = FakeStorage(data, fail_reads=set(range(1, 100)))
    with pytest.raises(OSError, match=r"memory://shard.jsonl: reading failed 3 times") as raised:
        list(read_block(data, Block(0, 0, None), storage, read_size=16,
                        retry=RetryPolicy(attempts=3, backoff=0)))
    assert len(storage.opens) == 3
    assert "Input/output error" in str(raised.value)


def test_progress_resets_the_failure_count():
    data = b"ab\n" * 200
    # every other read fails: each open delivers one read of whole lines, then an error
    storage = FakeStorage(data, fail_reads=set(range(2, 10_000, 2)))
    lines = list(read_block(data, Block(0, 0, None), storage, read_size=16,
                            retry=RetryPolicy(attempts=2, backoff=0)))
    assert lines == file_lines(data)
    assert len(storage.opens) > 2


def test_backoff_doubles_up_to_its_cap(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("streamds.storage.read.time.sleep", slept.append)
    data = b'{"a": 1}\n' * 10
    storage = FakeStorage(data, fail_reads={1, 2, 3, 4})
    retry = RetryPolicy(attempts=6, backoff=0.5, max_backoff=1.5, jitter=0)
    assert list(read_block(data, Block(0, 0, None), storage, read_size=64, retry=retry)) == (
        file_lines(data)
    )
    assert slept == [0.5, 1.0, 1.5, 1.5]


def test_backoff_is_jittered_around_its_doubling(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("streamds.storage.read.time.sleep", slept.append)
    data = b'{"a": 1}\n' * 10
    storage = FakeStorage(data, fail_reads=set(range(1, 9)))
    retry = RetryPolicy(backoff=1.0, max_backoff=4.0, jitter=0.25)
    assert list(read_block(data, Block(0, 0, None), storage, read_size=64, retry=retry)) == (
        file_lines(data)
    )
    bases = [1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert all(0.75 * b <= s <= 1.25 * b for s, b in zip(slept, bases, strict=True))
    assert slept != bases  # readers hit by one outage do not retry in lockstep


def test_retry_gives_up_after_its_time(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("streamds.retry.time.monotonic", lambda: clock[0])
    monkeypatch.setattr(
        "streamds.storage.read.time.sleep", lambda s: clock.__setitem__(0, clock[0] + s)
    )
    data = b'{"a": 1}\n' * 10
    storage = FakeStorage(data, fail_reads=set(range(1, 10_000)))
    retry = RetryPolicy(backoff=1.0, max_backoff=10.0, give_up_after=60.0, jitter=0)
    with pytest.raises(OSError, match=r"failed 10 times in a row.*give_up_after") as raised:
        list(read_block(data, Block(0, 0, None), storage, read_size=64, retry=retry))
    assert not is_transient(raised.value)  # a caller up the stack does not retry again
    assert clock[0] == 65  # waited 1 + 2 + 4 + 8 + 5 x 10 s; failing at 65 s >= 60: gave up


def tar_of(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return buffer.getvalue()


def read_tar(data: bytes, storage: FakeStorage, resume_at: int | None = None) -> list:
    chunks = read_lines(shard_of(data, "tar"), Block(0), 0, resume_at=resume_at, opener=storage,
                        retry=NO_WAIT, read_size=512)
    return [pair for chunk in chunks for pair in zip(chunk.offsets, chunk.lines, strict=False)]


TAR_MEMBERS = {
    **{f"s{i:03d}.json": b'{"i": %d}' % i for i in range(40)},
    "notes.txt": b"not a record",
    "rest.jsonl": b"".join(b'{"j": %d}\n' % j for j in range(30)),
}


def test_tar_records_are_numbered_by_ordinal():
    data = tar_of(TAR_MEMBERS)
    pairs = read_tar(data, FakeStorage(data))
    assert [offset for offset, _ in pairs] == list(range(70))
    assert pairs[0][1] == b'{"i": 0}' and pairs[-1][1] == b'{"j": 29}'
    assert read_tar(data, FakeStorage(data), resume_at=35) == pairs[35:]


def test_tar_read_errors_are_retried_from_the_next_record():
    data = tar_of(TAR_MEMBERS)
    clean = FakeStorage(data)
    expected = read_tar(data, clean)
    assert clean.reads > 3
    for failing_read in range(2, clean.reads + 1):
        storage = FakeStorage(data, fail_reads={failing_read})
        assert read_tar(data, storage) == expected
        assert len(storage.opens) == 2


# -- end to end: the real opener, through every codec -----------------------------------------


def flaky_requests(monkeypatch, fail: set[int]) -> list[int]:
    """Make the storage requests numbered in `fail` (from 1, over all shards) raise EIO,
    in small requests so that a shard takes many; returns the request counter."""
    counter = [0]
    real = RangeReader._read_once

    def read_once(self, shard, start, end):
        counter[0] += 1
        if counter[0] in fail:
            raise eio()
        return real(self, shard, start, end)

    monkeypatch.setattr(RangeReader, "_read_once", read_once)
    monkeypatch.setattr("streamds.storage.ranges.DIRECT_REQUEST", 1024)
    monkeypatch.setattr("streamds.storage.readahead.MIN_PIECE", 1024)
    monkeypatch.setattr("streamds.formats.codecs.READ_SIZE", 1024)  # compressed reads too
    return counter


@pytest.mark.parametrize("readahead", [0, 4 << 10], ids=["direct", "readahead"])
@pytest.mark.parametrize(
    "name",
    ["p.jsonl", "s.jsonl.zst", "f.jsonl.zst", "g.jsonl.gz", "b.jsonl.bz2", "x.jsonl.xz", "t.tar"],
)
def test_storage_errors_are_retried_through_every_codec(
    tmp_path, monkeypatch, caplog, name, readahead
):
    records = corpus.make_records(3000)
    if name == "f.jsonl.zst":
        path = corpus.write_foreign_zst(tmp_path / name, corpus.jsonl(records))
    else:
        path = corpus.write(tmp_path / name, records)
    # quick waits (read-ahead threads wait on their stop event, not time.sleep)
    ds = StreamingJsonl(path, storage=Storage(readahead=readahead, retry=RetryPolicy(
        backoff=0.001, max_backoff=0.001)))
    counter = flaky_requests(monkeypatch, {2, 3, 5})
    with caplog.at_level(logging.WARNING, logger="streamds.retry"):
        assert list(ds) == records
    retried = [r for r in caplog.records if "; retry " in r.getMessage()]
    assert counter[0] > 5 and len(retried) >= 3  # the errors were hit, and waited out


@pytest.mark.parametrize("remote_mount", [False, True], ids=["local disk", "remote mount"])
def test_a_file_on_a_local_disk_is_read_a_read_at_a_time_and_handed_on_uncopied(
        tmp_path, monkeypatch, remote_mount):
    """A local disk is asked for a line reader's read at a time, and a read of all a request
    fetched is the request's own bytes; a network or FUSE mount keeps big requests (each is
    a round trip)."""
    import streamds.storage.ranges as ranges
    from streamds.storage.shards import resolve_shards

    path = tmp_path / "a.jsonl"
    corpus.write_plain(path, corpus.jsonl(corpus.make_records(30_000)))  # ~1.7 MB
    monkeypatch.setattr(ranges, "on_remote_mount", lambda paths: remote_mount)
    fetched: list[bytes] = []
    real = RangeReader._read_once

    def read_once(self, shard, start, end):
        fetched.append(real(self, shard, start, end))
        return fetched[-1]

    monkeypatch.setattr(RangeReader, "_read_once", read_once)
    (shard,) = resolve_shards(str(path))
    file = ranges.RangeFile(RangeReader(), shard, 0)  # nothing planned: the storage's size
    first = file.read(ranges.LOCAL_REQUEST)
    assert len(fetched) == 1
    size = path.stat().st_size
    assert len(fetched[0]) == (size if remote_mount else ranges.LOCAL_REQUEST) < 2 << 20
    assert (first is fetched[0]) is not remote_mount  # all of a request: not a copy of it
    assert first + file.read(1 << 30) == path.read_bytes()
