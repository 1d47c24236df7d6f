"""Guarantee 7, the error half: bad arguments, missing or empty sources, undecodable shards
and missing codec libraries fail early, with messages that name the thing and the fix."""

from __future__ import annotations

import importlib
import struct

import corpus
import pytest

from streamds import CorruptRecordError, CorruptShardError, MissingCodecError, StreamingJsonl


@pytest.fixture
def shard(tmp_path):
    return corpus.write(tmp_path / "data.jsonl", corpus.make_records(10))


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        ({"buffer_size": 0}, ["buffer_size", "got 0", "shuffle=False"]),
        ({"buffer_size": 2.5}, ["buffer_size", "got 2.5"]),
        ({"on_error": "ignore"}, ["on_error", "'ignore'", "'raise'", "'skip'"]),
        ({"rank": 2, "world_size": 2}, ["rank", "got 2", "world_size=2", "count from 0"]),
        ({"rank": -1}, ["rank", "got -1"]),
        ({"world_size": 0}, ["world_size", "got 0"]),
        ({"seed": -1}, ["seed", "got -1", "non-negative"]),
        ({"seed": "7"}, ["seed", "got '7'"]),
        ({"shuffle": "yes"}, ["shuffle", "'yes'", "True or False"]),
    ],
    ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, dict) else None,
)
def test_bad_argument_fails_in_the_constructor_naming_it(shard, options, parts):
    with pytest.raises(ValueError) as raised:
        StreamingJsonl(shard, **options)
    for part in parts:
        assert part in str(raised.value)


def test_bad_arguments_fail_before_the_source_is_listed(tmp_path):
    with pytest.raises(ValueError, match="buffer_size"):
        StreamingJsonl(tmp_path / "missing.jsonl", buffer_size=0)


def test_map_filter_and_set_epoch_check_their_arguments(shard):
    ds = StreamingJsonl(shard)
    with pytest.raises(ValueError, match="map needs a callable, got 'text'"):
        ds.map("text")
    with pytest.raises(ValueError, match="filter needs a callable, got None"):
        ds.filter(None)
    with pytest.raises(ValueError, match=r"epoch must be an integer >= 0, got -1; epochs count"):
        ds.set_epoch(-1)


def test_missing_file_names_it(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError) as raised:
        StreamingJsonl(missing)
    assert str(missing) in str(raised.value)
    assert "does not exist" in str(raised.value)


def test_glob_matching_nothing_names_the_pattern(tmp_path):
    corpus.write(tmp_path / "train-0.jsonl", corpus.make_records(3))
    pattern = str(tmp_path / "valid-*.jsonl")
    with pytest.raises(FileNotFoundError) as raised:
        StreamingJsonl(pattern)
    assert pattern in str(raised.value)
    assert "no files match" in str(raised.value)


def test_existing_file_with_glob_characters_in_its_name_is_read(tmp_path):
    path = corpus.write(tmp_path / "train[1].jsonl", corpus.make_records(3))
    assert list(StreamingJsonl(path)) == corpus.make_records(3)


def test_directory_without_jsonl_files_says_what_it_looked_for(tmp_path):
    (tmp_path / "notes.txt").write_text("not a shard")
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as raised:
        StreamingJsonl(tmp_path)
    message = str(raised.value)
    assert str(tmp_path) in message and "no JSONL files" in message and ".jsonl" in message


def test_empty_and_repeated_sources_are_refused(shard):
    with pytest.raises(ValueError, match="empty list"):
        StreamingJsonl([])
    with pytest.raises(ValueError, match="more than once") as raised:
        StreamingJsonl([shard, str(shard)])
    assert str(shard) in str(raised.value)


@pytest.mark.parametrize("content", [b'{"id": 0}\n{"id": 1}\n', b"PK\x03\x04 zip bytes", b"x"])
def test_zst_that_is_not_zstd_raises_corrupt_shard_error(tmp_path, content):
    path = tmp_path / "data.jsonl.zst"
    path.write_bytes(content)
    for on_error in ("raise", "skip"):
        ds = StreamingJsonl(path, on_error=on_error)
        if on_error == "raise":
            with pytest.raises(CorruptShardError) as raised:
                list(ds)
            assert str(path) in str(raised.value) and "zstd" in str(raised.value)
        else:
            assert list(ds) == []  # skipped and counted, never parsed as raw bytes
            assert ds.counts["corrupt_blocks"] == 1


@pytest.mark.parametrize(
    ("suffix", "module", "package"),
    [
        (".jsonl.zst", "zstandard", "pip install zstandard"),
        (".jsonl.gz", "gzip", "zlib"),
        (".jsonl.bz2", "bz2", "bz2"),
        (".jsonl.xz", "lzma", "lzma"),
    ],
)
def test_missing_codec_library_names_the_package(tmp_path, monkeypatch, suffix, module, package):
    path = corpus.write(tmp_path / f"data{suffix}", corpus.make_records(5))
    plain = corpus.write(tmp_path / "plain.jsonl", corpus.make_records(5))
    real_import = importlib.import_module

    def import_module(name: str, *args, **kwargs):
        if name == module:
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("streamds.formats.codecs.importlib.import_module", import_module)
    with pytest.raises(MissingCodecError) as raised:
        StreamingJsonl(path)
    assert str(path) in str(raised.value)
    assert package in str(raised.value)
    assert isinstance(raised.value, ImportError)
    assert list(StreamingJsonl(plain)) == corpus.make_records(5)  # other codecs still work


def test_damaged_seek_table_raises_corrupt_shard_error(tmp_path):
    path = corpus.write(tmp_path / "data.jsonl.zst", corpus.make_records(200))
    blob = bytearray(path.read_bytes())
    # the first seek table entry's Compressed_Size, after the skippable frame header
    num_frames, descriptor, _ = struct.unpack("<IBI", blob[-9:])
    entry_size = 12 if descriptor & 0x80 else 8
    table_start = len(blob) - (8 + num_frames * entry_size + 9)
    blob[table_start + 8] ^= 0x01
    path.write_bytes(bytes(blob))
    with pytest.raises(CorruptShardError) as raised:
        list(StreamingJsonl(path))
    assert str(path) in str(raised.value)


def test_bad_line_error_carries_line_and_offset_as_attributes(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": oops}\n{"a": 4}\n')
    with pytest.raises(CorruptRecordError) as raised:
        list(StreamingJsonl(path))
    assert raised.value.line == 3
    assert raised.value.offset == len(b'{"a": 1}\n{"a": 2}\n')
    assert raised.value.url == str(path)


def test_utf8_byte_order_mark_at_file_start_is_not_an_error(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"a": 2}\n')
    assert list(StreamingJsonl(path)) == [{"a": 1}, {"a": 2}]


def test_directory_listing_skips_hidden_folders(tmp_path):
    corpus.write(tmp_path / "train.jsonl", corpus.make_records(3))
    (tmp_path / ".ipynb_checkpoints").mkdir()
    corpus.write(tmp_path / ".ipynb_checkpoints" / "train.jsonl", corpus.make_records(3))
    assert list(StreamingJsonl(tmp_path)) == corpus.make_records(3)
