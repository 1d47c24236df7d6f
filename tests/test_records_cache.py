"""The store of blocks of records behind `ds.cache` (`streamds.storage.record_store`).

Processes that race or crash are forked children synchronised by pipes (no sleeps); a crash
is a SIGKILL while the child holds a partial block.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import random
import signal
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamds.storage.plan import Block
from streamds.storage.record_codec import (
    BAD_LINE,
    BLANK_LINE,
    DROPPED,
    UncacheableRecordError,
    decode_record,
    encode_record,
)
from streamds.storage.record_keys import block_key
from streamds.storage.record_store import CachedBlockError, RecordStore
from streamds.storage.shards import Shard, resolve_shards

FORK = multiprocessing.get_context("fork")


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types, all the way down (arrays: dtype, shape, values)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) and same(k, kb)
                                          for k, kb in zip(a, b, strict=True))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


VALUES = {
    "none": None, "true": True, "false": False, "int": 7, "negative": -(1 << 63),
    "big int": 1 << 80, "negative big int": -(1 << 70) - 3, "float": 0.1, "nan": float("nan"),
    "str": "café 数据 🚀", "lone surrogate": "a\udc80b", "empty str": "", "bytes": b"\x00\xff",
    "token ids": list(range(-3, 8000)), "int tuple": (1, 2, 3),
    "int32 edges": [-(1 << 31), (1 << 31) - 1], "past int32": [0, 1 << 31],
    "past int32 below": (-(1 << 31) - 1, 0), "int64 edges": [-(1 << 63), (1 << 63) - 1],
    "floats": [0.5, 1.5, -2.0],
    "float tuple": (0.5, 1e300), "bools": [True, False, True], "ints and bools": [1, True, 0],
    "ints and floats": [1, 2.0], "one int": [5], "empty list": [], "empty tuple": (),
    "int beyond int64 in a list": [1, 1 << 64], "nested": {"a": [{"b": (None, "x")}], 1: 2.5},
    "dict keys": {1: "int", 2.5: "float", None: "none", b"k": "bytes", (1, "t"): "tuple"},
    "int64 array": np.arange(12, dtype=np.int64).reshape(3, 4),
    "fortran array": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
    "big-endian array": np.arange(4, dtype=">i4"), "bool array": np.array([True, False]),
    "str array": np.array(["a", "bcd"]), "empty array": np.zeros((0, 3), dtype=np.int16),
    "complex array": np.array([1 + 2j]), "datetime array": np.array(["2024-01-01"], "M8[D]"),
    "numpy scalars": [np.int32(5), np.float64(0.25), np.bool_(True), np.str_("s"), np.str_("")],
    "tensor": torch.arange(10, dtype=torch.int64).reshape(2, 5),
    "bfloat16 tensor": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "bool tensor": torch.tensor([True, False]), "scalar tensor": torch.tensor(3.5),
    "empty tensor": torch.zeros(0, 4, dtype=torch.float16),
    "tensor with grad": torch.ones(3, requires_grad=True),
    "strided tensor": torch.arange(12).reshape(3, 4).t(),
}


@pytest.mark.parametrize("name", list(VALUES))
def test_round_trip_keeps_values_and_types(name: str) -> None:
    record = {"value": VALUES[name], "text": "t"}
    back = decode_record(encode_record(record))
    if name == "tensor with grad":  # comes back without its gradient
        assert not back["value"].requires_grad
        back["value"] = back["value"].requires_grad_()
        assert torch.equal(back["value"], record["value"])
        return
    assert same(back, record), (back, record)


JSON_LIKE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: (st.lists(inner) | st.lists(inner).map(tuple)
                   | st.dictionaries(st.text() | st.integers(), inner)),
    max_leaves=30,
)


@settings(max_examples=100, deadline=None)
@given(JSON_LIKE)
def test_round_trip_of_any_nesting(record: Any) -> None:
    assert same(decode_record(encode_record(record)), record)


def test_token_ids_take_four_bytes_each() -> None:
    ids = list(range(50_000, 58_000))
    assert len(encode_record(ids)) < 4 * len(ids) + 16
    assert len(encode_record([*ids, 1 << 40])) > 8 * len(ids)


def test_round_trip_of_a_bare_value_and_dropped() -> None:
    assert encode_record(DROPPED) != encode_record(None)
    assert decode_record(encode_record(DROPPED)) is DROPPED
    assert same(decode_record(encode_record([1, "a", None])), [1, "a", None])


def test_lines_without_a_record_are_entries_read_apart(tmp_path: Path) -> None:
    assert len({encode_record(mark) for mark in (DROPPED, BLANK_LINE, BAD_LINE, None)}) == 4
    store = RecordStore(str(tmp_path))
    entries = [{"i": 0}, BLANK_LINE, True, DROPPED, BAD_LINE, {}, "x"]
    with store.start(KEY, len(entries)) as writer:
        for index, entry in enumerate(entries):
            writer.put(index, entry)
    with store.get(KEY) as reader:
        assert [reader.record(i) for i in range(len(entries))] == entries
        assert reader.line_marks(0, len(entries)) == {1: BLANK_LINE, 4: BAD_LINE}
        assert reader.line_marks(2, 4) == {}


def test_decoded_arrays_are_writable_copies() -> None:
    array = decode_record(encode_record(np.arange(3)))
    array[0] = 9  # not a read-only view of the file's bytes
    tensor = decode_record(encode_record(torch.arange(3)))
    tensor[0] = 9


@pytest.mark.parametrize(("record", "where", "what"), [
    ({"meta": {"when": datetime.date(2024, 1, 1)}}, "record['meta']['when']", "datetime.date"),
    ({"ids": [1, 2, {3}]}, "record['ids'][2]", "set"),
    ({"d": OrderedDict(a=1)}, "record['d']", "collections.OrderedDict"),
    ({"x": np.array([object()])}, "record['x']", "dtype object"),
    ({"x": torch.eye(2).to_sparse()}, "record['x']", "layout torch.sparse_coo"),
    ({frozenset(): 1}, "record", "frozenset"),
    ({"f": lambda: 0}, "record['f']", "function"),
])
def test_refusal_names_the_place_the_type_and_the_fix(record: Any, where: str, what: str
                                                      ) -> None:
    with pytest.raises(UncacheableRecordError) as caught:
        encode_record(record)
    message = str(caught.value)
    assert f"cannot store {where}:" in message
    assert what in message
    assert "the cache stores dict, list, tuple, str, int" in message
    assert isinstance(caught.value, TypeError)


def test_too_deep_is_refused_not_overflowed() -> None:
    record: Any = 0
    for _ in range(2000):
        record = [record]
    with pytest.raises(UncacheableRecordError, match="nested deeper than"):
        encode_record(record)


# ---------------------------------------------------------------------------------------------
# keys


def shard(**changes: Any) -> Shard:
    fields: dict[str, Any] = {"url": "/data/a.jsonl", "path": "/data/a.jsonl", "size": 1000,
                              "format": "jsonl", "codec": None, "checksum": None,
                              "version": "mtime=1.5"}
    fields.update(changes)
    return Shard(**fields)


BLOCK = Block(0, 0, 500)


def key_of(source: Shard | None = None, block: Block = BLOCK, *, name: str = "a.jsonl",
           key: str = "tok-v1", upstream: str = "") -> str | None:
    return block_key(source or shard(), block, name=name, key=key, upstream=upstream)


def test_every_part_of_the_identity_changes_the_key() -> None:
    keys = [
        key_of(),
        key_of(shard(size=1001)),
        key_of(shard(version="mtime=2.5")),
        key_of(shard(checksum="00ff")),
        key_of(shard(checksum="00fe")),
        key_of(shard(codec="zst")),
        key_of(block=Block(0, 0, 501)),
        key_of(block=Block(0, 500, None)),
        key_of(name="b.jsonl"),
        key_of(key="tok-v2"),
        key_of(upstream="on_error=skip"),
    ]
    assert all(key is not None and len(key) == 32 for key in keys)
    assert len(set(keys)) == len(keys)
    assert key_of() == key_of(shard(url="/mnt/elsewhere/a.jsonl"))  # the name, not the mount


def test_a_shard_that_cannot_be_told_stale_has_no_key() -> None:
    assert key_of(shard(version=None)) is None
    assert key_of(shard(version=None, checksum="00ff")) is not None


def test_a_changed_file_gets_another_key(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n')
    before = key_of(resolve_shards(str(path))[0])
    path.write_text('{"a": 2}\n')  # same size: only the modification time tells
    os.utime(path, ns=(10**18, 10**18))
    after = key_of(resolve_shards(str(path))[0])
    assert before is not None and after is not None and before != after


def test_credentials_reach_no_key_file_name_or_file(tmp_path: Path) -> None:
    url = "https://user:s3cretpw@host/data/a.jsonl?X-Amz-Signature=t0psecret&part=1"
    secret = shard(url="https://***@host/data/a.jsonl?X-Amz-Signature=***&part=1", path=url,
                   version='etag="abc"')
    key = key_of(secret, name=url)
    other = url.replace("s3cretpw", "newpw").replace("t0psecret", "othersig")
    assert key == key_of(secret, name=other)  # the credentials are no part of the identity
    store = RecordStore(str(tmp_path))
    writer = store.start(key, 1)
    writer.put(0, {"text": "x"})
    assert writer.complete
    for path in tmp_path.iterdir():
        for text in ("s3cretpw", "t0psecret", "user"):
            assert text not in path.name
            assert text.encode() not in path.read_bytes()


def test_a_malformed_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="32 lowercase hex digits"):
        RecordStore(str(tmp_path)).get("../../etc/passwd")


# ---------------------------------------------------------------------------------------------
# writing and reading


KEY = "0123456789abcdef" * 2
KEY2 = "fedcba9876543210" * 2
KEY3 = "00112233445566778899aabbccddeeff"


def records(count: int, *, text: int = 20) -> list[Any]:
    return [{"id": i, "text": "x" * text, "ids": list(range(i, i + 5))} for i in range(count)]


def visible(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("*.records"))


@pytest.mark.parametrize("count_first", [True, False])
def test_out_of_order_puts_with_drops_read_back_in_order(tmp_path: Path, count_first: bool
                                                         ) -> None:
    store = RecordStore(str(tmp_path))
    entries = records(12)
    for dropped in (3, 4, 11):
        entries[dropped] = DROPPED
    order = list(range(12))
    random.Random(0).shuffle(order)
    writer = store.start(KEY, 12 if count_first else None)
    for index in order[:-1]:
        writer.put(index, entries[index])
    assert not writer.complete
    assert visible(tmp_path) == [] and store.get(KEY) is None  # no partial block is seen
    if not count_first:
        writer.put(order[-1], entries[order[-1]])
        assert not writer.complete  # the count is not known yet
        writer.expect(12)
    else:
        writer.put(order[-1], entries[order[-1]])
    assert writer.complete
    assert visible(tmp_path) == [f"{KEY}.records"]
    with store.get(KEY) as reader:
        assert len(reader) == 12
        assert list(reader) == entries
        assert reader.record(4) is DROPPED and reader.record(5) == entries[5]
        with pytest.raises(IndexError):
            reader.record(12)
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def test_positions_map_to_ordinals_and_back(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    positions = [0, 40, 95, 96, 300]
    writer = store.start(KEY, 5)
    for index in (3, 0, 4, 2, 1):
        writer.put(index, DROPPED if index == 2 else {"i": index}, positions[index])
    with store.get(KEY) as reader:
        assert [reader.position(i) for i in range(5)] == positions
        assert [reader.first_at(p) for p in (0, 1, 40, 95, 97, 300, 301)] == [0, 1, 1, 2, 4,
                                                                                4, 5]


def test_put_at_interleaved_blocks_in_shuffled_order(tmp_path: Path) -> None:
    """As after a shuffle: two blocks' records interleaved, each known by its position only,
    the counts known once the blocks were read; ordinals are the positions' ranks."""
    store = RecordStore(str(tmp_path))
    blocks = {KEY: [(p * 37, {"at": p * 37}) for p in range(15)],
              KEY2: [(p * 11 + 5, DROPPED if p % 4 == 0 else {"at": p}) for p in range(9)]}
    writers = {key: store.start(key) for key in blocks}
    mixed = [(key, entry) for key, entries in blocks.items() for entry in entries]
    random.Random(1).shuffle(mixed)
    for step, (key, (position, record)) in enumerate(mixed):
        writers[key].put_at(position, record)
        if step == 3:
            for key_known, entries in blocks.items():
                writers[key_known].expect(len(entries))
    assert all(writer.complete for writer in writers.values())
    for key, entries in blocks.items():
        with store.get(key) as reader:
            assert list(reader) == [record for _, record in entries]
            assert [reader.position(i) for i in range(len(reader))] == [p for p, _ in entries]


def test_put_at_refuses_a_repeat_an_extra_and_a_mix(tmp_path: Path) -> None:
    writer = RecordStore(str(tmp_path)).start(KEY)
    writer.put_at(10, {"a": 1})
    with pytest.raises(ValueError, match="position 10 put twice"):
        writer.put_at(10, {"a": 1})
    with pytest.raises(ValueError, match="put and put_at mixed"):
        writer.put(0, {"a": 1})
    writer.put_at(20, {"a": 2})
    with pytest.raises(ValueError, match="2 positions were put but the block has 1"):
        writer.expect(1)
    writer.expect(3)
    writer.put_at(25, {"a": 3})
    assert writer.complete
    with pytest.raises(ValueError, match="position 30 put after the block was complete"):
        writer.put_at(30, {"a": 4})


def test_positions_that_do_not_increase_are_refused(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    writer = store.start(KEY, 2)
    writer.put(1, {"i": 1}, 10)
    with pytest.raises(ValueError, match="ordinal 1 at position 10 after ordinal 0 at 10"):
        writer.put(0, {"i": 0}, 10)
    assert store.get(KEY) is None and list(tmp_path.glob("*.partial-*")) == []


def test_an_ordinal_put_twice_or_out_of_range_is_refused(tmp_path: Path) -> None:
    writer = RecordStore(str(tmp_path)).start(KEY, 3)
    writer.put(1, {"a": 1})
    with pytest.raises(ValueError, match="put twice"):
        writer.put(1, {"a": 1})
    with pytest.raises(ValueError, match="out of range"):
        writer.put(3, {"a": 1})
    writer.abort()
    assert list(tmp_path.glob("*.records*")) == [tmp_path / f"{KEY}.records.lock"]


def test_an_uncacheable_record_stops_the_writer_and_names_the_ordinal(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    writer = store.start(KEY, 2)
    writer.put(0, {"a": 1})
    with pytest.raises(UncacheableRecordError, match=r"record\['when'\].*ordinal 1 "):
        writer.put(1, {"when": datetime.date(2024, 1, 1)})
    assert not writer.stored and store.get(KEY) is None
    assert store.start(KEY, 2) is not None  # released: another writer may try


def test_an_empty_block_is_stored(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    assert store.start(KEY, 0).complete
    with store.get(KEY) as reader:
        assert len(reader) == 0 and list(reader) == []


def test_a_stored_block_is_not_started_again(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    store.start(KEY, 0)
    assert store.start(KEY, 0) is None


def test_a_damaged_entry_is_named_and_a_damaged_file_removed(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path))
    writer = store.start(KEY, 2)
    writer.put(0, {"text": "first"})
    writer.put(1, {"text": "second"})
    path = tmp_path / f"{KEY}.records"
    data = bytearray(path.read_bytes())
    at = data.index(b"second")
    data[at] ^= 1
    path.write_bytes(bytes(data))
    with store.get(KEY) as reader:
        assert reader.record(0) == {"text": "first"}
        with pytest.raises(CachedBlockError, match=rf"{KEY}.records: ordinal 1: entry at offset"):
            reader.record(1)
    path.write_bytes(bytes(data[:-3]))  # cut short: the footer does not match
    assert store.get(KEY) is None
    assert not path.exists()


# ---------------------------------------------------------------------------------------------
# processes


def _write_when_told(directory: str, key: str, entries: list[Any], started, go) -> None:
    store = RecordStore(directory)
    writer = store.start(key, len(entries))
    started.send(writer is not None)
    half = len(entries) // 2
    for index in range(half):
        writer.put(index, entries[index])
    writer._file.flush()  # the partial file holds them (a crash below leaves it behind)
    started.send("half")
    go.recv()
    for index in range(half, len(entries)):
        writer.put(index, entries[index])
    started.send(writer.complete)


def test_one_writer_per_block_across_processes(tmp_path: Path) -> None:
    entries = records(40)
    started, child_end = FORK.Pipe()
    go, child_go = FORK.Pipe()
    child = FORK.Process(target=_write_when_told,
                         args=(str(tmp_path), KEY, entries, child_end, child_go))
    child.start()
    try:
        assert started.recv() is True and started.recv() == "half"
        store = RecordStore(str(tmp_path))
        assert store.start(KEY, 40) is None  # the child writes it: this process computes
        assert store.get(KEY) is None
        go.send(True)
        assert started.recv() is True
    finally:
        go.send(True)  # (again, harmless) so that a failed assertion leaves no child waiting
        child.join(timeout=60)
        child.kill()
    with store.get(KEY) as reader:
        assert list(reader) == entries


def _race(directory: str, key: str, entries: list[Any], barrier, results) -> None:
    barrier.wait()
    writer = RecordStore(directory).start(key, len(entries))
    if writer is None:
        results.put("computed")
        return
    for index in reversed(range(len(entries))):
        writer.put(index, entries[index])
    results.put("wrote" if writer.complete else "failed")


def test_racing_processes_leave_one_whole_file(tmp_path: Path) -> None:
    entries = records(200)
    barrier, results = FORK.Barrier(3), FORK.Queue()
    children = [FORK.Process(target=_race, args=(str(tmp_path), KEY, entries, barrier, results))
                for _ in range(3)]
    for child in children:
        child.start()
    outcomes = sorted(results.get(timeout=60) for _ in children)
    for child in children:
        child.join()
    assert "failed" not in outcomes and outcomes.count("wrote") >= 1
    assert visible(tmp_path) == [f"{KEY}.records"]
    with RecordStore(str(tmp_path)).get(KEY) as reader:
        assert list(reader) == entries


def test_a_crash_mid_write_leaves_no_block_and_the_next_writer_succeeds(tmp_path: Path) -> None:
    entries = records(30)
    started, child_end = FORK.Pipe()
    _, child_go = FORK.Pipe()
    child = FORK.Process(target=_write_when_told,
                         args=(str(tmp_path), KEY, entries, child_end, child_go))
    child.start()
    assert started.recv() is True and started.recv() == "half"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    partials = list(tmp_path.glob("*.partial-*"))
    assert len(partials) == 1 and partials[0].stat().st_size > 0
    store = RecordStore(str(tmp_path))
    assert visible(tmp_path) == [] and store.get(KEY) is None
    writer = store.start(KEY, len(entries))  # the dead writer's lock went with it
    assert writer is not None
    assert not partials[0].exists()  # its partial file is removed
    for index, entry in enumerate(entries):
        writer.put(index, entry)
    with store.get(KEY) as reader:
        assert list(reader) == entries


# ---------------------------------------------------------------------------------------------
# the limit


def write(store: RecordStore, key: str, entries: list[Any]) -> bool:
    writer = store.start(key, len(entries))
    for index, entry in enumerate(entries):
        writer.put(index, entry)
    return writer.complete


def block_bytes(tmp_path: Path, entries: list[Any]) -> int:
    probe = RecordStore(str(tmp_path / "probe"))
    write(probe, KEY, entries)
    return (tmp_path / "probe" / f"{KEY}.records").stat().st_size


def test_least_recently_used_blocks_go_first(tmp_path: Path) -> None:
    entries = records(20, text=100)
    size = block_bytes(tmp_path, entries)
    store = RecordStore(str(tmp_path / "cache"), limit=2 * size + size // 2)
    assert write(store, KEY, entries) and write(store, KEY2, entries)
    os.utime(store.path_of(KEY), (1000, 1000))
    os.utime(store.path_of(KEY2), (2000, 2000))
    store.get(KEY).close()  # used now: KEY2 is the least recently used
    assert write(store, KEY3, entries)
    assert store.get(KEY2) is None
    assert store.get(KEY) is not None and store.get(KEY3) is not None
    assert store.stored_bytes() <= store.limit


def test_a_block_in_use_is_never_removed(tmp_path: Path) -> None:
    entries = records(20, text=100)
    size = block_bytes(tmp_path, entries)
    store = RecordStore(str(tmp_path / "cache"), limit=size + size // 2)
    assert write(store, KEY, entries)
    with store.get(KEY) as reader:  # held: the new block finds no room and is not stored
        writer = store.start(KEY2, len(entries))
        for index, entry in enumerate(entries):
            writer.put(index, entry)
        assert not writer.complete and not writer.stored
        assert list(reader) == entries
    assert visible(tmp_path / "cache") == [f"{KEY}.records"]
    assert list((tmp_path / "cache").glob("*.partial-*")) == []
    assert write(store, KEY2, entries)  # released: now it makes room
    assert visible(tmp_path / "cache") == [f"{KEY2}.records"]


def test_a_block_larger_than_the_limit_is_not_stored(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path), limit=1000)
    writer = store.start(KEY, 50)
    for index, entry in enumerate(records(50)):
        writer.put(index, entry)  # gives up once past the limit, then ignores the rest
    assert not writer.complete and not writer.stored
    assert visible(tmp_path) == [] and list(tmp_path.glob("*.partial-*")) == []
    assert store.start(KEY, 50) is not None


def test_a_bad_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="limit must be a number of bytes"):
        RecordStore("/tmp/x", limit=-1)
