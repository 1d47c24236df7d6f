"""Test corpora: the same JSON lines written as every shard format streamds reads.

Each writer takes the decoded JSONL bytes (so a test can place blank lines, malformed lines or
leave the final newline off) and the path to write, and returns the path. `jsonl` turns
records into those bytes; `write` picks the writer from the file name.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson
import torch.utils.data
import webdataset
import zstandard

from streamds.formats.seekable import SeekableWriter

FRAME_SIZE = 512  # decoded bytes per seekable frame: small, so test shards have many frames
TAR_JSONL_MEMBERS = 3  # .jsonl members per tar-of-JSONL shard


def make_records(count: int, *, start: int = 0) -> list[dict[str, Any]]:
    """`count` records with ids from `start`, about 100 bytes each, some of them non-ASCII."""
    texts = ["plain ascii text", "café naïve façade", "数据流 テスト", "emoji 🚀🧪", "tab\tquote\""]
    return [
        {"id": i, "text": f"{texts[i % len(texts)]} {i}", "tags": ["a", "b"][: i % 3]}
        for i in range(start, start + count)
    ]


def jsonl(records: Iterable[Any]) -> bytes:
    """Records as JSON lines, each ending in a newline."""
    return b"".join(orjson.dumps(record) + b"\n" for record in records)


def _lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


def write_parts(root: Path, records: int, parts: int) -> str:
    """`records` records with ids 0.. in `parts` plain files part-K.jsonl of equal size."""
    each = records // parts
    for part in range(parts):
        (root / f"part-{part}.jsonl").write_bytes(jsonl(make_records(each, start=part * each)))
    return str(root)


def write_plain(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def write_two_sources(root: Path, count: int) -> tuple[str, str]:
    """``a.jsonl`` (ids 0..count-1) and ``b.jsonl`` (ids 1000..): two sources to mix."""
    a, b = (write_plain(root / f"{name}.jsonl", jsonl(make_records(count, start=start)))
            for name, start in (("a", 0), ("b", 1000)))
    return str(a), str(b)


def write_seekable_zst(path: Path, data: bytes, *, frame_size: int = FRAME_SIZE) -> Path:
    """Frames of whole lines with a seek table; the writer ends every line with a newline."""
    with path.open("wb") as f, SeekableWriter(f, frame_size=frame_size) as writer:
        writer.write_lines(_lines(data))
    return path


def write_foreign_zst(path: Path, data: bytes) -> Path:
    """One zstd frame, no seek table, no checksum: what `zstd file.jsonl` makes."""
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    return path


def write_gz(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data, mtime=0))
    return path


def write_bz2(path: Path, data: bytes) -> Path:
    path.write_bytes(bz2.compress(data))
    return path


def write_xz(path: Path, data: bytes) -> Path:
    path.write_bytes(lzma.compress(data))
    return path


def write_tar_json(path: Path, data: bytes) -> Path:
    """A webdataset shard: one sample per line, `sampleNNNNNN.json` plus a `.txt` member."""
    with webdataset.TarWriter(str(path)) as writer:
        for index, line in enumerate(_lines(data)):
            writer.write({"__key__": f"sample{index:06d}", "json": line, "txt": f"n{index}"})
    return path


def write_tar_jsonl(path: Path, data: bytes, *, members: int = TAR_JSONL_MEMBERS) -> Path:
    """The lines split over `members` members `part-K.jsonl` (the last keeps `data`'s ending)."""
    lines = _lines(data)
    step = -(-len(lines) // members) or 1
    groups = [lines[i : i + step] for i in range(0, len(lines), step)] or [[]]
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for index, group in enumerate(groups):
            ending = b"\n" if index < len(groups) - 1 or data.endswith(b"\n") else b""
            body = b"\n".join(group) + ending if group else b""
            info = tarfile.TarInfo(f"part-{index}.jsonl")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return path


WRITERS: dict[str, Callable[[Path, bytes], Path]] = {
    ".jsonl": write_plain,
    ".jsonl.zst": write_seekable_zst,
    ".jsonl.gz": write_gz,
    ".jsonl.bz2": write_bz2,
    ".jsonl.xz": write_xz,
    ".tar": write_tar_json,
}


def write(path: Path, records: Iterable[Any]) -> Path:
    """`records` as the format `path`'s suffix names (`.jsonl.zst` is seekable)."""
    for suffix, writer in sorted(WRITERS.items(), key=lambda item: -len(item[0])):
        if path.name.endswith(suffix):
            return writer(path, jsonl(records))
    raise ValueError(f"no test writer for {path.name}")


def as_list(batch: list[Any]) -> list[Any]:
    """Collate that keeps a batch as the list of records (module-level, so workers pickle it)."""
    return batch


def read_all(
    dataset: torch.utils.data.IterableDataset, num_workers: int, *, batch_size: int = 64
) -> list[Any]:
    """Every record one epoch of a real DataLoader yields, flattened, in arrival order."""
    with warnings.catch_warnings():  # more workers than this machine's cores is the point
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=as_list
        )
        return [record for batch in loader for record in batch]
