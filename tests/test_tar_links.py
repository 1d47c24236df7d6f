"""Tar hard-link and symbolic-link members (issue 34, item 8): read as the member they point
to, by the reader and the converter alike, or refused naming the member; never skipped.

Expected records come from extracting the archive with `tarfile` into a folder and reading
each record member's file there, in archive order: what the links mean on disk.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import orjson
import pytest

from streamds import StreamingJsonl
from streamds.preprocess.convert import ConversionError, convert

Member = tuple[str, bytes | None, str | None, str | None]  # name, data, link kind, target


def tar_of(members: list[Member]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data, kind, target in members:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind is None:
                assert data is not None
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.type = tarfile.LNKTYPE if kind == "hard" else tarfile.SYMTYPE
                info.linkname = target or ""
                tar.addfile(info)
    return buf.getvalue()


def extracted_records(data: bytes, where: Path) -> list[dict]:
    """The records of the archive's .json / .jsonl members as extraction leaves them."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = [m.name for m in tar.getmembers()]
        tar.extractall(where, filter="fully_trusted")
    found = []
    for name in names:
        if name.endswith(".json"):
            found.append(orjson.loads((where / name).read_bytes()))
        elif name.endswith(".jsonl"):
            found += [orjson.loads(line) for line in (where / name).read_bytes().splitlines()]
    return found


def record(n: int) -> bytes:
    return orjson.dumps({"n": n, "text": f"record {n}"})


LINKED: list[Member] = [
    ("s/000.json", record(0), None, None),
    ("s/001.json", None, "hard", "s/000.json"),  # an earlier member, by its archive path
    ("s/d/002.json", None, "sym", "../003.json"),  # a later member, relative to its folder
    ("s/003.json", record(3), None, None),
    ("s/004.jsonl", record(4) + b"\n" + record(5) + b"\n", None, None),
    ("s/005.jsonl", None, "sym", "004.jsonl"),
    ("s/006.json", None, "sym", "d/002.json"),  # a link to a link
    ("s/notes.txt", None, "sym", "000.json"),  # not a record name: no record, as any .txt
]


@pytest.mark.parametrize("codec", [None, "gz"])
def test_link_members_read_as_their_targets_by_the_reader_and_the_converter(tmp_path, codec):
    data = tar_of(LINKED)
    expected = extracted_records(data, tmp_path / "extracted")
    assert [r["n"] for r in expected] == [0, 0, 3, 3, 4, 5, 4, 5, 3]
    path = tmp_path / ("links.tar" if codec is None else "links.tar.gz")
    path.write_bytes(data if codec is None else gzip.compress(data))

    assert list(StreamingJsonl(str(path))) == expected
    out = convert([path], tmp_path / "out", shard_size=200)
    assert out.manifest.totals["records"] == len(expected)
    assert list(StreamingJsonl(str(tmp_path / "out"))) == expected


def test_a_resume_after_a_link_member_continues_exactly(tmp_path):
    path = tmp_path / "links.tar"
    path.write_bytes(tar_of(LINKED))
    full = list(StreamingJsonl(str(path)))
    assert len(full) == 9  # the link members included
    for taken in range(1, len(full)):
        ds = StreamingJsonl(str(path))
        it = iter(ds)
        head = [next(it) for _ in range(taken)]
        resumed = StreamingJsonl(str(path))
        resumed.load_state_dict(ds.state_dict())
        assert head + list(resumed) == full, taken


@pytest.mark.parametrize(("kind", "target", "why"), [
    ("sym", "/etc/passwd", "an absolute path, outside the archive"),
    ("sym", "../../outside.json", "outside the archive"),
    ("hard", "s/missing.json", "not in the archive"),
    ("hard", "s/003.json", "not in the archive"),  # a hard link names an earlier member only
    ("sym", "d", "not a file"),
    ("sym", "009.json", "a chain of more than 16 links"),
])
def test_a_link_whose_target_is_no_file_in_the_archive_is_refused_naming_it(
        tmp_path, kind, target, why):
    path = tmp_path / "links.tar"
    path.write_bytes(tar_of([
        ("s/000.json", record(0), None, None),
        ("s/002.json", None, kind, target),
        ("s/003.json", record(3), None, None),
        ("s/d", None, "dir", None),
        ("s/009.json", None, "sym", "010.json"),  # a loop
        ("s/010.json", None, "sym", "009.json"),
    ]))
    message = rf"links.tar: tar member s/002.json is a (hard|symbolic) link to .*{why}"
    with pytest.raises(ValueError, match=message):
        list(StreamingJsonl(str(path)))
    with pytest.raises(ConversionError, match=message):
        convert([path], tmp_path / "out")
