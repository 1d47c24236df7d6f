"""Tar link members (hard and symbolic links) read as the member they point to.

tar stores a file named twice once: the second name is a link member, with no data of its
own (a hard link names an earlier member by its archive path; a symbolic link names a path
relative to its own folder). A link whose name is a record member reads as its target's
data when the target is a file in the same archive (links followed, up to `MAX_HOPS`), as
extracting the archive would give; a target outside the archive, missing, not a file, or
a loop is refused (`TarLinkError`, naming the member, its target and the fix). Never
skipped.

The readers go forward only, so at an archive's first such link `LinkTargets` reads it
twice more from its start (`reopen`): its headers, then the data of the targets its links
need. Memory: an index entry per member and each needed target's data, once.
"""

from __future__ import annotations

import contextlib
import posixpath
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["MAX_HOPS", "LinkTargets", "TarLinkError", "is_link"]

MAX_HOPS = 16  # links followed from one member before it counts as a loop
_FIX = ("make the tar with the files themselves (GNU tar: --hard-dereference, and --dereference "
        "for symbolic links), or add the target to the archive")


class TarLinkError(ValueError):
    """A link member whose target is no file in the archive."""

    def __init__(self, message: str, *, url: str, member: str) -> None:
        super().__init__(message)
        self.url = url
        self.member = member


def is_link(member: tarfile.TarInfo) -> bool:
    return member.islnk() or member.issym()


@dataclass(frozen=True)
class _Entry:
    offset: int  # where its header begins: the member's identity in every pass
    name: str
    type: bytes
    linkname: str


def _clean(name: str) -> str:
    return posixpath.normpath(name.lstrip("/")) if name else name


def _entries(stream: BinaryIO) -> list[_Entry]:
    """Every member's header, in archive order (a damaged header ends the list: the main
    pass reports it)."""
    found = []
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        member = tar.next()
        while member is not None:
            found.append(_Entry(member.offset, _clean(member.name), member.type,
                                member.linkname))
            tar.fileobj.seek(tar.offset)  # past the data, forward
            try:
                member = tarfile.TarInfo.fromtarfile(tar)
            except tarfile.HeaderError:
                break
    return found


class LinkTargets:
    """The data each link member of one archive reads as; `reopen` gives the archive's
    decoded bytes from its start (None: links are refused, naming the member)."""

    def __init__(self, reopen: Callable[[], BinaryIO] | None, url: str) -> None:
        self.reopen = reopen
        self.url = url
        self._data: dict[int, bytes] | None = None  # link header offset -> its data
        self._by_offset: dict[int, _Entry] = {}  # every member, by its header offset
        self._by_name: dict[str, list[_Entry]] = {}  # every member, by its name

    def data(self, member: tarfile.TarInfo) -> bytes:
        """The data of the file the link `member` points to; TarLinkError where none."""
        if self.reopen is None:
            raise TarLinkError(
                f"{self.url}: tar member {member.name} is a link to {member.linkname}, and "
                f"this archive cannot be read twice to follow it; {_FIX}",
                url=self.url, member=member.name,
            )
        if self._data is None:
            self._data = self._read_targets()
        if member.offset not in self._data:  # its target is no file here: say why
            self._target(self._by_offset[member.offset], self._by_name)
            raise TarLinkError(
                f"{self.url}: tar member {member.name} is a link to {member.linkname}, whose "
                "data could not be read again (the archive changed while it was read?); "
                "read it again", url=self.url, member=member.name,
            )
        return self._data[member.offset]

    def _read_targets(self) -> dict[int, bytes]:
        """Index the archive's headers, resolve every link, read the targets' data."""
        assert self.reopen is not None
        with self.reopen() as stream:
            entries = _entries(stream)
        self._by_offset = {entry.offset: entry for entry in entries}
        for entry in entries:
            self._by_name.setdefault(entry.name, []).append(entry)
        wanted = {}
        for entry in entries:
            if entry.type in (tarfile.LNKTYPE, tarfile.SYMTYPE):
                with contextlib.suppress(TarLinkError):  # raised where it is read (`data`)
                    wanted[entry.offset] = self._target(entry, self._by_name).offset
        needed = set(wanted.values())
        data: dict[int, bytes] = {}
        with self.reopen() as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            member = tar.next()
            while member is not None and len(data) < len(needed):
                if member.offset in needed:
                    extracted = tar.extractfile(member)
                    data[member.offset] = extracted.read() if extracted is not None else b""
                tar.fileobj.seek(tar.offset)  # past the data, forward
                try:
                    member = tarfile.TarInfo.fromtarfile(tar)
                except tarfile.HeaderError:
                    break
        return {link: data[target] for link, target in wanted.items() if target in data}

    def _target(self, link: _Entry, by_name: dict[str, list[_Entry]]) -> _Entry:
        """The file `link` resolves to, as extraction makes it: a hard link's target is the
        last member of that name before it, a symbolic link's the last of that name."""
        current = link
        for _ in range(MAX_HOPS):
            if current.type == tarfile.LNKTYPE:
                name = _clean(current.linkname)
                found = [e for e in by_name.get(name, ()) if e.offset < current.offset]
            elif current.type == tarfile.SYMTYPE:
                if current.linkname.startswith("/"):
                    self._refuse(link, current, "an absolute path, outside the archive")
                name = posixpath.normpath(
                    posixpath.join(posixpath.dirname(current.name), current.linkname))
                if name == ".." or name.startswith("../"):
                    self._refuse(link, current, "outside the archive")
                found = by_name.get(name, [])
            elif current.type in tarfile.REGULAR_TYPES:
                return current
            else:
                self._refuse(link, current, "not a file (a folder or a device)")
            if not found:
                self._refuse(link, current, "not in the archive")
            current = found[-1]
        self._refuse(link, current, f"a chain of more than {MAX_HOPS} links (a loop?)")
        raise AssertionError  # unreachable: _refuse raises

    def _refuse(self, link: _Entry, at: _Entry, why: str) -> None:
        kind = "hard link" if link.type == tarfile.LNKTYPE else "symbolic link"
        via = "" if at is link else f" (through {at.name})"
        target = at.linkname if at.type in (tarfile.LNKTYPE, tarfile.SYMTYPE) else at.name
        raise TarLinkError(
            f"{self.url}: tar member {link.name} is a {kind} to {target}{via}, which is "
            f"{why}, so its record cannot be read; {_FIX}",
            url=self.url, member=link.name,
        )
