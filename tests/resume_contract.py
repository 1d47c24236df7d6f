"""The exact-resume contract (DESIGN.md guarantee 3), one check for every stage and loader.

torchdata's `run_test_save_load_state` habit: run the pipeline once without interruption;
then, for each cut point, consume that many items from a fresh pipeline, take its state,
pass the state through pickle (as a checkpoint on disk would), build another fresh pipeline,
load the state into it and require ``prefix + rest == uninterrupted``.

`make()` builds the thing under test, fresh on every call. It is either

- a stage (`RecordStream`, `ShuffleBuffer`): ``reset(state=None)``, ``get_state()``, iteration;
- a stateful dataset or loader (`StreamingJsonl`, torchdata's `StatefulDataLoader`):
  ``state_dict()``, ``load_state_dict(state)``, iteration.

Items are compared with ``==``, so a loader needs a collate that yields plain values (a list of
ids, say), not tensors.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import corpus

from streamds.storage.plan import make_blocks
from streamds.storage.shards import resolve_shards

__all__ = [
    "checkpoint",
    "ids",
    "load_state",
    "records",
    "run_test_save_load_state",
    "save_state",
    "write_mixed",
]


def save_state(thing: Any) -> Any:
    """The state of a stage (`get_state`) or of a dataset or loader (`state_dict`)."""
    if hasattr(thing, "get_state"):
        return thing.get_state()
    return thing.state_dict()


def load_state(thing: Any, state: Any) -> None:
    """Load `state` into a fresh stage (`reset(state)`) or dataset or loader."""
    if hasattr(thing, "get_state"):
        thing.reset(state)
    else:
        thing.load_state_dict(state)


def checkpoint(state: Any) -> Any:
    """`state` after a trip through pickle: only what a checkpoint file keeps survives."""
    return pickle.loads(pickle.dumps(state))


def _close(iterator: Iterator[Any]) -> None:
    """Stop a half-consumed generator now, so its files close before the next run opens them."""
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def _first_difference(got: Sequence[Any], want: Sequence[Any]) -> str:
    for index, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"item {index}: got {a!r}, uninterrupted run has {b!r}"
    return f"lengths differ: got {len(got)} items, uninterrupted run has {len(want)}"


def run_test_save_load_state(
    make: Callable[[], Any],
    cut_points: Iterable[int],
    *,
    expected: Sequence[Any] | None = None,
    after: Callable[[Any], Any] | None = None,
) -> list[Any]:
    """Check exact resume at every cut in `cut_points` (items consumed before the state).

    `expected`: the uninterrupted output when the caller has it already (saves one run).
    `after`: something observable once a run is finished (e.g. the stage's error counts);
    the resumed run must end with the same value as the uninterrupted one.
    Returns the uninterrupted output. Raises AssertionError naming the cut and the first
    item that differs.

    One run, stopped after the last cut, takes the state at every cut (through pickle, as a
    checkpoint keeps it) and must yield the uninterrupted output all the same; each state
    then resumes a fresh run.
    """
    if after is not None and expected is not None:
        raise ValueError("`after` needs the uninterrupted run: do not pass `expected` with it")
    if expected is None:
        whole = make()
        reference = list(whole)
        final = after(whole) if after is not None else None
        del whole
    else:
        reference, final = list(expected), None
    cuts = list(cut_points)
    for cut in cuts:
        if not 0 <= cut <= len(reference):
            raise ValueError(f"cut point {cut} outside 0..{len(reference)}")
    states, seen = _states_at(make, set(cuts))
    assert seen == reference[:len(seen)], (
        "a run whose state was taken along the way differs from the uninterrupted run: "
        f"{_first_difference(seen, reference)}"
    )
    for cut in cuts:
        assert cut in states, f"cut {cut}: the run ended after {len(seen)} items"
        fresh = make()
        load_state(fresh, states[cut])
        rest = list(fresh)
        resumed = reference[:cut] + rest
        assert resumed == reference, (
            f"resume after {cut} of {len(reference)} items differs from the uninterrupted "
            f"run: {_first_difference(resumed, reference)}"
        )
        if after is not None:
            assert after(fresh) == final, (
                f"resume after {cut} items: {after(fresh)!r} at the end, uninterrupted run "
                f"ends with {final!r}"
            )
        del fresh  # a DataLoader's workers exit now, not while the next one forks
    return reference


_END = object()  # what next() returns at the end of a run


def _states_at(make: Callable[[], Any], cuts: set[int]) -> tuple[dict[int, Any], list[Any]]:
    """One run of `make()` up to the last of `cuts`: its state after each count of items in
    `cuts` (taken before the next item is asked for, as a loop that stops there takes it),
    and the items it yielded."""
    first = make()
    iterator = iter(first)
    seen: list[Any] = []
    states = {0: checkpoint(save_state(first))} if 0 in cuts else {}
    last = max(cuts, default=0)
    while len(seen) < last:
        item = next(iterator, _END)
        if item is _END:
            break
        seen.append(item)
        if len(seen) in cuts:
            states[len(seen)] = checkpoint(save_state(first))
    _close(iterator)
    del iterator, first  # a DataLoader's workers exit now, not while the next one forks
    return states, seen


# -- a corpus of every shard format, for the resume tests --------------------------------------


def stop_ranks_part_way(
    loader_for: Callable[[int], Any], batches: Sequence[int]
) -> tuple[list[Any], list[Any]]:
    """Rank r's loader (`loader_for(r)`) yields `batches[r]` batches, then its state is taken
    (through pickle, as a checkpoint is); returns (every item consumed, the states)."""
    consumed: list[Any] = []
    states = []
    for rank, count in enumerate(batches):
        loader = loader_for(rank)
        iterator = iter(loader)
        for _ in range(count):
            consumed.extend(next(iterator))
        states.append(pickle.loads(pickle.dumps(loader.state_dict())))
        del iterator, loader
    return consumed, states


def records(count: int, start: int, width: int = 60) -> list[dict[str, Any]]:
    """Records with ids from `start`; text lengths vary, so offsets follow no pattern."""
    return [{"id": i, "text": "w" * (width + (i * 7919) % 97)} for i in range(start, start + count)]


def ids(batch: list[dict[str, Any]]) -> list[int]:
    """Collate to the list of ids (module level, so worker processes can pickle it)."""
    return [record["id"] for record in batch]


def write_mixed(directory: Path, *, scale: int = 1) -> list[int]:
    """Every shard format in one directory; the plain and seekable files span several blocks.

    Plain JSONL and seekable zstd (~160 KB each at scale 1, 3 blocks each), gzip, a tar of
    .json members, a tar of .jsonl members, a foreign zstd file. Returns the ids in file order.
    """
    directory.mkdir(parents=True)
    parts = [
        ("part-0.jsonl", corpus.write_plain, records(130 * scale, 0, width=1200)),
        ("part-1.jsonl.zst", _seekable, records(130 * scale, 10_000, width=1200)),
        ("part-2.jsonl.gz", corpus.write_gz, records(20 * scale, 20_000)),
        ("part-3.tar", corpus.write_tar_json, records(15 * scale, 30_000)),
        ("part-4.tar", corpus.write_tar_jsonl, records(15 * scale, 40_000)),
        ("part-5.jsonl.zst", corpus.write_foreign_zst, records(12 * scale, 50_000)),
    ]
    for name, writer, part in parts:
        writer(directory / name, corpus.jsonl(part))
    assert len(make_blocks(resolve_shards(str(directory)))) >= 9  # big files: several blocks
    return [record["id"] for _, _, part in parts for record in part]


def _seekable(path: Path, data: bytes) -> Path:
    return corpus.write_seekable_zst(path, data, frame_size=8192)
