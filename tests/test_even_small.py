"""Even ranks on small corpora: no silent loss (issue 9, bullet 4).

A corpus of a few 64 KiB blocks over more ranks than blocks used to make `even_ranks="drop"`
yield 0 records on every rank, without a word. Under even ranks a small corpus is now cut
into about 1024 blocks (never depending on the world, so positions keep their meaning); where
no even split is possible "drop" refuses with the numbers and the fix, and a split that drops
or repeats more than 1% of the records logs a warning.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from pathlib import Path

import corpus
import pytest
from torch.utils.data import DataLoader

from streamds import StateMismatchError, StreamingJsonl, merge_states
from streamds.stages.balance import check_split
from streamds.storage.plan import (
    MIN_BLOCK_SIZE,
    MIN_SMALL_BLOCK,
    SMALL_CORPUS_BLOCKS,
    make_blocks,
    small_corpus_piece,
)
from streamds.storage.shards import Shard

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SMALL_BYTES = 365_000  # the file: 6 blocks of 64 KiB


def plain_shard(size: int, name: str = "s.jsonl") -> Shard:
    return Shard(url=name, path=name, size=size, format="jsonl", codec=None)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """One plain JSONL file of about 365 KB, records of uneven length."""
    path = tmp_path_factory.mktemp("small") / "small.jsonl"
    lines, size, i = [], 0, 0
    while size < SMALL_BYTES:
        line = corpus.jsonl([{"id": i, "text": "y" * (60 + i % 80)}])
        lines.append(line)
        size += len(line)
        i += 1
    path.write_bytes(b"".join(lines))
    return str(path), i


def rank_ids(source: str | list[str], world_size: int, mode: str | None, *,
             shuffle: bool = False, workers: int = 0) -> list[list[int]]:
    out = []
    for rank in range(world_size):
        dataset = StreamingJsonl(source, shuffle=shuffle, seed=4, buffer_size=16, rank=rank,
                                 world_size=world_size, even_ranks=mode)
        loader = DataLoader(dataset, batch_size=32, num_workers=workers,
                            collate_fn=corpus.as_list)
        out.append([record["id"] for batch in loader for record in batch])
    return out


def even_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "even_ranks" in r.getMessage()]


# -- the cut: pure, from the corpus alone -------------------------------------------------------


def test_a_small_corpus_is_cut_finely_under_even_ranks_only() -> None:
    shard = plain_shard(SMALL_BYTES)
    assert len(make_blocks([shard])) == 6  # what a plain read keeps
    fine = make_blocks([shard], fine=True)
    assert len(fine) >= 256
    assert fine[0].start == 0 and fine[-1].end is None
    for before, after in itertools.pairwise(fine):
        assert before.end == after.start  # the pieces tile the file


def test_the_fine_piece_depends_on_the_corpus_size_only() -> None:
    assert small_corpus_piece([plain_shard(100)]) == MIN_SMALL_BLOCK
    assert small_corpus_piece([plain_shard(4 << 20)]) == (4 << 20) // SMALL_CORPUS_BLOCKS
    big = SMALL_CORPUS_BLOCKS * MIN_BLOCK_SIZE
    assert small_corpus_piece([plain_shard(big)]) is None
    shards = [plain_shard(big // 2, "a.jsonl"), plain_shard(big // 2, "b.jsonl")]
    assert make_blocks(shards, fine=True) == make_blocks(shards)  # a large corpus: unchanged
    gz = Shard(url="g.jsonl.gz", path="g", size=big, format="jsonl", codec="gz")
    assert small_corpus_piece([gz]) == MIN_SMALL_BLOCK  # read whole: no bytes to cut


# -- the numbers --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [4, 8])
def test_drop_over_more_ranks_than_plain_blocks_keeps_records(
    small_file: tuple[str, int], world_size: int, caplog: pytest.LogCaptureFixture
) -> None:
    source, total = small_file
    drop = rank_ids(source, world_size, "drop")
    sizes = {len(rank) for rank in drop}
    assert len(sizes) == 1 and sizes != {0}, sizes  # was 0 records on every rank over 8
    kept = [i for rank in drop for i in rank]
    assert max(Counter(kept).values()) == 1
    assert len(kept) >= 0.97 * total, f"dropped {total - len(kept)} of {total}"  # was 28% over 4
    lost = (total - len(kept)) / total
    assert bool(even_warnings(caplog)) == (lost > 0.01), (lost, even_warnings(caplog))


@pytest.mark.parametrize("shuffle", [False, True])
def test_pad_over_eight_ranks_repeats_little(
    small_file: tuple[str, int], shuffle: bool
) -> None:
    source, total = small_file
    pad = rank_ids(source, 8, "pad", shuffle=shuffle, workers=2)
    assert len({len(rank) for rank in pad}) == 1
    assert set(i for rank in pad for i in rank) == set(range(total))
    # was 46% repeated; what is left is ranks owning one block more or less than others
    # (seeds 0-5 repeat 6-10%, dealt rank-major or worker-major alike)
    assert sum(len(rank) for rank in pad) <= 1.12 * total


# -- no even split: refused, with the numbers and the fix ----------------------------------------


def test_drop_refuses_fewer_records_than_ranks(tmp_path: Path) -> None:
    path = corpus.write(tmp_path / "three.jsonl", corpus.make_records(3))
    dataset = StreamingJsonl(str(path), rank=0, world_size=4, even_ranks="drop")
    with pytest.raises(ValueError, match=r"3 records over 4 ranks.*even_ranks='pad'"):
        iter(dataset)
    pad = rank_ids(str(path), 4, "pad")  # pad can: every rank repeats the three
    assert pad == [[0, 1, 2]] * 4


def test_drop_refuses_blocks_that_cannot_reach_every_rank(tmp_path: Path) -> None:
    """Two gzip files are two blocks: over four ranks "drop" would keep nothing."""
    paths = [str(corpus.write(tmp_path / f"part-{k}.jsonl.gz",
                              corpus.make_records(50, start=50 * k))) for k in range(2)]
    dataset = StreamingJsonl(paths, rank=1, world_size=4, even_ranks="drop")
    with pytest.raises(ValueError, match=r"drop all 100 records.*\(2 in the corpus\).*4 ranks"):
        list(dataset)
    with pytest.raises(ValueError, match="even_ranks='drop'"):
        rank_ids(paths, 4, "drop", workers=1)  # raised in the worker, the same message


def test_a_lossy_split_warns_with_its_numbers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whole-file blocks of 10 and 30 records over two ranks: drop loses 20 of 40 (50%)."""
    paths = [str(corpus.write(tmp_path / "a.jsonl.gz", corpus.make_records(10))),
             str(corpus.write(tmp_path / "b.jsonl.gz", corpus.make_records(30, start=10)))]
    drop = rank_ids(paths, 2, "drop")
    assert [len(rank) for rank in drop] == [10, 10]
    said = even_warnings(caplog)
    assert len(said) == 1, said  # reader 0 says it, once per epoch
    assert "drops 20 of 40 records (50.0%)" in said[0] and "2 ranks" in said[0]
    caplog.clear()
    rank_ids(paths, 2, "pad")
    assert "repeats 20 of 40 records (50.0%)" in even_warnings(caplog)[0]


def test_a_split_within_one_percent_is_quiet(
    small_file: tuple[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    source, total = small_file
    drop = rank_ids(source, 2, "drop")
    assert total - sum(len(rank) for rank in drop) <= 0.01 * total
    assert even_warnings(caplog) == []


def test_check_split_numbers() -> None:
    assert check_split([5, 5], [5, 5], 2, "drop", blocks=2) is None
    assert check_split([51, 50], [50, 50], 2, "drop", blocks=2) is None  # 1 of 101: quiet
    assert "drops 4 of 20 records (20.0%)" in check_split([12, 8], [8, 8], 2, "drop", blocks=2)
    assert "repeats 4 of 20" in check_split([12, 8], [12, 12], 2, "pad", blocks=2)
    with pytest.raises(ValueError, match="1 records over 2 ranks"):
        check_split([1, 0], [0, 0], 2, "drop", blocks=1)
    resumed = check_split([1, 0], [0, 0], 2, "drop", blocks=1, resumed=True)
    assert "what is left of this epoch" in resumed  # the end of a resumed epoch: said


# -- positions keep their meaning -----------------------------------------------------------------


def test_a_state_of_the_fine_cut_is_refused_by_a_plain_dataset(
    small_file: tuple[str, int]
) -> None:
    source, _ = small_file
    even = StreamingJsonl(source, even_ranks="pad")
    iterator = iter(even)
    for _ in range(100):
        next(iterator)
    state = even.state_dict()
    with pytest.raises(StateMismatchError, match="even_ranks"):
        StreamingJsonl(source).load_state_dict(state)
    again = StreamingJsonl(source, even_ranks="pad")
    again.load_state_dict(state)
    assert [r["id"] for r in again] == [r["id"] for r in iterator]


def test_elastic_resume_over_the_fine_cut(small_file: tuple[str, int]) -> None:
    """Two ranks read part of the epoch; three ranks finish it: every record is read."""
    source, total = small_file
    states, seen = [], []
    for rank in range(2):
        dataset = StreamingJsonl(source, shuffle=True, seed=9, buffer_size=32, rank=rank,
                                 world_size=2, even_ranks="pad")
        iterator = iter(dataset)
        seen += [next(iterator)["id"] for _ in range(300 + 200 * rank)]
        states.append(dataset.state_dict())
    merged = merge_states(states)
    rest = []
    for rank in range(3):
        dataset = StreamingJsonl(source, shuffle=True, seed=9, buffer_size=32, rank=rank,
                                 world_size=3, even_ranks="pad").with_resume(merged)
        rest.append([record["id"] for record in dataset])
    assert len({len(rank) for rank in rest}) == 1
    assert max(Counter(seen).values()) == 1
    assert set(seen) | {i for rank in rest for i in rank} == set(range(total))


# -- a rank with nothing to read is never silent (issue 26) ---------------------------------------

README_BYTES = 119_000  # the README's example file: two 64 KiB blocks when read plainly


@pytest.fixture(scope="module")
def readme_sized(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("readme") / "example.jsonl"
    lines, size, i = [], 0, 0
    while size < README_BYTES:
        lines.append(corpus.jsonl([{"id": i, "text": "z" * (80 + i % 40)}]))
        size += len(lines[-1])
        i += 1
    path.write_bytes(b"".join(lines))
    return str(path)


def detected_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int) -> None:
    """The world as torchrun gives it (RANK / WORLD_SIZE), not as arguments."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))


def test_a_readme_sized_corpus_reaches_every_rank_of_two_with_workers(
    readme_sized: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two blocks over 2 ranks x 2 workers: dealt worker-major, each rank's first worker owns
    one (dealt rank-major, rank 0's workers took both and rank 1 was refused as empty).
    Every record once over the ranks."""
    seen = []
    for rank in range(2):
        detected_rank(monkeypatch, rank, 2)
        loader = DataLoader(StreamingJsonl(readme_sized), batch_size=16, num_workers=2,
                            collate_fn=corpus.as_list)
        seen.append([record["id"] for batch in loader for record in batch])
    assert all(seen)
    lines = Path(readme_sized).read_bytes().count(b"\n")
    assert sorted(seen[0] + seen[1]) == list(range(lines))


def test_an_empty_rank_of_a_detected_world_is_refused(
    readme_sized: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two blocks over 3 ranks x 2 workers: rank 2 has none. A DDP job would wait for rank 2
    forever; it is refused at iteration, in the worker."""
    detected_rank(monkeypatch, 2, 3)
    loader = DataLoader(StreamingJsonl(readme_sized), batch_size=16, num_workers=2)
    with pytest.raises(ValueError, match=(
            r"rank 2 of world_size=3 has nothing to read: the corpus \(1\d\d,\d{3} bytes\) is "
            r"cut into 2 block\(s\).*2 DataLoader workers per rank.*fewer ranks.*"
            r"even_ranks='pad'.*block_size")):
        next(iter(loader))
    # one gzip file is one block: without workers rank 1 of 2 gets none
    detected_rank(monkeypatch, 1, 2)
    gz = corpus.write(Path(readme_sized).with_suffix(".jsonl.gz"), corpus.make_records(40))
    with pytest.raises(ValueError, match="rank 1 of world_size=2 has nothing to read"):
        list(StreamingJsonl(str(gz)))


def test_ranks_that_all_read_something_are_not_refused(
    readme_sized: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same file over 2 ranks without workers (a block each), and with even_ranks='pad'
    with 2 workers (cut finer): every rank reads."""
    counts = []
    for rank in range(2):
        detected_rank(monkeypatch, rank, 2)
        counts.append(sum(1 for _ in StreamingJsonl(readme_sized)))
        padded = DataLoader(StreamingJsonl(readme_sized, even_ranks="pad"), batch_size=16,
                            num_workers=2, collate_fn=corpus.as_list)
        assert sum(len(batch) for batch in padded) > 0
    assert all(counts)


def test_an_empty_rank_chosen_by_arguments_is_logged_once(
    readme_sized: str, caplog: pytest.LogCaptureFixture
) -> None:
    """rank= / world_size= passed by hand (a deliberate split, e.g. inference on slices):
    the idle rank is said once per process, not refused."""
    dataset = StreamingJsonl(readme_sized, rank=3, world_size=4)
    assert list(dataset) == [] and list(dataset) == []
    said = [r.getMessage() for r in caplog.records if "has nothing to read" in r.getMessage()]
    assert len(said) == 1 and "rank 3 of world_size=4" in said[0]


def test_a_tiny_source_of_a_mix_is_no_empty_rank(
    readme_sized: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a Mix a rank may own nothing of one source and still read the others: no
    refusal. Rank 1 of 2 owns no block of the tiny file (one block)."""
    from streamds import Mix

    tiny = tmp_path / "tiny.jsonl"
    tiny.write_bytes(corpus.jsonl([{"id": -1 - i, "text": "t"} for i in range(3)]))
    detected_rank(monkeypatch, 1, 2)
    with pytest.raises(ValueError, match="has nothing to read"):
        list(StreamingJsonl(str(tiny)))  # alone: refused
    mixed = Mix([StreamingJsonl(readme_sized), StreamingJsonl(str(tiny))], [0.9, 0.1],
                seed=0, stop="all")
    assert any(record["id"] >= 0 for record in mixed)
