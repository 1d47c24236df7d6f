"""streamds.integrations in one process: the missing-framework message, and StreamdsLoader's
gathered state (each rank's own back in the same world; merged under another world)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import warnings
from pathlib import Path

import corpus
import pytest
import torch

from streamds import StreamingJsonl, World
from streamds.integrations import require

pytest.importorskip("torchdata")

from streamds.integrations.loader import RANKS, StreamdsLoader

RECORDS = 160


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    return corpus.write_parts(tmp_path_factory.mktemp("integrations"), RECORDS, 8)


def ids(batch: list[dict]) -> list[int]:
    return [record["id"] for record in batch]


def test_a_missing_framework_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"pip install 'streamds\[frameworks\]'"):
        require("no_such_framework_for_streamds")


def test_import_streamds_imports_no_framework() -> None:
    code = ("import sys, streamds, streamds.integrations; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("workers", [0, 2])
def test_state_of_one_process_resumes_exactly(source: str, workers: int) -> None:
    def loader() -> StreamdsLoader:
        return StreamdsLoader(StreamingJsonl(source, shuffle=True, seed=2, buffer_size=8),
                              batch_size=4, num_workers=workers, collate_fn=ids)

    whole = [batch for batch in loader()]
    first = loader()
    iterator = iter(first)
    head = [next(iterator) for _ in range(9)]
    state = first.state_dict()
    assert list(state) == [RANKS] and len(state[RANKS]) == 1
    again = loader()
    again.load_state_dict(state)
    assert head + list(again) == whole


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_at_the_end_of_an_epoch_resumes_at_the_next(
    source: str, workers: int
) -> None:
    # every reader's records fill whole batches (160 records, 2 readers, batches of 4), so
    # the state after the last batch is taken before any reader has been asked for more
    def loader() -> StreamdsLoader:
        return StreamdsLoader(StreamingJsonl(source), batch_size=4,
                              num_workers=workers, collate_fn=ids)

    first = loader()
    assert sum(len(batch) for batch in first) == RECORDS
    state = first.state_dict()  # what Lightning saves at the end of the epoch
    again = loader()
    again.load_state_dict(state)
    again.dataset.set_epoch(1)
    epoch_1 = [i for batch in again for i in batch]
    assert sorted(epoch_1) == list(range(RECORDS))  # the next epoch, whole


def test_trained_lags_the_batches_handed_out(source: str) -> None:
    loader = StreamdsLoader(StreamingJsonl(source), batch_size=4, collate_fn=ids)
    iterator = iter(loader)
    loader.trained = 0
    trained = [next(iterator) for _ in range(5)]
    loader.trained = 4  # the fifth batch was fetched ahead, not trained
    resumed = StreamdsLoader(StreamingJsonl(source), batch_size=4, collate_fn=ids)
    resumed.load_state_dict(loader.state_dict())
    assert next(iter(resumed)) == trained[4]



def fails_at_id_100(record: dict) -> dict:
    if record["id"] == 100:
        raise ValueError("record 100 is bad")
    return record


def test_a_failed_epoch_stops_its_workers_before_the_error_reaches_the_loop(
    source: str
) -> None:
    """Left to the garbage collector (the error holds the iterator in a reference cycle),
    the two workers took 10 s to go, in whatever code ran then."""
    loader = StreamdsLoader(StreamingJsonl(source).map(fails_at_id_100), batch_size=4,
                            num_workers=2, collate_fn=ids)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="record 100 is bad") as raised:
        for _ in loader:
            pass
    assert set(multiprocessing.active_children()) - before == set()  # exited and joined
    assert raised.value is not None  # the error (and the iterator it holds) is still alive
    assert loader.state_dict()[RANKS]  # still readable after the failure


def test_states_of_another_world_are_merged(source: str) -> None:
    # two ranks read part of their shares; one process finishes the epoch
    states, read = [], []
    for rank in range(2):
        loader = StreamdsLoader(StreamingJsonl(source, shuffle=True, seed=2, buffer_size=8,
                                               rank=rank, world_size=2),
                                batch_size=4, collate_fn=ids)
        iterator = iter(loader)
        read += [i for _ in range(6) for i in next(iterator)]
        states.append(loader.own_state_dict())
    alone = StreamdsLoader(StreamingJsonl(source, shuffle=True, seed=2, buffer_size=8),
                           batch_size=4, collate_fn=ids)
    alone.load_state_dict({RANKS: states})
    rest = [i for batch in alone for i in batch]
    assert sorted(read + rest) == list(range(RECORDS))


def test_streamds_trainer_without_a_steady_length_needs_max_steps(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import framework_worker as worker
    from transformers import TrainingArguments

    from streamds.integrations.transformers import StreamdsTrainer
    from streamds.preprocess.convert import convert

    sources, start = [], 0
    for part, count in enumerate((3, 9, 30)):  # one block each, of unequal sizes
        (tmp_path / f"p{part}.jsonl").write_bytes(
            corpus.jsonl(corpus.make_records(count, start=start)))
        convert([str(tmp_path / f"p{part}.jsonl")], tmp_path / f"o{part}")
        sources.append(str(tmp_path / f"o{part}"))
        start += count
    dataset = StreamingJsonl(sources, shuffle=True, seed=0)

    def trainer(**options: object) -> StreamdsTrainer:
        args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4,
                                 dataloader_num_workers=2, report_to=[], save_strategy="no",
                                 remove_unused_columns=False, use_cpu=True, disable_tqdm=True,
                                 logging_strategy="no", **options)
        made = worker.trainer_class(StreamdsTrainer)(model=worker.tiny_model(), args=args,
                                                     train_dataset=dataset,
                                                     data_collator=worker.collate)
        made.seen = []
        return made

    # 2 workers, batches of 4: epochs of 11, 11, 12 batches; Trainer would plan 11 for all
    with pytest.raises(ValueError, match=r"cannot plan epochs: len\(\) differs from epoch to"):
        trainer(num_train_epochs=3).train()
    # with max_steps: each worker streams its share of epoch 0, then of epoch 1, ...; the
    # loader takes batches from the 2 workers in turn
    streamed = trainer(max_steps=34)
    streamed.train()
    blocks = [set(range(0, 3)), set(range(3, 12)), set(range(12, 42))]  # one block a shard
    for reader in range(2):
        stream = [i for step in streamed.seen[reader::2] for i in step]
        epoch = 0
        while stream:
            seat = World(0, 1, reader, 2)
            share = set().union(*(blocks[b] for b, _ in dataset._plan.work(epoch, seat)))
            part, stream = stream[:len(share)], stream[len(share):]
            assert set(part) <= share and (len(part) == len(share) or not stream)
            assert len(set(part)) == len(part)
            epoch += 1
        assert epoch >= 2


def test_streamds_trainer_pins_memory_only_for_an_accelerator(tmp_path: Path,
                                                               source: str) -> None:
    # Trainer's dataloader_pin_memory defaults to True; on CPU torch warns at every epoch that
    # pinning has no accelerator to serve
    pytest.importorskip("transformers")
    import framework_worker as worker
    from transformers import TrainingArguments

    from streamds.integrations.transformers import StreamdsTrainer

    # (not use_cpu=True, which turns dataloader_pin_memory off itself)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], max_steps=1,
                             dataloader_pin_memory=True)
    trainer = StreamdsTrainer(model=worker.tiny_model(), args=args,
                              train_dataset=StreamingJsonl(source), data_collator=worker.collate)
    assert trainer.get_train_dataloader().pin_memory == (args.device.type != "cpu")


def test_loaders_are_built_without_torchdatas_set_vital_warning(source: str) -> None:
    """torchdata's constructor calls torch's deprecated set_vital; ours ignore exactly that."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from streamds.integrations.loader import stateful_loader

    def caught(build) -> list[str]:
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            build()
        return [str(w.message) for w in found]

    if not any("set_vital" in m for m in caught(lambda: StatefulDataLoader(range(4)))):
        pytest.skip("this torch and torchdata pair does not warn about set_vital")
    ds = StreamingJsonl(source)
    assert caught(lambda: StreamdsLoader(ds, batch_size=4)) == []
    assert caught(lambda: stateful_loader(ds, batch_size=4)) == []
    # any other warning still shows: torch's about more workers than CPUs
    many = 4 * (os.cpu_count() or 1) + 1
    for build in (StreamdsLoader, stateful_loader):
        messages = caught(lambda build=build: build(ds, batch_size=4, num_workers=many))
        assert len(messages) == 1 and "worker processes" in messages[0], messages
    assert caught(lambda: StatefulDataLoader(range(4)))  # the filter ended with the call


def test_lightning_does_not_warn_that_an_exact_len_could_be_inaccurate(tmp_path: Path) -> None:
    """The documented setup (StreamdsCallback + StreamdsLoader over a corpus with a length)
    fits without Lightning's "`__len__` could be inaccurate" warning, which it gives for any
    IterableDataset with a len()."""
    pl = pytest.importorskip("lightning.pytorch")
    import framework_worker as worker

    from streamds.integrations.lightning import StreamdsCallback
    from streamds.preprocess.convert import convert

    (tmp_path / "in.jsonl").write_bytes(corpus.jsonl(corpus.make_records(24)))
    convert([str(tmp_path / "in.jsonl")], tmp_path / "shards")
    loader = StreamdsLoader(StreamingJsonl(tmp_path / "shards"), batch_size=4, num_workers=0,
                            collate_fn=worker.collate)
    assert len(loader) == 6
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         callbacks=[StreamdsCallback()], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        trainer.fit(_lightning_module(pl), train_dataloaders=loader)
    said = [str(w.message) for w in found]
    assert trainer.global_step == 6
    assert not any("could be inaccurate" in message for message in said), said


def test_a_max_steps_stream_refuses_a_reader_without_blocks_instead_of_hanging(
        tmp_path: Path) -> None:
    """StreamdsTrainer with max_steps streams epoch after epoch in each worker; a worker that
    owns no block of a one-block corpus got empty epochs forever (a DataLoader timeout)."""
    pytest.importorskip("transformers")
    from torch.utils.data import DataLoader

    from streamds.integrations.transformers import EpochStream

    path = tmp_path / "one-block.jsonl"
    path.write_bytes(corpus.jsonl(corpus.make_records(12)))
    loader = DataLoader(EpochStream(StreamingJsonl(path)), batch_size=None, num_workers=2,
                        timeout=60)  # broken, the empty worker would time the loader out
    records = 0
    with pytest.raises(ValueError, match=r"worker 1 of 2.*got no record in epochs 0 and 1"):
        for _ in loader:
            records += 1
            assert records < 100_000, "the empty worker was never refused"
    one = iter(EpochStream(StreamingJsonl(path)))  # one reader owns the block: it streams on
    assert [next(one)["id"] for _ in range(24)] == list(range(12)) * 2


def _lightning_module(pl):  # a linear model over framework_worker's batches
    import framework_worker as worker

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(worker.SEQ, 1)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.layer(batch["input_ids"].float()).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


def test_lightning_without_the_callback_is_refused_naming_it(source: str, tmp_path: Path) -> None:
    """Without StreamdsCallback every epoch would repeat epoch 0's order and a checkpoint
    would count the batch fetched ahead: the loader refuses to start, naming the callback;
    with it, the same fit runs (and iterating the loader outside Lightning is unaffected)."""
    pl = pytest.importorskip("lightning.pytorch")
    import framework_worker as worker

    from streamds.integrations.lightning import StreamdsCallback

    def fit(callbacks: list) -> pl.Trainer:
        loader = StreamdsLoader(StreamingJsonl(source, shuffle=True, seed=1), batch_size=8,
                                num_workers=0, collate_fn=worker.collate)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                             callbacks=callbacks, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False,
                             default_root_dir=str(tmp_path))
        trainer.fit(_lightning_module(pl), train_dataloaders=loader)
        return trainer

    with pytest.raises(ValueError, match=r"callbacks=\[StreamdsCallback\(\)\]"):
        fit([])
    assert fit([StreamdsCallback()]).global_step == 2 * RECORDS // 8
    assert len(list(StreamdsLoader(StreamingJsonl(source), batch_size=8, collate_fn=ids))) == (
        RECORDS // 8)


def test_another_loaders_state_is_refused_naming_what_to_pass(source: str) -> None:
    from streamds import StateMismatchError
    from streamds.integrations.loader import stateful_loader

    plain = stateful_loader(StreamingJsonl(source), batch_size=4, collate_fn=ids)
    next(iter(plain))
    loader = StreamdsLoader(StreamingJsonl(source), batch_size=4)
    for other in (plain.state_dict(), StreamingJsonl(source).state_dict(), [1]):
        with pytest.raises(StateMismatchError, match=r"not a StreamdsLoader state .*"
                           r"StreamdsLoader.state_dict\(\)"):
            loader.load_state_dict(other)


@pytest.mark.parametrize("given", ["batch", "loader", "mix_batch"])
def test_streamds_trainer_refuses_batches_naming_the_dataset_to_pass(
        source: str, tmp_path: Path, given: str) -> None:
    """Trainer batches records itself: ds.batch(8) would reach the user's collate as lists of
    batches, and ds.loader(8) made Trainer ask for max_steps even where it was set."""
    pytest.importorskip("transformers")
    import framework_worker as worker
    from transformers import TrainingArguments

    from streamds import Mix
    from streamds.integrations.transformers import StreamdsTrainer

    ds = StreamingJsonl(source)
    train = {"batch": lambda: ds.batch(8), "loader": lambda: ds.loader(8, num_workers=0),
             "mix_batch": lambda: Mix([ds], weights=[1.0], seed=0).batch(8)}[given]()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, report_to=[],
                             use_cpu=True, save_strategy="no", remove_unused_columns=False)
    with pytest.raises(ValueError, match=r"train_dataset=ds, .*per_device_train_batch_size=8"):
        StreamdsTrainer(model=worker.tiny_model(), args=args, train_dataset=train,
                        data_collator=worker.collate)
