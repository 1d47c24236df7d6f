"""`ds.cache(directory, key=...)`: records of the steps before it, stored per block and read
back in later epochs and resumes: the same records, order, states and drop counts as
without it; nothing stale served (`streamds.stages.cache`)."""

from __future__ import annotations

import dataclasses
import errno
import functools
import gc
import logging
import os
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from resume_contract import checkpoint, run_test_save_load_state, write_mixed
from torch.utils.data import DataLoader

from streamds import StreamingJsonl
from streamds.stages import cache as cache_stage
from streamds.stages.cache import PIECE
from streamds.storage.records_cache import SUFFIX, RecordStore, UncacheableRecordError

CALLS = {"map": 0}


def tokenize(record: dict[str, Any]) -> dict[str, Any] | None:
    """A map that counts its calls, drops every 7th record and makes token ids."""
    CALLS["map"] += 1
    if record["id"] % 7 == 3:
        return None
    return {"id": record["id"], "ids": [ord(c) for c in record["text"][: record["id"] % 11]]}


def tag(record: dict[str, Any]) -> dict[str, Any] | None:
    """A step after the cache (not stored): drops every 5th record."""
    return None if record["id"] % 5 == 0 else {**record, "after": True}


def as_set(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "bad": {1, 2}}


@pytest.fixture(scope="module")
def corpus(mixed: tuple[Path, list[int]]) -> Path:
    return mixed[0]


def dataset(corpus: Path, cache: Path | None, *, shuffle: bool = True, key: str = "k1",
            **options: Any) -> StreamingJsonl:
    ds = StreamingJsonl(str(corpus), shuffle=shuffle, buffer_size=40, seed=3, **options)
    ds = ds.map(tokenize)
    return ds if cache is None else ds.cache(cache, key=key)


def ids(records: Any) -> list[int]:
    return [record["id"] for record in records]


def epoch(ds: StreamingJsonl, number: int, workers: int = 0) -> list[int]:
    ds.set_epoch(number)
    if workers == 0:
        return ids(ds)
    return ids(DataLoader(ds, batch_size=None, num_workers=workers))


def stored(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(SUFFIX))


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_cached_epoch_calls_the_map_for_no_stored_block(corpus: Path, tmp_path: Path,
                                                          shuffle: bool) -> None:
    plain = dataset(corpus, None, shuffle=shuffle)
    cached = dataset(corpus, tmp_path, shuffle=shuffle)
    CALLS["map"] = 0
    first = epoch(cached, 0)
    lines = CALLS["map"]
    assert lines > 300 and first == epoch(plain, 0)
    want = epoch(plain, 1)
    assert (want != first) == shuffle
    CALLS["map"] = 0
    assert epoch(cached, 1) == want
    assert CALLS["map"] == 0
    assert cached.counts["dropped"] == plain.counts["dropped"] > 0


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_same_records_in_the_same_order_as_without_the_cache(
        corpus: Path, tmp_path: Path, shuffle: bool, workers: int) -> None:
    plain = dataset(corpus, None, shuffle=shuffle).map(tag)
    cached = dataset(corpus, tmp_path, shuffle=shuffle).map(tag)  # `tag` is not stored
    for number in (0, 1):
        want = epoch(plain, number, workers)
        assert epoch(cached, number, workers) == want
    assert len(stored(tmp_path)) == len(cached._block_list)
    assert not [name for name in os.listdir(tmp_path) if "partial" in name]


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_rank_of_a_world_reads_as_without_the_cache(corpus: Path, tmp_path: Path,
                                                          shuffle: bool) -> None:
    seen = []
    for number in (0, 1):
        for rank in range(3):
            world = {"rank": rank, "world_size": 3, "shuffle": shuffle}
            got = epoch(dataset(corpus, tmp_path, **world), number)
            assert got == epoch(dataset(corpus, None, **world), number)
            seen += got
    assert sorted(seen) == sorted(2 * epoch(dataset(corpus, None), 0))


@pytest.mark.parametrize("shuffle", [False, True])
def test_exact_resume_in_the_filling_epoch(corpus: Path, tmp_path: Path, shuffle: bool
                                           ) -> None:
    made = iter(range(1000))

    def make() -> StreamingJsonl:  # every run fills a fresh directory
        return dataset(corpus, tmp_path / str(next(made)), shuffle=shuffle)

    want = epoch(dataset(corpus, None, shuffle=shuffle), 0)
    got = run_test_save_load_state(make, range(0, len(want), 23),
                                   after=lambda ds: ds.counts["dropped"])
    assert ids(got) == want
    gc.collect()  # readers cut short give up the blocks they were filling
    assert not [path for path in tmp_path.rglob("*") if "partial" in path.name]


@pytest.mark.parametrize("piece", [PIECE, 16])
@pytest.mark.parametrize("shuffle", [False, True])
def test_exact_resume_in_a_cached_epoch(corpus: Path, tmp_path: Path, shuffle: bool,
                                        piece: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_stage, "PIECE", piece)  # 16: stored blocks in several chunks
    want = epoch(dataset(corpus, None, shuffle=shuffle), 0)
    epoch(dataset(corpus, tmp_path, shuffle=shuffle), 0)  # fills the cache
    CALLS["map"] = 0
    got = run_test_save_load_state(lambda: dataset(corpus, tmp_path, shuffle=shuffle),
                                   range(0, len(want), 13), after=lambda ds: ds.counts["dropped"])
    assert CALLS["map"] == 0  # resumes read the buffer's records from the store too
    assert ids(got) == want


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache") / "big"
    write_mixed(root, scale=5)  # past a shuffle round (1024 records): buffers re-read
    return root


@pytest.mark.parametrize("filled", [False, True], ids=["filling", "cached"])
def test_exact_resume_past_a_shuffle_round_rereads_the_buffer(big: Path, tmp_path: Path,
                                                              filled: bool) -> None:
    if filled:
        epoch(dataset(big, tmp_path), 0)
    made = iter(range(1000))

    def make() -> StreamingJsonl:
        return dataset(big, tmp_path if filled else tmp_path / f"fresh-{next(made)}")

    want = epoch(dataset(big, None), 0)
    assert len(want) > 1100
    CALLS["map"] = 0
    assert ids(run_test_save_load_state(make, [1030, len(want) - 3])) == want
    assert (CALLS["map"] == 0) == filled


def batch_ids(batch: list[dict[str, Any]]) -> list[int]:
    return [record["id"] for record in batch]


@pytest.mark.parametrize("filled", [False, True], ids=["filling", "cached"])
def test_exact_resume_of_a_loader_with_two_workers(corpus: Path, tmp_path: Path,
                                                   filled: bool) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    if filled:
        epoch(dataset(corpus, tmp_path), 0, workers=2)
    made = iter(range(1000))

    def make() -> StatefulDataLoader:
        where = tmp_path if filled else tmp_path / f"fresh-{next(made)}"
        return StatefulDataLoader(dataset(corpus, where), batch_size=8, num_workers=2,
                                  collate_fn=batch_ids)

    want = list(StatefulDataLoader(dataset(corpus, None), batch_size=8, num_workers=2,
                                   collate_fn=batch_ids))
    assert run_test_save_load_state(make, [1, 9, 20]) == want


@pytest.mark.parametrize("piece", [PIECE, 16])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_state_moves_between_cached_and_uncached_datasets(
        corpus: Path, tmp_path: Path, shuffle: bool, piece: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_stage, "PIECE", piece)  # 16: chunks cut unlike the source's
    want = epoch(dataset(corpus, None, shuffle=shuffle), 0)
    epoch(dataset(corpus, tmp_path, shuffle=shuffle), 0)  # fills the cache
    for take, give in [(tmp_path, None), (None, tmp_path)]:
        for cut in range(0, len(want), 19):
            first = dataset(corpus, take, shuffle=shuffle)
            prefix = ids(islice(iter(first), cut))
            state = checkpoint(first.state_dict())
            second = dataset(corpus, give, shuffle=shuffle)
            second.load_state_dict(state)
            assert prefix + ids(second) == want, (take, cut)


def test_elastic_resume_from_a_cached_epoch(corpus: Path, tmp_path: Path) -> None:
    from streamds import merge_states

    want = sorted(epoch(dataset(corpus, None), 0))
    epoch(dataset(corpus, tmp_path), 0)  # fills the cache
    seen: list[int] = []
    states = []
    for rank in (0, 1):
        ds = dataset(corpus, tmp_path, rank=rank, world_size=2)
        seen += ids(islice(iter(ds), 60 + 40 * rank))
        states.append(checkpoint(ds.state_dict()))
    merged = merge_states(states)
    for rank in range(3):
        seen += ids(dataset(corpus, tmp_path, rank=rank, world_size=3).with_resume(merged))
    assert sorted(seen) == want


def test_even_ranks_cached_as_without_the_cache(corpus: Path, tmp_path: Path) -> None:
    for rank in (0, 1):
        options = {"even_ranks": "drop", "rank": rank, "world_size": 2}
        plain = dataset(corpus, None, **options)
        cached = dataset(corpus, tmp_path, **options)
        for number in (0, 1):
            assert epoch(cached, number) == epoch(plain, number)
    CALLS["map"] = 0
    epoch(dataset(corpus, tmp_path, even_ranks="drop", rank=0, world_size=2), 2)
    assert CALLS["map"] == 0


@pytest.mark.parametrize("shuffle", [False, True])
def test_counts_of_a_cached_epoch_are_those_of_the_source(tmp_path: Path, shuffle: bool
                                                         ) -> None:
    source = tmp_path / "a.jsonl"
    lines = []
    for i in range(400):
        lines.append(f'{{"id": {i}, "text": "{"w" * (i % 9)}"}}')
        if i % 31 == 0:
            lines.append("")  # blank
        if i % 47 == 5:
            lines.append('{"id": "cut')  # malformed, skipped
    source.write_text("\n".join(lines) + "\n")

    def make(cache: Path | None) -> StreamingJsonl:
        ds = StreamingJsonl(str(source), shuffle=shuffle, buffer_size=30, on_error="skip")
        ds = ds.map(tokenize)
        return ds if cache is None else ds.cache(cache, key="k")

    want = ids(make(None))
    plain = make(None)
    list(plain)
    counts = plain.counts
    assert counts["bad"] and counts["blank"] and counts["dropped"]
    for number in (0, 1):  # fills, then from the store
        cached = make(tmp_path / "c")
        CALLS["map"] = 0
        assert ids(cached) == want and cached.counts == counts, number
    assert CALLS["map"] == 0
    got = run_test_save_load_state(lambda: make(tmp_path / "c"), range(0, len(want), 37),
                                   after=lambda ds: ds.counts)
    assert ids(got) == want


def test_a_changed_file_or_another_key_is_never_served(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.jsonl").write_text("".join(f'{{"id": {i}, "text": "t{i}"}}\n'
                                            for i in range(50)))
    cache = tmp_path / "cache"
    epoch(dataset(source, cache), 0)
    CALLS["map"] = 0
    assert epoch(dataset(source, cache), 1)
    assert CALLS["map"] == 0  # stored
    assert epoch(dataset(source, cache, key="k2"), 1)
    assert CALLS["map"] == 50  # another key: computed
    # the same size, another modification time: computed afresh, new records
    text = (source / "a.jsonl").read_text().replace(': "t', ': "u')
    (source / "a.jsonl").write_text(text)
    os.utime(source / "a.jsonl", ns=(1, 1))
    CALLS["map"] = 0
    ds = dataset(source, cache, shuffle=False)
    got = list(ds)
    assert CALLS["map"] == 50
    assert [r["ids"] for r in got] == [[ord(c) for c in f"u{r['id']}"[: r["id"] % 11]]
                                       for r in got]


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_dataset_that_filled_the_cache_reads_a_rewritten_file_anew(
        tmp_path: Path, shuffle: bool) -> None:
    """Keys are checked against the file at each epoch, not only when .cache() is called."""
    path = tmp_path / "a.jsonl"
    path.write_text("".join(f'{{"id": {i}, "text": "t{i}"}}\n' for i in range(60)))
    ds = dataset(path, tmp_path / "cache", shuffle=shuffle)
    old = list(ds)
    path.write_text(path.read_text().replace(': "t', ': "u'))  # the same size
    before = os.stat(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    want = list(dataset(path, None, shuffle=shuffle))
    assert want != old
    CALLS["map"] = 0
    ds.set_epoch(0)
    assert list(ds) == want  # not the stored records of the old file
    assert CALLS["map"] == 60
    CALLS["map"] = 0
    assert list(ds) == want  # the new records are stored and served
    assert CALLS["map"] == 0


def test_a_shard_that_cannot_be_told_stale_is_read_uncached(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = tmp_path / "a.jsonl"
    source.write_text("".join(f'{{"id": {i}, "text": "t{i}"}}\n' for i in range(30)))
    ds = StreamingJsonl(str(source)).map(tokenize)
    ds._shards = [dataclasses.replace(shard, version=None, checksum=None)
                  for shard in ds._shards]  # as a storage without mtimes or ETags gives them
    with caplog.at_level(logging.WARNING, logger="streamds"):
        cached = ds.cache(tmp_path / "c", key="k")
    assert "1 of 1 shards are read without the cache" in caplog.text
    want = ids(StreamingJsonl(str(source)).map(tokenize))
    for _ in range(2):
        CALLS["map"] = 0
        assert ids(cached) == want
        assert CALLS["map"] == 30
    assert not (tmp_path / "c").exists()  # nothing stored, nothing locked


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_damaged_stored_block_is_computed_and_stored_again(
        corpus: Path, tmp_path: Path, shuffle: bool, caplog: pytest.LogCaptureFixture) -> None:
    want = epoch(dataset(corpus, None, shuffle=shuffle), 0)
    epoch(dataset(corpus, tmp_path, shuffle=shuffle), 0)
    biggest = max(stored(tmp_path), key=lambda name: os.path.getsize(tmp_path / name))
    with open(tmp_path / biggest, "r+b") as f:  # one byte of an entry flipped
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="streamds"):
        assert epoch(dataset(corpus, tmp_path, shuffle=shuffle), 0) == want
    assert "does not match its checksum" in caplog.text
    assert biggest not in stored(tmp_path)
    assert epoch(dataset(corpus, tmp_path, shuffle=shuffle), 0) == want  # stores it again
    assert biggest in stored(tmp_path)


def test_two_readers_share_a_directory_one_writer_per_block(corpus: Path, tmp_path: Path
                                                            ) -> None:
    want = epoch(dataset(corpus, None, shuffle=False), 0)
    first = iter(dataset(corpus, tmp_path, shuffle=False))
    head = ids(islice(first, 5))  # holds the first block's writer
    assert epoch(dataset(corpus, tmp_path, shuffle=False), 0) == want  # computes that block
    assert head + ids(first) == want  # and the first reader stores it
    blocks = len(dataset(corpus, None)._block_list)
    assert len(stored(tmp_path)) == blocks
    assert not [name for name in os.listdir(tmp_path) if "partial" in name]
    CALLS["map"] = 0
    assert epoch(dataset(corpus, tmp_path, shuffle=False), 1) == want
    assert CALLS["map"] == 0


def test_the_limit_is_kept(corpus: Path, tmp_path: Path) -> None:
    full = tmp_path / "full"
    epoch(dataset(corpus, full), 0)
    sizes = sorted(os.path.getsize(full / name) for name in stored(full))
    limit = sum(sizes[:3]) + 10
    bounded = dataset(corpus, None).cache(tmp_path / "bounded", key="k1", limit=str(limit))
    want = epoch(dataset(corpus, None), 1)
    for number in (0, 1):
        epoch(bounded, number)
    assert epoch(bounded, 1) == want
    held = RecordStore(str(tmp_path / "bounded")).stored_bytes()
    assert 0 < held <= limit


def test_a_limit_that_stores_nothing_says_so_once(
        corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bounded = dataset(corpus, None).cache(tmp_path / "tiny", key="k1", limit=10)
    with caplog.at_level(logging.WARNING, logger="streamds"):
        assert epoch(bounded, 0) == epoch(dataset(corpus, None), 0)
    said = [r.getMessage() for r in caplog.records if "is not stored" in r.getMessage()]
    assert len(said) == 1 and "limit=10" in said[0] and "raise limit=" in said[0], said
    assert not stored(tmp_path / "tiny")


def read_only(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Opening anything under `directory` to write fails as on a read-only mount."""
    real = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if (str(path).startswith(str(directory))
                and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)


def test_a_read_only_cache_directory_is_read_and_never_written(
        corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    want = epoch(dataset(corpus, tmp_path / "c"), 0)  # fills it
    for name in os.listdir(tmp_path / "c"):  # a copy made without the lock files
        if name.endswith(".lock"):
            os.remove(tmp_path / "c" / name)
    read_only(monkeypatch, tmp_path / "c")
    CALLS["map"] = 0
    assert epoch(dataset(corpus, tmp_path / "c"), 0) == want  # no [Errno 30]
    assert CALLS["map"] == 0  # every block served
    with caplog.at_level(logging.WARNING, logger="streamds"):
        assert epoch(dataset(corpus, tmp_path / "c", key="k2"), 0) == want  # computed
    said = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(said) == 1 and "writable directory" in said[0]


def test_a_cache_directory_under_home_is_expanded(
        corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    epoch(dataset(corpus, None).cache("~/records", key="k"), 0)
    assert stored(tmp_path / "home" / "records")
    assert not (tmp_path / "~").exists()


def tokenize_with(record: dict[str, Any], width: int) -> dict[str, Any]:
    return {"id": record["id"], "ids": [ord(c) for c in record["text"][:width]]}


class Unnamed:
    """A callable whose settings no repr says."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        return tokenize_with(record, self.width)


def test_steps_of_one_name_with_other_arguments_do_not_share_records(
        corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def cached(fn: Any) -> StreamingJsonl:
        return StreamingJsonl(str(corpus)).map(fn).cache(tmp_path, key="k")

    two, five = functools.partial(tokenize_with, width=2), functools.partial(tokenize_with,
                                                                              width=5)
    assert list(cached(two)) == list(StreamingJsonl(str(corpus)).map(two))  # stores
    assert list(cached(five)) == list(StreamingJsonl(str(corpus)).map(five))  # not two's
    with caplog.at_level(logging.WARNING, logger="streamds"):
        cached(Unnamed(3))
    assert "told apart from other steps of its name by key='k' alone" in caplog.text


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_unstorable_record_names_the_file_and_line(tmp_path: Path, shuffle: bool) -> None:
    source = tmp_path / "a.jsonl"
    source.write_text('{"id": 1, "text": "x"}\n{"id": 2, "text": "y"}\n')
    ds = StreamingJsonl(str(source), shuffle=shuffle).map(as_set).cache(tmp_path / "c",
                                                                         key="k")
    with pytest.raises(UncacheableRecordError, match=r"a\.jsonl: line [12]\b.*set"):
        list(ds)


@pytest.mark.parametrize(("call", "match"), [
    (lambda ds, d: ds.cache(d, key="k").cache(d, key="k"), "twice"),
    (lambda ds, d: ds.cache(d, key=""), "non-empty str"),
    (lambda ds, d: ds.cache(d, key=3), "non-empty str"),
    (lambda ds, d: ds.cache("s3://bucket/cache", key="k"), "local path"),
    (lambda ds, d: ds.cache(d, key="k", limit="ten"), "limit"),
    (lambda ds, d: ds.cache(d, key="k", limit=-1), "limit"),
])
def test_bad_arguments_are_refused_in_the_call(corpus: Path, tmp_path: Path,
                                               call: Callable[..., Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(StreamingJsonl(str(corpus)), tmp_path)
