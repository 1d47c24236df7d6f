"""The converter's command line: ``streamds convert`` and ``python -m streamds.preprocess``.

::

    streamds convert INPUT... --output DIR [--shard-size 256MB] [--format jsonl.zst|tar]
                     [--workers N] [--level 3] [--frame-size 4MiB]
                     [--transform module:function] [--on-error raise|skip] [--quiet]
                     [--read-ahead 64] [--read-ahead-bytes 256MiB]
                     [--storage-options JSON]
                     [--parts N] [--executor local|process|process:N|dask://HOST:PORT]
                     [--part K | --merge] [--overwrite]

INPUT may be an fsspec URL (``https://host/d/train.jsonl.zst``, ``s3://bucket/d/``, a remote
folder or glob of ``.json`` files).

``--parts N`` cuts the input into N parts (default: one per GiB), each converted into its own
folder by a task; ``--executor`` says where the tasks run (``local``: here, one after another;
``process``: a pool of one process per core this process may use, ``process:N`` of N;
``dask://HOST:PORT``: the Dask scheduler there, with the ``cluster`` extra). For launchers
that start one process per part (a Slurm job array): ``--part K`` converts part K only,
``--merge`` writes the manifest once every part is done. The output is the same bytes
whichever ran the parts.

A rerun resumes (or reuses) ``--output`` only over the same input files: when a file was
added, removed or changed since the conversion began, it is refused naming the file;
``--overwrite`` deletes the earlier conversion and converts afresh.

Exit status: 0 on success, 2 for bad arguments or input (the reason on stderr), 130 when
interrupted (rerun the same command to resume). Results go to stdout, the progress bar to
stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import Any

import orjson

from streamds.redact import redact
from streamds.stages.parse import ON_ERROR
from streamds.units import human_bytes, size_argument

from .conversion_counts import Progress
from .convert import (
    DEFAULT_FRAME_SIZE,
    DEFAULT_READ_AHEAD,
    DEFAULT_READ_AHEAD_BYTES,
    DEFAULT_SHARD_SIZE,
    ConvertResult,
    convert,
    convert_part,
    merge_parts,
)
from .errors import ConversionError
from .writers import FORMATS

__all__ = ["build_parser", "main", "summary"]


def build_parser(prog: str = "python -m streamds.preprocess") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert JSONL files, trees of small .json files, tar shards, and Parquet "
        "and Arrow files into "
        "seekable .jsonl.zst (or webdataset .tar) shards with a manifest. Rerun the same "
        "command after an interruption to resume.",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="JSONL file (.jsonl/.txt, plain or .zst/.gz/.bz2/.xz), directory "
                        "or glob of .json files (any depth), tar shard, or Parquet (.parquet, "
                        ".pq) or Arrow IPC (.arrow) file")
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
                        help="record -> record or None, e.g. "
                        "streamds.preprocess.text:to_summarisation or "
                        "'streamds.preprocess.text:summarisation(max_words=512)'")
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
    parser.add_argument("--parts", type=int, default=None, metavar="N",
                        help="cut the input into N parts of similar size, each a task "
                        "(default: one per GiB of input); the output depends on it")
    parser.add_argument("--executor", default="local", type=_executor_argument,
                        metavar="local|process|process:N|dask://HOST:PORT",
                        help="where the parts run (default local: here, one after another); "
                        "the output does not depend on it")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--part", type=int, default=None, metavar="K",
                      help="convert part K only (0-based), e.g. one task of a job array")
    only.add_argument("--merge", action="store_true",
                      help="write the manifest of a conversion whose parts are all done")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete an earlier conversion in --output (its shards, journal and "
                        "manifest) and convert afresh, e.g. after the inputs changed")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return parser


def _executor_argument(text: str) -> str:
    """--executor: local, process, process:N or dask://HOST:PORT (checked, not yet made)."""
    kind, _, rest = text.partition(":")
    ok = (text == "local" or text == "process"
          or (kind == "process" and rest.isdigit() and int(rest) >= 1)
          or (text.startswith("dask://") and len(text) > len("dask://")))
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{redact(text)!r}: use local, process, process:N (N processes) or dask://HOST:PORT"
        )
    return text


@contextlib.contextmanager
def open_executor(spec: str) -> Iterator[Executor | None]:
    """The executor `--executor` names, shut down (or disconnected) on leaving."""
    if spec == "local":
        yield None
        return
    if spec.startswith("process"):
        count = int(spec.partition(":")[2] or 0) or len(os.sched_getaffinity(0))
        # spawn: a fresh interpreter per worker, whatever threads this process has
        with ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn")) as pool:
            yield pool
        return
    try:
        from distributed import Client
    except ImportError as err:
        raise ImportError(
            f"--executor {spec} needs Dask's distributed ({err}); install the 'cluster' "
            "extra: pip install 'streamds[cluster]' (in a clone: pip install -e '.[cluster]')"
        ) from err
    with Client("tcp://" + spec.removeprefix("dask://")) as client:
        yield client.get_executor()


def _json_object(text: str) -> dict[str, Any]:
    """--storage-options: a JSON object, or a usage error naming the value."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        # the value is not shown: it holds keys and secrets
        raise argparse.ArgumentTypeError(f"not JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object ({{...}}), got a JSON {type(value).__name__}"
        )
    return value


BAR_STEPS = 200  # redraws of the bar over a known total, at most: one per 0.5% read


class _Bar:
    """The progress bar: bytes read (with their rate and, with a known total, the time left)
    when every input size is known, else files. Made at the first report, which comes once
    the conversion has listed the inputs (listed once only).

    Redraws follow the work, not the clock: one per `BAR_STEPS`-th of the total (every report
    when there is no total; the converter reports every MiB or 1024 records), so a long
    conversion moves the bar steadily and a test sees every step without waiting.
    """

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, p: Progress) -> None:
        from tqdm import tqdm

        by_bytes = p.bytes_total is not None or p.files_total is None
        if self.bar is None:
            total = p.bytes_total if by_bytes else p.files_total
            self.bar = tqdm(total=total or None, unit="B" if by_bytes else " files",
                            unit_scale=by_bytes, desc="converting", file=sys.stderr,
                            dynamic_ncols=True, smoothing=0.1, mininterval=0,
                            miniters=max(1, (total or 0) // BAR_STEPS))
        done = p.resumed_bytes + p.stored_bytes if by_bytes else p.files
        self.bar.update(done - self.bar.n)
        if p.parts_total is not None:
            what = f"parts {p.parts:,}/{p.parts_total:,}"
        else:
            what = f"files {p.files:,}" + (f"/{p.files_total:,}" if p.files_total else "")
        self.bar.set_postfix_str(f"{what} records {p.records:,} shards {p.shards}",
                                 refresh=False)

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
    skipped = []
    if c.bad:
        more = c.bad - len(result.skipped)
        skipped = [f"  skipped  {c.bad:,} bad records (--on-error skip)"
                   + (", the first:" if result.skipped else "")]
        skipped += [f"    {place}" for place in result.skipped]
        if more > 0 and result.skipped:
            skipped.append(f"    ... and {more:,} more")
    return "\n".join([
        f"wrote {totals['shards']} {m.shard_format} shards to {result.output} "
        f"({result.shards_written} this run{reused})",
        f"  records  in {c.records_in:,}  out {c.records_out:,}  dropped {c.dropped:,}  "
        f"bad {c.bad:,}",
        f"  bytes    in {human_bytes(c.input_bytes)}  out {human_bytes(totals['bytes'])}  "
        f"(decoded {human_bytes(totals['decoded_bytes'])}, ratio {ratio:.2f}x)",
        f"  time     {result.seconds:.1f} s  ({speed:.1f} MB/s of stored input this run)",
        *skipped,
    ])


def main(argv: Sequence[str] | None = None, prog: str = "python -m streamds.preprocess") -> int:
    """The conversion command line; exit 0, or 2 with the reason on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["convert"]:
        argv = argv[1:]
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.overwrite and (args.merge or args.part is not None):
        parser.error("--overwrite deletes every part's shards, so it runs without --part and "
                     "--merge: run the whole conversion with --overwrite once, or delete "
                     f"{args.output} before the parts start")
    bar = _Bar() if not args.quiet and not args.merge else None  # a merge reads no input
    options: dict[str, Any] = dict(
        shard_size=args.shard_size, format=args.format, level=args.level,
        frame_size=args.frame_size, transform=args.transform, on_error=args.on_error,
        workers=args.workers, read_ahead=args.read_ahead,
        read_ahead_bytes=args.read_ahead_bytes, storage_options=args.storage_options,
        parts=args.parts,
    )
    try:
        if args.merge:
            result = merge_parts(args.inputs, args.output, **options)
        elif args.part is not None:
            result = convert_part(args.inputs, args.output, args.part, progress=bar, **options)
        else:
            with open_executor(args.executor) as executor:
                result = convert(args.inputs, args.output, executor=executor, progress=bar,
                                 overwrite=args.overwrite, **options)
    except (ConversionError, ValueError, FileNotFoundError, ImportError, OSError) as err:
        if bar is not None:
            bar.close()
        print(f"{prog}: error: {redact(str(err))}", file=sys.stderr)  # (a net: see redact)
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
