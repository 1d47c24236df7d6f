"""Hugging Face `Trainer` with a loader that streamds alone splits by rank.

`Trainer` hands its train loader to `accelerator.prepare`, which splits an `IterableDataset`
again across processes (streamds refuses that with `DoubleSplitError`). `StreamdsTrainer`
builds the train loader of a streamds dataset itself and keeps it away from accelerate: each
rank reads, parses and maps only its own share (DataLoader workers split it further), and the
batches go to the device through Trainer's own input preparation.

Two shapes, chosen by ``max_steps``:

- ``max_steps`` unset (epochs): needs the loader's ``len()``, the batches this rank yields in
  every epoch (known for a converted corpus or under even_ranks, and where every epoch
  yields as many: Trainer plans all epochs from the first one's length); without it a
  ValueError names why. An epoch that would still yield another number is refused before
  its first batch. `set_epoch` reaches the dataset in every epoch, also the one a
  resume fast-forwards through.
- ``max_steps`` set: one endless stream, epoch after epoch (each epoch every record of this
  rank's share once), so no rank runs out before another and `max_steps` alone ends the run.

Evaluation (`evaluate`, `predict`, ``eval_strategy``) of a streamds eval dataset goes through
`EvalLoader` (streamds.integrations.eval_loader), never accelerate's: each rank reads its own
share, every rank makes as many eval steps, and the gathered losses, logits and labels keep
each rank's real rows only, so every eval record counts exactly once over the ranks. Refused:
an eval dataset with ``even_ranks`` ("drop" skips records, "pad" repeats them), or given a
rank or world_size other than the run's (its shares would not add up to the set once).

Resuming is Trainer's own in transformers 5.24: it saves no loader state and re-reads and
discards the batches trained before the checkpoint (accelerate's `skip_first_batches`); a
streamds dataset yields the same batches again for the same seed, epoch and world, so the
resumed run trains exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..world import detect_world
from . import require
from .eval_loader import AccelerateRanks, EvalLoader, gather_rows

_transformers = require("transformers")

__all__ = ["EpochLoader", "EpochStream", "StreamdsTrainer"]


def _is_streamds(dataset: Any) -> bool:
    from ..datasets.dataset import StreamingJsonl
    from ..datasets.mix import Mix
    from ..datasets.pack import Packed

    return isinstance(dataset, (StreamingJsonl, Mix, Packed))


def _refuse_batches(dataset: Any, role: str = "train") -> None:
    """Refuse a streamds dataset that yields whole batches (``ds.batch(n)``) or a streamds
    loader (``ds.loader(n)``) as Trainer's `role` dataset: Trainer batches the records itself
    (`per_device_{role}_batch_size`, `data_collator`), so it would hand lists of batches to
    the collator, and a loader is no dataset at all."""
    from ..datasets.batching import Batched
    from ..train.loader import Loader

    if isinstance(dataset, Loader):
        given = f"ds.loader({dataset.batch_size}) (a loader, not a dataset)"
        size = dataset.batch_size
    elif isinstance(dataset, Batched):
        given, size = "ds.batch(...) (a dataset of whole batches)", dataset.size
    elif getattr(dataset, "_batch", None) is not None:  # a StreamingJsonl's .batch(...)
        given, size = "ds.batch(...) (a dataset of whole batches)", dataset._batch.size
    else:
        return
    size_text = size if isinstance(size, int) else "N"
    raise ValueError(
        f"StreamdsTrainer was given {given} as {role}_dataset; Trainer makes the batches "
        f"itself: pass the dataset of records, StreamdsTrainer({role}_dataset=ds, "
        f"args=TrainingArguments(per_device_{role}_batch_size={size_text}, ...), "
        "data_collator=collate)"
    )


def _readers(dataset: Any) -> list[Any]:
    """The StreamingJsonl readers under a streamds dataset (a mix's sources, a packing's)."""
    from ..datasets.mix import Mix
    from ..datasets.pack import Packed

    if isinstance(dataset, Mix):
        return [reader for source in dataset.datasets for reader in _readers(source)]
    if isinstance(dataset, Packed):
        return _readers(dataset.source)
    return [dataset]


def _refuse_even_ranks(dataset: Any) -> None:
    """Refuse an eval dataset with even_ranks: "drop" leaves records out of the metrics and
    "pad" repeats records that nothing tells from the others; `EvalLoader` evens the steps."""
    modes = {reader.even_ranks for reader in _readers(dataset)} - {None}
    if modes:
        mode = modes.pop()
        what = ("leaves records out of every evaluation" if mode == "drop" else
                "repeats records, which would count twice in the metrics")
        raise ValueError(
            f"StreamdsTrainer was given an eval dataset with even_ranks={mode!r}, which {what}; "
            "StreamdsTrainer evens the eval steps itself (a rank that runs out repeats a batch "
            "that counts nowhere): build the eval dataset without even_ranks, e.g. "
            "StreamingJsonl('eval/', even_ranks=None)")


def _refuse_another_world(dataset: Any, accelerator: Any) -> None:
    """Refuse an eval dataset given a rank or world_size other than the run's: its ranks'
    shares would not add up to the eval set once (rank=0, world_size=1 under 2 processes
    counts every record twice; world_size=2 in one process never reads rank 1's share)."""
    if (dataset.rank, dataset.world_size) == (None, None):
        return
    world = detect_world(dataset.rank, dataset.world_size)
    run = (accelerator.process_index, accelerator.num_processes)
    if (world.rank, world.world_size) != run:
        raise ValueError(
            f"StreamdsTrainer was given an eval dataset with rank={dataset.rank}, "
            f"world_size={dataset.world_size}, but this is rank {run[0]} of {run[1]} "
            "process(es): the ranks' shares would not hold every eval record once (each "
            "rank reading the whole set counts each record once per process). Leave rank and "
            "world_size unset: StreamdsTrainer's eval loader lets each rank read its own share")


def _owns_no_block(dataset: Any) -> bool:
    """Whether this rank owns no block of a StreamingJsonl eval set (a small set cut into
    fewer blocks than ranks; every rank owns a block once there are as many blocks as ranks).
    Such a rank reads nothing (the dataset would refuse an empty rank of a DDP job) and
    `EvalLoader` gives it another rank's batch to repeat, counted nowhere."""
    from ..datasets.dataset import StreamingJsonl
    from ..datasets.pack import Packed

    if isinstance(dataset, Packed):  # packs what its reader yields
        return _owns_no_block(dataset.source)
    if not isinstance(dataset, StreamingJsonl):
        return False  # a mix's sources never refuse an empty rank
    world = detect_world(dataset.rank, dataset.world_size)
    return dataset._plan.num_blocks <= world.rank


class EpochLoader(DataLoader):
    """A DataLoader whose `set_epoch` reaches its streamds dataset (Trainer calls it)."""

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


class EpochStream(IterableDataset):
    """Epoch after epoch of `dataset` from its current epoch on, without end (no len).

    A reader that gets no record in two epochs in a row is refused: the blocks a reader
    owns follow its index, so one that owns none now owns none in any epoch, and streaming
    empty epochs would wait forever (a corpus of fewer blocks than readers)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.first = dataset.epoch

    def __iter__(self) -> Iterator[Any]:
        empty = 0
        for epoch in itertools.count(self.first):
            self.dataset.set_epoch(epoch)
            yielded = False
            for item in self.dataset:
                yielded = True
                yield item
            empty = 0 if yielded else empty + 1
            if empty == 2:
                info = get_worker_info()
                where = "" if info is None else (
                    f" (DataLoader worker {info.id} of {info.num_workers})")
                raise ValueError(
                    f"with max_steps a reader{where} streams epoch after epoch, and it got no "
                    f"record in epochs {epoch - 1} and {epoch}: the corpus has fewer blocks "
                    "than readers (ranks x dataloader_num_workers), or a filter dropped every "
                    "record of its blocks; use fewer dataloader_num_workers, or more blocks "
                    "(convert with a smaller --frame-size, or read the plain .jsonl)")


class _StepsTaken(dict):
    """An `EvalLoader` evaluation's metrics, whose steps per second are the loader's steps.

    Trainer's `evaluate` and `predict` add the speed metrics to the loop's metrics with one
    `update`, its steps counted as the samples over global batches of eval_batch_size x
    processes: the steps only where every rank's share fills as many full batches. The
    ranks make as many steps as the rank with the most batches, so here the steps per second
    are those steps over the runtime the same update reports.
    """

    STEPS = "_steps_per_second"
    RUNTIME = "_runtime"

    def __init__(self, metrics: dict[str, Any], steps: int) -> None:
        super().__init__(metrics)
        self.steps = steps

    def update(self, *args: Any, **kwargs: Any) -> None:
        added = dict(*args, **kwargs)
        for key in added:
            if key.endswith(self.STEPS):
                runtime = added.get(key.removesuffix(self.STEPS) + self.RUNTIME)
                if runtime:  # Trainer reports no speed for a runtime of 0
                    added[key] = round(self.steps / runtime, 3)
        super().update(added)


class StreamdsTrainer(_transformers.Trainer):
    """A `transformers.Trainer` whose streamds train dataset is split by streamds alone.

    Example::

        trainer = StreamdsTrainer(model=model, args=TrainingArguments(...),
                                  train_dataset=StreamingJsonl("shards/", shuffle=True)
                                  .map(tokenize), data_collator=collator)
        trainer.train()

    Any other train dataset goes the Trainer's own way. Under more than one process use
    ``even_ranks`` with epochs, so that every rank makes as many steps (DDP syncs each step).
    A streamds eval dataset (``eval_dataset=``, `evaluate`, `predict`) needs no even_ranks: its
    `EvalLoader` evens the eval steps and the metrics get every eval record once.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_batches(self.train_dataset)

    def get_train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset
        _refuse_batches(dataset)
        if not _is_streamds(dataset):
            return super().get_train_dataloader()
        args = self.args
        collate = self._get_collator_with_removed_columns(self.data_collator,
                                                          description="training")
        options: dict[str, Any] = {
            "batch_size": self._train_batch_size, "collate_fn": collate,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory and args.device.type != "cpu",
            "persistent_workers": args.dataloader_persistent_workers,
            "prefetch_factor": args.dataloader_prefetch_factor,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "drop_last": args.dataloader_drop_last,
        }
        if args.max_steps > 0:
            return DataLoader(EpochStream(dataset), **options)
        loader = EpochLoader(dataset, **options)
        try:
            len(loader)
        except TypeError as err:  # Trainer would only say that max_steps is needed
            raise ValueError(f"StreamdsTrainer cannot plan epochs: {err}") from err
        return loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """A streamds eval dataset's `EvalLoader` (see the module); any other, Trainer's."""
        name = eval_dataset if isinstance(eval_dataset, str) else "eval"
        dataset = (self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else
                   self.eval_dataset if eval_dataset is None else eval_dataset)
        _refuse_batches(dataset, "eval")
        if not _is_streamds(dataset):
            return super().get_eval_dataloader(eval_dataset)
        return self._streamds_eval_loader(dataset, "evaluation", name)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        _refuse_batches(test_dataset, "eval")
        if not _is_streamds(test_dataset):
            return super().get_test_dataloader(test_dataset)
        return self._streamds_eval_loader(test_dataset, "test", None)

    def _streamds_eval_loader(self, dataset: Any, description: str,
                              name: str | None) -> EvalLoader:
        _refuse_even_ranks(dataset)
        _refuse_another_world(dataset, self.accelerator)
        args = self.args
        kept = getattr(self, "_streamds_eval_loaders", {})
        if name is not None and name in kept and args.dataloader_persistent_workers:
            return kept[name]  # as Trainer keeps its own: no new workers for every evaluation
        collate = self._get_collator_with_removed_columns(self.data_collator,
                                                          description=description)
        workers: dict[str, Any] = {
            "num_workers": args.dataloader_num_workers,
            "persistent_workers": args.dataloader_persistent_workers,
            "prefetch_factor": args.dataloader_prefetch_factor,
            "multiprocessing_context": args.dataloader_multiprocessing_context}
        if _owns_no_block(dataset):
            dataset, workers = [], {}  # nothing to read here: no workers either
        loader = EvalLoader(
            dataset, ranks=AccelerateRanks(self.accelerator), batch_size=args.eval_batch_size,
            collate_fn=collate,
            pin_memory=args.dataloader_pin_memory and args.device.type != "cpu", **workers)
        if name is not None and args.dataloader_persistent_workers:
            self._streamds_eval_loaders = {**kept, name: loader}
        return loader

    def evaluation_loop(self, dataloader: DataLoader, *args: Any, **kwargs: Any) -> Any:
        """Trainer's loop; over an `EvalLoader` its gathers keep each rank's real rows
        (`gather_rows`), accelerate's `GradientState` sees the loader's last step, and its
        samples (what the speed metrics divide) are the real rows of every rank."""
        if not isinstance(dataloader, EvalLoader):
            return super().evaluation_loop(dataloader, *args, **kwargs)
        accelerator, options = self.accelerator, self.args
        self.gather_function = functools.partial(gather_rows, accelerator, dataloader)
        # batch_eval_metrics reads gradient_state.end_of_dataloader, as accelerate's own
        # loaders register themselves while they iterate
        accelerator.gradient_state._add_dataloader(dataloader)
        # each rank's batch loss over its own tokens: averaged over the tokens of every rank's
        # batch, a rank's loss would be scaled by its share of the step's tokens (a short
        # batch's shrunk, a repeat's tokens counted), which only equal weights undo
        averaged, options.average_tokens_across_devices = (
            options.average_tokens_across_devices, False)
        try:
            output = super().evaluation_loop(dataloader, *args, **kwargs)
        finally:
            options.average_tokens_across_devices = averaged
            accelerator.gradient_state._remove_dataloader(dataloader)
            self.gather_function = accelerator.gather_for_metrics
        # Trainer counts this rank's rows (its dataset's length, or the rows it saw, repeats
        # included): eval_samples_per_second divides what every rank evaluated instead, and
        # eval_steps_per_second the steps the loader made (_StepsTaken)
        return output._replace(num_samples=dataloader.rows_kept,
                               metrics=_StepsTaken(output.metrics, dataloader.steps))

    def _run_epoch(self, **kwargs: Any) -> Any:
        loader = kwargs["train_dataloader"]
        if isinstance(loader, EpochLoader):
            epoch = kwargs["epoch"]
            # a resume wraps the loader in accelerate's SkipDataLoader, which has no set_epoch
            loader.set_epoch(epoch)
            planned, batches = kwargs["steps_in_epoch"], len(loader)
            if batches != planned:
                raise ValueError(
                    f"epoch {epoch} yields {batches} batches on this rank, but Trainer planned "
                    f"every epoch from the first one's {planned} (it assumes epochs of one "
                    "length, also when it resumes); with shuffle=True the shares of ranks and "
                    "workers vary by epoch. Set max_steps in TrainingArguments (the loader "
                    "then streams epoch after epoch), or shuffle=False"
                )
        return super()._run_epoch(**kwargs)
