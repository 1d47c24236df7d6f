"""Codecs on the files people really have (issue 9, part 3).

A file's name picks its codec; its first bytes must agree, so a gzip or plain text file named
`.zst` is reported as what it is ("this is not zstd (looks like gzip)"), not as corrupt zstd.
zstd frames with windows up to 2 GiB (`zstd --long=31`) decode; a larger window is refused
by name. A truncated file yields every line that decodes before the cut, and the error says
where the decoded data ends.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import random
import shutil
import subprocess
import zlib
from collections.abc import Callable

import orjson
import pytest
import zstandard

from streamds import CorruptShardError, StreamingJsonl
from streamds.preprocess.convert import ConversionError, convert

JSONL = b'{"id": 0}\n{"id": 1}\n'


def jsonl(count: int, *, seed: int = 0) -> bytes:
    """JSON lines of varied length that compress moderately (so cuts land mid-stream)."""
    rng = random.Random(seed)
    return b"".join(
        orjson.dumps({"id": i, "t": "".join(rng.choices("abcdefgh ", k=rng.randrange(80))),
                      "r": rng.getrandbits(32)}) + b"\n"
        for i in range(count)
    )


def ids(records: list[dict]) -> list[int]:
    return [record["id"] for record in records]


# -- magic bytes ---------------------------------------------------------------------------


WRONG_NAMES = {
    # name: (bytes, what the error says it looks like, the fix it offers)
    "gzip.jsonl.zst": (gzip.compress(JSONL, mtime=0), "looks like gzip", "end in .gz"),
    "text.jsonl.zst": (JSONL, "looks like uncompressed text", "drop the .zst suffix"),
    "bom-text.jsonl.zst": (b"\xef\xbb\xbf" + JSONL, "looks like uncompressed text", "drop"),
    "xz.jsonl.zst": (lzma.compress(JSONL), "looks like xz", "end in .xz"),
    "zip.jsonl.zst": (b"PK\x03\x04" + b"\x00" * 40, "looks like zip", "unpack the zip"),
    "zstd.jsonl.gz": (zstandard.ZstdCompressor().compress(JSONL), "looks like zstd",
                      "end in .zst"),
    "text.jsonl.gz": (JSONL, "looks like uncompressed text", "drop the .gz suffix"),
    "bz2.jsonl.gz": (bz2.compress(JSONL), "looks like bzip2", "end in .bz2"),
    "text.jsonl.bz2": (JSONL, "looks like uncompressed text", "drop the .bz2 suffix"),
    "gzip.jsonl.xz": (gzip.compress(JSONL, mtime=0), "looks like gzip", "end in .gz"),
    "binary.jsonl.zstd": (bytes(range(1, 40)), "looks like unknown binary data", "copy it"),
}


@pytest.mark.parametrize("name", WRONG_NAMES)
def test_wrong_codec_is_named_not_called_corrupt(tmp_path, name):
    data, looks, fix = WRONG_NAMES[name]
    path = tmp_path / name
    path.write_bytes(data)
    codec = {"zst": "zstd", "zstd": "zstd", "gz": "gzip", "bz2": "bzip2", "xz": "xz"}
    expected = f"this is not {codec[name.rsplit('.', 1)[-1]]} ({looks}"
    with pytest.raises(CorruptShardError) as raised:
        list(StreamingJsonl(path))
    message = str(raised.value)
    assert str(path) in message and expected in message and fix in message, message
    assert "corrupt" not in message
    assert raised.value.offset == 0 and "offset 0" in message


def test_wrong_codec_is_skipped_and_counted_under_skip(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(JSONL)
    (tmp_path / "b.jsonl.zst").write_bytes(gzip.compress(b'{"id": 9}\n', mtime=0))
    ds = StreamingJsonl(tmp_path, on_error="skip")
    assert ids(list(ds)) == [0, 1]
    assert ds.counts["corrupt_blocks"] == 1


def test_wrong_codec_is_named_by_the_converter(tmp_path):
    path = tmp_path / "in.jsonl.zst"
    path.write_bytes(gzip.compress(JSONL, mtime=0))
    expected = r"in\.jsonl\.zst: this is not zstd \(looks like gzip"
    with pytest.raises(ConversionError, match=expected):
        convert([path], tmp_path / "out")


@pytest.mark.parametrize("name", ["empty.jsonl.zst", "empty.jsonl.gz", "empty.jsonl.bz2",
                                  "empty.jsonl.xz"])
def test_empty_compressed_file_has_no_records(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    ds = StreamingJsonl(tmp_path / name)
    assert list(ds) == []


def test_looks_like_knows_the_common_formats():
    from streamds.formats.codecs import looks_like

    assert looks_like(zstandard.ZstdCompressor().compress(b"x")[:6]) == ("zstd", "zst")
    assert looks_like(b"\x5e\x2a\x4d\x18\x00\x00") == ("zstd", "zst")  # a skippable frame
    assert looks_like(b"\xfd7zXZ\x00") == ("xz", "xz")
    assert looks_like("{\"é\": 1".encode()[:4]) == ("uncompressed text", None)  # cut character


def test_seekable_shard_whose_seek_table_points_off_a_frame_is_named(tmp_path):
    import corpus

    path = corpus.write_seekable_zst(tmp_path / "s.jsonl.zst", jsonl(400), frame_size=2048)
    ds = StreamingJsonl(path)
    shard = ds.shards[0]
    assert shard.frames is not None and len(shard.frames) > 3
    from dataclasses import replace

    from streamds.storage.read import open_decoded_at

    third = shard.frames[2]
    shifted = replace(third, compressed_offset=third.compressed_offset + 3)
    bad = replace(shard, frames=(*shard.frames[:2], shifted, *shard.frames[3:]))
    with pytest.raises(CorruptShardError, match=r"no zstd frame begins at compressed offset"):
        open_decoded_at(bad, third.decompressed_offset + 1).read(10)


# -- zstd windows ----------------------------------------------------------------------------


def long_window_zstd(data: bytes) -> bytes:
    """`cat data | zstd --long=31`: a 2 GiB window declared, the content size unknown."""
    params = zstandard.ZstdCompressionParameters.from_level(
        3, window_log=31, enable_ldm=True, write_content_size=False
    )
    out = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return out.compress(data) + out.flush()


def test_long_window_zstd_is_read(tmp_path):
    data = jsonl(3000)
    blob = long_window_zstd(data)
    assert zstandard.get_frame_parameters(blob).window_size == 1 << 31  # --long=31
    path = tmp_path / "long.jsonl.zst"
    path.write_bytes(blob)
    assert ids(list(StreamingJsonl(path))) == list(range(3000))


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd command line tool")
def test_zstd_command_line_long_31_is_read(tmp_path):
    data = jsonl(2000, seed=5)
    made = subprocess.run(["zstd", "-q", "--long=31", "-c"], input=data, capture_output=True,
                          check=True)
    path = tmp_path / "cli.jsonl.zst"
    path.write_bytes(made.stdout)
    assert ids(list(StreamingJsonl(path))) == list(range(2000))


def frame_with_window_log(window_log: int) -> bytes:
    """A zstd frame header declaring a 2**window_log window, then one raw block of data."""
    descriptor = (window_log - 10) << 3
    block = b'{"id": 0}\n'
    header = (len(block) << 3) | 1  # last block, raw, size
    return (b"\x28\xb5\x2f\xfd" + bytes([0x00, descriptor]) + header.to_bytes(3, "little")
            + block)


def test_window_beyond_2_gib_is_refused_by_name(tmp_path):
    ok = tmp_path / "ok.jsonl.zst"
    ok.write_bytes(frame_with_window_log(31))
    assert list(StreamingJsonl(ok)) == [{"id": 0}]  # the hand-made frame is valid
    path = tmp_path / "huge-window.jsonl.zst"
    path.write_bytes(frame_with_window_log(32))
    with pytest.raises(CorruptShardError) as raised:
        list(StreamingJsonl(path))
    message = str(raised.value)
    assert "window too large" in message and "4096 MiB" in message
    assert "--long=31" in message and str(path) in message


# -- truncation --------------------------------------------------------------------------------


def zstd_one_frame(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def zstd_small_frames(data: bytes) -> bytes:
    """Many frames (as `zstd` writes from several runs appended), no seek table."""
    compressor = zstandard.ZstdCompressor()
    return b"".join(compressor.compress(data[i : i + 5000]) for i in range(0, len(data), 5000))


def decodable_prefix(codec: str, blob: bytes) -> bytes:
    """What an independent decoder recovers from a cut file."""
    if codec == "gz":
        out = []
        while blob:
            member = zlib.decompressobj(31)
            out.append(member.decompress(blob))
            blob = member.unused_data
        return b"".join(out)
    if codec == "bz2":
        return bz2.BZ2Decompressor().decompress(blob)
    if codec == "xz":
        return lzma.LZMADecompressor().decompress(blob)
    out = []
    while blob:
        frame = zstandard.ZstdDecompressor().decompressobj()
        try:
            out.append(frame.decompress(blob))
        except zstandard.ZstdError:
            break
        if not frame.eof:
            break
        blob = frame.unused_data
    return b"".join(out)


COMPRESSORS: dict[str, tuple[str, Callable[[bytes], bytes]]] = {
    "gz": ("gz", lambda data: gzip.compress(data, mtime=0)),
    "gz-two-members": ("gz", lambda data: gzip.compress(data[:70_000], mtime=0)
                       + gzip.compress(data[70_000:], mtime=0)),
    "xz": ("xz", lzma.compress),
    "bz2": ("bz2", lambda data: bz2.compress(data, 1)),
    "zst-one-frame": ("zst", zstd_one_frame),
    "zst-frames": ("zst", zstd_small_frames),
}


@pytest.mark.parametrize("fraction", [0.35, 0.55, 0.8])
@pytest.mark.parametrize("kind", COMPRESSORS)
def test_truncated_file_keeps_every_line_before_the_cut(tmp_path, kind, fraction):
    codec, compress = COMPRESSORS[kind]
    data = jsonl(9000, seed=1)
    blob = compress(data)
    cut = blob[: int(len(blob) * fraction)]
    prefix = decodable_prefix(codec, cut)
    whole_lines = prefix[: prefix.rfind(b"\n") + 1]
    expected = [orjson.loads(line)["id"] for line in whole_lines.splitlines()]
    path = tmp_path / f"cut.jsonl.{codec}"
    path.write_bytes(cut)

    skipping = StreamingJsonl(path, on_error="skip")
    assert ids(list(skipping)) == expected
    assert skipping.counts["corrupt_blocks"] == 1

    got: list[int] = []
    with pytest.raises(CorruptShardError) as raised:
        for record in StreamingJsonl(path):
            got.append(record["id"])
    assert got == expected
    message = str(raised.value)
    assert f"after decoded offset {len(prefix)};" in message, message
    assert f"ends at compressed offset {len(cut)}," in message and "cut short" in message
    assert str(path) in message


def test_truncated_file_keeps_lines_in_the_converter(tmp_path):
    data = jsonl(9000, seed=3)
    blob = gzip.compress(data, mtime=0)
    cut = blob[: len(blob) // 2]
    prefix = decodable_prefix("gz", cut)
    expected = prefix.count(b"\n")
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(cut)
    result = convert([path], tmp_path / "out", on_error="skip")
    assert result.manifest.counts["records_out"] == expected
    assert result.manifest.counts["bad"] == 1  # the unreadable rest, counted once


def test_corrupt_stream_keeps_the_lines_before_the_damage(tmp_path):
    data = jsonl(9000, seed=4)
    first, second = gzip.compress(data[:200_000], mtime=0), gzip.compress(data[200_000:], mtime=0)
    damaged = bytearray(second)
    damaged[20:60] = b"\xff" * 40  # a damaged deflate block at the start of the second member
    path = tmp_path / "damaged.jsonl.gz"
    path.write_bytes(first + bytes(damaged))
    expected = data[:200_000].count(b"\n")
    ds = StreamingJsonl(path, on_error="skip")
    assert ids(list(ds))[:expected] == list(range(expected))
    with pytest.raises(CorruptShardError, match=r"corrupt \.gz data before compressed offset \d+ "
                       r"\(after decoded offset \d+\)"):
        list(StreamingJsonl(path))


def test_concatenated_gzip_members_with_zero_padding_read_whole(tmp_path):
    path = tmp_path / "joined.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"id": 0}\n', mtime=0) + b"\x00" * 7
                     + gzip.compress(b'{"id": 1}\n', mtime=0))
    assert ids(list(StreamingJsonl(path))) == [0, 1]


def test_garbage_after_a_gzip_stream_is_damage_after_the_good_lines(tmp_path):
    path = tmp_path / "tail.jsonl.gz"
    path.write_bytes(gzip.compress(JSONL, mtime=0) + b"not gzip at all")
    got: list[int] = []
    with pytest.raises(CorruptShardError, match=r"tail\.jsonl\.gz: corrupt \.gz data") as raised:
        for record in StreamingJsonl(path):
            got.append(record["id"])
    assert got == [0, 1]
    assert f"after decoded offset {len(JSONL)})" in str(raised.value)
