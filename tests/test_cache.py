"""The local shard cache (`cache_dir=`): one verified copy per node, read in later epochs.

Shards are real converted seekable zstd shards with a manifest (so copies are checked against
the manifest's size and checksum). Copies are made by background threads named
"streamds-cache"; tests wait for them by joining those threads.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path

import corpus
import fsspec
import pytest
from torch.utils.data import DataLoader

import streamds.storage.mounts
import streamds.storage.readahead as readahead
from streamds import Storage, StreamingJsonl
from streamds.preprocess.convert import convert
from streamds.storage.ranges import RangeReader
from streamds.storage.shard_cache import Cache, ShardCacheSettings, namespace_of
from streamds.storage.shards import resolve_shards

RECORDS = corpus.make_records(3000)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four or more seekable shards of ~50 KB decoded, with a manifest."""
    root = tmp_path_factory.mktemp("cache-src")
    source = corpus.write(root / "all.jsonl", RECORDS)
    out = root / "shards"
    convert([source], out, shard_size=50_000, frame_size=16 << 10, progress=None)
    assert len(list(out.glob("*.jsonl.zst"))) >= 4
    return out


def wait_for_copies() -> None:
    for thread in threading.enumerate():
        if thread.name == "streamds-cache":
            thread.join()


def cache_of(spec: ShardCacheSettings) -> Cache:
    return Cache(spec, RangeReader()._read_source, RangeReader)


def copies(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.glob("*/*") if p.suffix == ".zst")


def count_source_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counter = [0]
    real = RangeReader._read_once

    def read_once(self, shard, start, end):
        counter[0] += 1
        return real(self, shard, start, end)

    monkeypatch.setattr(RangeReader, "_read_once", read_once)
    return counter


def ids(ds: StreamingJsonl, num_workers: int = 0) -> list[int]:
    if num_workers == 0:
        return [record["id"] for record in ds]
    loader = DataLoader(ds, batch_size=50, num_workers=num_workers, collate_fn=corpus.as_list)
    return [record["id"] for batch in loader for record in batch]


def test_second_epoch_reads_only_the_local_copies(shards, tmp_path, monkeypatch):
    reads = count_source_reads(monkeypatch)
    ds = StreamingJsonl(shards, storage=Storage(cache_dir=tmp_path / "cache"))
    assert ids(ds) == [r["id"] for r in RECORDS]
    wait_for_copies()
    assert reads[0] > 0
    made = copies(tmp_path / "cache")
    assert sorted(p.name.split("-", 1)[1] for p in made) == sorted(
        p.name for p in shards.glob("*.jsonl.zst"))
    for copy in made:  # byte for byte the source
        assert copy.read_bytes() == (shards / copy.name.split("-", 1)[1]).read_bytes()
    assert not list((tmp_path / "cache").glob("*/*.partial-*"))
    before = reads[0]
    ds.set_epoch(1)
    assert sorted(ids(ds)) == [r["id"] for r in RECORDS]
    assert reads[0] == before  # the second epoch never touched the source


def test_workers_in_several_processes_share_one_copy_per_shard(shards, tmp_path, monkeypatch):
    log = tmp_path / "copies.log"
    real_complete = Cache._complete

    def logged(self, shard, *args):  # runs in the forked workers: log to a file
        with open(log, "a") as f:
            f.write(f"{shard.path}\n")
        return real_complete(self, shard, *args)

    monkeypatch.setattr(Cache, "_complete", logged)
    cache = tmp_path / "cache"
    for epoch in range(2):
        ds = StreamingJsonl(shards, shuffle=True, seed=epoch, storage=Storage(cache_dir=cache))
        got = ids(ds, num_workers=3)
        assert sorted(got) == [r["id"] for r in RECORDS]  # every record once, in each epoch
    copied = log.read_text().split()
    assert len(copied) == len(set(copied))  # no shard was copied twice on this node
    assert len(copies(cache)) == len(set(copied)) >= 1
    assert not list(cache.glob("*/*.partial-*"))


def test_a_dead_copiers_partial_file_is_never_read_and_is_cleaned_up(shards, tmp_path):
    cache = tmp_path / "cache"
    first = StreamingJsonl(shards, storage=Storage(cache_dir=cache))
    shard = first.shards[0]
    spec = first._cache
    target = cache_of(spec).path_of(shard)
    target.parent.mkdir(parents=True)
    # what a process killed mid-copy leaves: half the bytes under a partial name and the lock
    # file (its lock went with it)
    Path(f"{target}.partial-dead").write_bytes(Path(shard.path).read_bytes()[: 1000])
    Path(f"{target}.lock").touch()
    assert ids(first) == [r["id"] for r in RECORDS]
    wait_for_copies()
    assert not Path(f"{target}.partial-dead").exists()
    assert target.read_bytes() == Path(shard.path).read_bytes()


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_copy_is_replaced_and_never_read(shards, tmp_path, caplog, damage):
    cache = tmp_path / "cache"
    ds = StreamingJsonl(shards, storage=Storage(cache_dir=cache))
    assert ids(ds) == [r["id"] for r in RECORDS]
    wait_for_copies()
    victim = copies(cache)[0]
    data = bytearray(victim.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 2 :]
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="streamds.storage.shard_cache"):
        data = StreamingJsonl(shards, storage=Storage(cache_dir=cache))
        assert ids(data) == [r["id"] for r in RECORDS]
    assert "is damaged" in caplog.text and victim.name in caplog.text
    wait_for_copies()
    assert victim.read_bytes() == (shards / victim.name.split("-", 1)[1]).read_bytes()


def test_eviction_removes_the_least_recently_used_copy_nobody_uses(shards, tmp_path):
    found = resolve_shards(shards)
    a, b, c = found[0], found[1], found[2]
    limit = a.size + b.size + c.size // 2  # room for two shards, not three
    spec = ShardCacheSettings(str(tmp_path / "cache"), limit, namespace_of(found))

    def use(cache: Cache, shard) -> None:
        assert cache.local_fd(shard) is None  # first touch: copying starts
        wait_for_copies()
        assert cache.local_fd(shard) is not None

    first = cache_of(spec)
    use(first, a)
    use(first, b)
    first.close()  # a and b: complete, unused; a is older
    os.utime(first.path_of(a), (1, 1))
    third = cache_of(spec)
    use(third, c)
    assert not third.path_of(a).exists() and third.path_of(b).exists()
    total = sum(p.stat().st_size for p in copies(tmp_path / "cache"))
    assert total <= limit

    # a copy in use is never removed: b is held by `holder`, c by `third`; a cannot fit
    holder = cache_of(spec)
    assert holder.local_fd(b) is not None
    fourth = cache_of(spec)
    assert fourth.local_fd(a) is None
    wait_for_copies()  # the copy gives up for want of room: nothing in use was removed
    assert third.path_of(b).exists() and third.path_of(c).exists()
    assert not third.path_of(a).exists()
    assert fourth.local_fd(a) is None  # read from the source instead
    for cache in (third, holder, fourth):
        cache.close()


def test_two_corpora_never_share_a_namespace(shards, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    corpus.write(other / "x.jsonl", RECORDS[:10])
    one = StreamingJsonl(shards, storage=Storage(cache_dir=tmp_path / "cache"))._cache
    two = StreamingJsonl(other, storage=Storage(cache_dir=tmp_path / "cache"))._cache
    assert one is not None and two is not None and one.namespace != two.namespace


def test_a_lock_held_elsewhere_means_the_source_is_read_meanwhile(shards, tmp_path):
    found = resolve_shards(shards)
    spec = ShardCacheSettings(str(tmp_path / "cache"), None, namespace_of(found))
    cache = cache_of(spec)
    target = cache.path_of(found[0])
    target.parent.mkdir(parents=True)
    fd = os.open(f"{target}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process is copying this shard
    try:
        assert cache.local_fd(found[0]) is None
        assert not [t for t in threading.enumerate() if t.name == "streamds-cache"]
    finally:
        os.close(fd)
    cache.close()


def test_cache_dir_must_be_a_local_directory(tmp_path):
    with pytest.raises(ValueError, match="cache_dir must be a local directory"):
        StreamingJsonl(corpus.write(tmp_path / "a.jsonl", RECORDS[:3]),
                       storage=Storage(cache_dir="s3://b/c"))
    with pytest.raises(ValueError, match="cache_limit"):
        StreamingJsonl(corpus.write(tmp_path / "b.jsonl", RECORDS[:3]),
                       storage=Storage(cache_dir=tmp_path, cache_limit="lots"))


def test_read_ahead_is_on_for_mounts_and_urls_and_off_on_local_disk(tmp_path, monkeypatch):
    path = corpus.write(tmp_path / "a.jsonl", RECORDS[:10])
    assert StreamingJsonl(path).readahead == 0  # a local disk: the kernel reads ahead
    mounts = ((str(tmp_path.resolve()), "fuse.drive"), ("/", "ext4"))
    monkeypatch.setattr(streamds.storage.mounts, "_mounts", lambda: mounts)
    assert StreamingJsonl(path).readahead == readahead.DEFAULT_READAHEAD  # a mounted Drive
    assert StreamingJsonl(path, storage=Storage(readahead="8MB")).readahead == 8_000_000
    assert StreamingJsonl(path, storage=Storage(readahead=0)).readahead == 0
    with fsspec.open("memory://corpus/a.jsonl", "wb") as f:
        f.write(path.read_bytes())
    assert StreamingJsonl("memory://corpus/a.jsonl").readahead == readahead.DEFAULT_READAHEAD


class GatedSource:
    """The copier's source: each request waits for the test's go-ahead and is recorded."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []
        self.waiting = threading.Semaphore(0)  # released when a request arrives
        self.go = threading.Semaphore(0)  # released by the test, one per request

    def read(self, shard, start: int, end: int) -> bytes:
        self.asked.append((start, end))
        self.waiting.release()
        assert self.go.acquire(timeout=60)
        return Path(shard.path).read_bytes()[start:end]

    def close(self) -> None:
        pass


def test_bytes_the_reader_fetches_are_written_through_and_the_copier_fetches_the_rest(
    shards, tmp_path, monkeypatch
):
    import streamds.storage.shard_cache as cache_module

    shard = resolve_shards(shards)[0]
    size = shard.size
    monkeypatch.setattr(cache_module, "COPY_REQUEST", size // 4)
    spec = ShardCacheSettings(str(tmp_path / "cache"), None, namespace_of([shard]))
    fetched: list[tuple[int, int]] = []

    def reader_fetch(shard, start, end):
        fetched.append((start, end))
        return Path(shard.path).read_bytes()[start:end]

    source = GatedSource()
    cache = Cache(spec, reader_fetch, lambda: source)
    source_bytes = Path(shard.path).read_bytes()
    three_quarters = size - size // 4
    half = three_quarters - size // 4

    # the first read starts the copier, which begins at the end
    assert cache.read(shard, 0, half) == source_bytes[:half]
    assert source.waiting.acquire(timeout=60)
    source.go.release()
    assert source.waiting.acquire(timeout=60)  # its second request: the first one is kept
    # the copier's bytes are read back from the partial copy, not fetched again
    assert cache.read(shard, three_quarters, size) == source_bytes[three_quarters:]
    assert fetched == [(0, half)]
    source.go.release()
    wait_for_copies()
    # between them, every byte was fetched once: the copier skipped what the reader wrote
    assert source.asked == [(three_quarters, size), (half, three_quarters)]
    assert cache.path_of(shard).read_bytes() == source_bytes
    assert not list((tmp_path / "cache").glob("*/*.partial-*"))
    assert cache.read(shard, 10, 20) == source_bytes[10:20]
    assert fetched == [(0, half)]  # complete: read locally
    cache.close()


def test_a_copy_is_complete_only_when_every_byte_is_held(shards, tmp_path, monkeypatch):
    """A copier that fails halfway leaves no copy: the partial file is removed, readers read
    the source, and a later process copies the shard again."""
    shard = resolve_shards(shards)[0]
    spec = ShardCacheSettings(str(tmp_path / "cache"), None, namespace_of([shard]))

    class Failing:
        def read(self, shard, start, end):
            raise OSError(5, "Input/output error")

        def close(self) -> None:
            pass

    cache = Cache(spec, RangeReader()._read_source, Failing)
    assert cache.read(shard, 0, 100) == Path(shard.path).read_bytes()[:100]
    wait_for_copies()
    assert not cache.path_of(shard).exists()
    assert not list((tmp_path / "cache").glob("*/*.partial-*"))
    assert cache.read(shard, 0, 100) == Path(shard.path).read_bytes()[:100]  # the source
    cache.close()
    again = cache_of(spec)
    again.read(shard, 0, 100)
    wait_for_copies()
    assert again.path_of(shard).read_bytes() == Path(shard.path).read_bytes()
    again.close()


def test_with_read_ahead_the_first_epoch_fetches_each_byte_about_once(shards, tmp_path,
                                                                      monkeypatch):
    """Read-ahead's bytes are written through and the copier fetches only the rest: one epoch
    with a cache costs one copy's bytes, not two."""
    fetched = [0]
    real = RangeReader._read_once

    def counted(self, shard, start, end):
        data = real(self, shard, start, end)
        fetched[0] += len(data)
        return data

    monkeypatch.setattr(RangeReader, "_read_once", counted)
    ds = StreamingJsonl(shards, storage=Storage(cache_dir=tmp_path / "cache", readahead="1MB"))
    assert ids(ds) == [r["id"] for r in RECORDS]
    wait_for_copies()
    total = sum(p.stat().st_size for p in shards.glob("*.jsonl.zst"))
    assert sum(p.stat().st_size for p in copies(tmp_path / "cache")) == total
    assert total <= fetched[0] <= total * 1.02


def test_the_copier_leaves_ranges_read_ahead_has_claimed_to_the_readers(shards, tmp_path,
                                                                       monkeypatch):
    import streamds.storage.shard_cache as cache_module

    shard = resolve_shards(shards)[0]
    size = shard.size
    monkeypatch.setattr(cache_module, "COPY_REQUEST", size // 4)
    three_quarters = size - size // 4
    half = three_quarters - size // 4
    decisions: list[tuple[int, int] | None] = []
    decided = threading.Semaphore(0)
    real_last_free = cache_module._Claims._last_free

    def last_free(self, *args):
        decisions.append(real_last_free(self, *args))
        decided.release()
        return decisions[-1]

    monkeypatch.setattr(cache_module._Claims, "_last_free", last_free)
    reader_go = threading.Event()
    source_bytes = Path(shard.path).read_bytes()

    def reader_fetch(shard, start, end):
        assert reader_go.wait(timeout=60)
        return source_bytes[start:end]

    source = GatedSource()
    cache = Cache(ShardCacheSettings(str(tmp_path / "cache"), None, namespace_of([shard])),
                  reader_fetch, lambda: source)
    cache_module.CLAIMS.add(shard.path, 0, half)  # read-ahead has asked for the first half
    reader = threading.Thread(target=cache.read, args=(shard, 0, half))
    reader.start()
    for _ in range(2):  # the copier takes the unclaimed half, from the end
        assert decided.acquire(timeout=60) and source.waiting.acquire(timeout=60)
        source.go.release()
    assert decided.acquire(timeout=60)
    assert decisions[-1] is None  # only claimed bytes are missing: it waits for the reader
    reader_go.set()
    reader.join()
    cache_module.CLAIMS.remove(shard.path, 0, half)
    for _ in range(8):
        source.go.release()  # (a copier that did not wait gets its requests answered)
    wait_for_copies()
    assert source.asked == [(three_quarters, size), (half, three_quarters)]
    assert cache.path_of(shard).read_bytes() == source_bytes
    cache.close()
