"""`Records.batches` and `Shuffle.batches`: lists of n records (cut from the chunks as slices, or
gathered without a step per record) hand out the same records, with the same state after each
list, as n steps of record-by-record iteration; a state taken after any list, or after any
record, resumes exactly; positions name each record's line."""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from streamds.stages.chunks import Chunk
from streamds.stages.parse import BLANK
from streamds.stages.records import Records
from streamds.stages.shuffle import Shuffle


class Chunks:
    """A source of chunks; state: the index of the next chunk."""

    def __init__(self, chunks: list[Chunk]) -> None:
        self.chunks = chunks
        self.next = 0

    def reset(self, state: dict[str, Any] | None = None) -> None:
        self.next = 0 if state is None else state["next"]

    def get_state(self) -> dict[str, Any]:
        return {"next": self.next}

    @property
    def counts(self) -> dict[str, int]:
        return {}

    def __iter__(self) -> Any:
        while self.next < len(self.chunks):
            self.next += 1
            yield self.chunks[self.next - 1]


def make_chunks(layout: list[list[bool]]) -> list[Chunk]:
    """Chunk k holds records "k.i" and a BLANK marker where `layout[k][i]` is False."""
    chunks, offset = [], 0
    for k, kinds in enumerate(layout):
        items: list[Any] = [f"{k}.{i}" if record else BLANK for i, record in enumerate(kinds)]
        offsets = list(range(offset, offset + 10 * len(items) + 1, 10))
        offset = offsets[-1]
        chunks.append(Chunk(k, block=100 + k, offsets=offsets, items=items,
                            clean=all(kinds)))
    return chunks


layouts = st.lists(st.lists(st.booleans() | st.just(True), max_size=12), max_size=8)


@settings(max_examples=100, deadline=None)
@given(layouts, st.integers(1, 9), st.data())
def test_a_state_after_any_list_resumes_exactly(
    layout: list[list[bool]], size: int, data: st.DataObject
) -> None:
    chunks = make_chunks(layout)
    everything = [r for batch in Records(Chunks(chunks)).batches(size) for r in batch]
    first = Records(Chunks(chunks))
    lists = first.batches(size)
    taken = data.draw(st.integers(0, len(everything) // size + 1))
    before = [r for batch in islice(lists, taken) for r in batch]
    state = first.get_state()
    resumed = Records(Chunks(chunks))
    resumed.reset(state)
    after = [r for batch in resumed.batches(size) for r in batch]
    assert before + after == everything


def shuffle_of(chunks: list[Chunk], buffer: int, round_size: int) -> Shuffle:
    lines = {(chunk.block, chunk.offsets[i]): item
             for chunk in chunks for i, item in enumerate(chunk.items)}
    return Shuffle(Chunks(chunks), size=buffer, seed_parts=(7,), round_size=round_size,
                   fetch=lambda positions: [lines[p] for p in positions])


shuffles = st.tuples(st.integers(1, 12), st.integers(1, 9))  # buffer size, round size


@settings(max_examples=150, deadline=None)
@given(layouts, st.integers(1, 9), shuffles, st.data())
def test_a_shuffle_state_after_any_record_resumes_into_lists_exactly(
    layout: list[list[bool]], size: int, shuffle: tuple[int, int], data: st.DataObject
) -> None:
    chunks = make_chunks(layout)
    everything = list(shuffle_of(chunks, *shuffle))
    first = shuffle_of(chunks, *shuffle)
    handed = data.draw(st.integers(0, len(everything)))
    before = list(islice(first, handed))  # a state taken between two lists' records
    resumed, one_by_one = shuffle_of(chunks, *shuffle), shuffle_of(chunks, *shuffle)
    resumed.reset(first.get_state())
    one_by_one.reset(first.get_state())
    records = iter(one_by_one)
    after = []
    for batch in resumed.batches(size):
        assert batch == list(islice(records, size))
        assert resumed.get_state() == one_by_one.get_state()
        after += batch
    assert before + after == everything
    again = shuffle_of(chunks, *shuffle)  # and a state taken after a list, resumed one by one
    lists = again.batches(size)
    taken = [r for batch in islice(lists, data.draw(st.integers(0, 4))) for r in batch]
    rest = shuffle_of(chunks, *shuffle)
    rest.reset(again.get_state())
    assert taken + list(rest) == everything


# a stage over the chunks: Records, or a Shuffle with a small buffer and short rounds
Stage = Callable[[list[Chunk]], "Records | Shuffle"]
stages = st.one_of(
    st.just(lambda chunks: Records(Chunks(chunks))),
    shuffles.map(lambda shuffle: lambda chunks: shuffle_of(chunks, *shuffle)),
)


@settings(max_examples=250, deadline=None)
@given(layouts, st.integers(1, 9), stages)
def test_lists_match_record_by_record_iteration(
    layout: list[list[bool]], size: int, stage: Stage
) -> None:
    chunks = make_chunks(layout)
    one_by_one = stage(chunks)
    records = iter(one_by_one)
    in_lists = stage(chunks)
    for batch in in_lists.batches(size):
        assert batch == list(islice(records, size))
        assert in_lists.get_state() == one_by_one.get_state()
        assert in_lists.done == one_by_one.done
    assert list(records) == []
    assert in_lists.done and one_by_one.done


@settings(max_examples=150, deadline=None)
@given(layouts, st.integers(1, 9), stages)
def test_positions_name_each_records_line(
    layout: list[list[bool]], size: int, stage: Stage
) -> None:
    chunks = make_chunks(layout)
    where = {item: (chunk.block, chunk.offsets[i])
             for chunk in chunks for i, item in enumerate(chunk.items) if item is not BLANK}
    for batch, blocks, offsets in stage(chunks).batches_with_positions(size):
        assert list(zip(blocks, offsets, strict=True)) == [where[r] for r in batch]
