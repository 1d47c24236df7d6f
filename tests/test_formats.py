"""Shard format conformance: one abstract suite, one subclass per format streamds reads.

Like fsspec's `fsspec/tests/abstract`: a format joins by subclassing `FormatTests` with a
`write_data` hook (decoded JSONL bytes -> a shard of that format) and saying what the format
can and cannot detect. Every subclass runs every test.
"""

from __future__ import annotations

import collections
import tarfile
from pathlib import Path
from typing import Any

import corpus
import orjson
import pytest

from streamds import CorruptRecordError, CorruptShardError, StreamingJsonl
from streamds.storage.plan import make_blocks

BIG = 4000  # records per shard: ~230 KB decoded, several blocks where the format splits
BAD_LINE = b'{"id": -1, "text": "cut off'


def record_ids(records: list[dict[str, Any]]) -> list[int]:
    return [record["id"] for record in records]


def drop_multiples_of_three(record: dict[str, Any]) -> dict[str, Any] | None:
    return None if record["id"] % 3 == 0 else {**record, "seen": True}


def id_is_odd(record: dict[str, Any]) -> bool:
    return record["id"] % 2 == 1


def add_length(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "length": len(record["text"])}


def line_offset(data: bytes, index: int) -> int:
    """Byte offset of line `index` (0-based) of `data`."""
    offset = 0
    for _ in range(index):
        offset = data.index(b"\n", offset) + 1
    return offset


def with_lines_inserted(records: list[Any], inserts: dict[int, bytes]) -> tuple[bytes, list[int]]:
    """JSONL of `records` with `inserts[i]` placed before record i; also the inserted lines'
    0-based line numbers."""
    lines: list[bytes] = []
    placed: list[int] = []
    for index, record in enumerate(records):
        if index in inserts:
            placed.append(len(lines))
            lines.append(inserts[index])
        lines.append(orjson.dumps(record))
    return b"\n".join(lines) + b"\n", placed


class FormatTests:
    """The conformance suite. Subclasses set `suffix` and `writer`; the rest are defaults."""

    suffix: str
    writer: staticmethod
    big_records = BIG  # records in the shared shard
    splits = False  # one shard splits into blocks for several readers (else: whole file)
    keeps_missing_final_newline = True  # the writer can end the data without a newline
    damage_detectable = True  # a damaged byte in the middle raises CorruptShardError
    truncation_error: type[Exception] = CorruptShardError

    # -- hooks ------------------------------------------------------------------------------

    def write_data(self, path_stem: Path, data: bytes) -> Path:
        """`data`, decoded JSONL bytes, as a shard of this format at `path_stem` + suffix."""
        return type(self).writer(path_stem.with_name(path_stem.name + self.suffix), data)

    def write(self, path_stem: Path, records: list[Any]) -> Path:
        return self.write_data(path_stem, corpus.jsonl(records))

    def location(self, path: Path, data: bytes, index: int) -> list[str]:
        """What an error message says to locate line `index` of the shard."""
        return [str(path), f"line {index + 1}", f"byte offset {line_offset(data, index)}"]

    def error_offset(self, data: bytes, index: int) -> int:
        """The `offset` attribute of the error for line `index`."""
        return line_offset(data, index)

    def damage(self, path: Path) -> None:
        """Flip one byte in the middle of the stored shard."""
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        path.write_bytes(bytes(blob))

    def truncate(self, path: Path) -> None:
        blob = path.read_bytes()
        path.write_bytes(blob[: len(blob) // 2 + 7])

    # -- fixtures ---------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def big(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
        """One shard of `big_records` records, written once per format."""
        records = corpus.make_records(cls.big_records)
        return cls().write(tmp_path_factory.mktemp("big") / "big", records), records

    # -- reading ----------------------------------------------------------------------------

    def test_one_reader_yields_records_in_file_order(self, big):
        path, records = big
        assert list(StreamingJsonl(path)) == records

    def test_shard_is_split_only_where_the_format_allows(self, big):
        path, _ = big
        blocks = make_blocks(StreamingJsonl(path).shards)
        assert len(blocks) >= 3 if self.splits else len(blocks) == 1

    @pytest.mark.parametrize(
        ("num_workers", "shuffle"), [(0, False), (2, False), (3, False), (3, True)]
    )
    def test_workers_read_every_record_exactly_once(self, big, num_workers, shuffle):
        path, records = big
        out = corpus.read_all(StreamingJsonl(path, shuffle=shuffle, seed=3), num_workers)
        assert sorted(record_ids(out)) == record_ids(records)
        assert sorted(out, key=lambda record: record["id"]) == records

    @pytest.mark.parametrize("world_size", [1, 2, 3, 4])
    @pytest.mark.parametrize("shuffle", [False, True])
    def test_ranks_read_every_record_exactly_once(self, big, world_size, shuffle):
        path, records = big
        out = [
            record
            for rank in range(world_size)
            for record in StreamingJsonl(path, shuffle=shuffle, rank=rank, world_size=world_size)
        ]
        assert sorted(record_ids(out)) == record_ids(records)

    def test_fewer_shards_than_readers(self, tmp_path):
        records = corpus.make_records(150)
        for index in range(3):
            self.write(tmp_path / f"part-{index}", records[index * 50 : (index + 1) * 50])
        out = []
        for rank in range(2):  # 2 ranks x 3 workers = 6 readers for 3 shards
            ds = StreamingJsonl(tmp_path, shuffle=True, rank=rank, world_size=2)
            out += corpus.read_all(ds, num_workers=3)
        assert sorted(record_ids(out)) == record_ids(records)

    def test_blank_lines_are_not_records(self, tmp_path):
        records = corpus.make_records(1500)
        blanks = {index: [b"", b"   ", b"\t"][index % 3] for index in range(0, 1500, 7)}
        data, _ = with_lines_inserted(records, blanks)
        ds = StreamingJsonl(self.write_data(tmp_path / "blanks", data))
        assert list(ds) == records
        assert ds.counts["blank"] == len(blanks)

    def test_final_line_without_newline_is_a_record(self, tmp_path):
        if not self.keeps_missing_final_newline:
            pytest.skip("the writer of this format ends every line with a newline")
        records = corpus.make_records(1500)
        data = corpus.jsonl(records)[:-1]
        assert list(StreamingJsonl(self.write_data(tmp_path / "open", data))) == records

    def test_unicode_and_line_separators_inside_strings(self, tmp_path):
        texts = ["\u2028 line sep", "para \u2029", "nel \x85", "cr \r lf \n", "nul \x00",
                 "astral 𝔘𝔫𝔦", "combining é", "rtl עברית", "bom \ufeff"]
        records = [{"id": i, "text": text} for i, text in enumerate(texts * 20)]
        path = self.write(tmp_path / "unicode", records)
        assert list(StreamingJsonl(path)) == records

    def test_crlf_line_endings(self, tmp_path):
        records = corpus.make_records(200)
        data = b"".join(orjson.dumps(record) + b"\r\n" for record in records)
        assert list(StreamingJsonl(self.write_data(tmp_path / "crlf", data))) == records

    # -- shuffle and transforms -------------------------------------------------------------

    def test_shuffle_yields_the_same_records_in_a_seeded_order(self, big):
        path, records = big

        def read(seed: int) -> list[Any]:
            return list(StreamingJsonl(path, shuffle=True, seed=seed, buffer_size=100))

        first = read(seed=7)
        assert sorted(first, key=lambda record: record["id"]) == records
        assert read(seed=7) == first
        # another seed draws another order, not just another ending
        moved = sum(a != b for a, b in zip(first, read(seed=8), strict=True))
        assert moved > len(records) // 2
        assert sum(a != b for a, b in zip(first, records, strict=True)) > len(records) // 2

    def test_transform_maps_and_drops_records(self, big):
        path, records = big
        ds = StreamingJsonl(path).map(drop_multiples_of_three)
        expected = [{**record, "seen": True} for record in records if record["id"] % 3]
        assert list(ds) == expected
        assert ds.counts["dropped"] == len(records) - len(expected)

    def test_map_and_filter_return_new_datasets(self, big):
        path, records = big
        ds = StreamingJsonl(path)
        derived = ds.filter(id_is_odd).map(add_length)
        expected = [{**record, "length": len(record["text"])} for record in records]
        assert list(derived) == [record for record in expected if record["id"] % 2]
        assert derived.counts["dropped"] == len(records) // 2
        assert list(ds) == records

    # -- errors -----------------------------------------------------------------------------

    def test_malformed_line_raises_naming_file_line_and_offset(self, tmp_path):
        count = self.big_records
        records = corpus.make_records(count)
        data, (bad,) = with_lines_inserted(records, {count * 3 // 4: BAD_LINE})
        path = self.write_data(tmp_path / "bad", data)
        with pytest.raises(CorruptRecordError) as raised:
            list(StreamingJsonl(path))
        message = str(raised.value)
        for part in self.location(path, data, bad):
            assert part in message
        assert raised.value.offset == self.error_offset(data, bad)
        assert "on_error='skip'" in message

    def test_malformed_lines_are_skipped_and_counted(self, tmp_path):
        count = self.big_records
        records = corpus.make_records(count)
        bad_lines = {10: BAD_LINE, count // 2: b"[1, 2", count - 1: b"not json"}
        data, _ = with_lines_inserted(records, bad_lines)
        ds = StreamingJsonl(self.write_data(tmp_path / "bad", data), on_error="skip")
        assert list(ds) == records
        assert ds.counts["bad"] == len(bad_lines)

    def test_truncated_shard_raises_naming_the_file(self, big, tmp_path):
        path, _ = big
        cut = tmp_path / path.name
        cut.write_bytes(path.read_bytes())
        self.truncate(cut)
        with pytest.raises(self.truncation_error) as raised:
            list(StreamingJsonl(cut))
        assert str(cut) in str(raised.value)
        assert raised.value.url == str(cut)
        assert f"{raised.value.offset}" in str(raised.value)  # where: the offset it names

    def test_truncated_shard_is_skipped_and_counted(self, big, tmp_path):
        path, records = big
        cut = tmp_path / path.name
        cut.write_bytes(path.read_bytes())
        self.truncate(cut)
        ds = StreamingJsonl(cut, on_error="skip")
        out = list(ds)
        assert out == records[: len(out)] and len(out) < len(records)
        counts = ds.counts
        assert counts["corrupt_blocks"] + counts["bad"] == 1

    def test_damaged_shard_raises_naming_the_file(self, big, tmp_path):
        if not self.damage_detectable:
            pytest.skip("this format has no checksum that catches a flipped byte")
        path, _ = big
        damaged = tmp_path / path.name
        damaged.write_bytes(path.read_bytes())
        self.damage(damaged)
        with pytest.raises(CorruptShardError) as raised:
            list(StreamingJsonl(damaged))
        assert str(damaged) in str(raised.value)
        assert raised.value.url == str(damaged)
        assert f"{raised.value.offset}" in str(raised.value)


class TestPlainJsonl(FormatTests):
    suffix = ".jsonl"
    writer = staticmethod(corpus.write_plain)
    splits = True
    damage_detectable = False
    truncation_error = CorruptRecordError  # the cut line is a malformed record

    def truncate(self, path: Path) -> None:
        blob = path.read_bytes()
        path.write_bytes(blob[: blob.index(b"\n", len(blob) // 2) - 3])  # inside a line


class TestSeekableZst(FormatTests):
    suffix = ".jsonl.zst"
    writer = staticmethod(corpus.write_seekable_zst)
    splits = True
    keeps_missing_final_newline = False

    def test_shard_has_many_frames(self, big):
        path, _ = big
        (shard,) = StreamingJsonl(path).shards
        assert shard.frames is not None and len(shard.frames) > 100


class TestForeignZst(FormatTests):
    suffix = ".jsonl.zst"
    writer = staticmethod(corpus.write_foreign_zst)
    damage_detectable = False  # no content checksum in the frame

    def test_shard_has_no_seek_table(self, big):
        path, _ = big
        (shard,) = StreamingJsonl(path).shards
        assert shard.frames is None


class TestGzip(FormatTests):
    suffix = ".jsonl.gz"
    writer = staticmethod(corpus.write_gz)


class TestBzip2(FormatTests):
    suffix = ".jsonl.bz2"
    writer = staticmethod(corpus.write_bz2)


class TestXz(FormatTests):
    suffix = ".jsonl.xz"
    writer = staticmethod(corpus.write_xz)


class TarTests(FormatTests):
    """Tar shards locate records by member and ordinal, and carry no data checksum."""

    suffix = ".tar"

    def member_of(self, path: Path, index: int) -> str:
        raise NotImplementedError

    def location(self, path: Path, data: bytes, index: int) -> list[str]:
        return [str(path), f"member {self.member_of(path, index)}", f"record {index + 1}"]

    def error_offset(self, data: bytes, index: int) -> int:
        return index

    def damage(self, path: Path) -> None:
        """Flip a byte in the name of a member header in the middle (its checksum fails)."""
        with tarfile.open(path) as tar:
            members = tar.getmembers()
        blob = bytearray(path.read_bytes())
        blob[members[len(members) // 2].offset + 3] ^= 0xFF
        path.write_bytes(bytes(blob))


class TestTarJson(TarTests):
    writer = staticmethod(corpus.write_tar_json)
    big_records = 1000  # two members per record: keep the shard small

    def member_of(self, path: Path, index: int) -> str:
        return f"sample{index:06d}.json"

    def test_only_json_members_are_records(self, big):
        path, records = big
        with tarfile.open(path) as tar:
            suffixes = collections.Counter(Path(name).suffix for name in tar.getnames())
        assert suffixes == {".json": len(records), ".txt": len(records)}
        assert list(StreamingJsonl(path)) == records


class TestTarJsonl(TarTests):
    writer = staticmethod(corpus.write_tar_jsonl)

    def member_of(self, path: Path, index: int) -> str:
        with tarfile.open(path) as tar:
            for member in tar:
                lines = tar.extractfile(member).read().split(b"\n")  # type: ignore[union-attr]
                count = len(lines) - (lines[-1] == b"")
                if index < count:
                    return member.name
                index -= count
        raise IndexError(index)
