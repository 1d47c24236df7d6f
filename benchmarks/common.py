"""Shared benchmark helpers: the machine, generated corpora, timing, and docs sections.

Corpora are generated once under `bench-data/` (git-ignored) and reused while their file
names match: a name carries the corpus kind, its target size and the seed, so changing
`--scale` makes new files instead of mixing old ones. Every file is written under a
temporary name and renamed when complete, so an interrupted run never leaves a partial
corpus that a later run would trust.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "bench-data"
# the docs page the benchmarks write their tables into, between <!-- bench:NAME:start/end -->
# markers (--write-docs); figures of the current code only, never a commit id or history
PERFORMANCE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results"  # git-ignored: every run's figures

# the checkout whose streamds a benchmark imports: this one (`python benchmarks/x.py` from
# anywhere), or in a child that `child_result` started for another checkout, that one (this
# file is imported in the child too, and inserting ROOT would import this checkout's instead)
TREE = Path(os.environ.get("STREAMDS_BENCH_TREE", ROOT))
if str(TREE) not in sys.path:
    sys.path.insert(0, str(TREE))

__all__ = [
    "DATA_DIR",
    "MB",
    "PERFORMANCE",
    "RESULTS",
    "ROOT",
    "Corpus",
    "add_write_docs",
    "child_result",
    "command_line",
    "machine",
    "publish",
    "pubmed_corpus",
    "replace_section",
    "small_lines_corpus",
]

MB = 1e6
_READ = 8 << 20  # bytes per read when copying or scanning files


# -- the machine ---------------------------------------------------------------------------


def machine() -> str:
    """One line naming the CPU, the cores this process may use, memory and Python."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor() or model
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = ""
    try:
        import psutil

        memory = f", {psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
    except ImportError:
        pass
    return (
        f"{model}, {cores} cores{memory}, Linux {platform.release().split('-')[0]}, "
        f"Python {platform.python_version()}"
    )


def add_write_docs(parser: Any, section: str) -> None:
    """`--write-docs` (alias: the older `--write-readme`): put the table into `section` of
    docs/performance.md."""
    parser.add_argument("--write-docs", "--write-readme", dest="write_docs", action="store_true",
                        help=f"replace the bench:{section} section of docs/performance.md")


def command_line() -> str:
    """How this process was started, as a shell command relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script_text = str(script.relative_to(ROOT))
    except ValueError:
        script_text = str(script)
    return shlex.join(["python", script_text, *sys.argv[1:]])


# -- corpora -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """One generated corpus in every layout the benchmarks read."""

    name: str
    plain: Path  # the JSONL file
    zst: Path  # the same lines as a seekable .jsonl.zst (frames of whole lines), manifest beside
    tar_dir: Path  # the same records as webdataset tar shards, one .json member each
    records: int
    decoded_bytes: int

    @property
    def tars(self) -> list[Path]:
        return sorted(self.tar_dir.glob("*.tar"))


@contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """A temporary path that becomes `path` when the block exits cleanly."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            for child in tmp.iterdir():
                child.unlink()
            tmp.rmdir()
        elif tmp.exists():
            tmp.unlink()


def _lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb", buffering=_READ) as f:
        yield from f


def _write_seekable(plain: Path, out: Path, *, level: int, frame_size: int) -> None:
    """`out`: the lines of `plain` as seekable zstd, with the manifest.json that
    `streamds convert` would write beside it (records per frame: frames end lines)."""
    from streamds.formats.manifest import Manifest, ShardEntry, file_checksum, write_manifest
    from streamds.formats.seekable import SeekableWriter

    out.parent.mkdir(parents=True, exist_ok=True)
    with _atomic(out) as tmp:
        with open(tmp, "wb") as f:
            writer = SeekableWriter(f, level=level, frame_size=frame_size)
            writer.write_lines(_lines(plain))
            stats = writer.close()
        entry = ShardEntry(
            name=out.name,
            bytes=tmp.stat().st_size,
            decoded_bytes=sum(s.decompressed_size for s in stats),
            records=sum(s.records for s in stats),
            checksum=file_checksum(tmp),
            records_per_frame=tuple(s.records for s in stats),
            frame_sizes=tuple((s.compressed_size, s.decompressed_size) for s in stats),
        )
        options = {"level": level, "frame_size": frame_size}
        write_manifest(out.parent, Manifest("jsonl.zst", (entry,), options=options))


def _write_tars(plain: Path, out_dir: Path, *, shards: int, records: int) -> None:
    """`shards` tar files of `{key}.json` members, records split evenly, in corpus order."""
    import io

    per_shard = -(-records // shards)
    with _atomic(out_dir) as tmp:
        tmp.mkdir()
        lines = _lines(plain)
        for shard in range(shards):
            name = tmp / f"shard-{shard:06d}.tar"
            with tarfile.open(name, "w", format=tarfile.USTAR_FORMAT) as tar:
                for index in range(shard * per_shard, min(records, (shard + 1) * per_shard)):
                    line = next(lines).rstrip(b"\n")
                    info = tarfile.TarInfo(f"{index:09d}.json")
                    info.size = len(line)
                    info.mtime = 0
                    tar.addfile(info, io.BytesIO(line))


def _scan(plain: Path) -> tuple[int, int]:
    """(lines, bytes) of a file."""
    lines = size = 0
    with open(plain, "rb", buffering=0) as f:
        while data := f.read(_READ):
            lines += data.count(b"\n")
            size += len(data)
    return lines, size


def _build(
    name: str,
    write_plain: Callable[[Path], object],
    *,
    level: int,
    frame_size: int,
    tar_shards: int,
    log: Callable[[str], None],
) -> Corpus:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    plain = DATA_DIR / f"{name}.jsonl"
    zst = DATA_DIR / f"{name}.seekable-l{level}" / "shard-000000.jsonl.zst"
    tar_dir = DATA_DIR / f"{name}.wds-{tar_shards}"
    meta_path = DATA_DIR / f"{name}.meta.json"
    if not plain.exists():
        log(f"generating {plain.name}")
        start = time.perf_counter()
        with _atomic(plain) as tmp:
            write_plain(tmp)
        log(f"  done in {time.perf_counter() - start:.0f}s")
        meta_path.unlink(missing_ok=True)
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
    else:
        records, size = _scan(plain)
        meta = {"records": records, "decoded_bytes": size}
        meta_path.write_text(json.dumps(meta))
    if not zst.exists():
        log(f"compressing {zst.parent.name}/{zst.name} (seekable zstd, level {level}, manifest)")
        start = time.perf_counter()
        _write_seekable(plain, zst, level=level, frame_size=frame_size)
        log(f"  done in {time.perf_counter() - start:.0f}s")
    if not tar_dir.exists():
        log(f"writing {tar_dir.name}/ ({tar_shards} webdataset tar shards)")
        start = time.perf_counter()
        _write_tars(plain, tar_dir, shards=tar_shards, records=meta["records"])
        log(f"  done in {time.perf_counter() - start:.0f}s")
    return Corpus(name, plain, zst, tar_dir, meta["records"], meta["decoded_bytes"])


def pubmed_corpus(
    target_bytes: int, *, seed: int = 0, record_chars: int = 10_000, tar_shards: int = 8,
    log: Callable[[str], None] = print,
) -> Corpus:
    """PubMed-layout records (~2.1 x `record_chars` bytes a line) totalling `target_bytes`."""
    from streamds.tools.synthetic import write_pubmed

    def write(path: Path) -> None:
        write_pubmed(path, target_bytes=target_bytes, seed=seed, record_chars=record_chars)

    name = f"pubmed-{_size_name(target_bytes)}-c{record_chars}-s{seed}"
    return _build(name, write, level=3, frame_size=4 << 20, tar_shards=tar_shards, log=log)


def small_lines_corpus(
    target_bytes: int, *, seed: int = 0, line_bytes: int = 300, tar_shards: int = 8,
    log: Callable[[str], None] = print,
) -> Corpus:
    """`{"id", "text", "label"}` lines of about `line_bytes` bytes totalling `target_bytes`."""
    from streamds.tools.synthetic import write_small_lines

    def write(path: Path) -> None:
        write_small_lines(path, target_bytes=target_bytes, seed=seed, line_bytes=line_bytes)

    name = f"small-{_size_name(target_bytes)}-l{line_bytes}-s{seed}"
    return _build(name, write, level=3, frame_size=4 << 20, tar_shards=tar_shards, log=log)


def _size_name(size: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


# -- docs ------------------------------------------------------------------------------------


def copies_folder(source: Path, folder: Path, copies: int, suffix: str) -> Path:
    """`folder`, holding `copies` copies of the file `source` named copy-NN`suffix` (made
    once; copies, not links: the same file under two names is read once)."""
    if not folder.is_dir():
        part = folder.with_name(folder.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir()
        for copy in range(copies):
            shutil.copyfile(source, part / f"copy-{copy:02d}{suffix}")
        part.rename(folder)
    return folder


def replace_section(path: Path, section: str, body: str) -> None:
    """Replace the text between `<!-- bench:{section}:start -->` and its `end` marker.

    Raises ValueError naming the missing marker when the file lacks either one.
    """
    text = path.read_text()
    start, end = f"<!-- bench:{section}:start -->", f"<!-- bench:{section}:end -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"{path}: no {start} ... {end} markers; add them where the table goes")
    path.write_text(pattern.sub(lambda _: f"{start}\n{body.strip()}\n{end}", text, count=1))


def child_result(args: list[str], spec: Any, *, what: str, tree: Path | None = None) -> Any:
    """Run ``python *args <spec as JSON>`` in a fresh process from the repository root (with
    `tree` first on its path: another checkout's streamds) and return the JSON it prints last;
    RuntimeError naming `what`, with the end of its stderr, when it fails."""
    # bytecode caches on, as an installed package has them (this sandbox turns them off, and
    # compiling streamds anew would count in every child's first batch)
    env = {key: value for key, value in os.environ.items()
           if key != "PYTHONDONTWRITEBYTECODE"}
    if tree is not None:  # (a `-c` child imports the working directory's first: use a file)
        env["PYTHONPATH"] = env["STREAMDS_BENCH_TREE"] = str(tree)
    done = subprocess.run([sys.executable, *args, json.dumps(spec)], capture_output=True,
                          text=True, cwd=ROOT, env=env)
    if done.returncode:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def publish(name: str, body: str, runs: Any, docs_section: str | None = None) -> None:
    """Print a benchmark's `body` (its table and notes), keep it and every run (`runs`, as
    JSON) in benchmarks/results/<name>.md / .json, and with `docs_section` put `body` into
    that section of docs/performance.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(body + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(runs, indent=1))
    print(body)
    if docs_section is not None:
        replace_section(PERFORMANCE, docs_section, body)


# -- CPU accounting, for telling a quiet machine from a busy one ----------------------------

_HZ = os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds all processes have used since boot (from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / _HZ


def own_cpu() -> float:
    """CPU seconds of this process and its reaped children (DataLoader workers, zstd)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
