"""Spawn and forkserver (issue 9, bullet 7): DataLoader workers started by "spawn" (the
default on macOS and Windows) or "forkserver" (Linux's default from Python 3.14) receive the
dataset by pickling. Datasets, transforms defined in modules and every pipeline stage pickle;
a loader under either start method yields every record exactly once and a StatefulDataLoader
resumes exactly; a lambda is named, with the fix, instead of failing deep inside pickle.
"""

from __future__ import annotations

import copy
import functools
import pickle
from pathlib import Path
from typing import Any

import corpus
import orjson
import pytest
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import streamds
import streamds.stages.transform
from streamds import StreamingJsonl
from streamds.stages.pipeline import Reader
from streamds.stages.transform import Step
from streamds.world import World

WORKERS = 2
BATCH = 16
BAD_EVERY = 97  # every 97th line of the corpus is malformed
BLANK_EVERY = 89


# -- transforms defined at module level: what spawn needs ------------------------------------


def tag(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "len": len(record["text"])}


def odd_only(record: dict[str, Any]) -> bool:
    return record["id"] % 2 == 1


def scaled(record: dict[str, Any], *, factor: int) -> dict[str, Any]:
    return {**record, "id": record["id"] * factor}


def keep(batch: list) -> list:
    return batch


# -- the corpus --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def messy(tmp_path_factory) -> dict[str, Any]:
    """Two plain shards and a seekable zst one, with malformed and blank lines, in several
    blocks each (so that both workers read)."""
    root = tmp_path_factory.mktemp("spawn")
    ids, bad, blank, number = [], 0, 0, 0
    for shard, count in enumerate((1500, 900, 700)):
        lines = []
        for record in corpus.make_records(count, start=10_000 * shard):
            number += 1
            if number % BAD_EVERY == 0:
                lines.append(b'{"id": broken')
                bad += 1
            if number % BLANK_EVERY == 0:
                lines.append(b"   ")
                blank += 1
            lines.append(orjson.dumps({**record, "text": record["text"] * 40}))
            ids.append(record["id"])
        suffix = ".jsonl.zst" if shard == 2 else ".jsonl"
        corpus.WRITERS[suffix](root / f"part-{shard}{suffix}", b"\n".join(lines) + b"\n")
    return {"root": root, "ids": ids, "bad": bad, "blank": blank}


def dataset(root: Path) -> StreamingJsonl:
    return (StreamingJsonl(root, shuffle=True, seed=3, buffer_size=200, on_error="skip",
                           storage=streamds.Storage(block_size=64 << 10))
            .filter(odd_only)
            .map(tag))


def loader(ds: Any, context: str | None) -> StatefulDataLoader:
    return StatefulDataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=keep,
                              multiprocessing_context=context)


def read(ds: Any, context: str | None, limit: int | None = None) -> tuple[list, Any]:
    """Record ids the loader yields (the first `limit` batches) and its state after them."""
    dl = loader(ds, context)
    out = []
    for step, batch in enumerate(dl):
        out.extend(record["id"] for record in batch)
        if limit is not None and step + 1 == limit:
            break
    return out, dl.state_dict()


# -- pickling ----------------------------------------------------------------------------------


def test_every_stage_and_the_reader_pickle_and_read_the_same(messy):
    ds = dataset(messy["root"]).map(functools.partial(scaled, factor=3))
    reader = Reader(ds._spec(), ds._fresh(World(0, 1, 0, 1)))
    stages = [reader.lines, reader.parse, reader.transform, reader.even, reader.top, reader]
    copies = [pickle.loads(pickle.dumps(stage)) for stage in stages]
    assert [type(copy) for copy in copies] == [type(stage) for stage in stages]
    assert list(copies[-1]) == list(reader)
    again = pickle.loads(pickle.dumps(ds))
    assert list(again) == list(ds)


def test_a_lambda_or_nested_function_is_named_with_the_fix():
    def nested(record):
        return record

    steps = [("map", tag), ("filter", lambda record: True)]
    said = streamds.stages.transform.unpicklable_step(steps)
    assert said is not None
    for part in ("filter step 2 of 2", "lambda", "spawn", "top level of a module"):
        assert part in said
    nested_said = streamds.stages.transform.unpicklable_step([("map", functools.partial(nested))])
    assert nested_said is not None and "defined inside a function" in nested_said
    assert "test_a_lambda_or_nested_function_is_named_with_the_fix.<locals>.nested" in (
        nested_said)
    fine = [("map", tag), ("map", functools.partial(scaled, factor=2))]
    assert streamds.stages.transform.unpicklable_step(fine) is None


def test_a_step_pickles_its_function_by_name_and_refuses_a_lambda_with_the_fix():
    step = Step("map", tag)
    assert pickle.loads(pickle.dumps(step)) == step == ("map", tag)
    assert copy.copy(step) is step and copy.deepcopy(step) is step  # dataset.map copies
    with pytest.raises(pickle.PicklingError) as raised:
        pickle.dumps(Step("filter", lambda record: True))
    for part in ("filter step test_spawn.", "<lambda> is a lambda", "'spawn'",
                 "top level of a module"):
        assert part in str(raised.value)


@pytest.mark.filterwarnings("ignore:Got pickle error")  # torch's hint, beside our error
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_lambda_under_spawn_fails_in_the_main_process_naming_the_fix(messy, context):
    if context not in mp.get_all_start_methods():
        pytest.skip(f"{context} is not available on this platform")
    ds = StreamingJsonl(messy["root"])
    ds._steps = (Step("map", tag), Step("map", lambda record: record))  # as .map() makes them
    dl = DataLoader(ds, batch_size=BATCH, num_workers=1, collate_fn=keep,
                    multiprocessing_context=context)
    with pytest.raises(pickle.PicklingError, match=r"map step .*<lambda> is a lambda.*module"):
        next(iter(dl))


def test_pickling_a_dataset_with_a_lambda_names_the_step_and_the_fix(messy):
    ds = StreamingJsonl(messy["root"]).map(tag).map(lambda record: record)
    with pytest.raises(pickle.PicklingError, match=r"map step .*lambda.*top level of a module"):
        pickle.dumps(ds)


# -- DataLoader workers started by spawn and forkserver ----------------------------------------


def test_workers_started_by_pickling_yield_once_and_resume_exactly(messy):
    """The first half under spawn, the rest resumed under forkserver: each start method
    pickles the dataset (and the resumed one its state) into workers that import everything
    afresh, and a spawned worker costs seconds, so each method starts one loader."""
    contexts = [context for context in ("spawn", "forkserver")
                if context in mp.get_all_start_methods()]
    first, then = contexts[0], contexts[-1]  # spawn alone where forkserver is missing
    ds = dataset(messy["root"])
    reference, end = read(ds, None)  # fork (or the platform's default): the same readers
    assert sorted(reference) == sorted(i for i in messy["ids"] if i % 2 == 1)
    total = streamds.counts_of(end)
    assert (total["bad"], total["blank"]) == (messy["bad"], messy["blank"])

    cut = len(reference) // BATCH // 2
    head, state = read(dataset(messy["root"]), first, limit=cut)
    resumed = dataset(messy["root"])
    dl = loader(resumed, then)
    dl.load_state_dict(state)
    rest = [record["id"] for batch in dl for record in batch]
    assert head + rest == reference  # every record once, in the uninterrupted order
    counted = streamds.counts_of(dl.state_dict())  # counted in spawned workers, summed here
    assert counted == total
