"""Visible counts (issue 9, bullet 5): lines without a record are counted where a user looks.

- every reader logs its skipped malformed lines with file and line (the first few of each
  file, then only counts) and a summary when its epoch ends;
- `streamds.counts_of(state)` sums the counts of every reader behind a dataset, batcher or
  StatefulDataLoader state (each worker counts in its own process; the state carries them);
- a transform that raises keeps its exception type and names the file, the 1-based line,
  the stage and the step.
"""

from __future__ import annotations

import functools
import logging
import random
from pathlib import Path
from typing import Any

import corpus
import orjson
import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import streamds
import streamds.stages.transform
from streamds import Storage, StreamingJsonl

BAD_LINE = b'{"id": "cut'
START = (1000, 5000)  # the first record id of each shard


def keep(batch: list) -> list:
    return batch


def even_ids(record: dict[str, Any]) -> bool:
    return record["id"] % 2 == 0


def needs_title(record: dict[str, Any], *, bad_id: int = 1300) -> dict[str, Any]:
    if record["id"] == bad_id:
        return {"title": record["title"]}  # no "title": KeyError on one record
    return record


def none_for_fives(record: dict[str, Any]) -> dict[str, Any] | None:
    return None if record["id"] % 5 == 0 else record


def drop_all(record: dict[str, Any]) -> bool:
    return False


class TwoArgumentError(Exception):
    """An exception type that cannot be built from one message."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)


def raises_custom(record: dict[str, Any]) -> dict[str, Any]:
    if record["id"] == 1300:
        raise TwoArgumentError(7, "bad record")
    return record


def write_lines(path: Path, lines: list[bytes]) -> Path:
    """`lines` as the format `path`'s suffix names."""
    suffix = next(s for s in sorted(corpus.WRITERS, key=len, reverse=True)
                  if path.name.endswith(s))
    return corpus.WRITERS[suffix](path, b"\n".join(lines) + b"\n")


@pytest.fixture(scope="module")
def defects(tmp_path_factory) -> dict[str, Any]:
    """Two shards of records with malformed and blank lines at known 1-based lines, in
    many 64 KiB blocks (so every worker and rank reads some)."""
    root = tmp_path_factory.mktemp("counts")
    files = {}
    for shard, (count, bad_every, blank_every) in enumerate([(2000, 150, 170), (1200, 400, 0)]):
        lines, bad_at, blank_at = [], [], []
        for record in corpus.make_records(count, start=START[shard]):
            if len(lines) % bad_every == bad_every - 1:
                lines.append(BAD_LINE)
                bad_at.append(len(lines))
            if blank_every and len(lines) % blank_every == blank_every - 1:
                lines.append(b"")
                blank_at.append(len(lines))
            lines.append(orjson.dumps({**record, "pad": "x" * 200}))
        path = write_lines(root / f"part-{shard}.jsonl", lines)
        files[path.name] = {"bad": bad_at, "blank": blank_at, "records": count}
    ids = [i for shard, count in enumerate((2000, 1200))
           for i in range(START[shard], START[shard] + count)]
    return {"root": root, "files": files, "ids": ids,
            "bad": sum(len(f["bad"]) for f in files.values()),
            "blank": sum(len(f["blank"]) for f in files.values())}


def skipping(root: Path, **options: Any) -> StreamingJsonl:
    return StreamingJsonl(root, on_error="skip", buffer_size=100,
                          storage=Storage(block_size=64 << 10), **options)


# -- the log ------------------------------------------------------------------------------


def skipped_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("skipped a malformed line")]


def test_skipped_lines_are_logged_with_file_and_line_then_only_counted(defects, caplog):
    caplog.set_level(logging.INFO, logger="streamds")
    records = list(skipping(defects["root"]))
    assert len(records) == len(defects["ids"])
    said = skipped_messages(caplog)
    limit = streamds.stages.parse.WARN_BAD_LINES
    expected = []
    for name, where in defects["files"].items():
        expected += [(name, line) for line in where["bad"][:limit]]
        assert len(where["bad"]) > limit or name == "part-1.jsonl"
    assert len(said) == len(expected)  # the first few of each file, no more
    for message, (name, line) in zip(said, expected, strict=True):
        assert f"{name}: line {line} (byte offset " in message, message
        assert "invalid JSON" in message and "'{\"id\": \"cut'" in message
    assert "further malformed lines of" in said[limit - 1]
    assert all(r.levelno == logging.WARNING for r in caplog.records
               if r.getMessage().startswith("skipped"))


def test_each_reader_logs_a_summary_when_its_epoch_ends(defects, caplog):
    caplog.set_level(logging.INFO, logger="streamds")
    ds = skipping(defects["root"], shuffle=True).filter(even_ids)
    records = list(ds)
    summaries = [r for r in caplog.records if "epoch 0 done" in r.getMessage()]
    assert len(summaries) == 1  # once, when the last record is out
    message = summaries[0].getMessage()
    assert summaries[0].levelno == logging.WARNING  # lines were lost to errors
    dropped = len(defects["ids"]) - len(records)
    for part in (f"{defects['bad']} malformed lines skipped (on_error='skip')",
                 f"{defects['blank']} blank lines", f"{dropped} records dropped",
                 "rank 0 of 1, worker 0 of 1", "part-0.jsonl: "):
        assert part in message, message


def test_a_clean_epoch_with_a_filter_logs_its_summary_as_info(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="streamds")
    path = corpus.write(tmp_path / "clean.jsonl", corpus.make_records(50))
    list(StreamingJsonl(path).map(none_for_fives))
    [summary] = [r for r in caplog.records if "epoch 0 done" in r.getMessage()]
    assert summary.levelno == logging.INFO
    assert "10 records dropped by map (None) or filter" in summary.getMessage()


def test_every_worker_logs_its_own_lines_and_summary(defects, tmp_path):
    """Workers log in their own processes: a handler set up before the loader starts them
    (inherited by fork) receives each worker's messages."""
    log_file = tmp_path / "workers.log"
    handler = logging.FileHandler(log_file)
    logger = logging.getLogger("streamds")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        loader = DataLoader(skipping(defects["root"]), batch_size=32, num_workers=2,
                            collate_fn=keep, multiprocessing_context="fork")
        assert sum(len(batch) for batch in loader) == len(defects["ids"])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        handler.close()
    text = log_file.read_text()
    for worker in (0, 1):
        assert f"worker {worker} of 2), epoch 0 done" in text
    assert text.count("skipped a malformed line") >= streamds.stages.parse.WARN_BAD_LINES


# -- counts_of: the totals in the main process -----------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("workers", [0, 2])
def test_counts_of_a_stateful_loader_state_sums_every_worker(defects, shuffle, workers):
    ds = skipping(defects["root"], shuffle=shuffle).filter(even_ids)
    loader = StatefulDataLoader(ds, batch_size=32, num_workers=workers, collate_fn=keep)
    seen = sum(len(batch) for batch in loader)
    counts = streamds.counts_of(loader.state_dict())
    if workers:  # the workers counted, in their own processes: no empty dict here
        with pytest.raises(RuntimeError, match=r"streamds\.counts_of\(loader\.state_dict"):
            ds.counts  # noqa: B018
    else:
        assert {key: ds.counts[key] for key in counts} == counts
    assert counts == {"bad": defects["bad"], "blank": defects["blank"],
                      "dropped": len(defects["ids"]) - seen, "corrupt_blocks": 0}


@pytest.mark.parametrize("workers", [0, 2])
def test_counts_in_the_main_process_of_a_plain_loader(defects, workers):
    """With workers the main process has no counts: it refuses (naming where they are)
    instead of an empty dict that reads as "nothing skipped"; without, it has them."""
    ds = skipping(defects["root"], shuffle=True)
    with pytest.raises(RuntimeError, match="no iterator of this dataset ran in this process"):
        ds.counts  # noqa: B018  (nothing read yet, anywhere)
    seen = sum(len(batch) for batch in DataLoader(ds, batch_size=32, num_workers=workers,
                                                  collate_fn=keep))
    assert seen == len(defects["ids"])
    if workers:
        with pytest.raises(RuntimeError) as refused:
            ds.counts  # noqa: B018
        assert "streamds.counts_of(loader.state_dict())" in str(refused.value)
        assert "'epoch N done' log line" in str(refused.value)
    else:
        assert (ds.counts["bad"], ds.counts["blank"]) == (defects["bad"], defects["blank"])


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_counts_survive_a_resume_and_count_the_whole_epoch(defects, shuffle, caplog):
    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(skipping(defects["root"], shuffle=shuffle), batch_size=32,
                                  num_workers=2, collate_fn=keep)

    first = loader()
    for step, _ in enumerate(first):
        if step == 40:
            break
    state = first.state_dict()
    middle = streamds.counts_of(state)
    assert middle["bad"] < defects["bad"]  # counted up to where the state resumes
    assert middle["bad"] > 0 or shuffle  # (a shuffle's state lags by up to a buffer)
    second = loader()
    second.load_state_dict(state)
    for _ in second:
        pass
    counts = streamds.counts_of(second.state_dict())
    assert (counts["bad"], counts["blank"]) == (defects["bad"], defects["blank"])


def test_counts_of_batcher_rank_and_merged_states(defects):
    def ranks(shuffle: bool) -> list[StreamingJsonl]:
        return [skipping(defects["root"], rank=rank, world_size=2, shuffle=shuffle)
                for rank in (0, 1)]

    states = []
    for ds in ranks(True):
        batches = streamds.Mix([ds], [1.0], seed=0).batch(8)  # a pool batcher's nested state
        loader = StatefulDataLoader(batches, batch_size=None, num_workers=1)
        for _ in loader:
            pass
        states.append(loader.state_dict())
    expected = {"bad": defects["bad"], "blank": defects["blank"], "dropped": 0,
                "corrupt_blocks": 0}
    assert streamds.counts_of(states) == expected  # every rank's batcher, ended
    assert streamds.counts_of({}) == dict.fromkeys(expected, 0)

    halfway = []
    for ds in ranks(False):
        stream = iter(ds)
        for _ in range(700):
            next(stream)
        halfway.append(ds.state_dict())
    merged = streamds.merge_states(halfway)
    assert streamds.counts_of(merged) == streamds.counts_of(halfway)
    assert 0 < streamds.counts_of(halfway)["bad"] < defects["bad"]


def test_a_filter_that_drops_everything_yields_nothing_and_says_so(defects, caplog):
    caplog.set_level(logging.INFO, logger="streamds")
    ds = StreamingJsonl(defects["root"], on_error="skip",
                        storage=streamds.Storage(block_size=64 << 10)).filter(drop_all)
    loader = StatefulDataLoader(ds, batch_size=32, num_workers=0, collate_fn=keep)
    assert list(loader) == []
    counts = streamds.counts_of(loader.state_dict())
    assert counts["dropped"] == len(defects["ids"]) and counts["bad"] == defects["bad"]
    [summary] = [r.getMessage() for r in caplog.records if "epoch 0 done" in r.getMessage()]
    assert f"{len(defects['ids'])} records dropped by map (None) or filter" in summary


def test_a_filter_that_drops_everything_under_even_ranks_says_why_it_cannot_even_out(tmp_path):
    corpus.write(tmp_path / "a.jsonl", corpus.make_records(3000))
    ds = StreamingJsonl(tmp_path, even_ranks="pad", rank=0, world_size=2).filter(drop_all)
    with pytest.raises(ValueError, match=r"quota of \d+ records: it found 0 .*filter drop"):
        list(ds)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_damaged_block_skipped_in_a_worker_is_counted_in_the_main_process(
    tmp_path, workers, caplog
):
    caplog.set_level(logging.INFO, logger="streamds")
    corpus.write(tmp_path / "good.jsonl", corpus.make_records(500))
    damaged = corpus.write(tmp_path / "cut.jsonl.gz", corpus.make_records(3000, start=10_000))
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    ds = StreamingJsonl(tmp_path, on_error="skip")
    loader = StatefulDataLoader(ds, batch_size=32, num_workers=workers, collate_fn=keep)
    seen = sum(len(batch) for batch in loader)
    assert 500 <= seen < 3500  # the good file, and what came before the cut
    counts = streamds.counts_of(loader.state_dict())
    assert counts["corrupt_blocks"] + counts["bad"] == 1
    if workers == 0:
        [summary] = [r for r in caplog.records if "epoch 0 done" in r.getMessage()]
        assert summary.levelno == logging.WARNING
        assert "cut.jsonl.gz" in caplog.text  # the block's own warning names the file


def test_a_byte_order_mark_at_the_start_of_a_file_is_not_a_bad_line(tmp_path):
    records = corpus.make_records(20)
    path = corpus.write_plain(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + corpus.jsonl(records))
    ds = StreamingJsonl(path)
    assert list(ds) == records
    assert ds.counts["bad"] == 0


# -- line numbers ----------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_line_numbers_in_any_order_match_a_plain_count(tmp_path, suffix):
    lines = [orjson.dumps({"id": i, "pad": "z" * (i % 97)}) for i in range(3000)]
    path = write_lines(tmp_path / f"data{suffix}", lines)
    ds = StreamingJsonl(path, storage=streamds.Storage(block_size=64 << 10))
    starts, offset = [], 0
    for line in lines:
        starts.append(offset)
        offset += len(line) + 1
    where = streamds.stages.parse.LineNumbers(ds.shards, ds._block_list)
    picks = random.Random(4).sample(range(len(lines)), 60)
    for number in picks:
        assert where.line(0, starts[number]) == number + 1


# -- a transform that raises ------------------------------------------------------------------


def notes(err: BaseException) -> str:
    return "\n".join(getattr(err, "__notes__", []))


def line_of_id(defects: dict[str, Any], wanted: int, name: str = "part-0.jsonl") -> int:
    """The 1-based line of record `wanted` in shard `name`."""
    path = defects["root"] / name
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if line.startswith(b'{"id":%d,' % wanted):
            return number
    raise AssertionError(wanted)


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize(("bad_id", "name"), [(1300, "part-0.jsonl"), (5008, "part-1.jsonl")],
                         ids=["chunk-with-markers", "clean-chunk"])
def test_a_raising_transform_keeps_its_type_and_names_file_line_and_stage(
    defects, shuffle, bad_id, name
):
    ds = (skipping(defects["root"], shuffle=shuffle).filter(even_ids)
          .map(functools.partial(needs_title, bad_id=bad_id)))
    with pytest.raises(KeyError) as raised:
        list(ds)
    assert type(raised.value) is KeyError and raised.value.args == ("title",)
    said = notes(raised.value)
    line = line_of_id(defects, bad_id, name)
    for part in ("transform stage", "map step 2 of 2 (partial(test_counts.needs_title))",
                 f"{name}: line {line} (byte offset "):
        assert part in said, said


def test_a_raising_transform_in_a_worker_names_the_line_in_the_main_process(defects):
    ds = skipping(defects["root"]).map(needs_title)
    loader = DataLoader(ds, batch_size=32, num_workers=2, collate_fn=keep)
    with pytest.raises(KeyError) as raised:
        for _ in loader:
            pass
    line = line_of_id(defects, 1300)
    assert f"part-0.jsonl: line {line} (byte offset " in str(raised.value)
    assert "map step 1 of 1 (test_counts.needs_title)" in str(raised.value)


def test_without_exception_notes_a_chained_error_of_the_same_type(defects, monkeypatch):
    """Python 3.10 has no add_note: an exception of the same type, chained, says it."""
    monkeypatch.setattr(streamds.stages.transform, "HAS_NOTES", False)
    with pytest.raises(KeyError) as raised:
        list(skipping(defects["root"]).map(needs_title))
    assert type(raised.value) is KeyError
    assert isinstance(raised.value.__cause__, KeyError)
    line = line_of_id(defects, 1300)
    assert f"part-0.jsonl: line {line}" in str(raised.value)


def test_without_notes_a_type_that_needs_more_arguments_is_raised_as_it_is(
    defects, monkeypatch, caplog
):
    monkeypatch.setattr(streamds.stages.transform, "HAS_NOTES", False)
    with pytest.raises(TwoArgumentError) as raised:
        list(skipping(defects["root"]).map(raises_custom))
    assert raised.value.args == (7, "bad record")
    line = line_of_id(defects, 1300)
    assert any(f"part-0.jsonl: line {line}" in r.getMessage() and r.levelno == logging.ERROR
               for r in caplog.records)


def test_a_raising_filter_in_a_tar_shard_names_the_member(tmp_path):
    path = corpus.write(tmp_path / "data.tar", corpus.make_records(30, start=1000))
    ds = StreamingJsonl(path).filter(functools.partial(needs_title, bad_id=1008))
    with pytest.raises(KeyError) as raised:
        list(ds)
    said = notes(raised.value)
    assert "filter step 1 of 1" in said and "data.tar: " in said and "(record 9)" in said


@pytest.mark.parametrize("first", [b"\xef\xbb\xbf\n", b'\xef\xbb\xbf{"id": -1}\n'],
                         ids=["lone-bom", "bom-and-record"])
def test_record_counts_read_a_byte_order_mark_as_the_reader_does(tmp_path: Path, first: bytes):
    from streamds.resume.block_counts import count_block_records
    from streamds.storage.plan import make_blocks
    from streamds.storage.shards import resolve_shards

    path = tmp_path / "bom.jsonl"
    path.write_bytes(first + corpus.jsonl(corpus.make_records(5)))
    shards = resolve_shards(str(path))
    read = list(StreamingJsonl(str(path)))
    assert sum(count_block_records(shards, make_blocks(shards))) == len(read) == 5 + (b"{" in first)


def test_a_plain_loader_resume_reads_a_byte_order_mark_as_the_reader_does(tmp_path: Path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf\n" + corpus.jsonl(corpus.make_records(10)))
    rest = StreamingJsonl(str(path)).resume_after_batches(1, batch_size=3, num_workers=0)
    assert [record["id"] for record in rest] == list(range(3, 10))


# -- counts after an epoch whose workers' records fill whole batches -------------------------


def under_5000(record: dict[str, Any]) -> bool:
    return record["id"] < 5000


@pytest.fixture(scope="module")
def whole_batches(tmp_path_factory) -> Path:
    """Two files, one per worker, each of 2048 records (whole batches of 32, and one whole
    message of ds.loader's small-record route), then lines that give no record: 3 malformed,
    1 blank and 5 records a filter drops (`under_5000`), plus one malformed line among the
    records."""
    root = tmp_path_factory.mktemp("whole")
    for part in range(2):
        lines = [orjson.dumps({"id": part * 2048 + i}) for i in range(2048)]
        lines.insert(10, BAD_LINE)
        lines += [BAD_LINE, b"", BAD_LINE] + [orjson.dumps({"id": 5000 + i}) for i in range(5)]
        lines.append(BAD_LINE)
        (root / f"part-{part}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return root


WHOLE = {"bad": 8, "blank": 2, "dropped": 10, "corrupt_blocks": 0}


def whole_dataset(root: Path) -> Any:
    return StreamingJsonl(root, on_error="skip").filter(under_5000)


@pytest.mark.parametrize("route", ["stateful_loader", "ds.loader", "ds.loader small records",
                                   "ds.loader snapshot_every_n_steps=3"])
def test_counts_after_an_epoch_hold_the_lines_after_each_workers_last_batch(
    whole_batches, route
):
    """Each worker's records fill whole batches, so it reads the lines after its last batch
    only when asked for one more; the state after the epoch holds them all (also 2 batches
    after the last snapshot: 128 batches), and loaded it starts the next epoch with every
    record once."""

    def make() -> Any:
        ds = whole_dataset(whole_batches)
        if route == "stateful_loader":
            return streamds.stateful_loader(ds, batch_size=32, num_workers=2, collate_fn=keep)
        every = {"snapshot_every_n_steps": 3} if "every" in route else {}
        return ds.loader(32, num_workers=2, small_records=route.endswith("small records"),
                         **every)

    loader = make()
    sizes = [len(batch) for batch in loader]
    assert sizes == [32] * 128  # whole batches only: no short last batch to end a worker
    state = loader.state_dict()
    assert streamds.counts_of(state) == WHOLE
    again = make()
    again.load_state_dict(state)
    ids = [record["id"] for batch in again for record in batch]
    assert sorted(ids) == list(range(4096))
    assert streamds.counts_of(again.state_dict()) == WHOLE


def test_counts_of_refuses_a_torchdata_state_that_misses_a_workers_end(whole_batches):
    """torchdata's own loader keeps no worker state taken after the last batch: counts_of
    says so (naming the fix) rather than count short; where each worker's state shows its
    end (a short last batch), it counts."""
    loader = StatefulDataLoader(whole_dataset(whole_batches), batch_size=32, num_workers=2,
                                collate_fn=keep)
    assert sum(len(batch) for batch in loader) == 4096
    with pytest.raises(ValueError, match=r"worker_0, worker_1 as of the last batch it made.*"
                                         r"streamds\.stateful_loader\(\.\.\.\) or ds\.loader"):
        streamds.counts_of(loader.state_dict())
    short_last = [  # 2048 = 68 * 30 + 8: each worker's last batch ends its records
        StatefulDataLoader(whole_dataset(whole_batches), batch_size=30, num_workers=2,
                           collate_fn=keep),
        StatefulDataLoader(whole_dataset(whole_batches).batch(30), batch_size=None,
                           num_workers=2, collate_fn=keep),
    ]
    for loader in short_last:
        assert sum(len(batch) for batch in loader) == 4096
        assert streamds.counts_of(loader.state_dict()) == WHOLE


# -- counts after an epoch of a Mix under torchdata's own loader -----------------------------


@pytest.fixture(scope="module")
def mix_sources(tmp_path_factory) -> tuple[Path, Path]:
    """Two sources of two files each (one per worker): "short" has 30 records a file, "long"
    200; a malformed line after every tenth record, and after the last record a malformed, a
    blank and a malformed line (read only when the reader looks for a record after its last)."""
    root = tmp_path_factory.mktemp("mix")
    paths = []
    for name, size in (("short", 30), ("long", 200)):
        directory = root / name
        directory.mkdir()
        for part in range(2):
            lines = []
            for i in range(size):
                lines.append(orjson.dumps({"id": (part + 1) * 100_000 + i}))
                if i % 10 == 3:
                    lines.append(BAD_LINE)
            lines += [BAD_LINE, b"", BAD_LINE]
            (directory / f"part-{part}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        paths.append(directory)
    return paths[0], paths[1]


def mixed(sources: tuple[Path, Path], stop: str) -> streamds.Mix:
    return streamds.Mix([StreamingJsonl(path, on_error="skip") for path in sources], [1, 1],
                        seed=1, stop=stop)


def test_counts_of_counts_a_torchdata_state_where_each_workers_mix_had_ended(mix_sources):
    """stop="first": a worker's mix ends with the short source, its long one part read. A
    short last batch of .batch(7) is made after the mix ended, so torchdata's state after it
    is the worker's end: counted as the loader that keeps each worker's end counts."""
    torchdata = StatefulDataLoader(mixed(mix_sources, "first").batch(7), batch_size=None,
                                   num_workers=2, collate_fn=keep)
    batches = list(torchdata)
    assert sum(len(batch) < 7 for batch in batches) == 2  # each worker's last batch is short
    ours = streamds.stateful_loader(mixed(mix_sources, "first").batch(7), batch_size=None,
                                    num_workers=2, collate_fn=keep)
    assert [len(batch) for batch in ours] == [len(batch) for batch in batches]
    expected = streamds.counts_of(ours.state_dict())
    assert expected["bad"] == 10 and expected["blank"] == 2  # the short source read to its end
    assert streamds.counts_of(torchdata.state_dict()) == expected


def test_counts_of_refuses_a_torchdata_state_of_a_mix_that_read_on_after_its_last_record(
        mix_sources):
    """One record a step: a worker's mix finds its end on the draw after its last record,
    reading the short source's last lines (malformed, blank) then; torchdata's state holds
    the worker as of its last record, without them, so counts_of refuses it, naming the
    loaders that keep each worker's end."""
    from streamds.resume import totals

    torchdata = StatefulDataLoader(mixed(mix_sources, "first"), batch_size=None, num_workers=2,
                                   collate_fn=keep)
    ours = streamds.stateful_loader(mixed(mix_sources, "first"), batch_size=None,
                                    num_workers=2, collate_fn=keep)
    assert len(list(torchdata)) == len(list(ours))
    short = totals.counts_of(torchdata.state_dict())  # what counting it anyway would say
    assert short["bad"] < streamds.counts_of(ours.state_dict())["bad"]
    # (a worker that ends before the other's last record shows its end at that record)
    with pytest.raises(ValueError, match=r"each of worker_\d as of the last batch.*"
                                         r"streamds\.Mix reads on after its last record.*"
                                         r"streamds\.stateful_loader\(\.\.\.\) or ds\.loader"):
        streamds.counts_of(torchdata.state_dict())


def test_counts_of_refuses_a_cycle_mix_whose_sources_started_a_new_pass(mix_sources):
    """stop="cycle" reads the short source again and again; each pass starts its source
    afresh, so a state holds the counts of the current pass only: refused, not counted
    short."""
    ds = mixed(mix_sources, "cycle")
    records = list(ds)
    assert len(records) > 2 * 200  # the short source ran several passes
    with pytest.raises(ValueError, match=r"stop='cycle' whose source\(s\) \[0\] started a new "
                                         r"pass.*'epoch N done'"):
        streamds.counts_of(ds.state_dict())
    everything = mixed(mix_sources, "all")
    assert len(list(everything)) == 2 * (30 + 200)
    assert streamds.counts_of(everything.state_dict()) == {
        "bad": 2 * (5 + 22), "blank": 4, "dropped": 0, "corrupt_blocks": 0}
