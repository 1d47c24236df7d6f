"""The ``streamds`` command: convert, inspect, verify, bench, synthetic.

::

    streamds convert INPUT... --output DIR [--shard-size 256MB] [--format jsonl.zst|tar]
                     [--workers N] [--level 3] [--frame-size 4MiB]
                     [--transform module:function] [--on-error raise|skip] [--quiet]
                     [--parts N] [--executor local|process|process:N|dask://HOST:PORT]
                     [--part K | --merge] [--storage-options JSON] [--read-ahead N]
    streamds inspect DIR_OR_FILE [--no-count] [--quiet]
    streamds verify DIR_OR_FILE [--quiet]
    streamds bench SOURCE [...]
    streamds synthetic {pubmed,small-lines,splits,small-files} OUT ...

Exit status: 0 on success, 1 when `verify` finds damage, 2 for bad arguments or input.
The library never prints; this module does (results on stdout, progress on stderr).
`convert` is the converter's own command line (`streamds.preprocess.command`, the writing side, from
the checkout's `preprocess/` folder) and `bench` lives in `streamds.tools.bench`; both are
imported only when asked for, and no other module of streamds imports the converter.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson

from ..formats.filenames import is_record_name
from ..formats.manifest import MANIFEST_NAME, Manifest, ManifestError, read_manifest, verify_shard
from ..formats.unfinished import MARKER_NAMES, UnfinishedConversionError, check_finished
from ..formats.values import dumps, loads
from ..redact import redact
from ..units import human_bytes

__all__ = ["main"]

_USAGE = """usage: streamds {convert,inspect,verify,bench,synthetic} ...

  convert INPUT... --output DIR   JSONL files, small-file trees, tar shards -> seekable shards
  inspect DIR_OR_FILE             shards, records, bytes, frames, codec, ratio, a sample record
  verify DIR_OR_FILE              re-read every shard against manifest.json (exit 1 on damage)
  bench SOURCE [...]              loader throughput and where the time goes
  synthetic pubmed OUT --bytes 8MB   a PubMed-layout sample corpus to try things on

Run `streamds COMMAND --help` for a command's options."""

_SAMPLE_CHARS = 400
_TABLE_ROWS = 20


def _progress(total: int, desc: str, quiet: bool, unit: str = "shard"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=quiet,
                dynamic_ncols=True, leave=False)


def _sample(record: bytes) -> str:
    try:  # values' loads and dumps keep integers beyond 64 bits exact (orjson's: floats)
        text = dumps(loads(record)).decode()
    except orjson.JSONDecodeError:
        text = record[:_SAMPLE_CHARS].decode("utf-8", "replace") + "  (not valid JSON)"
    return text if len(text) <= _SAMPLE_CHARS else text[:_SAMPLE_CHARS] + " ..."


# -- inspect -----------------------------------------------------------------------------


def _first_record(shards: Sequence[Any]) -> bytes | None:
    from ..storage.plan import Block
    from ..storage.read import read_lines

    for shard in shards:
        for chunk in read_lines(shard, Block(0), 0):
            for line in chunk.lines:
                if line.strip():
                    return line
    return None


def _count_records(shard: Any) -> tuple[int, int]:
    """(records, decoded bytes) of a shard, reading it once."""
    from ..storage.plan import Block
    from ..storage.read import open_decoded_at, read_lines

    if not shard.format.line_positions:  # members, a document's records: as the reader
        records = decoded = 0
        for chunk in read_lines(shard, Block(0), 0):
            records += sum(1 for line in chunk.lines if line.strip())
            decoded += sum(map(len, chunk.lines))
        return records, decoded
    newlines = decoded = 0
    last = b"\n"
    with closing(open_decoded_at(shard, 0)) as stream:
        while data := stream.read(1 << 20):
            newlines += data.count(b"\n")
            decoded += len(data)
            last = data[-1:]
    return newlines + (last != b"\n"), decoded


def _inspect_manifest(directory: Path, manifest: Manifest) -> list[str]:
    from ..formats.registry import named
    from ..storage.shards import resolve_shards

    totals = manifest.totals
    ratio = totals["decoded_bytes"] / totals["bytes"] if totals["bytes"] else 0.0
    fmt = named(manifest.shard_format)
    c = manifest.counts
    out = [
        f"{directory}: converted shards ({MANIFEST_NAME}, version 1)",
        f"  format     {fmt.name} ({fmt.summary})",
        f"  codec      {fmt.codec or 'none'}",
        f"  seekable   {'yes' if fmt.splits else f'no ({fmt.name}: split by whole shard)'}",
        f"  shards     {totals['shards']:,}",
        f"  records    {totals['records']:,}",
        f"  bytes      {human_bytes(totals['bytes'])} stored, "
        f"{human_bytes(totals['decoded_bytes'])} decoded (ratio {ratio:.2f}x)",
    ]
    if fmt.splits:
        frames = totals["frames"]
        mean = totals["decoded_bytes"] / frames if frames else 0
        out.append(f"  frames     {frames:,} (mean {human_bytes(mean)} decoded)")
    if c:
        out.append(f"  counts     in {c.get('records_in', 0):,}  out {c.get('records_out', 0):,}"
                   f"  dropped {c.get('dropped', 0):,}  bad {c.get('bad', 0):,}")
    options = "  ".join(f"{k}={v}" for k, v in manifest.options.items() if v is not None)
    out.append(f"  options    {options}")
    # redacted again: a manifest written before streamds redacted its inputs may hold them
    out.append(f"  inputs     {redact(', '.join(manifest.inputs))}")
    out.append(f"  {'shard':<28}{'records':>12}{'bytes':>12}{'decoded':>12}{'frames':>8}")
    for entry in manifest.shards[:_TABLE_ROWS]:
        out.append(f"  {entry.name:<28}{entry.records:>12,}{human_bytes(entry.bytes):>12}"
                   f"{human_bytes(entry.decoded_bytes):>12}{entry.frames:>8}")
    if len(manifest.shards) > _TABLE_ROWS:
        out.append(f"  ... {len(manifest.shards) - _TABLE_ROWS} more")
    if manifest.shards:
        first = resolve_shards(str(directory / manifest.shards[0].name))
        record = _first_record(first)
        if record is not None:
            out.append(f"  sample     {_sample(record)}")
    return out


def _left_out_lines(left_out: Any, target: str) -> list[str]:
    """What a folder listing did not read, one line per file (the first few) with why."""
    if not left_out:
        return []
    folder = os.path.abspath(target) if os.path.isdir(target) else None
    out = [f"  left out   {len(left_out):,} file{'s' * (len(left_out) != 1)} or folders not "
           "read as records:"]
    for path, reason in left_out.examples[:_TABLE_ROWS]:
        name = os.path.relpath(path, folder) if folder and os.path.isabs(path) else path
        out.append(f"    {name}: {reason}")
    if len(left_out) > _TABLE_ROWS:
        out.append(f"    ... {len(left_out) - _TABLE_ROWS} more")
    return out


def _inspect_files(target: str, count: bool, quiet: bool) -> list[str]:
    from ..storage.shards import list_source

    listing = list_source(target)
    shards = listing.shards
    out = [f"{redact(target)}: {len(shards)} file{'s' * (len(shards) != 1)}"]
    out.append(f"  {'file':<40}{'codec':>6}{'seekable':>9}{'frames':>8}{'records':>12}"
               f"{'bytes':>11}{'decoded':>11}{'ratio':>7}")
    total_records = total_bytes = total_decoded = 0
    with _progress(len(shards), "inspecting", quiet or not count, unit="file") as bar:
        for shard in shards:
            seekable = "yes" if shard.frames is not None else "no"
            frames = len(shard.frames) if shard.frames is not None else "-"
            records: int | str = "-"
            decoded = shard.decoded_size
            if count:
                records, decoded = _count_records(shard)
                total_records += records
            size = shard.size or 0
            total_bytes += size
            total_decoded += decoded or 0
            ratio = f"{decoded / size:.2f}x" if decoded and size else "-"
            name = shard.url
            if len(shards) > 1 and os.path.isdir(target):
                name = os.path.relpath(shard.path, target)
            if len(shards) <= _TABLE_ROWS or len(out) < _TABLE_ROWS + 2:
                records_text = f"{records:,}" if isinstance(records, int) else records
                out.append(
                    f"  {name[-40:]:<40}{shard.codec or 'none':>6}{seekable:>9}{frames!s:>8}"
                    f"{records_text:>12}{human_bytes(size):>11}"
                    f"{human_bytes(decoded) if decoded is not None else '-':>11}{ratio:>7}"
                )
            bar.update(1)
    if len(shards) > _TABLE_ROWS:
        out.append(f"  ... {len(shards) - _TABLE_ROWS} more")
    if count:
        ratio_all = total_decoded / total_bytes if total_bytes else 0.0
        out.append(f"  total      {total_records:,} records, {human_bytes(total_bytes)} stored, "
                   f"{human_bytes(total_decoded)} decoded (ratio {ratio_all:.2f}x)")
    formats = sorted({s.format.name for s in shards})
    out.append(f"  format     {', '.join(formats)}")
    out.extend(_left_out_lines(listing.left_out, target))
    record = _first_record(shards)
    if record is not None:
        out.append(f"  sample     {_sample(record)}")
    if all(s.frames is None for s in shards if s.codec == "zst") and any(
        s.codec is not None for s in shards
    ):
        out.append("  note       compressed files without seek tables are read whole by one "
                   "worker; `streamds convert` makes seekable shards")
    return out


def _cmd_inspect(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="streamds inspect",
        description="Describe a converted directory (from its manifest) or any JSONL "
        "files: shards, records, bytes, frames, codec, compression ratio, a sample record.",
    )
    parser.add_argument("target", metavar="DIR_OR_FILE", help="directory, file, glob or URL")
    parser.add_argument("--no-count", action="store_true",
                        help="without a manifest, do not read files to count records")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    target = Path(args.target)
    try:
        if target.is_dir() and (target / MANIFEST_NAME).is_file():
            lines = _inspect_manifest(target, read_manifest(target))
        else:
            lines = _inspect_files(args.target, not args.no_count, args.quiet)
    except (OSError, ValueError) as err:
        print(f"streamds inspect: error: {redact(str(err))}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


# -- verify ------------------------------------------------------------------------------


def _unlisted(directory: Path, manifest: Manifest) -> list[str]:
    listed = {entry.name for entry in manifest.shards}
    extra = []
    for name in sorted(os.listdir(directory)):
        if is_record_name(name) and name not in listed:
            extra.append(
                f"{name}: not listed in the manifest, but a reader of {directory} would read "
                "it too; remove it or convert again"
            )
    return extra


def _verify_file(path: Path) -> int:
    """Verify one file: against the manifest beside it when that lists it, else by reading
    every record (decoding, seek table, JSON) with what no manifest can tell left unchecked."""
    directory = path.parent
    manifest = None
    if (directory / MANIFEST_NAME).is_file():
        try:
            manifest = read_manifest(directory)
        except ManifestError as err:
            print(f"streamds verify: error: {err}", file=sys.stderr)
            return 1
    entry = next((e for e in manifest.shards if e.name == path.name), None) if manifest else None
    if manifest is not None and entry is not None:
        problems = verify_shard(directory, entry, manifest.shard_format)
        if problems:
            print(f"DAMAGED {entry.name}")
            for problem in problems:
                print(f"  {problem}")
            print(f"{path}: damaged", file=sys.stderr)
            return 1
        print(f"{path}: OK, {entry.records:,} records, {entry.frames:,} frames verified against "
              f"{directory / MANIFEST_NAME}")
        return 0
    from ..datasets.dataset import StreamingJsonl

    records = 0
    try:
        for _ in StreamingJsonl(str(path)):
            records += 1
    except (OSError, ValueError) as err:
        print(f"DAMAGED {path}\n  {err}")
        print(f"{path}: damaged after {records:,} records", file=sys.stderr)
        return 1
    print(f"{path}: OK, {records:,} records decoded and parsed; no {MANIFEST_NAME} beside it "
          "lists it, so its size, checksum and record counts were not checked (verify the "
          "folder `streamds convert` wrote for those)")
    return 0


def _cmd_verify(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="streamds verify",
        description="Re-read every shard of a converted directory against its manifest: "
        "size, xxh64 checksum, seek table, records per frame, every record parses. "
        "Exit 1 naming each damaged shard. Given one file, verify it against the manifest "
        "beside it, or without one read and parse every record.",
    )
    parser.add_argument("directory", metavar="DIR_OR_FILE")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    directory = Path(args.directory)
    if directory.is_file() and directory.name != MANIFEST_NAME:
        return _verify_file(directory)
    if directory.is_file():  # the manifest itself: its folder
        directory = directory.parent
    if not directory.exists():
        print(f"streamds verify: error: {directory} does not exist", file=sys.stderr)
        return 2
    try:
        manifest = read_manifest(directory)
    except FileNotFoundError:
        try:  # a conversion that stopped: name the command that finishes it
            check_finished([str(directory / name) for name in MARKER_NAMES
                            if (directory / name).is_file()], [],
                           lambda path: Path(path).read_bytes(), str)
        except UnfinishedConversionError as err:
            print(f"streamds verify: error: {err}", file=sys.stderr)
            return 1
        print(f"streamds verify: error: {directory} has no {MANIFEST_NAME}; verify works on "
              "directories written by `streamds convert`, and on single files", file=sys.stderr)
        return 2
    except ManifestError as err:
        print(f"streamds verify: error: {err}", file=sys.stderr)
        return 1
    damaged: dict[str, list[str]] = {}
    with _progress(len(manifest.shards), "verifying", args.quiet) as bar:
        for entry in manifest.shards:
            problems = verify_shard(directory, entry, manifest.shard_format)
            if problems:
                damaged[entry.name] = problems
            bar.update(1)
    extra = _unlisted(directory, manifest)
    counted = manifest.counts.get("records_out")
    records = manifest.totals["records"]
    mismatch = counted is not None and counted != records
    for name, problems in damaged.items():
        print(f"DAMAGED {name}")
        for problem in problems:
            print(f"  {problem}")
    for problem in extra:
        print(f"UNLISTED {problem}")
    if mismatch:
        print(f"MANIFEST counts records_out={counted} but its shards hold {records} records")
    if damaged or extra or mismatch:
        names = ", ".join(damaged) or "none"
        print(f"{directory}: {len(damaged)} of {len(manifest.shards)} shards damaged ({names})"
              f"{f', {len(extra)} unlisted files' if extra else ''}", file=sys.stderr)
        return 1
    print(f"{directory}: OK, {len(manifest.shards)} shards, {records:,} records, "
          f"{manifest.totals['frames']:,} frames verified")
    return 0


# -- dispatch ----------------------------------------------------------------------------


def _cmd_convert(argv: Sequence[str]) -> int:
    try:
        from streamds.preprocess.command import main as convert_main
    except ImportError as err:
        missing = getattr(err, "name", None) or "a module"
        print(f"streamds convert: error: the converter (streamds.preprocess) cannot be "
              f"imported: {err}; {missing} is missing from this environment: reinstall or "
              "upgrade streamds (`pip install --upgrade streamds`, or `pip install -e .` in a "
              "checkout) so that its declared dependencies are installed", file=sys.stderr)
        return 2
    return convert_main(list(argv), prog="streamds convert")


def _cmd_bench(argv: Sequence[str]) -> int:
    bench = importlib.import_module("streamds.tools.bench")  # on use: it imports torch
    return int(bench.main(list(argv)) or 0)


def _cmd_synthetic(argv: Sequence[str]) -> int:
    from . import synthetic

    return synthetic.main(list(argv))


_COMMANDS = {
    "convert": _cmd_convert,
    "inspect": _cmd_inspect,
    "verify": _cmd_verify,
    "bench": _cmd_bench,
    "synthetic": _cmd_synthetic,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamds`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from .. import __version__

        print(f"streamds {__version__}")
        return 0
    command = _COMMANDS.get(argv[0])
    if command is None:
        print(f"{_USAGE}\n\nstreamds: error: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    try:
        status = command(argv[1:])
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        return _output_closed()
    return status


def _output_closed() -> int:
    """The reader of stdout went away (`streamds inspect DIR | head -1`): stop quietly, with
    the status a shell gives a command ended by SIGPIPE, and send what is still buffered
    to /dev/null so that the interpreter's last flush does not fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + 13  # SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
