"""Faults (DESIGN.md guarantee 7): flaky storage is invisible; damaged shards are named.

`FlakyFileSystem` is a real fsspec filesystem (the local one, under the test protocol
``flaky://``) whose files fail chosen reads the way Google Drive and network mounts do:
``OSError(5, "Input/output error")`` or ``ConnectionResetError``, every k-th read, at chosen
byte offsets, or on open, a bounded number of times. Reads are also capped at `max_read`
bytes, so a shard takes many reads and faults land in the middle of files, after lines were
handed out. A run over ``flaky://`` must equal a clean run, order included; past the retry
limit the error names the file and the offset. Then damaged shards: truncated or flipped
bytes raise CorruptShardError naming the file, or are skipped and counted.
"""

from __future__ import annotations

import io
import random
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import corpus
import fsspec
import pytest
import zstandard
from fsspec.implementations.local import LocalFileSystem
from resume_contract import ids, run_test_save_load_state
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import streamds
import streamds.storage.read
from streamds import CorruptShardError, StreamingJsonl
from streamds.formats.seekable import read_seek_table
from streamds.storage.plan import make_blocks
from streamds.storage.read import RetryPolicy

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

KiB = 1024


def io_error() -> OSError:
    return OSError(5, "Input/output error")


def connection_reset() -> OSError:
    return ConnectionResetError(104, "Connection reset by peer")


class FaultPlan:
    """Which opens and reads of a FlakyFileSystem fail; records every failure it injects.

    every: every k-th read call fails (counted over all files), at most `limit` times in all.
    at: {raw byte offset: n}: the next n reads that cover that offset fail.
    opens: the next n opens fail.
    max_read: no read returns more than this many bytes (a short read, as from a socket).
    """

    def __init__(
        self,
        *,
        every: int | None = None,
        limit: int | None = None,
        at: dict[int, int] | None = None,
        opens: int = 0,
        max_read: int | None = 16 * KiB,
        error: Callable[[], OSError] = io_error,
    ) -> None:
        self.every = every
        self.limit = limit
        self.at = dict(at or {})
        self.opens = opens
        self.max_read = max_read
        self.error = error
        self.reads = 0
        self.failures: list[tuple[str, int | None]] = []  # (path, raw offset; None: an open)

    def _fail(self, path: str, position: int | None) -> None:
        self.failures.append((path, position))
        raise self.error()

    def before_open(self, path: str) -> None:
        if self.opens > 0:
            self.opens -= 1
            self._fail(path, None)

    def before_read(self, path: str, position: int, size: int) -> int:
        """The size this read may return; raises the planned error instead when it fails."""
        self.reads += 1
        if self.max_read is not None and size > 0:
            size = min(size, self.max_read)
        span = size if size > 0 else 1 << 62
        for offset, left in self.at.items():
            if left > 0 and position <= offset < position + span:
                self.at[offset] = left - 1
                self._fail(path, position)
        due = self.every is not None and self.reads % self.every == 0
        if due and (self.limit is None or len(self.failures) < self.limit):
            self._fail(path, position)
        return size


class FlakyFile(io.RawIOBase):
    """A local file whose reads go through a FaultPlan first."""

    def __init__(self, inner: Any, path: str, plan: FaultPlan) -> None:
        self._inner = inner
        self._path = path
        self._plan = plan

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def read(self, size: int | None = -1) -> bytes:
        size = -1 if size is None else size
        size = self._plan.before_read(self._path, self._inner.tell(), size)
        return self._inner.read(size)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._inner.close()
        super().close()


class FlakyFileSystem(LocalFileSystem):
    """The local filesystem under ``flaky://``; files fail as `plan` says (none: never)."""

    protocol = "flaky"
    root_marker = "/"
    cachable = False  # every dataset gets its own instance, so plans never leak between tests

    def __init__(self, plan: FaultPlan | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plan = plan

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        plan = self.plan
        if plan is None or "r" not in mode:
            return super()._open(path, mode=mode, **kwargs)
        plan.before_open(path)
        return FlakyFile(super()._open(path, mode=mode, **kwargs), path, plan)


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)


def arm(dataset: StreamingJsonl, plan: FaultPlan) -> FaultPlan:
    """Make the files of `dataset` fail as `plan` says from now on (the constructor ran clean)."""
    for shard in dataset.shards:
        shard.fs.plan = plan
    return plan


def flaky_url(path: Path) -> str:
    return f"flaky://{path}"


def fast_retries(attempts: int) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, backoff=0.0)


# -- corpora ---------------------------------------------------------------------------------------


def lines_of(count: int, start: int) -> list[bytes]:
    """JSON lines of random hex text: ~240 bytes each, compressing only about 2x."""
    rng = random.Random(start)
    return [
        corpus.jsonl([{"id": i, "text": rng.randbytes(100 + i % 17).hex()}])
        for i in range(start, start + count)
    ]


def seekable(path: Path, data: bytes) -> Path:
    return corpus.write_seekable_zst(path, data, frame_size=64 * KiB)


FORMATS: dict[str, Callable[[Path, bytes], Path]] = {
    "jsonl": corpus.write_plain,
    "jsonl.zst": seekable,
    "jsonl.gz": corpus.write_gz,
    "tar": corpus.write_tar_jsonl,
}
BIG = 6500  # records in the big shard: ~1.5 MB decoded, more than one 1 MiB read of any codec


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per format, a directory with one big and one small shard."""
    root = tmp_path_factory.mktemp("faults")
    made = {}
    for suffix, writer in FORMATS.items():
        directory = root / suffix.replace(".", "-")
        directory.mkdir()
        writer(directory / f"big.{suffix}", b"".join(lines_of(BIG, 0)))
        writer(directory / f"small.{suffix}", b"".join(lines_of(20, 100_000)))
        made[suffix] = directory
    return made


def read_ids(dataset: StreamingJsonl, num_workers: int = 0) -> list[int]:
    if num_workers == 0:
        return [record["id"] for record in dataset]
    loader = DataLoader(dataset, batch_size=64, num_workers=num_workers, collate_fn=ids)
    return [i for batch in loader for i in batch]


# -- transient faults are retried, invisibly ------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("error", [io_error, connection_reset], ids=["EIO", "reset"])
@pytest.mark.parametrize("suffix", FORMATS)
def test_transient_read_errors_are_invisible(
    shards: dict[str, Path], suffix: str, error: Callable[[], OSError], shuffle: bool
) -> None:
    url = flaky_url(shards[suffix])
    clean = read_ids(StreamingJsonl(url, shuffle=shuffle, seed=9, buffer_size=500))
    dataset = StreamingJsonl(url, shuffle=shuffle, seed=9, buffer_size=500)
    dataset.retry = fast_retries(7)
    plan = arm(dataset, FaultPlan(every=5, limit=6, error=error))
    assert read_ids(dataset) == clean
    assert len(plan.failures) == 6  # the faults really happened ...
    assert any(position for _, position in plan.failures)  # ... and not only at file starts
    assert sorted(clean) == list(range(BIG)) + list(range(100_000, 100_020))


@pytest.mark.parametrize("suffix", FORMATS)
def test_failed_opens_are_retried(shards: dict[str, Path], suffix: str) -> None:
    url = flaky_url(shards[suffix])
    clean = read_ids(StreamingJsonl(url))
    dataset = StreamingJsonl(url)
    dataset.retry = fast_retries(3)
    plan = arm(dataset, FaultPlan(opens=2, error=connection_reset))
    assert read_ids(dataset) == clean
    assert [at for _, at in plan.failures] == [None, None]  # two opens failed (read-ahead
    # opens shards in parallel, so they may be of two files)


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz"])
def test_transient_faults_in_workers(shards: dict[str, Path], suffix: str) -> None:
    url = flaky_url(shards[suffix])
    clean = read_ids(StreamingJsonl(url, shuffle=True, buffer_size=100), num_workers=2)
    dataset = StreamingJsonl(url, shuffle=True, buffer_size=100)
    dataset.retry = fast_retries(3)
    arm(dataset, FaultPlan(every=4, limit=2))  # each worker process gets its own copy
    assert read_ids(dataset, num_workers=2) == clean


def test_resume_over_flaky_storage(shards: dict[str, Path]) -> None:
    """Resuming re-reads the shuffle buffer's records (`fetch`): that path retries too."""
    url = flaky_url(shards["jsonl.gz"])
    plans = []

    def make() -> StreamingJsonl:
        dataset = StreamingJsonl(url, shuffle=True, seed=4, buffer_size=300)
        dataset.retry = fast_retries(4)
        plans.append(arm(dataset, FaultPlan(every=3, limit=3)))
        return dataset

    cuts = [0, 1, 299, 3000, BIG + 19]
    run_test_save_load_state(make, cuts)
    assert sum(len(plan.failures) == 3 for plan in plans) >= len(cuts)  # resumed runs had faults


def test_retries_back_off_exponentially(
    shards: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(streamds.storage.read.time, "sleep", slept.append)  # record, never wait
    url = flaky_url(shards["jsonl"] / "big.jsonl")
    clean = read_ids(StreamingJsonl(url))
    # one request at a time: one run of failures
    dataset = StreamingJsonl(url, storage=streamds.Storage(readahead=0))
    dataset.retry = RetryPolicy(attempts=5, backoff=0.25, max_backoff=0.75, jitter=0)
    arm(dataset, FaultPlan(at={300_000: 4}))
    assert read_ids(dataset) == clean
    assert slept == [0.25, 0.5, 0.75, 0.75]


# -- past the retry limit: an error naming the file and the offset -----------------------------


def line_starts(lines: list[bytes]) -> list[int]:
    starts, offset = [], 0
    for line in lines:
        starts.append(offset)
        offset += len(line)
    return starts


@pytest.mark.parametrize(
    "suffix",
    [
        "jsonl",
        "jsonl.zst",
        "jsonl.gz",
        "tar",
    ],
)
def test_retries_give_up_after_the_limit(shards: dict[str, Path], suffix: str) -> None:
    path = shards[suffix] / f"big.{suffix}"
    url = flaky_url(path)
    fault = path.stat().st_size * 9 // 10  # a raw byte offset past the first 1 MiB decoded

    # read-ahead pieces of 256 KiB, so the fault lies past the first piece of every format
    just_enough = StreamingJsonl(url, storage=streamds.Storage(readahead=256 * KiB))
    just_enough.retry = fast_retries(4)
    arm(just_enough, FaultPlan(at={fault: 3}))  # never 4 failures in a row
    assert read_ids(just_enough) == list(range(BIG))

    dataset = StreamingJsonl(url, storage=streamds.Storage(readahead=256 * KiB))
    dataset.retry = fast_retries(4)
    plan = arm(dataset, FaultPlan(at={fault: 1_000_000}))  # the storage never recovers
    got: list[int] = []
    with pytest.raises(OSError, match=re.escape(url)) as caught:
        got.extend(record["id"] for record in dataset)
    assert len(plan.failures) >= 4
    named = re.search(r"offset (\w+)", str(caught.value))
    assert named and named.group(1).isdigit(), f"no offset named: {caught.value}"
    stopped = int(named.group(1))
    assert stopped > 0  # the retries resumed mid-file: the records before the fault came
    if suffix == "tar":  # tar offsets count records
        assert got == list(range(stopped))
    else:  # decoded byte offsets: reading stopped at a line start, every line before it came
        starts = line_starts(lines_of(BIG, 0))
        assert got == [i for i, start in enumerate(starts) if start < stopped]


@pytest.mark.parametrize("attempts", [1, 4])
def test_retry_limit_is_exact(shards: dict[str, Path], attempts: int) -> None:
    url = flaky_url(shards["jsonl"] / "big.jsonl")
    dataset = StreamingJsonl(url)
    dataset.retry = fast_retries(attempts)
    plan = arm(dataset, FaultPlan(at={0: 1_000_000}))  # the first read of the file, forever
    with pytest.raises(OSError, match=rf"decoded offset 0: .*failed {attempts} times in a row"):
        next(iter(dataset))
    assert len(plan.failures) == attempts


@pytest.mark.parametrize("how", ["deleted", "unreadable"])
def test_permanent_errors_are_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(streamds.storage.read.time, "sleep", slept.append)
    path = corpus.write_plain(tmp_path / "a.jsonl", b"".join(lines_of(10, 0)))
    dataset = StreamingJsonl(flaky_url(path))
    if how == "deleted":
        path.unlink()
        expected: type[OSError] = FileNotFoundError
    else:
        arm(dataset, FaultPlan(opens=1, error=lambda: PermissionError(13, "Permission denied")))
        expected = PermissionError
    with pytest.raises(expected):
        next(iter(dataset))
    assert slept == []


def test_transient_error_while_reading_a_seek_table_is_retried(
    shards: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streamds.storage.read.time, "sleep", lambda seconds: None)
    path = shards["jsonl.zst"] / "big.jsonl.zst"
    plan = FaultPlan(at={path.stat().st_size - 9: 1})  # the seek table's footer
    dataset = StreamingJsonl(flaky_url(path), storage=streamds.Storage(options={"plan": plan}))
    assert plan.failures
    assert read_ids(dataset) == list(range(BIG))


# -- damaged shards --------------------------------------------------------------------------------


def small_frames(path: Path, data: bytes) -> Path:
    return corpus.write_seekable_zst(path, data, frame_size=16 * KiB)


def checked_foreign_zst(path: Path, data: bytes) -> Path:
    """One zstd frame with a content checksum, as the zstd command line writes by default.

    (Without a checksum a flipped byte can decode to other valid JSON: nothing can notice.)
    """
    path.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(data))
    return path


DAMAGE = {
    "truncated-seekable-zst": ("jsonl.zst", small_frames, "truncate"),
    "truncated-foreign-zst": ("jsonl.zst", corpus.write_foreign_zst, "truncate"),
    "truncated-gz": ("jsonl.gz", corpus.write_gz, "truncate"),
    "flipped-byte-seekable-zst": ("jsonl.zst", small_frames, "flip"),
    "flipped-byte-foreign-zst": ("jsonl.zst", checked_foreign_zst, "flip"),
}
DAMAGED = 1400  # records of the damaged shard: ~330 KB decoded, several frames and blocks


def damaged_shard(directory: Path, kind: str) -> Path:
    suffix, writer, how = DAMAGE[kind]
    path = writer(directory / f"damaged.{suffix}", b"".join(lines_of(DAMAGED, 50_000)))
    blob = bytearray(path.read_bytes())
    if how == "truncate":
        del blob[len(blob) * 6 // 10 :]
    else:
        blob[len(blob) // 2] ^= 0x5A  # a byte well inside the compressed data
    path.write_bytes(bytes(blob))
    return path


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_shard_raises_naming_file_and_offset(tmp_path: Path, kind: str) -> None:
    path = damaged_shard(tmp_path, kind)
    with pytest.raises(CorruptShardError) as caught:
        for _ in StreamingJsonl(str(path)):
            pass
    error = caught.value
    assert str(path) in str(error) and error.url == str(path)
    assert re.search(rf"offset {error.offset}\b", str(error))
    assert 0 <= error.offset <= max(path.stat().st_size, 2 * DAMAGED * 300)
    assert isinstance(error, OSError)  # callers can catch it as the I/O error it is


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_shard_is_skipped_and_counted(tmp_path: Path, kind: str, num_workers: int) -> None:
    corpus.write_plain(tmp_path / "a.jsonl", b"".join(lines_of(300, 0)))
    small_frames(tmp_path / "b.jsonl.zst", b"".join(lines_of(700, 10_000)))
    damaged_shard(tmp_path, kind)
    dataset = StreamingJsonl(str(tmp_path), on_error="skip", shuffle=True, buffer_size=64)
    if num_workers == 0:
        got = Counter(read_ids(dataset))
        counts = dataset.counts
    else:  # each worker counts in its own process; the counts travel in the loader's state
        loader = StatefulDataLoader(dataset, batch_size=64, num_workers=num_workers,
                                    collate_fn=ids)
        got = Counter(i for batch in loader for i in batch)
        counts = streamds.counts_of(loader.state_dict())
        with pytest.raises(RuntimeError):
            dataset.counts  # noqa: B018 -- the main process read nothing: no silent zeros
    undamaged = set(range(300)) | set(range(10_000, 10_700))
    assert {i: got[i] for i in undamaged} == dict.fromkeys(undamaged, 1)
    from_damaged = set(got) - undamaged
    assert from_damaged < set(range(50_000, 50_000 + DAMAGED))  # some were lost, none invented
    assert max(got.values()) == 1
    assert counts["corrupt_blocks"] >= 1, counts


def flipped_seekable(directory: Path) -> tuple[Path, int, list[Any]]:
    """A seekable shard of 5 blocks with one byte flipped in its last frame."""
    path = small_frames(directory / "damaged.jsonl.zst", b"".join(lines_of(DAMAGED, 0)))
    blob = bytearray(path.read_bytes())
    with path.open("rb") as f:
        frames = read_seek_table(f, len(blob))
    assert frames is not None
    last = frames[-1]
    flipped = last.compressed_offset + last.compressed_size // 2
    blob[flipped] ^= 0x5A
    path.write_bytes(bytes(blob))
    blocks = make_blocks(StreamingJsonl(str(path)).shards)
    assert len(blocks) >= 4
    return path, flipped, blocks


def test_zstd_damage_offset_is_a_file_offset(tmp_path: Path) -> None:
    path, flipped, blocks = flipped_seekable(tmp_path)
    last_reader = len(blocks) - 1  # one block per reader: this one owns the damaged frame
    dataset = StreamingJsonl(str(path), rank=last_reader, world_size=len(blocks))
    with pytest.raises(CorruptShardError) as caught:
        for _ in dataset:
            pass
    assert caught.value.offset > flipped  # "corrupt zstd data before compressed offset N"


def test_zstd_damage_costs_only_the_damaged_block(tmp_path: Path) -> None:
    path, _, blocks = flipped_seekable(tmp_path)
    dataset = StreamingJsonl(str(path), on_error="skip")
    got = read_ids(dataset)
    starts = line_starts(lines_of(DAMAGED, 0))
    intact = [i for i, start in enumerate(starts) if start < blocks[-1].start]
    assert dataset.counts["corrupt_blocks"] == 1
    assert got[: len(intact)] == intact
