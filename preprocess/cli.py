"""The converter's command line: ``python -m preprocess`` and ``streamds convert``.

::

    python -m preprocess INPUT... --output DIR [--shard-size 256MB] [--format jsonl.zst|tar]
                         [--workers N] [--level 3] [--frame-size 4MiB]
                         [--transform module:function] [--on-error raise|skip] [--quiet]
                         [--read-ahead 64] [--read-ahead-bytes 256MiB]
                         [--storage-options JSON]

INPUT may be an fsspec URL (``https://host/d/train.jsonl.zst``, ``s3://bucket/d/``, a remote
folder or glob of ``.json`` files).

Exit status: 0 on success, 2 for bad arguments or input (the reason on stderr), 130 when
interrupted (rerun the same command to resume). Results go to stdout, the progress bar to
stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from streamds.parse import ON_ERROR
from streamds.tools.units import human_bytes, size_argument

from .convert import (
    DEFAULT_FRAME_SIZE,
    DEFAULT_READ_AHEAD,
    DEFAULT_READ_AHEAD_BYTES,
    DEFAULT_SHARD_SIZE,
    ConvertResult,
    convert,
)
from .counts import Progress
from .errors import ConversionError
from .writers import FORMATS

__all__ = ["build_parser", "main", "summary"]


def build_parser(prog: str = "python -m preprocess") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert JSONL files, trees of small .json files and tar shards into "
        "seekable .jsonl.zst (or webdataset .tar) shards with a manifest. Rerun the same "
        "command after an interruption to resume.",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="JSONL file (.jsonl/.txt, plain or .zst/.gz/.bz2/.xz), directory "
                        "or glob of .json files (any depth), or tar shard")
    parser.add_argument("--output", "-o", required=True, metavar="DIR")
    parser.add_argument("--shard-size", type=size_argument, default=DEFAULT_SHARD_SIZE,
                        metavar="SIZE", help="uncompressed bytes per shard (default 256MB)")
    parser.add_argument("--format", choices=tuple(FORMATS), default="jsonl.zst")
    parser.add_argument("--workers", type=int, default=1,
                        help="shards compressed at once; output does not depend on it")
    parser.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    parser.add_argument("--frame-size", type=size_argument, default=DEFAULT_FRAME_SIZE,
                        metavar="SIZE", help="decoded bytes per seekable frame (default 4MiB)")
    parser.add_argument("--transform", metavar="MODULE:FUNCTION",
                        help="record -> record or None, e.g. preprocess.text:to_summarisation "
                        "or 'preprocess.text:summarisation(max_words=512)'")
    parser.add_argument("--on-error", choices=ON_ERROR, default="raise",
                        help="malformed records and damaged files: stop (default) or skip "
                        "and count them")
    parser.add_argument("--read-ahead", type=int, default=DEFAULT_READ_AHEAD, metavar="N",
                        help=".json files opened at once, spread over folders, and local "
                        f"folders listed at once (default {DEFAULT_READ_AHEAD}; 0: one at a "
                        "time); for trees of small files on a mount or behind a URL")
    parser.add_argument("--read-ahead-bytes", type=size_argument,
                        default=DEFAULT_READ_AHEAD_BYTES, metavar="SIZE",
                        help="memory for files read ahead of the next N "
                        f"(default {DEFAULT_READ_AHEAD_BYTES >> 20}MiB)")
    parser.add_argument("--storage-options", type=_json_object, default=None, metavar="JSON",
                        help='fsspec options for URL inputs, e.g. \'{"anon": true}\'')
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return parser


def _json_object(text: str) -> dict[str, Any]:
    """--storage-options: a JSON object, or a usage error naming the value."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {text!r}")
    return value


class _Bar:
    """The progress bar: bytes when every input size is known, else files. Made at the first
    report, which comes once the conversion has listed the inputs (listed once only)."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, p: Progress) -> None:
        from tqdm import tqdm

        by_bytes = p.bytes_total is not None or p.files_total is None
        if self.bar is None:
            total = p.bytes_total if by_bytes else p.files_total
            self.bar = tqdm(total=total or None, unit="B" if by_bytes else " files",
                            unit_scale=by_bytes, desc="converting", file=sys.stderr,
                            dynamic_ncols=True, smoothing=0.1)
        done = p.resumed_bytes + p.stored_bytes if by_bytes else p.files
        self.bar.update(done - self.bar.n)
        files = f"/{p.files_total:,}" if p.files_total is not None else ""
        self.bar.set_postfix_str(f"files {p.files:,}{files} records {p.records:,} "
                                 f"shards {p.shards}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summary(result: ConvertResult) -> str:
    """The lines the CLI prints after a conversion."""
    m, c = result.manifest, result.counts
    totals = m.totals
    reused = f", {result.shards_reused} reused after verification" if result.shards_reused else ""
    ratio = totals["decoded_bytes"] / totals["bytes"] if totals["bytes"] else 0.0
    speed = result.stored_bytes / result.seconds / 1e6 if result.seconds else 0.0
    return "\n".join([
        f"wrote {totals['shards']} {m.shard_format} shards to {result.output} "
        f"({result.shards_written} this run{reused})",
        f"  records  in {c.records_in:,}  out {c.records_out:,}  dropped {c.dropped:,}  "
        f"bad {c.bad:,}",
        f"  bytes    in {human_bytes(c.input_bytes)}  out {human_bytes(totals['bytes'])}  "
        f"(decoded {human_bytes(totals['decoded_bytes'])}, ratio {ratio:.2f}x)",
        f"  time     {result.seconds:.1f} s  ({speed:.1f} MB/s of stored input this run)",
    ])


def main(argv: Sequence[str] | None = None, prog: str = "python -m preprocess") -> int:
    """The conversion command line; exit 0, or 2 with the reason on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["convert"]:
        argv = argv[1:]
    args = build_parser(prog).parse_args(argv)
    bar = _Bar() if not args.quiet else None
    try:
        result = convert(
            args.inputs, args.output, shard_size=args.shard_size, format=args.format,
            level=args.level, frame_size=args.frame_size, transform=args.transform,
            on_error=args.on_error, workers=args.workers, read_ahead=args.read_ahead,
            read_ahead_bytes=args.read_ahead_bytes, storage_options=args.storage_options,
            progress=bar,
        )
    except (ConversionError, ValueError, FileNotFoundError, ImportError) as err:
        if bar is not None:
            bar.close()
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        print(f"{prog}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    if bar is not None:
        bar.close()
    print(summary(result))
    return 0
