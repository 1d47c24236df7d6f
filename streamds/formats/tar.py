"""Tar shards (webdataset layout): a ``.json`` member is one record, a ``.jsonl`` member one
record per line.

One block per file, read forward from its start. Positions are record ordinals in the file,
so a resume skips that many records. `tar_records` is also how the converter reads tars.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any, BinaryIO, NamedTuple

from ..errors import CorruptShardError
from .filenames import TAR_LINES_MEMBERS, TAR_RECORD_MEMBERS
from .protocol import Block, Cursor, Format, LineChunk, Opener
from .samples import SampleKeys
from .tar_links import LinkTargets, is_link

__all__ = ["FORMAT", "Tar", "TarRecords", "tar_records"]


def _tar_members(tar: tarfile.TarFile, url: str) -> Iterator[tarfile.TarInfo]:
    """The members of a tar opened in stream mode, without keeping them in `tar.members`.

    `TarFile` iteration ends silently at a header that is cut short or damaged, which would
    drop the rest of the shard; here only the end-of-archive block ends it, anything else
    raises `CorruptShardError`.
    """
    member = tar.next()  # the first member, read when the archive was opened
    while member is not None:
        yield member
        tar.fileobj.seek(tar.offset)  # past the member's data: reads forward in stream mode
        try:
            member = tarfile.TarInfo.fromtarfile(tar)
        except tarfile.EOFHeaderError:
            return
        except tarfile.HeaderError as err:
            raise CorruptShardError(
                f"{url}: truncated or damaged tar header at byte {tar.offset}: {err}; copy or "
                "convert the file again",
                url=url,
                offset=tar.offset,
            ) from err


class TarRecords(NamedTuple):
    """The records of one tar member: `records[i]` is record number `first + i` of the shard."""

    member: str
    first: int
    records: list[bytes]


def tar_records(stream: BinaryIO, url: str, first: int = 0,
                reopen: Callable[[], BinaryIO] | None = None) -> Iterator[TarRecords]:
    """The records of a tar shard, member by member, from record number `first` on.

    `stream` holds the shard's decoded bytes from its start. A ``.json`` member is one record
    (one per webdataset sample, else `TarSampleError`); a ``.jsonl`` member is one record per
    line (blank lines count, so numbers match the reader's; parsing skips them). Members are
    read forward only, one at a time. A cut or damaged header or member raises
    `CorruptShardError` naming `url` and the record it follows: never a silently short shard.
    The library's reader and the converter both read tar shards here. A hard or symbolic
    link member reads as the file it points to (`formats.tar_links`; `reopen`: the shard's
    decoded bytes again from its start), or raises TarLinkError naming it.
    """
    ordinal = 0
    samples = SampleKeys(url)
    links = LinkTargets(reopen, url)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in _tar_members(tar, url):
                if not member.isfile() and not is_link(member):
                    continue
                if member.name.endswith(TAR_RECORD_MEMBERS):
                    samples.check(member.name)  # one JSON member per webdataset sample
                    one_record = True  # the member is one record
                elif member.name.endswith(TAR_LINES_MEMBERS):
                    one_record = False  # the member holds JSON lines
                else:
                    continue
                if one_record and ordinal < first:
                    ordinal += 1
                    continue
                if is_link(member):
                    data = links.data(member)
                else:
                    extracted = tar.extractfile(member)
                    data = extracted.read() if extracted is not None else b""
                records = [data] if one_record else data.split(b"\n")
                if not one_record and records and not records[-1]:
                    records.pop()
                skip = max(0, first - ordinal)
                ordinal += len(records)
                if records[skip:]:
                    yield TarRecords(member.name, ordinal - len(records) + skip, records[skip:])
    except tarfile.TarError as err:  # a member's data cut short, an unreadable first header
        raise CorruptShardError(
            f"{url}: truncated or damaged tar data after record {max(ordinal, first)}: "
            f"{err}; copy or convert the file again",
            url=url,
            offset=max(ordinal, first),
        ) from err


class Tar(Format):
    """A tar of JSON members: one block per file, positions are record ordinals."""

    name = "tar"
    suffixes = (".tar", ".tgz")
    summary = "webdataset"

    def read_block(self, opener: Opener, shard: Any, block: Block, block_id: int,
                   cursor: Cursor, read_size: int) -> Iterator[LineChunk]:
        """Records of the shard (`tar_records`), a chunk per member."""
        first = cursor.next_line or 0
        cursor.next_line = first

        def reopen() -> BinaryIO:  # the shard again from its start, to follow a link member
            return io.BufferedReader(opener(shard, 0), buffer_size=read_size)  # type: ignore[arg-type]

        stream = reopen()
        with closing(stream):
            for member in tar_records(stream, shard.url, first, reopen):
                end = member.first + len(member.records)
                cursor.next_line = end
                yield LineChunk(
                    block_id,
                    list(range(member.first, end + 1)),
                    member.records,
                    [f"member {member.member}"] * len(member.records),
                )


FORMAT = Tar()
