"""Transform: the user's map and filter steps, applied in the workers (in-stream preprocessing).

Steps compose into one function per record, run over a whole chunk in one comprehension. A
map returning None, or a filter returning a false value, turns the record into `DROPPED`,
which is counted here. For exact resume, steps must be deterministic functions of the record.

Where a reader shuffles, the steps run on records as they leave the shuffle buffer instead
(`AfterBuffer`, one record at a time), so that filling the buffer, and re-filling it on a
resume, costs a read and a parse per record, not a map (`streamds.stages.pipeline` says
where each runs).

With `ds.cache` (`streamds.stages.record_cache`), the stage that runs the steps also resolves the
placeholders of stored blocks into their stored records (the steps before the cache are not
run for them) and hands what the steps before the cache made of the other records to the
store; the steps after the cache run on both.

A step that raises keeps its exception type; the exception gains a note naming the file, the
1-based line, the stage and the step (``err.add_note``; before Python 3.11 an exception of
the same type, chained, where one can be built from a message). Finding the record costs
nothing until a step raises: the chunk's iterator says how far it got.

A batched map (`BatchedMap`, `ds.map(fn, batch_size=n)`) takes a list of
records and returns a list of the same length (None drops a record), so that a fast
tokenizer's `encode_batch` runs once per batch. Before the buffer it runs on the records of
one chunk at a time, in slices of at most `batch_size` (a batch never spans two chunks), so
the stage's state stays that of a per-record step: a chunk is handed on whole or not at all.
A reader with a batched step runs all its steps before the shuffle buffer
(`streamds.stages.pipeline.steps_after_buffer`): after the buffer, records leave one at a
time and a look-ahead batch would hold records no state can name. Where records come one at a
time (`apply_steps`, `AfterBuffer`), a batched step runs on batches of one.

Steps travel to DataLoader workers by pickling under the "spawn" and "forkserver" start
methods; a `Step` holding a lambda or a nested function refuses to pickle with a message that
names it and the fix (`unpicklable_step` says the same of any list of steps).
"""

from __future__ import annotations

import functools
import logging
import pickle
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import StateMismatchError
from ..storage.record_codec import UncacheableRecordError
from .chunks import COUNTS, SOURCE, STAGE, Below, Chunk, HandedOut, Rest, Stored, checked
from .forks import quiet_tokenizers_forks
from .parse import DROPPED, LineNumbers, Marker

if TYPE_CHECKING:
    from .record_cache import BlockCache

__all__ = [
    "AfterBuffer",
    "BatchLengthError",
    "BatchedMap",
    "Composed",
    "Step",
    "Transform",
    "apply_steps",
    "batch_size_of",
    "compose",
    "describe_step",
    "has_batched",
    "step_settings",
    "transform_items",
    "unpicklable_step",
]

log = logging.getLogger(__name__)

quiet_tokenizers_forks()  # forked workers that run a tokenizer print no fork warning

HAS_NOTES = sys.version_info >= (3, 11)  # BaseException.add_note


class Composed:
    """`steps` applied in order to one record; counts the records it drops in `dropped`
    (so a chunk's cleanliness is known without comparing items to a marker) and remembers
    the step that raised in `failed`."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = tuple(steps)
        self.dropped = 0
        self.failed: Step | None = None
        # (kind, fn, batch size or None) per step, unpacked once here rather than per record
        self._plan = tuple((step[0], step[1], batch_size_of(step)) for step in self.steps)
        self.batched = any(batched for *_, batched in self._plan)

    def __call__(self, record: Any) -> Any:
        try:  # free until something raises (and one setup opcode before Python 3.11)
            for kind, fn, batched in self._plan:
                if batched:  # a batched map, here on a batch of one
                    record = one_of(fn([record]), 1, (kind, fn))[0]
                    if record is None:
                        self.dropped += 1
                        return DROPPED
                elif kind == "map":
                    record = fn(record)
                    if record is None:
                        self.dropped += 1
                        return DROPPED
                elif not fn(record):
                    self.dropped += 1
                    return DROPPED
            return record
        except Exception:
            self.failed = next(s for s in self.steps if s[0] == kind and s[1] is fn)
            raise

    def over_chunk(self, items: list[Any]) -> list[Any]:
        """`items` (a chunk's records and markers) through the steps, step by step: a
        per-record step on each record, a batched map on the live records in slices of its
        batch size. Raises `StepFailed` saying the failing record's index (a batch's first)."""
        for step, (_, fn, batched) in zip(self.steps, self._plan, strict=True):
            live = [i for i, item in enumerate(items) if item.__class__ is not Marker]
            if not batched:
                one = Composed((step,))
                at = 0
                try:
                    for at in live:
                        items[at] = one(items[at])
                except Exception as err:
                    self.failed = step
                    raise StepFailed(at, 1) from err
                finally:
                    self.dropped += one.dropped
                continue
            for start in range(0, len(live), batched):
                where = live[start:start + batched]
                try:
                    out = one_of(fn([items[i] for i in where]), len(where), step)
                except Exception as err:
                    self.failed = step
                    raise StepFailed(where[0], len(where)) from err
                for i, record in zip(where, out, strict=True):
                    if record is None:
                        self.dropped += 1
                        items[i] = DROPPED
                    else:
                        items[i] = record
        return items


class StepFailed(Exception):
    """Internal: a step raised (the cause) on the record at `index` of a chunk, or on the
    batch of `size` records starting there."""

    def __init__(self, index: int, size: int) -> None:
        super().__init__(index, size)
        self.index = index
        self.size = size


def compose(steps: Sequence[Step]) -> Composed | None:
    """One function applying `steps` in order, or None when there are none."""
    return Composed(steps) if steps else None


def batch_size_of(step: Sequence[Any]) -> int | None:
    """A batched map's records per call; None for a per-record step (a plain 2-tuple too)."""
    return step[2] if len(step) > 2 and step[2] else None


def has_batched(steps: Sequence[Step]) -> bool:
    """Whether any of `steps` is a batched map."""
    return any(batch_size_of(step) for step in steps)


class BatchLengthError(ValueError):
    """A batched map returned something other than a list of one result per record."""


def one_of(out: Any, expected: int, step: Step) -> Sequence[Any]:
    """`out`, the result of batched map `step` on `expected` records, checked to be a list
    of `expected` results (a dict, such as a tokenizer's `BatchEncoding`, is refused)."""
    if isinstance(out, (dict, str, bytes)) or not hasattr(out, "__len__") \
            or not hasattr(out, "__getitem__"):
        raise BatchLengthError(
            f"the batched map {_name(step[1])} returned a {type(out).__name__}, not a list "
            f"of {expected} records; return one result per record, in order (for a "
            "tokenizer's output: [dict(zip(enc, values)) for values in zip(*enc.values())])")
    if len(out) != expected:
        raise BatchLengthError(
            f"the batched map {_name(step[1])} returned {len(out)} results for {expected} "
            "records; it must return one per record, in order (None drops a record)")
    return out


def transform_items(apply: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    """`items` with `apply` run on every record; markers pass through untouched."""
    return [item if item.__class__ is Marker else apply(item) for item in items]


def _name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_name(fn.func)})"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


def step_settings(fn: Any) -> str | None:
    """What tells `fn` apart from another step of its name, for `ds.cache` keys: "" for a
    function (its name says it all), a partial's arguments or a callable object's own repr
    where those reprs are stable; None where nothing stable can be said (an object with the
    default repr, an argument whose repr holds its address)."""
    if isinstance(fn, functools.partial):
        inner = step_settings(fn.func)
        if inner is None:
            return None
        said = ", ".join([*map(repr, fn.args), *(f"{k}={v!r}" for k, v in fn.keywords.items())])
        return None if " at 0x" in said else f"{inner}({said})"
    if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return ""
    if type(fn).__repr__ is object.__repr__:
        return None
    said = repr(fn)
    return None if " at 0x" in said else said


def describe_step(steps: Sequence[Step], step: Step) -> str:
    """``"map step 2 of 3 (mymodule.tokenize)"``."""
    kind, fn = step[0], step[1]
    number = next((i for i, s in enumerate(steps, 1) if s[0] == kind and s[1] is fn), 0)
    batched = " batched" if batch_size_of(step) else ""
    return f"{kind}{batched} step {number} of {len(steps)} ({_name(fn)})"


def _unpicklable(fn: Any) -> str | None:
    """What `fn` is when pickle cannot send it by name: "a lambda", "a function defined
    inside a function" (None: nothing known against it). Looks at names only, so it costs
    nothing; a step that fails for another reason still fails in pickle, with its message."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", "")
    if not isinstance(name, str):
        return None
    if "<lambda>" in name:
        return "a lambda"
    if "<locals>" in name:
        return "a function defined inside a function"
    return None


def _refusal(step: str, what: str) -> str:
    return (
        f"{step} is {what}, which pickle cannot send to DataLoader workers started by "
        "'spawn' or 'forkserver' (the default on macOS and Windows, and on Linux from Python "
        "3.14); define it with `def` at the top level of a module and pass that function "
        "(functools.partial of it for arguments)"
    )


def unpicklable_step(steps: Sequence[Step]) -> str | None:
    """Why `steps` cannot travel to a worker started by "spawn" or "forkserver" (a lambda or
    a function defined inside another function), naming the step and the fix; None when
    nothing is known to stop them."""
    for step in steps:
        what = _unpicklable(step[1])
        if what is not None:
            return _refusal(describe_step(steps, step), what)
    return None


def _reduce(step: Any, rebuild: tuple[Any, ...]) -> tuple[Any, ...]:
    """`step`'s pickle recipe, or `pickle.PicklingError` naming it and the fix."""
    what = _unpicklable(step.fn)
    if what is not None:
        raise pickle.PicklingError(_refusal(f"the {step.kind} step {_name(step.fn)}", what))
    return (type(step), rebuild)


class Step(NamedTuple):
    """One step: ``Step("map", fn)`` or ``Step("filter", predicate)`` (a plain 2-tuple works
    alike). Pickling one whose function is a lambda or a nested function raises
    `pickle.PicklingError` naming the step and the fix, instead of pickle's "attribute lookup
    <lambda> on __main__ failed"; copies share the function."""

    kind: str
    fn: Callable[[Any], Any]

    def __reduce__(self) -> tuple[Any, ...]:
        return _reduce(self, (self.kind, self.fn))

    def __copy__(self) -> Step:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Step:
        return self


class BatchedMap(NamedTuple):
    """A batched map step, ``BatchedMap("map", fn, n)`` (`ds.map(fn, batch_size=n)`): `fn`
    takes a list of at most `n` records and returns a list of as many results (None drops a
    record). Pickles and copies as `Step` does."""

    kind: str
    fn: Callable[[list[Any]], list[Any]]
    batch_size: int

    def __reduce__(self) -> tuple[Any, ...]:
        return _reduce(self, (self.kind, self.fn, self.batch_size))

    def __copy__(self) -> BatchedMap:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> BatchedMap:
        return self


def _annotated(err: Exception, note: str) -> Exception | None:
    """`err` with `note` added (returns None: re-raise `err` itself), or, before Python 3.11,
    an exception of the same type saying both, to raise from `err` (None where the type
    cannot be built from one message: `err` is raised unchanged and the note logged)."""
    if HAS_NOTES:
        err.add_note(note)
        return None
    try:
        wrapped = type(err)(f"{err}; {note}")
    except Exception:
        wrapped = None
    if wrapped is None or type(wrapped) is not type(err):
        log.error("%s: %s", type(err).__name__, note)
        return None
    return wrapped


def apply_steps(records: Iterable[Any], steps: Sequence[Step], where: str) -> Iterator[Any]:
    """`records` through `steps` one at a time, the dropped ones left out: the map and filter
    of a dataset built on other datasets (`streamds.Mix`, packed data), which knows no file or
    line of its records. A step that raises keeps its type and gains a note naming `where`,
    the step and how to have the file and line named."""
    apply = Composed(steps)
    for record in records:
        try:
            out = apply(record)
        except Exception as err:
            step = describe_step(steps, apply.failed) if apply.failed else "a step"
            note = (f"streamds: raised by {step} of {where}; map or filter the source datasets "
                    "instead to have the file and line of the record named")
            replacement = _annotated(err, note)
            if replacement is None:
                raise
            raise replacement from err
        if out is not DROPPED:
            yield out


class Transform:
    """Stage: chunks of records -> chunks of transformed records (DROPPED where removed).

    State: ``{"stage": "transform", "source": ..., "counts": {"dropped": n}}``. `where`
    names the file and line of
    a record whose step raised (without it, the block and byte offset).
    """

    STAGE = "transform"
    SOURCE = SOURCE
    COUNTS = COUNTS

    def __init__(
        self, source: Any, steps: Sequence[Step], *, where: LineNumbers | None = None,
        cache: BlockCache | None = None, cached_steps: int = 0,
    ) -> None:
        self.source = source
        self.steps = tuple(steps)
        self.apply = compose(steps)
        self.where = where
        # `ds.cache`: the first `cached_steps` steps make what the cache stores; the rest run
        # on the records, computed or stored
        self.cache = cache
        self.before_cache = compose(self.steps[:cached_steps])
        self.after_cache = compose(self.steps[cached_steps:])
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        if state is not None:
            checked(state, self.STAGE)
        self.source.reset(None if state is None else state[self.SOURCE])
        self._dropped = 0 if state is None else state[self.COUNTS]["dropped"]

    def get_state(self) -> dict[str, Any]:
        return {STAGE: self.STAGE, self.SOURCE: self.source.get_state(),
                self.COUNTS: {"dropped": self._dropped}}

    @property
    def counts(self) -> dict[str, int]:
        return {**self.source.counts, "dropped": self._dropped}

    def transform(self, chunk: Chunk) -> Chunk:
        """`chunk` with the steps applied (also used to re-read buffered records)."""
        return self.run(chunk, self.apply)

    def run(self, chunk: Chunk, apply: Composed | None) -> Chunk:
        """`chunk` with `apply` (some of the steps, `compose`) applied."""
        if apply is None:
            return chunk
        before = apply.dropped
        if apply.batched:
            return self._run_batched(chunk, apply, before)
        records: Iterator[Any] = iter(chunk.items)
        try:
            if chunk.clean:  # every item a record: no marker checks per item
                items = [apply(item) for item in records]
            else:
                items = transform_items(apply, records)
        except Exception as err:
            # the iterator stands just past the record whose step raised
            index = len(chunk.items) - records.__length_hint__() - 1  # type: ignore[attr-defined]
            wrapped = _annotated(err, self._note(chunk, index, apply.failed))
            if wrapped is None:
                raise
            raise wrapped from err
        clean = chunk.clean and apply.dropped == before
        return Chunk(chunk.work_index, chunk.block, chunk.offsets, items, clean, chunk.labels)

    def _run_batched(self, chunk: Chunk, apply: Composed, before: int) -> Chunk:
        """`run` where a step is a batched map: the chunk's records step by step."""
        try:
            items = apply.over_chunk(list(chunk.items))
        except StepFailed as failed:
            err = failed.__cause__
            assert isinstance(err, Exception)
            wrapped = _annotated(err, self._note(chunk, failed.index, apply.failed, failed.size))
            if wrapped is None:
                raise err from None
            raise wrapped from err
        clean = chunk.clean and apply.dropped == before
        return Chunk(chunk.work_index, chunk.block, chunk.offsets, items, clean, chunk.labels)

    def _note(self, chunk: Chunk, index: int, step: Step | None, size: int = 1) -> str:
        which = "a step" if step is None else describe_step(self.steps, step)
        offset = chunk.offsets[index]
        if self.where is None:
            place = f"block {chunk.block}, byte offset {offset}"
        else:
            place = f"{self.where.url(chunk.block)}: {self.where.describe(chunk, index)[1]}"
        what = "the record" if size == 1 else f"the batch of {size} records starting"
        return f"streamds: raised in the transform stage, {which}, on {what} at {place}"

    def _cached(self, cache: BlockCache) -> Iterator[Chunk]:
        """`__iter__` with `ds.cache`: stored blocks' records come from the store, the
        others are computed and handed to it."""
        for chunk in self.source:
            if chunk.stored:
                if cache.late:  # the steps run after the buffer: placeholders go on
                    yield chunk
                    continue
                items = [item if item.__class__ is Marker else cache.resolve(item)
                         for item in chunk.items]
                clean = not any(item.__class__ is Marker for item in items)
                out = Chunk(chunk.work_index, chunk.block, chunk.offsets, items, clean)
                out = self.run(out, self.after_cache)
            else:
                out = self.run(chunk, self.before_cache)
                cache.seen(out)
                out = self.run(out, self.after_cache)
            if not out.clean:
                self._dropped += sum(1 for item in out.items if item is DROPPED)
            yield out

    def __iter__(self) -> Iterator[Chunk]:
        if self.cache is not None:
            yield from self._cached(self.cache)
            return
        apply = self.apply
        for chunk in self.source:
            before = 0 if apply is None else apply.dropped
            out = self.transform(chunk)
            if apply is not None:
                self._dropped += apply.dropped - before
            yield out


class AfterBuffer:
    """Stage: records (as the shuffle buffer hands them out) -> the user's records after map
    and filter, one at a time; dropped ones are left out and counted.

    The source hands out records and, with its `tell` on, the position of the last one
    (`Shuffle.last_position`), which `where` turns into a file and line when a step raises.
    `batches(size)` gathers lists of `size` records that passed the steps (the last may be
    short). Without steps it passes the source's records and lists on at the source's speed.
    `on_end` is called once when the source's last record has gone through.

    State: ``{"stage": "after_buffer", "source": <the source's state>, "counts":
    {"dropped": n}}``. The source's state counts every record it handed out, those the steps
    dropped included, so a resume replays it without running a step.
    """

    STAGE = "after_buffer"
    SOURCE = SOURCE
    COUNTS = COUNTS

    def __init__(
        self, source: Any, steps: Sequence[Step], *, where: LineNumbers | None = None,
        on_end: Callable[[], None] | None = None, cache: BlockCache | None = None,
        cached_steps: int = 0,
    ) -> None:
        self.source = source
        self.steps = tuple(steps)
        self.apply = Composed(steps)
        self.where = where
        self.on_end = on_end
        # `ds.cache`: the first `cached_steps` steps make what the cache stores (as records
        # leave the buffer), the rest run on the records, computed or stored
        self.cache = cache
        self.before_cache = Composed(self.steps[:cached_steps])
        self.after_cache = Composed(self.steps[cached_steps:])
        self.reset()

    @classmethod
    def state_over(cls, source_state: Any, dropped: int = 0) -> dict[str, Any]:
        """The state of this stage over a source standing at `source_state`."""
        return {STAGE: cls.STAGE, cls.SOURCE: source_state, cls.COUNTS: {"dropped": dropped}}

    @classmethod
    def unfinished(cls, state: dict[str, Any], below: Below) -> Rest:
        """What a reader at `state` leaves: what the buffer below leaves (its state counts
        every record it handed out, those the steps dropped included)."""
        return below(cls.source_state(state))

    def over(self, source: Any, handed: HandedOut) -> dict[str, Any]:
        """This stage's state once the reader has handed out `handed` (every line a record,
        none dropped), the buffer below standing at `source`."""
        return self.state_over(source)

    @classmethod
    def source_state(cls, state: dict[str, Any]) -> Any:
        """The source's part of a state of this stage (strict)."""
        if not isinstance(state, dict) or state.get(STAGE) != cls.STAGE:
            found = state.get(STAGE) if isinstance(state, dict) else type(state).__name__
            raise StateMismatchError(
                f"this state has no map/filter stage after the shuffle buffer (it holds the "
                f"state of {found!r}); it was taken by a streamds version that ran the map and "
                "filter steps before the shuffle buffer, or by a dataset with other steps or "
                "settings. Finish the epoch with the version and dataset that took it, or "
                "restart the epoch"
            )
        return state[cls.SOURCE]

    def reset(self, state: dict[str, Any] | None = None) -> None:
        self.source.reset(None if state is None else self.source_state(state))
        self._dropped = 0 if state is None else state[self.COUNTS]["dropped"]

    def get_state(self) -> dict[str, Any]:
        return self.state_over(self.source.get_state(), self._dropped)

    @property
    def counts(self) -> dict[str, int]:
        below = self.source.counts
        return {**below, "dropped": below.get("dropped", 0) + self._dropped}

    @property
    def done(self) -> bool:
        """Whether the last record has been handed out: every record the source handed out
        has gone through the steps by the time a state can be taken."""
        return bool(self.source.done)

    def __iter__(self) -> Iterator[Any]:
        if self.cache is not None:
            yield from self._cached(self.cache)
            self._end()
            return
        if not self.steps:  # nothing to run: the source's records, at its speed
            yield from self.source
            self._end()
            return
        apply = self.apply
        for record in self.source:
            try:
                out = apply(record)
            except Exception as err:
                self.source.give_back()  # a state taken now hands this record out again
                wrapped = _annotated(err, self._note(apply.failed))
                if wrapped is None:
                    raise
                raise wrapped from err
            except BaseException:  # an interrupt inside a step: the record was not used
                self.source.give_back()
                raise
            if out is DROPPED:
                self._dropped += 1
                continue
            yield out
        self._end()

    def _cached(self, cache: BlockCache) -> Iterator[Any]:
        """`__iter__` with `ds.cache`: placeholders of stored blocks become their stored
        records; the others go through the cached steps and into the store."""
        source, before, after = self.source, self.before_cache, self.after_cache
        for record in source:
            try:
                if record.__class__ is Stored:
                    out = cache.resolve(record)
                else:
                    out = before(record) if before.steps else record
                    cache.put(*source.last_position, out)
                if out is not DROPPED and after.steps:
                    out = after(out)
            except UncacheableRecordError:
                source.give_back()
                raise
            except Exception as err:
                source.give_back()  # a state taken now hands this record out again
                wrapped = _annotated(err, self._note(before.failed or after.failed))
                if wrapped is None:
                    raise
                raise wrapped from err
            except BaseException:  # an interrupt inside a step: the record was not used
                source.give_back()
                raise
            if out is DROPPED:
                self._dropped += 1
                continue
            yield out

    def _end(self) -> None:
        if self.on_end is not None:
            self.on_end()

    def batches(self, size: int) -> Iterator[list[Any]]:
        """The records in lists of `size` (the last may be short), with the same state after
        each list as `size` steps of iteration."""
        if not self.steps and self.cache is None:
            yield from self.source.batches(size)
            self._end()
            return
        batch: list[Any] = []
        for record in self:
            batch.append(record)
            if len(batch) == size:
                yield batch
                batch = []
        if batch:
            yield batch

    def batches_with_positions(self, size: int) -> Iterator[Any]:
        """The source's `batches_with_positions` (lines for the main process to parse: there
        are no steps then)."""
        assert not self.steps, "records with positions are lines, which no step has seen"
        yield from self.source.batches_with_positions(size)
        self._end()

    def _note(self, step: Step | None) -> str:
        which = "a step" if step is None else describe_step(self.steps, step)
        block, offset = self.source.last_position
        place = (f"block {block}, offset {offset}" if self.where is None else
                 self.where.place(block, offset))
        return (f"streamds: raised in the transform stage (after the shuffle buffer), {which}, "
                f"on the record at {place}")
