"""`ds.map(fn, batch_size=n)`: a batched map gives what the per-record map gives, for any
batch size and any chunk cuts, resumes exactly after any batch (0 and 2 workers, with and
without a shuffle, and through `merge_states`), names the file and line of a failing batch,
resumes at that batch after an error, and is stored by `ds.cache` like a per-record step;
a real `tokenizers` tokenizer in 2 forked workers prints no "process just got forked"
warning."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resume_contract import run_test_save_load_state, stop_ranks_part_way
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import Storage, StreamingJsonl, merge_states
from streamds.stages.transform import BatchLengthError

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

RECORDS = 3000
FAILING = 1334  # kept by `tokens` (1334 % 7 == 4)
CALLS = {"batches": 0, "records": 0}


def tokens(record: dict[str, Any]) -> dict[str, Any] | None:
    """The per-record map: drops every 7th record, makes ids of the text."""
    if record["i"] % 7 == 3:
        return None
    return {"i": record["i"], "ids": [ord(c) for c in record["text"][: record["i"] % 13]]}


def tokens_batched(batch: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    CALLS["batches"] += 1
    CALLS["records"] += len(batch)
    return [tokens(record) for record in batch]


def fails_on_1334(batch: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    if any(record["i"] == FAILING for record in batch):
        raise ValueError("bad batch")
    return tokens_batched(batch)


def one_short(batch: list[dict[str, Any]]) -> list[Any]:
    return batch[:-1]


def as_dict(batch: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {"ids": [record["i"] for record in batch]}


def ids(batch: list[dict[str, Any]]) -> list[int]:
    return [record["i"] for record in batch]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("batched")
    for shard in range(3):
        (directory / f"s{shard}.jsonl").write_bytes(b"".join(
            orjson.dumps({"i": i, "text": "abcdefghijklmnop" * (1 + i % 10)}) + b"\n"
            for i in range(shard * RECORDS // 3, (shard + 1) * RECORDS // 3)))
    return directory


def dataset(corpus: Path, *, batch_size: int | None = 16, shuffle: bool = False,
            block_size: int = 64 << 10, fn: Any = None, **options: Any) -> StreamingJsonl:
    ds = StreamingJsonl(str(corpus), shuffle=shuffle, seed=5, buffer_size=50,
                        storage=Storage(block_size=block_size), **options)
    if batch_size is None:
        return ds.map(fn or tokens)
    return ds.map(fn or tokens_batched, batch_size=batch_size)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_size=st.integers(1, 400), block_size=st.sampled_from([64 << 10, 96 << 10, 1 << 20]),
       shuffle=st.booleans())
def test_equal_to_the_per_record_map_for_any_batch_size_and_chunk_cuts(
        corpus: Path, batch_size: int, block_size: int, shuffle: bool) -> None:
    want = list(dataset(corpus, batch_size=None, block_size=block_size))
    CALLS["batches"] = CALLS["records"] = 0
    got = list(dataset(corpus, batch_size=batch_size, block_size=block_size, shuffle=shuffle))
    if shuffle:
        assert sorted(got, key=lambda r: r["i"]) == want
    else:
        assert got == want
    assert CALLS["records"] == RECORDS  # every record mapped once, in lists of <= batch_size
    assert CALLS["batches"] >= RECORDS / batch_size


def test_lists_are_as_long_as_asked_within_a_chunk(corpus: Path) -> None:
    CALLS["batches"] = CALLS["records"] = 0
    list(dataset(corpus, batch_size=64, block_size=1 << 20))  # a few chunks per shard
    assert RECORDS / 64 <= CALLS["batches"] <= RECORDS / 64 + 6  # short only at chunk ends


def test_a_filter_after_a_batched_map_and_a_map_before_it(corpus: Path) -> None:
    want = [r for r in dataset(corpus, batch_size=None) if r["i"] % 2]
    ds = StreamingJsonl(str(corpus), storage=Storage(block_size=64 << 10)).map(dict)
    got = list(ds.map(tokens_batched, batch_size=10).filter(lambda r: r["i"] % 2))
    assert got == want


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_exact_resume_after_any_batch(corpus: Path, workers: int, shuffle: bool) -> None:
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(dataset(corpus, batch_size=16, shuffle=shuffle),
                                  batch_size=8, num_workers=workers, collate_fn=ids)

    cuts = [0, 1, 7, 40, 177] if workers else [0, 1, 2, 5, 13, 40, 64, 177]
    out = run_test_save_load_state(make, cuts)
    assert sorted(i for batch in out for i in batch) == [i for i in range(RECORDS) if i % 7 != 3]


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_elastic_merge_finishes_the_epoch_exactly_once(corpus: Path, shuffle: bool) -> None:
    consumed, states = stop_ranks_part_way(
        lambda rank: StatefulDataLoader(
            dataset(corpus, shuffle=shuffle, rank=rank, world_size=2), batch_size=8,
            num_workers=0, collate_fn=ids),
        [3, 11])
    merged = merge_states(states)
    rest = [r["i"] for r in dataset(corpus, shuffle=shuffle).with_resume(merged)]
    seen = [i for batch in consumed for i in (batch if isinstance(batch, list) else [batch])]
    everything = sorted(seen + rest)
    assert everything == [i for i in range(RECORDS) if i % 7 != 3]


def test_an_error_names_the_batch_file_and_first_line(corpus: Path) -> None:
    with pytest.raises(ValueError, match="bad batch") as caught:
        list(dataset(corpus, fn=fails_on_1334, batch_size=10, block_size=1 << 20))
    note = " ".join(getattr(caught.value, "__notes__", [])) or str(caught.value)
    # the shard s1 holds 1000..1999: the failing batch of 10 starts at most 9 lines before
    # line 335, which holds 1334
    assert "map batched step 1 of 1" in note and "fails_on_1334" in note
    line = int(re.search(r"s1\.jsonl: line (\d+)", note).group(1))
    assert 326 <= line <= 335 and "batch of 10 records" in note


@pytest.mark.parametrize("fn", [one_short, as_dict])
def test_a_result_not_one_per_record_is_an_error_naming_the_step_and_line(
        corpus: Path, fn: Any) -> None:
    with pytest.raises(BatchLengthError, match=fn.__name__) as caught:
        list(dataset(corpus, fn=fn, batch_size=10, block_size=1 << 20))
    note = " ".join(getattr(caught.value, "__notes__", [])) or str(caught.value)
    assert "s0.jsonl: line 1 " in note


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_a_state_after_a_failing_batch_resumes_at_that_batch(corpus: Path, shuffle: bool) -> None:
    full = [r["i"] for r in dataset(corpus, shuffle=shuffle)]
    ds = dataset(corpus, shuffle=shuffle, fn=fails_on_1334)
    before: list[int] = []
    with pytest.raises(ValueError, match="bad batch"):
        for record in ds:
            before.append(record["i"])
    fixed = dataset(corpus, shuffle=shuffle)
    fixed.load_state_dict(ds.state_dict())
    rest = [r["i"] for r in fixed]
    assert FAILING in rest
    assert before + rest == full


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_the_cache_stores_what_the_batched_map_made(corpus: Path, tmp_path: Path,
                                                    shuffle: bool) -> None:
    plain = dataset(corpus, batch_size=None, shuffle=shuffle)
    want = sorted(plain, key=lambda r: r["i"])
    cached = dataset(corpus, shuffle=shuffle).cache(tmp_path, key="k")
    CALLS["batches"] = CALLS["records"] = 0
    first = list(cached)
    assert CALLS["records"] == RECORDS
    cached.set_epoch(1)
    CALLS["records"] = 0
    second = list(cached)
    assert CALLS["records"] == 0  # read from the store
    assert sorted(first, key=lambda r: r["i"]) == sorted(second, key=lambda r: r["i"]) == want


def test_batch_size_must_be_a_positive_integer(corpus: Path) -> None:
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            StreamingJsonl(str(corpus)).map(tokens_batched, batch_size=bad)


TOKENIZE_IN_WORKERS = """
import os
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch.utils.data import DataLoader
from streamds import StreamingJsonl
import worker_fns

texts = ["the quick brown fox jumps over the lazy dog %d" % i for i in range(2000)]
tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=200,
                                                               special_tokens=["[UNK]"]))
tokenizer.encode_batch(texts)  # parallelism used in the main process before the fork
tokenizer.save(sys.argv[2])
ds = StreamingJsonl(sys.argv[1]).map(worker_fns.Encode(sys.argv[2]), batch_size=32)
batches = list(DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork",
                          collate_fn=list))
print("records", sum(len(b) for b in batches))
print("workers saw", sorted({r["env"] for b in batches for r in b}))
print("main process has", os.environ.get("TOKENIZERS_PARALLELISM"))
"""

WORKER_FNS = """
import os


class Encode:
    def __init__(self, path):
        self.path = path
        self.tokenizer = None

    def __call__(self, batch):
        if self.tokenizer is None:
            from tokenizers import Tokenizer
            self.tokenizer = Tokenizer.from_file(self.path)
        env = os.environ.get("TOKENIZERS_PARALLELISM")  # what tokenizers' fork handler read
        return [{"ids": e.ids, "env": env}
                for e in self.tokenizer.encode_batch([r["text"] for r in batch])]
"""


def test_tokenizers_in_forked_workers_print_no_fork_warning(corpus: Path,
                                                            tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    (tmp_path / "worker_fns.py").write_text(textwrap.dedent(WORKER_FNS))
    script = tmp_path / "run.py"
    script.write_text(TOKENIZE_IN_WORKERS)
    environ = {k: v for k, v in __import__("os").environ.items()
               if k != "TOKENIZERS_PARALLELISM"}
    environ["PYTHONPATH"] = f"{tmp_path}:{Path(__file__).parents[1]}"
    done = subprocess.run([sys.executable, str(script), str(corpus), str(tmp_path / "t.json")],
                          capture_output=True, text=True, env=environ, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"records {RECORDS}\n" in done.stdout
    # tokenizers' handler runs in the child before any Python code: the workers were forked
    # with the variable set, and the main process has it unset again
    assert "workers saw ['false']\n" in done.stdout and "main process has None\n" in done.stdout
    assert "forked" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-2000:]


def test_a_mix_maps_batched_in_lists_of_one(corpus: Path) -> None:
    from streamds import Mix

    def mixed(batch_size: int | None) -> list[Any]:
        source = StreamingJsonl(str(corpus), storage=Storage(block_size=64 << 10))
        mix = Mix([source], [1.0], seed=0)
        if batch_size is None:
            return list(mix.map(tokens))
        return list(mix.map(tokens_batched, batch_size=batch_size))

    CALLS["batches"] = CALLS["records"] = 0
    assert mixed(8) == mixed(None)
    assert CALLS["batches"] == CALLS["records"] == RECORDS
