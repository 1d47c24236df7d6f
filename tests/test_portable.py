"""Portable checkpoints (DESIGN guarantee 10; issue 26 item 4, issue 27's weak list).

A state names the corpus by each file's name relative to the source root, its size and the
manifest's checksum, so the same files under another folder or mount point resume exactly
(loaded states, merged states, Mix and packed states); a real difference is refused naming
the file and how it differs, and a different setting by name with both values.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from fsspec.core import url_to_fs
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from resume_contract import checkpoint, ids, write_mixed
from torchdata.stateful_dataloader import StatefulDataLoader

import streamds
import streamds.resume.identity as identity
from streamds import Mix, PackTokens, Storage, StreamingJsonl, merge_states
from streamds.errors import StateMismatchError
from streamds.preprocess.convert import convert
from streamds.resume.identity import Identity, relative_names, source_root
from streamds.storage.shards import Shard, natural_key
from streamds.train.loader import stop_workers

OPTIONS: dict[str, Any] = {"shuffle": True, "seed": 3, "buffer_size": 16}


@pytest.fixture(scope="module")
def drive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus as first mounted ("Drive"): every shard format in nested folders."""
    root = tmp_path_factory.mktemp("drive") / "MyDrive" / "corpus"
    write_mixed(root / "train")
    return root


@pytest.fixture
def local(drive: Path, tmp_path: Path) -> Path:
    """The same files copied, byte for byte, to another place (the runtime's local disk)."""
    target = tmp_path / "content" / "corpus"
    shutil.copytree(drive, target)
    return target


def spellings(root: Path) -> dict[str, Any]:
    """The ways to name the corpus under `root`: its folder, a glob, the list of its files."""
    files = sorted(str(path) for path in (root / "train").iterdir())
    return {"folder": str(root), "glob": str(root / "train" / "part-*"), "list": files}


def loader(source: Any, workers: int, **options: Any) -> StatefulDataLoader:
    return StatefulDataLoader(StreamingJsonl(source, **{**OPTIONS, **options}), batch_size=8,
                              num_workers=workers, collate_fn=ids)


def cut(source: Any, workers: int, batches: int) -> tuple[list[int], Any]:
    """The ids of the first `batches` batches of an epoch, and the loader state after them."""
    first = loader(source, workers)
    seen = [i for batch in itertools.islice(first, batches) for i in batch]
    return seen, checkpoint(first.state_dict())


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("spelling", ["folder", "glob", "list"])
def test_a_state_resumes_exactly_over_the_same_files_moved(drive, local, spelling, workers):
    whole = [i for batch in loader(spellings(drive)[spelling], workers) for i in batch]
    seen, state = cut(spellings(drive)[spelling], workers, 7)
    moved = loader(spellings(local)[spelling], workers)
    moved.load_state_dict(state)
    assert seen + [i for batch in moved for i in batch] == whole  # exactly, in order


def test_a_single_file_resumes_after_moving(drive, local):
    name = "train/part-0.jsonl"
    dataset = StreamingJsonl(str(drive / name), **OPTIONS)
    iterator = iter(dataset)
    head = [next(iterator)["id"] for _ in range(20)]
    state = checkpoint(dataset.state_dict())
    rest = [record["id"] for record in iterator]
    moved = StreamingJsonl(str(local / name), **OPTIONS)
    moved.load_state_dict(state)
    assert [record["id"] for record in moved] == rest and head


def test_a_merged_state_finishes_over_the_moved_files_in_another_world(drive, local):
    states = []
    seen: list[int] = []
    for rank in range(2):
        first = StatefulDataLoader(
            StreamingJsonl(str(drive), rank=rank, world_size=2, **OPTIONS), batch_size=8,
            num_workers=2, collate_fn=ids)
        seen += [i for batch in itertools.islice(first, 5) for i in batch]
        states.append(checkpoint(first.state_dict()))
    merged = checkpoint(merge_states(states))
    rest = [record["id"] for record in
            StreamingJsonl(str(local), **OPTIONS).with_resume(merged)]
    every = [record["id"] for record in StreamingJsonl(str(drive))]
    assert sorted(seen + rest) == sorted(every)  # every record once: none twice, none lost


def test_mix_and_packed_states_resume_over_the_moved_files(drive, local):
    def mix(root: Path) -> Mix:
        a = StreamingJsonl(str(root / "train" / "part-0.jsonl"), **OPTIONS)
        b = StreamingJsonl(str(root / "train"), **OPTIONS)
        return Mix([a, b], [0.3, 0.7], seed=1)

    def packed(root: Path) -> Any:
        return StreamingJsonl(str(root), **OPTIONS).map(tokens).pack(
            PackTokens(seq_len=7, eos_id=0))

    for make, key in ((mix, "id"), (packed, "input_ids")):
        whole = [_value(item, key) for item in make(drive)]
        first = make(drive)
        iterator = iter(first)
        head = [_value(next(iterator), key) for _ in range(30)]
        state = checkpoint(first.state_dict())
        moved = make(local)
        moved.load_state_dict(state)
        assert head + [_value(item, key) for item in moved] == whole


def tokens(record: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": [record["id"] % 1000 + 1, 5]}


def _value(item: dict[str, Any], key: str) -> Any:
    value = item[key]
    return value.tolist() if hasattr(value, "tolist") else value


# -- a real difference, named -----------------------------------------------------------------


def refused(state: Any, source: Any, workers: int = 0, **options: Any) -> str:
    """The refusal of `state` (taken with as many workers) by a loader with `workers` workers:
    with workers the first batch raises it, from the worker that loads the state."""
    again = loader(source, workers, **options)
    again.load_state_dict(state)
    with pytest.raises(StateMismatchError) as raised:
        next(iter(again))  # a StatefulDataLoader's workers load the state as they start
    # stop the failed iterator's workers and queue feeder threads now (its traceback holds
    # it): a later fork while a feeder thread holds an import lock breaks the child's imports
    stop_workers(again)
    return str(raised.value)


def test_a_deleted_shard_is_named(drive, local):
    _, state = cut(str(drive), 2, 3)
    (local / "train" / "part-3.tar").unlink()
    message = refused(state, str(local), workers=2)  # refused inside a worker as well
    assert "missing here (only in the state): 'train/part-3.tar'" in message
    assert "the same files under another folder or mount point load" in message


def test_an_added_file_is_named(drive, local):
    _, state = cut(str(drive), 0, 3)
    (local / "extra").mkdir()
    (local / "extra" / "more.jsonl").write_bytes(b'{"id": -1}\n')
    message = refused(state, str(local))
    assert "added here (not in the state): 'extra/more.jsonl'" in message
    assert "missing" not in message


def test_a_file_of_another_size_is_named(drive, local):
    _, state = cut(str(drive), 0, 3)
    with open(local / "train" / "part-2.jsonl.gz", "ab") as grown:
        grown.write(b"\0")
    message = refused(state, str(local))
    assert "other size: 'train/part-2.jsonl.gz' (" in message
    assert "bytes in the state" in message


@pytest.mark.parametrize(("setting", "value", "said"), [
    ("seed", 4, "seed=3 in the state, 4 here"),
    ("shuffle", False, "shuffle=True in the state, False here"),
    ("buffer_size", 17, "buffer_size=16 in the state, 17 here"),
    ("storage", Storage(block_size=1 << 17), "block_size=8388608 in the state, 131072 here"),
    ("even_ranks", "drop", "even_ranks=None in the state, 'drop' here"),
])
def test_another_setting_is_named_with_both_values(drive, setting, value, said):
    _, state = cut(str(drive), 0, 3)
    message = refused(state, str(drive), **{setting: value})
    assert said in message
    assert "files differ" not in message  # the same files: only the setting is named


def test_a_merged_state_and_merge_states_name_the_difference(drive, local):
    states = []
    for rank in range(2):
        first = StreamingJsonl(str(drive), rank=rank, world_size=2, **OPTIONS)
        iterator = iter(first)
        next(iterator)
        states.append(first.state_dict())
    merged = merge_states(states)
    (local / "train" / "part-4.tar").unlink()
    with pytest.raises(StateMismatchError, match=r"missing here .*'train/part-4.tar'"):
        StreamingJsonl(str(local), **OPTIONS).with_resume(merged)
    other = StreamingJsonl(str(local), rank=1, world_size=2, **OPTIONS)
    next(iter(other))
    with pytest.raises(StateMismatchError, match=r"missing in reader \(rank 1, worker 0\) "
                                                 r"\(only in reader \(rank 0, worker 0\)\): "
                                                 "'train/part-4.tar'"):
        merge_states([states[0], other.state_dict()])


def test_a_merged_state_of_an_earlier_version_is_refused_with_the_reason(drive):
    merged = merge_states([StreamingJsonl(str(drive), **OPTIONS).state_dict()])
    merged["fingerprint"] = "0123456789abcdef01234567"  # what earlier versions wrote
    with pytest.raises(StateMismatchError, match="earlier version identified the corpus by "
                                                 "absolute paths"):
        StreamingJsonl(str(drive), **OPTIONS).with_resume(merged)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shards `streamds convert` wrote, with the manifest's checksums."""
    root = tmp_path_factory.mktemp("converted")
    data = root / "in.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"id": i, "text": "w" * 300}) + b"\n"
                              for i in range(3000)))
    convert([str(data)], root / "shards", shard_size=200_000)
    return root / "shards"


def test_a_shard_with_another_checksum_is_named(shards, tmp_path):
    dataset = StreamingJsonl(str(shards), **OPTIONS)
    assert all(shard.checksum for shard in dataset.shards)
    iterator = iter(dataset)
    next(iterator)
    state = checkpoint(dataset.state_dict())
    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    StreamingJsonl(str(copy), **OPTIONS).load_state_dict(state)  # moved: loads
    manifest = json.loads((copy / "manifest.json").read_text())
    entry = manifest["shards"][1]
    entry["checksum"] = "0" * len(entry["checksum"])  # another shard of the same size
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StateMismatchError,
                       match=rf"other checksum: '{entry['name']}' \(checksum [0-9a-f]+ in the "
                             r"state, 0+ here\)"):
        StreamingJsonl(str(copy), **OPTIONS).load_state_dict(state)


# -- the identity itself ---------------------------------------------------------------------


def fake(path: str, size: int = 10) -> Shard:
    return Shard(url=path, path=path, size=size, format="jsonl", codec=None)


def test_names_hold_no_credentials_nor_location():
    shard = fake("https://user:PW@host/data/a.jsonl?sig=SECRET&token=T#frag")
    alone = relative_names([shard], ["https://user:PW@host/data"])
    assert alone == ["a.jsonl"]
    spread = relative_names([shard, fake("/local/b.jsonl")],
                            ["https://user:PW@host/data", "/local"])
    state = Identity.of([shard, fake("/local/b.jsonl")], spread,
                        dict.fromkeys(identity.SETTINGS)).state
    text = json.dumps(state) + json.dumps(spread)
    assert not any(secret in text for secret in ("PW", "SECRET", "token", "frag"))


def test_a_large_corpus_keeps_a_bounded_listing_that_still_names_the_folder(monkeypatch):
    settings = dict.fromkeys(identity.SETTINGS)
    names = [f"part-{folder}/{index:05d}.jsonl" for folder in range(3) for index in range(400)]
    shards = [fake(f"/d/{name}") for name in names]
    monkeypatch.setattr(identity, "LISTING_LIMIT", 2000)
    old = Identity.of(shards, names, settings)
    assert old.state["listing"].startswith("folders:") and len(old.state["listing"]) <= 2000
    new = Identity.of(shards[:-1], names[:-1], settings)
    said = new.differences(old.to_state())
    assert said == ["files differ (too many to list them in a state): folder 'part-2': 400 "
                    "files (4000 bytes) in the state, 399 (3990 bytes) here"]
    monkeypatch.setattr(identity, "LISTING_LIMIT", 10)  # not even the folders fit: totals
    old = Identity.of(shards, names, settings)
    assert old.state["listing"] == ""
    assert new.differences(old.to_state()) == [
        "the corpus has 1200 files (12000 bytes) in the state, 1199 (11990 bytes) here"]


def test_taking_a_state_shares_the_listing(drive):
    """The listing is made once per dataset; each state refers to it (no per-call copy)."""
    dataset = StreamingJsonl(str(drive), **OPTIONS)
    iterator = iter(dataset)
    next(iterator)
    first, second = dataset.state_dict(), dataset.state_dict()
    assert first["fingerprint"]["listing"] is second["fingerprint"]["listing"]
    assert len(first["fingerprint"]["listing"]) <= streamds.resume.identity.LISTING_LIMIT


NAME = st.from_regex(r"[a-z0-9]{1,3}(/[a-z0-9]{1,3}){0,2}\.jsonl", fullmatch=True)
ROOTS = ["/mnt/drive/MyDrive/corpus", "/content/corpus", "/data/x1/y", "memory://bucket/c"]


def placed(names: list[str], root: str, spelling: str) -> tuple[list[Shard], dict[str, Any]]:
    """Fake shards of `names` under `root` in reading order, and their identity's state."""
    _, path = url_to_fs(root)  # a shard's path is its filesystem's ("/bucket/c/a.jsonl")
    shards = sorted((Shard(url=f"{root}/{name}", path=f"{path}/{name}", size=len(name),
                           format="jsonl", codec=None) for name in names),
                    key=lambda shard: natural_key(shard.url))
    items = [root] if spelling == "folder" else [shard.url for shard in shards]
    roots = [source_root(item, shards, {}) for item in items]
    return shards, Identity.of(shards, relative_names(shards, roots),
                               dict.fromkeys(identity.SETTINGS)).to_state()


@settings(max_examples=60, deadline=None)
@given(names=st.lists(NAME, min_size=2, max_size=12, unique=True),
       where=st.permutations(ROOTS), spelling=st.sampled_from(["folder", "list"]),
       data=st.data())
def test_the_same_names_under_any_root_are_one_corpus_and_a_change_is_named(
        names, where, spelling, data):
    names = [name for name in names if not any(other.startswith(name[:-6] + "/")
                                               for other in names)]  # no file-folder clash
    assume(len(names) >= 2)
    first, second = where[0], where[1]
    _, old = placed(names, first, spelling)
    _, new = placed(names, second, spelling)
    assert old["corpus"] == new["corpus"]
    assert identity.differences(old, new) == []
    if spelling == "folder":  # a list's common folder moves with the files it lists
        gone = data.draw(st.sampled_from(names))
        _, fewer = placed([name for name in names if name != gone], second, spelling)
        said = identity.differences(old, fewer)
        assert said == [f"files differ: missing here (only in the state): {gone!r}"]
        assert identity.differences(fewer, old) == [
            f"files differ: added here (not in the state): {gone!r}"]


def test_a_state_taken_over_http_with_a_signed_url_resumes_from_local_disk(drive):
    """The same files served over HTTP (a signed URL) and on local disk are one corpus; the
    state holds neither the host nor the signature."""
    pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")
    from testbed.http import serve

    folder = drive / "train"
    names = ["part-0.jsonl", "part-1.jsonl.zst"]
    with serve(folder) as server:
        # (a query on the .zst would hide its codec from the reader: not this test's matter)
        urls = [f"{server.url}/{names[0]}?sig=SECRET", f"{server.url}/{names[1]}"]
        remote = StreamingJsonl(urls, **OPTIONS)
        iterator = iter(remote)
        head = [next(iterator)["id"] for _ in range(40)]
        state = checkpoint(remote.state_dict())
        rest = [record["id"] for record in iterator]
    kept = pickle.dumps(state)
    assert b"SECRET" not in kept and b"127.0.0.1" not in kept
    local = StreamingJsonl([str(folder / name) for name in names], **OPTIONS)
    local.load_state_dict(state)
    assert [record["id"] for record in local] == rest and head


def test_a_merged_mix_state_finishes_over_the_moved_files(drive, local):
    def mix(root: Path, rank: int | None = None) -> Mix:
        world = {} if rank is None else {"rank": rank, "world_size": 2}
        a = StreamingJsonl(str(root / "train" / "part-0.jsonl"), **OPTIONS, **world)
        b = StreamingJsonl(str(root / "train"), **OPTIONS, **world)
        return Mix([a, b], [0.3, 0.7], seed=1)

    seen: list[int] = []
    states = []
    for rank in range(2):
        ranked = mix(drive, rank)
        iterator = iter(ranked)
        seen += [next(iterator)["id"] for _ in range(25)]
        states.append(checkpoint(ranked.state_dict()))
    merged = checkpoint(merge_states(states))
    rest = [record["id"] for record in mix(local).with_resume(merged)]
    every = [record["id"] for record in mix(drive)]
    assert sorted(seen + rest) == sorted(every)


# -- a file rewritten at the same size (issue 34 item 4) -------------------------------------


def reordered_file(tmp_path: Path) -> tuple[Path, dict[str, Any], list[int]]:
    """A 500-line file, the state after 250 of its records, and those records."""
    path = tmp_path / "c.jsonl"
    lines = [orjson.dumps({"i": i}) for i in range(500)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    dataset = StreamingJsonl(str(path))
    seen = [record["i"] for record in itertools.islice(dataset, 250)]
    return path, checkpoint(dataset.state_dict()), seen


def test_a_file_rewritten_at_the_same_size_is_refused_by_name(tmp_path):
    path, state, _ = reordered_file(tmp_path)
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join(lines[::-1]) + b"\n")  # the same lines, in another order
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(StateMismatchError,
                       match=r"files modified since \(the same name and size\): 'c.jsonl' .*"
                             r"cp -p"):
        StreamingJsonl(str(path)).load_state_dict(state)


def test_a_copy_keeping_its_times_loads_and_one_without_them_is_refused(tmp_path):
    path, state, seen = reordered_file(tmp_path)
    kept, fresh = tmp_path / "kept", tmp_path / "fresh"
    kept.mkdir()
    fresh.mkdir()
    shutil.copy2(path, kept / path.name)
    shutil.copy(path, fresh / path.name)
    stat = (fresh / path.name).stat()
    os.utime(fresh / path.name, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    resumed = StreamingJsonl(str(kept / path.name))
    resumed.load_state_dict(state)
    assert seen + [record["i"] for record in resumed] == list(range(500))
    with pytest.raises(StateMismatchError, match="modification times"):
        StreamingJsonl(str(fresh / path.name)).load_state_dict(state)


def test_a_checksummed_copy_loads_whatever_its_times(shards, tmp_path):
    dataset = StreamingJsonl(str(shards), **OPTIONS)
    next(iter(dataset))
    state = checkpoint(dataset.state_dict())
    copy = tmp_path / "copy"
    shutil.copytree(shards, copy, copy_function=shutil.copy)  # new modification times
    for path in copy.iterdir():
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    StreamingJsonl(str(copy), **OPTIONS).load_state_dict(state)  # the checksums name them


@pytest.mark.parametrize(("version", "seconds"), [
    ("mtime=1733446800.25 created=1.0", 1733446800.25),
    ("last-modified=Fri, 06 Dec 2024 01:00:00 GMT", 1733446800.0),
    ('etag="abc" lastmodified=2024-12-06 01:00:00+00:00', 1733446800.0),
    ("updated=2024-12-06T01:00:00Z", 1733446800.0),
    ('etag="abc"', None),
    (None, None),
])
def test_modification_times_are_read_from_every_storage(version, seconds):
    assert identity.modified_time(version) == seconds
    if seconds is not None:  # a date in whole seconds is the same time as a finer mtime
        assert identity._same_time(math.floor(seconds), seconds + 0.25)
        assert not identity._same_time(seconds + 0.5, seconds + 0.25)
