"""Values that must not change between the file and the record, and bad inputs that must get
a clear error (issue 27): big integers, lone surrogates, NUL tails, CR-only line endings,
tar samples with two JSON members, NaN, UTF-16, arrays in .jsonl, Parquet, non-object
lines, Mix of batched and plain sources, PackTokens ids."""

from __future__ import annotations

import gzip
import io
import json
import logging
import tarfile
from pathlib import Path
from typing import Any

import pytest

from streamds import Mix, PackTokens, StreamingJsonl
from streamds.errors import CorruptRecordError
from streamds.formats import values
from streamds.formats.samples import TarSampleError
from streamds.preprocess.convert import ConversionError, convert
from streamds.stages.parse_later import LineBatch, MalformedLine, parse_payload, payload_pieces

BIG = 123456789012345678901234567890
RECORDS = [{"pmid": BIG}, {"n": -9223372036854775809}, {"n": 18446744073709551616},
           {"n": -9223372036854775808, "f": 0.30000000000000004}, {"s": "\ud800"},
           {"nested": [{"x": [10**40, -(10**25)]}]}, {"id": "12345678901234567890123"}]


def _lines(records: list[Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _same(got: list[Any], want: list[Any]) -> None:
    """Equal, and every number of the same type (1e29 == 10**29 would pass ==)."""
    assert got == want
    assert json.dumps(got) == json.dumps(want)


# -- 1, 3: exact values on every reading path -----------------------------------------------

def test_values_loads_reads_as_python_json():
    for record in RECORDS:
        line = json.dumps(record).encode()
        _same([values.loads(line)], [json.loads(line)])
    plain = [r for r in RECORDS if r != {"s": "\ud800"}]  # a surrogate: line by line
    got, whole = values.loads_many([json.dumps(r).encode() for r in plain])
    _same(got, plain)
    assert whole
    assert values.loads_many([b'{"a": 1}', b"[1]"])[1] is False


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.json", "a.tar"])
def test_reader_keeps_big_ints_and_surrogates(tmp_path, name):
    path = tmp_path / name
    data = _lines(RECORDS)
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    elif name.endswith(".json"):  # one pretty-printed array document
        path.write_text(json.dumps(RECORDS, indent=2))
    elif name.endswith(".tar"):
        _tar(path, [(f"{i:04d}.json", json.dumps(r).encode()) for i, r in enumerate(RECORDS)])
    else:
        path.write_bytes(data)
    _same(list(StreamingJsonl(path)), RECORDS)


def test_main_process_parsing_keeps_big_ints(tmp_path):
    """The lines a worker hands over (`parse_later`) are parsed exactly too."""
    lines = [json.dumps(r).encode() for r in RECORDS]
    payload = b"".join(payload_pieces(lines, [0] * len(lines), range(len(lines)),
                                      {0: "x.jsonl"}))
    _same(list(parse_payload(payload).records), RECORDS)
    batch = LineBatch(lines, [0] * len(lines), list(range(len(lines))), where=None)  # type: ignore[arg-type]
    _same(batch.records, RECORDS)


def test_big_ints_found_in_the_worker_are_read_exactly_in_the_main_process(monkeypatch):
    """The worker searches the lines it hands over for big integers (the search reads every
    byte); the main process reads the lines it names with `json` and does not search again."""
    plain = [r for r in RECORDS if "s" not in r]  # orjson reads every line (no surrogate)
    lines = [json.dumps(r).encode() for r in plain]
    payload = b"".join(payload_pieces(lines, [0] * len(lines), range(len(lines)),
                                      {0: "x.jsonl"}))

    def searched(data: Any) -> list[int]:
        raise AssertionError("the main process searched the lines again")

    monkeypatch.setattr(values, "big_int_starts", searched)
    _same(list(parse_payload(payload).records), plain)


def test_main_process_parsing_refuses_a_non_object_line():
    lines = [b'{"a": 1}', b"[1, 2]"]
    payload = b"".join(payload_pieces(lines, [0, 0], [0, 9], {0: "memory://x.jsonl"}))
    got = parse_payload(payload)
    assert isinstance(got, MalformedLine)
    assert "holds a JSON array, not a JSON object" in got.exc_msg and "byte offset 9" in got.exc_msg


def test_workers_parse_big_ints_exactly(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(_lines(RECORDS * 20))
    import torch

    loader = torch.utils.data.DataLoader(StreamingJsonl(path).batch(8), batch_size=None,
                                         num_workers=1)
    _same([r for batch in loader for r in batch], RECORDS * 20)


# -- 2, 3: the converter writes and reads them exactly ----------------------------------------

@pytest.mark.parametrize("fmt", ["jsonl.zst", "tar"])
def test_convert_keeps_big_ints_and_surrogates(tmp_path, fmt):
    source = tmp_path / "in.jsonl"
    source.write_bytes(_lines(RECORDS))
    out = tmp_path / "out"
    convert([str(source)], out, format=fmt)
    _same(list(StreamingJsonl(out)), RECORDS)
    from streamds.formats.manifest import read_manifest, verify_shard

    assert [verify_shard(out, entry, fmt) for entry in read_manifest(out).shards] == [[]]


def test_convert_keeps_big_ints_of_a_json_array_and_a_tar(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.json").write_text(json.dumps(RECORDS, indent=1))
    _tar(tmp_path / "in" / "b.tar", [(f"{i:04d}.json", json.dumps(r).encode())
                                     for i, r in enumerate(RECORDS)])
    convert([str(tmp_path / "in")], tmp_path / "out")
    _same(list(StreamingJsonl(tmp_path / "out")), RECORDS * 2)


# -- 4, 5, 7: what a bad file looks like, and what to do ------------------------------------

def _error(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(CorruptRecordError) as reader:
        list(StreamingJsonl(path))
    with pytest.raises(ConversionError) as converter:
        convert([str(path)], tmp_path / f"out-{name}")
    return f"{reader.value}\n{converter.value}"


def test_nul_tail_says_interrupted_write(tmp_path):
    good = b'{"a": 1}\n{"a": 2}\n'
    message = _error(tmp_path, "nul.jsonl", good + b"\x00" * 80)
    assert "NUL bytes from byte offset 18" in message and "interrupted" in message
    assert "truncate -s 18" in message and "80 NUL bytes" in message
    assert "\\x00\\x00" not in message  # counted, not dumped
    assert str(tmp_path / "nul.jsonl") in message


def test_cr_only_line_endings(tmp_path):
    message = _error(tmp_path, "cr.jsonl", b'{"a": 1}\r{"a": 2}\r{"a": 3}\r')
    assert "CR-only line endings" in message and "tr '\\r' '\\n'" in message
    assert "line 1" in message


def test_crlf_still_reads(tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b'{"a": 1}\r\n{"a": 2}\r\n')
    assert list(StreamingJsonl(path)) == [{"a": 1}, {"a": 2}]


def test_nan_hint(tmp_path):
    message = _error(tmp_path, "nan.jsonl", b'{"a": 1}\n{"a": NaN}\n')
    assert "NaN or Infinity" in message and "line 2" in message and "null" in message


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_utf16_hint(tmp_path, encoding):
    message = _error(tmp_path, "u16.jsonl", '{"a": 1}\n{"a": 2}\n'.encode(encoding))
    assert "UTF-16" in message and "iconv" in message


def test_pretty_array_in_jsonl_hint(tmp_path):
    data = json.dumps([{"a": 1}, {"a": 2}], indent=2).encode()
    message = _error(tmp_path, "pretty.jsonl", data)
    assert "pretty-printed JSON" in message and "name it .json" in message


def test_a_truncated_last_line_is_called_cut_short_not_pretty_printed(tmp_path):
    message = _error(tmp_path, "cut.jsonl", b'{"a": 1}\n{"a": 2}\n{"a": [3, 4, "fi')
    assert "line 3" in message and "cut short" in message and "on_error='skip'" in message
    assert "pretty-printed" not in message


def test_one_line_array_in_jsonl_is_refused(tmp_path):
    message = _error(tmp_path, "array.jsonl", b'[{"a": 1}, {"a": 2}]\n')
    assert "holds a JSON array, not a JSON object" in message and "named .json" in message


PARQUET = b"PAR1\x15\x04\x15\x00" + bytes(range(40))


def test_parquet_named_explicitly(tmp_path):
    # by its name: read as Parquet (tests/test_parquet.py); these bytes are no whole Parquet
    # file, so the dataset names it as damaged when it is built, and convert too
    path = tmp_path / "data.parquet"
    path.write_bytes(PARQUET)
    with pytest.raises(OSError, match=r"data\.parquet: damaged Parquet file \(footer\)"):
        StreamingJsonl(path)
    with pytest.raises(ValueError, match=r"data\.parquet: damaged Parquet file \(footer\)"):
        convert([str(path)], tmp_path / "out")


def test_parquet_bytes_under_a_jsonl_name(tmp_path):
    # by its bytes: a Parquet file renamed .jsonl is named as Parquet where it is parsed
    message = _error(tmp_path, "data.jsonl", PARQUET)
    assert "Parquet" in message and "read_parquet" in message


# -- 8: a record is an object --------------------------------------------------------------

@pytest.mark.parametrize("line", [b"42", b"[1, 2]", b'"text"', b"null", b"true"])
def test_non_object_lines_are_refused(tmp_path, line):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n' + line + b'\n{"a": 2}\n')
    with pytest.raises(CorruptRecordError, match=r"line 2 \(byte offset 9\): holds .*, not a "
                       r"JSON object") as err:
        list(StreamingJsonl(path))
    assert err.value.line == 2
    skipping = StreamingJsonl(path, on_error="skip")
    assert list(skipping) == [{"a": 1}, {"a": 2}]
    assert skipping.counts["bad"] == 1
    with pytest.raises(ConversionError, match=r"a\.jsonl: line 2: holds .*not a JSON object"):
        convert([str(path)], tmp_path / "out")


def test_non_object_skip_is_logged(tmp_path, caplog):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n7\n')
    with caplog.at_level(logging.WARNING):
        assert list(StreamingJsonl(path, on_error="skip")) == [{"a": 1}]
    assert "holds a JSON number, not a JSON object" in caplog.text


def test_json_array_of_objects_still_yields_elements(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"a": 1}, {"a": 2}]))
    assert list(StreamingJsonl(path)) == [{"a": 1}, {"a": 2}]
    (tmp_path / "b.json").write_text(json.dumps([{"a": 1}, 5]))
    with pytest.raises(CorruptRecordError, match=r"element of the JSON array \(record 2\): "
                       r"holds a JSON number"):
        list(StreamingJsonl(tmp_path / "b.json"))


def test_convert_refuses_a_transform_that_returns_no_object(tmp_path):
    from streamds.preprocess.run import ConversionRun  # noqa: F401  (the module under test)

    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n')
    with pytest.raises(ConversionError, match="the transform returned list, not a dict"):
        convert([str(path)], tmp_path / "out", transform=lambda r: [r])


# -- 6: one JSON member per tar sample --------------------------------------------------------

def test_tar_sample_with_meta_json_is_refused(tmp_path):
    path = _tar(tmp_path / "wds.tar", [("000001.json", b'{"a": 1}'),
                                       ("000001.meta.json", b'{"src": "x"}'),
                                       ("000002.json", b'{"a": 2}')])
    with pytest.raises(TarSampleError, match=r"000001\.json and 000001\.meta\.json are one "
                       r"sample .*000001_meta\.json"):
        list(StreamingJsonl(path))
    with pytest.raises(ConversionError, match=r"000001\.meta\.json"):
        convert([str(path)], tmp_path / "out")


def test_tar_samples_with_other_members_still_read(tmp_path):
    path = _tar(tmp_path / "wds.tar", [("d/000001.json", b'{"a": 1}'), ("d/000001.txt", b"x"),
                                       ("d/000002.json", b'{"a": 2}'), ("e/000002.json", b"{}")])
    assert list(StreamingJsonl(path)) == [{"a": 1}, {"a": 2}, {}]


# -- 9, 10 ---------------------------------------------------------------------------------

def test_mix_refuses_batched_with_plain(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n')
    a, b = StreamingJsonl(path), StreamingJsonl(path)
    with pytest.raises(ValueError, match=r"datasets \[0\] are batched .* datasets \[1\] are "
                       r"not.*\.batch\(n\)"):
        Mix([a.batch(4), b], [1, 1], seed=0)
    Mix([a, b], [1, 1], seed=0)  # both plain: fine


@pytest.mark.parametrize("ids, shown", [([1, -3, 2], "-3 at index 1"),
                                        ([1, True, 2], "True at index 1")])
def test_pack_refuses_negative_and_bool_ids(tmp_path, ids, shown):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"ids": [5, 6]}\n' + json.dumps({"ids": ids}).encode() + b"\n")
    packed = StreamingJsonl(path).pack(PackTokens(seq_len=4, eos_id=0, key="ids"))
    with pytest.raises(ValueError, match=rf"record\['ids'\] of document 2 .*holds {shown}"):
        list(packed)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_big_integer_nested_a_thousand_deep_is_read_exactly(tmp_path, on_error):
    """orjson reads 1,000 levels (it refuses past 1,024) but not the big integer exactly;
    Python's json, its fallback, stops at the recursion limit: it reads with a higher one
    (was: a bare ValueError "nested too deeply", which on_error="skip" did not catch)."""
    depth = 1000
    deep = b'{"a":' + b"[" * depth + str(BIG).encode() + b"]" * depth + b"}"
    path = tmp_path / "deep.jsonl"
    path.write_bytes(b'{"id":0}\n' + deep + b'\n{"id":2}\n')
    records = list(StreamingJsonl(str(path), on_error=on_error))
    assert len(records) == 3 and records[0] == {"id": 0} and records[2] == {"id": 2}
    for record in (records[1], values.loads(deep)):
        value = record["a"]
        for _ in range(depth):
            [value] = value
        assert value == BIG and isinstance(value, int)
