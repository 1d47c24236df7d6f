"""A conversion in parts: the plan, one task per part on any executor, then the merge.

::

    prepare                             # _plan.json made once (or loaded), checked
      -> PartTask per unfinished part   # the job (paths, options) and the part, never records
      -> executor.submit(run_part, ...) # in-process, a process pool, a Dask cluster, Ray, ...
           -> convert_directory         # part-0000K/: its own journal; its manifest.json last
      -> merge                          # manifest.json: every part's shards, in part order

The output, a function of the inputs and options only (the number of parts included)::

    out/_plan.json                          # the parts, as parts_plan.py cut them
    out/part-00000/shard-000000.jsonl.zst   # part 0's shards, journal (hidden), manifest.json
    out/part-00001/...
    out/manifest.json                       # names part-00000/shard-000000.jsonl.zst, ...

A part is finished when its folder holds its manifest, its journal says it ended, and its
shards are there with their sizes; a rerun (after a crash, a killed node, a pre-empted job)
skips finished parts and resumes the others from their journals. Readers of ``out/`` read
the shards in part order (natural order of their paths) and skip ``_plan.json`` and the
manifests.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import (
    FIRST_COMPLETED,
    Executor,
    Future,
    ProcessPoolExecutor,
    as_completed,
    wait,
)
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from queue import Empty
from typing import Any

from streamds.formats.manifest import MANIFEST_NAME, Manifest, read_manifest, write_manifest

from .counts import Counts, Progress
from .errors import ConversionError
from .identity import INPUTS_NAME, InputFiles, InputsWatch, check_part_files
from .job import (
    FILES_KEY,
    ConvertResult,
    Job,
    check_converted,
    convert_directory,
    job_fingerprint,
)
from .journal import JOURNAL_NAME, Journal
from .lock import LOCK_NAME
from .parts_plan import PLAN_NAME, Part, Plan, make_plan, read_plan, write_plan
from .recovery import is_temporary
from .run import SKIPPED_SHOWN
from .sources import Inputs, Leaf

__all__ = [
    "PARTS_FIX",
    "SENT_FILES",
    "PartTask",
    "finished_part",
    "merge",
    "prepare",
    "run_part",
    "run_plan",
]

SENT_FILES = 100_000  # a part of at most this many files gets their list with its task
PARTS_FIX = ("run the whole conversion again with --overwrite (without --part or --merge: it "
             "deletes the earlier shards), or delete {output} and run every part again")


@dataclass(frozen=True)
class PartTask:
    """What one task carries: the job, the output directory and its part of the plan."""

    job: Job
    output: str
    part: Part
    plan_fingerprint: dict[str, Any]
    files: tuple[Leaf, ...] | None = None  # the part's files, as the planner listed them
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex, compare=False, repr=False)

    def __dask_tokenize__(self) -> str:
        """Dask keys a submitted task by its arguments unless told it is impure: an earlier
        run's result (or failure) on the same client would stand in for this run's work,
        and hashing thousands of files costs seconds. Every task object is its own key."""
        return self.nonce

    @property
    def folder(self) -> Path:
        return Path(self.output) / self.part.folder

    @property
    def fingerprint(self) -> dict[str, Any]:
        """What the part's journal must match: the plan's inputs and options, and the part."""
        return {**self.plan_fingerprint, "part": self.part.to_json()}


def run_part(task: PartTask, source: Inputs | None = None,
             progress: Callable[[Progress], None] | None = None) -> ConvertResult:
    """Convert one part into its folder (or find it finished); the part's result.

    Picklable and self-contained: any executor can run it on any machine that sees the
    inputs and the output directory. `source`: the inputs already listed by the plan, and
    `progress`: reports while the part runs, when the part runs in the process that made it.
    """
    started = time.perf_counter()
    journal = finished_part(task)
    if journal is not None:
        manifest = read_manifest(task.folder)
        return ConvertResult(task.folder, manifest, len(manifest.shards), 0, 0,
                             time.perf_counter() - started, tuple(journal.skipped))
    job = task.job
    if source is None:
        source = job.source()
        source.exclude(task.output)  # the output may lie inside an input directory
        if task.files is not None:
            source.use_listing(task.files)
    check_part_files(Path(task.output), job.inputs, source.span_leaves(task.part.span),
                     fix=PARTS_FIX.format(output=task.output))
    task.folder.mkdir(exist_ok=True)
    return convert_directory(
        job, task.folder, source=source, apply=job.load_transform(),
        fingerprint=task.fingerprint, span=task.part.span, tar_prefix=f"{task.part.index:05d}-",
        progress=progress, watch=_watch(job, task.output),
    )


def _watch(job: Job, output: str | os.PathLike) -> InputsWatch | None:
    """The checks that the inputs do not change while they are converted, against the
    identity recorded when the plan was made (None: none is recorded)."""
    recorded = InputFiles.read(Path(output))
    if recorded is None:
        return None
    return InputsWatch(recorded, job.inputs, fix=PARTS_FIX.format(output=output),
                       threads=job.read_ahead)


def finished_part(task: PartTask) -> Journal | None:
    """The part's journal when the part is finished (see the module), else None.

    ConversionError when its folder holds another conversion's journal.
    """
    if not (task.folder / MANIFEST_NAME).is_file():
        return None
    journal = Journal(task.folder, task.fingerprint)
    if not journal.load() or not journal.complete:
        return None
    for item in journal.shards:
        try:
            if (task.folder / item["shard"]["name"]).stat().st_size != item["shard"]["bytes"]:
                return None
        except FileNotFoundError:
            return None
    return journal


def prepare(job: Job, out: Path, parts: int | None, source: Inputs,
            files: InputFiles) -> Plan | None:
    """The plan `out` is converted by (made and written, or read and checked), or None for a
    conversion in one part, which writes straight into `out` as it always did.

    `files` is the identity of the inputs (listed by `source`): its digest is part of the
    plan's fingerprint, and a new plan records it in `out` first. ConversionError when `out`
    holds a conversion made otherwise.
    """
    fingerprint = job_fingerprint(job, files)
    recorded = read_plan(out)
    if recorded is not None:
        return _checked(recorded, fingerprint, parts, out)
    if (out / JOURNAL_NAME).exists() or parts == 1:
        if parts not in (None, 1):
            raise ConversionError(
                f"{out} holds a conversion in one part; rerun it without --parts (or with "
                "--parts 1), or convert into an empty directory"
            )
        return None
    _check_unused(out, job.format)
    plan = make_plan(source, parts, fingerprint)
    if len(plan.parts) == 1:
        return None
    written = read_plan(out)  # a task started at the same time may have written it
    if written is None:
        files.write(out)  # before the plan: a plan always has its inputs' record
        write_plan(out, plan)
        return plan
    if written != plan:
        raise ConversionError(
            f"{out}: another task wrote a different plan of parts meanwhile; the inputs changed "
            "while they were planned: convert into an empty directory"
        )
    return written


def _checked(plan: Plan, fingerprint: dict[str, Any], parts: int | None, out: Path) -> Plan:
    theirs = plan.fingerprint
    options = {key: value for key, value in theirs["options"].items() if key != "parts"}
    if ({**theirs, "options": options} != fingerprint):
        diff = [f"{key}: {options.get(key)!r} -> {value!r}"
                for key, value in fingerprint["options"].items() if options.get(key) != value]
        if theirs["inputs"] != fingerprint["inputs"]:
            diff.append(f"inputs: {theirs['inputs']} -> {fingerprint['inputs']}")
        if theirs.get(FILES_KEY) != fingerprint[FILES_KEY]:
            diff.append("the input files (names, sizes or modification times)")
        raise ConversionError(
            f"{out} holds a conversion made with other inputs or options ({'; '.join(diff)}); "
            "rerun the same command to resume it, rerun with --overwrite to convert afresh "
            "(it deletes the earlier shards), or convert into an empty directory"
        )
    if parts is not None and parts != len(plan.parts):
        raise ConversionError(
            f"{out} holds a conversion in {len(plan.parts)} parts, not {parts}; pass --parts "
            f"{len(plan.parts)} (or leave it out) to resume it, or convert into an empty "
            "directory"
        )
    return plan


def _check_unused(out: Path, fmt: str) -> None:
    """`out` may hold only what tasks planning the same conversion at once leave there, and
    the temporary files of a run killed before its first shard."""
    leftovers = sorted(
        name for name in os.listdir(out)
        if not (name in (PLAN_NAME, INPUTS_NAME, LOCK_NAME) or name.startswith(f".{PLAN_NAME}.")
                or name.startswith("part-") or is_temporary(name, fmt))
    )
    if leftovers:
        shown = ", ".join(leftovers[:3]) + (", ..." if len(leftovers) > 3 else "")
        raise ConversionError(
            f"{out} is not empty ({shown}) and holds no conversion ({PLAN_NAME} or "
            f"{JOURNAL_NAME}); convert into an empty or new directory"
        )


def tasks_of(job: Job, out: Path, plan: Plan) -> list[PartTask]:
    return [PartTask(job, str(out), part, plan.fingerprint) for part in plan.parts]


def run_plan(job: Job, out: Path, plan: Plan, executor: Executor | None,
             progress: Callable[[Progress], None] | None = None,
             source: Inputs | None = None) -> ConvertResult:
    """Run every unfinished part of `plan` on `executor` (None: here, one after another,
    reading `source` if given), then merge. A failed part fails the conversion after the
    others have finished (ConversionError naming it); the finished parts are kept for the
    rerun. `progress` hears of every part as it reads, when the parts run here or in a
    process pool's workers, else (a Dask cluster) as each part finishes."""
    started = time.perf_counter()
    tasks = tasks_of(job, out, plan)
    pending = [task for task in tasks if finished_part(task) is None]
    waiting = {task.part.index for task in pending}
    report = _Reporter(plan, progress)
    for task in tasks:
        if task.part.index not in waiting:
            report.done[task.part.index] = run_part(task)
    report.show()
    failures: list[tuple[Part, BaseException]] = []
    for task, outcome in _outcomes(pending, executor, source, report):
        if isinstance(outcome, BaseException):
            failures.append((task.part, outcome))
            continue
        report.finished(task.part.index, outcome)
    if failures:
        part, err = min(failures, key=lambda failure: failure[0].index)
        raise ConversionError(
            f"{len(failures)} of {len(plan.parts)} parts failed; the first, {part.folder}: "
            f"{type(err).__name__}: {err}; the finished parts are kept: rerun the same command "
            "to redo only the unfinished ones"
        ) from err
    watch = _watch(job, out)
    if watch is not None and source is not None and source.listed:  # before the manifest
        watch.check_files(list(source.leaves()))
    manifest = merge(job, out, plan)
    results = [report.done[index] for index in sorted(report.done)]
    return ConvertResult(
        output=out,
        manifest=manifest,
        shards_reused=sum(result.shards_reused for result in results),
        shards_written=sum(result.shards_written for result in results),
        stored_bytes=sum(result.stored_bytes for result in results),
        seconds=time.perf_counter() - started,
        skipped=_first_skipped(result.skipped for result in results),
    )


def _first_skipped(lists: Iterable[Sequence[str]]) -> tuple[str, ...]:
    """The first `SKIPPED_SHOWN` places of skipped records, in part order."""
    return tuple(itertools.islice(itertools.chain.from_iterable(lists), SKIPPED_SHOWN))


def _outcomes(tasks: list[PartTask], executor: Executor | None, source: Inputs | None,
              report: _Reporter) -> Iterator[tuple[PartTask, ConvertResult | BaseException]]:
    """Each task with its result or (on an executor) its error, as they finish; tasks run
    here, or in a process pool, tell `report` how far they have read as they go."""
    if executor is None:
        for task in tasks:  # errors propagate as without parts
            yield task, run_part(task, source, report.moving(task.part.index))
        return
    if source is not None and source.listed:  # send each part its files, if not too many
        tasks = [_with_files(task, source) for task in tasks]
    with _ProgressChannel.for_executor(executor, report) as channel:
        futures = {
            executor.submit(run_part, task, None, channel and channel.sender(task.part.index)):
            task for task in tasks
        }
        finishing = as_completed(futures) if channel is None else channel.finishing(futures)
        for future in finishing:
            try:
                yield futures[future], future.result()
            except Exception as err:  # the task's error, a killed worker, a broken pool
                yield futures[future], err


class _Send:
    """What a part running in a worker reports with: ``[part, Progress fields]`` onto
    `queue` (a `multiprocessing` manager's, or a Dask cluster's, queue: both pickle with
    the task and reach the reporting process)."""

    def __init__(self, queue: Any, index: int) -> None:
        self.queue = queue
        self.index = index

    def __call__(self, p: Progress) -> None:
        self.queue.put([self.index, asdict(p)])  # plain values: Dask's queue takes msgpack


class _ProgressChannel:
    """Progress from parts that run in other processes, to the reporting process.

    Each worker puts its reports on a queue: a `multiprocessing` manager's for a process
    pool, the scheduler's (`distributed.Queue`) for a Dask cluster. While it waits for the
    parts, the reporting process takes them off every `WAIT` seconds, and always before it
    handles a finished part (a part's reports are all queued before its result returns), so
    the display moves with the bytes each part reads. Any other executor reports as each
    part finishes.
    """

    WAIT = 0.2  # seconds between looks at the queue while no part finishes

    def __init__(self, queue: Any, take: Callable[[], list[Any]], report: _Reporter) -> None:
        self.queue = queue
        self.take = take  # every report queued so far, without waiting
        self.report = report

    @classmethod
    @contextlib.contextmanager
    def for_executor(cls, executor: Executor, report: _Reporter
                     ) -> Iterator[_ProgressChannel | None]:
        if report.progress is None:
            yield None
        elif isinstance(executor, ProcessPoolExecutor):
            # the pool's own way of starting processes: a spawning pool's caller already
            # guards its main module, and a forking one may not
            context = getattr(executor, "_mp_context", None) or multiprocessing.get_context()
            with context.Manager() as manager:
                queue = manager.Queue()
                yield cls(queue, lambda: _queued(queue), report)
        elif (client := _dask_client(executor)) is not None:
            try:
                from distributed import Queue
            except ImportError as err:  # a Dask executor comes with Dask: cannot happen
                raise ImportError(f"{err}; install the 'cluster' extra: pip install "
                                  "'streamds[cluster]'") from err
            queue = Queue(client=client)
            try:
                yield cls(queue, lambda: queue.get(batch=True), report)
            finally:
                queue.close()
        else:
            yield None

    def sender(self, index: int) -> _Send:
        return _Send(self.queue, index)

    def finishing(self, futures: Iterable[Future[Any]]) -> Iterator[Future[Any]]:
        """`futures` as they finish, the reports of the running parts shown meanwhile."""
        waiting = set(futures)
        while waiting:
            done, waiting = wait(waiting, timeout=self.WAIT, return_when=FIRST_COMPLETED)
            self.drain()
            yield from done

    def drain(self) -> None:
        for index, values in self.take():
            self.report.moved(index, Progress(**values))


def _queued(queue: Any) -> list[Any]:
    """Everything on a `multiprocessing` queue now, without waiting."""
    items = []
    while True:
        try:
            items.append(queue.get_nowait())
        except Empty:
            return items


def _dask_client(executor: Executor) -> Any:
    """The Dask client behind `Client.get_executor()`'s executor, else None."""
    if type(executor).__module__.partition(".")[0] != "distributed":
        return None
    return getattr(executor, "_client", None)


def _with_files(task: PartTask, source: Inputs) -> PartTask:
    files = source.span_leaves(task.part.span)
    return replace(task, files=tuple(files)) if len(files) <= SENT_FILES else task


class _Reporter:
    """Progress of a conversion in parts: the finished parts (their planned bytes, records
    and shards) plus what each running part has read so far."""

    def __init__(self, plan: Plan, progress: Callable[[Progress], None] | None) -> None:
        self.plan = plan
        self.progress = progress
        self.done: dict[int, ConvertResult] = {}
        self.running: dict[int, Progress] = {}

    def finished(self, index: int, result: ConvertResult) -> None:
        self.done[index] = result
        self.running.pop(index, None)
        self.show()

    def moved(self, index: int, p: Progress) -> None:
        if index not in self.done:  # a late report of a finished part changes nothing
            self.running[index] = p
            self.show()

    def moving(self, index: int) -> Callable[[Progress], None] | None:
        """The progress callback of part `index`, run here (None: nobody listens)."""
        if self.progress is None:
            return None
        return lambda p: self.moved(index, p)

    def show(self) -> None:
        if self.progress is None:
            return
        results = list(self.done.values())
        finished = {Path(result.output).name for result in results}
        running = list(self.running.values())
        self.progress(Progress(
            files=0,
            records=sum(result.counts.records_in for result in results)
            + sum(p.records for p in running),
            stored_bytes=sum(part.bytes for part in self.plan.parts if part.folder in finished)
            + sum(p.stored_bytes for p in running),
            resumed_bytes=sum(p.resumed_bytes for p in running),
            shards=sum(len(result.manifest.shards) for result in results)
            + sum(p.shards for p in running),
            bytes_total=self.plan.bytes,
            parts=len(results),
            parts_total=len(self.plan.parts),
        ))


def merge(job: Job, out: Path, plan: Plan) -> Manifest:
    """Write ``out/manifest.json`` from the parts' manifests, in part order; ConversionError
    naming the parts that are not finished."""
    tasks = tasks_of(job, out, plan)
    unfinished = [task.part.folder for task in tasks if finished_part(task) is None]
    if unfinished:
        shown = ", ".join(unfinished[:5]) + (", ..." if len(unfinished) > 5 else "")
        raise ConversionError(
            f"{out}: {len(unfinished)} of {len(tasks)} parts are not finished ({shown}); run "
            "them (--part K, or the whole conversion again) before --merge"
        )
    shards = []
    counts = Counts()
    skipped = []
    for task in tasks:
        skipped.append(Journal.read_skipped(task.folder))
        manifest = read_manifest(task.folder)
        shards += [replace(entry, name=f"{task.part.folder}/{entry.name}")
                   for entry in manifest.shards]
        for name in (each.name for each in fields(Counts)):
            setattr(counts, name, getattr(counts, name) + manifest.counts[name])
    check_converted(job, counts, list(_first_skipped(skipped)))
    manifest = Manifest(
        shard_format=job.format,
        shards=tuple(shards),
        counts=asdict(counts),
        options=plan.fingerprint["options"],
        inputs=job.recorded_inputs,
    )
    write_manifest(out, manifest)
    return manifest
