"""Tar samples: which members of a webdataset tar belong to one sample.

webdataset's rule: a member's sample key is its path with the file name cut at its first
dot (``d/000001.meta.json`` -> key ``d/000001``, extension ``meta.json``), and consecutive
members with one key are one sample. streamds reads one record per JSON member, so a sample
with two JSON members (``KEY.json`` beside ``KEY.meta.json``) would split one sample into
two records; `SampleKeys` refuses it, naming both members, for the reader and the converter
alike.
"""

from __future__ import annotations

__all__ = ["SampleKeys", "TarSampleError", "sample_key"]


class TarSampleError(ValueError):
    """A tar sample (webdataset key) with more than one JSON member."""

    def __init__(self, message: str, *, url: str, member: str) -> None:
        super().__init__(message)
        self.url = url
        self.member = member


def sample_key(name: str) -> str:
    """The webdataset sample key of member `name`.

    >>> sample_key("d/000001.meta.json"), sample_key("000001.json"), sample_key("a.b/c.json")
    ('d/000001', '000001', 'a.b/c')
    """
    folder, slash, base = name.rpartition("/")
    return folder + slash + base.split(".", 1)[0]


class SampleKeys:
    """Checks the JSON members of one tar, in order: `check(name)` raises `TarSampleError`
    when `name` has the sample key of the JSON member just before it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._last: tuple[str, str] | None = None  # (key, member) of the last JSON member

    def check(self, name: str) -> None:
        key = sample_key(name)
        last = self._last
        if last is not None and last[0] == key:
            raise TarSampleError(
                f"{self.url}: tar members {last[1]} and {name} are one sample (webdataset key "
                f"{key!r}: the name up to the first dot), and streamds reads one JSON member "
                "per sample; merge them into one JSON object per sample (e.g. the metadata "
                "under a key of the record), or give each its own key (e.g. "
                f"{key}_meta.json) to read them as separate records",
                url=self.url, member=name,
            )
        self._last = (key, name)
