"""One rank of a training run inside a real framework, for tests/test_frameworks.py.

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/framework_worker.py \\
        SCENARIO SOURCE OUT_DIR [--workers W] [--max-steps N] [--resume-from CHECKPOINT]
        [--one-rank] [--eval SOURCE...]

Scenarios: "accelerate" (a DataLoader through Accelerator().prepare, accelerate's defaults;
--one-rank: the dataset does not split by rank, accelerate's dispatcher alone splits),
"streamds-accelerate" (streamds.integrations.accelerate.prepare_loader, save_state at step 35),
"trainer" (Hugging Face Trainer, its defaults), "lightning" (StreamdsLoader and
StreamdsCallback, DDP, a checkpoint every 5 steps under OUT_DIR/ckpt), "streamds-trainer"
(streamds.integrations.transformers.StreamdsTrainer), two epochs or --max-steps, a
checkpoint every 5 steps under OUT_DIR/run; with --eval SOURCE... an evaluation at the start
and every 5 steps over each of those eval sets, whose metric records the ids of the eval
records it was given (under "evals" in the report: one list per evaluation, the eval sets in
turn; their losses under "eval_losses"). The model is
a one-layer GPT-2 built from a config (no download). The record ids of every batch a rank
trains on are written to OUT_DIR/rank-R.json as
``{"steps": [[ids...], ...], "evals": [[ids...], ...], "error": None | "ClassName: message"}``;
an exception is caught, written there and re-raised.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from streamds import StreamingJsonl

BATCH = 4
VOCAB = 64
SEQ = 4


def collate(records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Token ids made from the record ids, and the ids themselves under "rid"."""
    rid = torch.tensor([record["id"] for record in records], dtype=torch.int64)
    tokens = (rid[:, None] + torch.arange(SEQ)[None, :]) % VOCAB
    return {"input_ids": tokens, "labels": tokens, "rid": rid}


def tiny_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=8, n_layer=1, n_head=1)
    return GPT2LMHeadModel(config)


def run_accelerate(source: str, workers: int, one_rank: bool, seen: list[list[int]]) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True)
    world = {"rank": 0, "world_size": 1} if one_rank else {}
    dataset = StreamingJsonl(source, shuffle=True, seed=0, buffer_size=16, **world)
    loader = accelerator.prepare(
        DataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=collate))
    for batch in loader:
        seen.append(batch["rid"].tolist())


def run_streamds_accelerate(source: str, out: Path, workers: int, resume_from: str | None,
                            seen: list[list[int]]) -> None:
    """A plain accelerate loop with streamds.integrations.accelerate.prepare_loader; the state
    is saved with accelerator.save_state after step 35 (OUT_DIR/state)."""
    from accelerate import Accelerator

    from streamds.integrations.accelerate import prepare_loader

    accelerator = Accelerator(cpu=True)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    dataset = StreamingJsonl(source, shuffle=True, seed=0, buffer_size=16)
    loader = prepare_loader(dataset, accelerator, batch_size=BATCH, num_workers=workers,
                            collate_fn=collate)
    step, first_epoch = 0, 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        step, first_epoch = json.loads((Path(resume_from) / "progress.json").read_text())
    for epoch in range(first_epoch, 2):
        dataset.set_epoch(epoch)
        for batch in loader:
            rid = batch.pop("rid")
            seen.append(rid.tolist())
            batch = {key: value.to(accelerator.device) for key, value in batch.items()}
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == 35 and resume_from is None:
                accelerator.save_state(str(out / "state"))
                if accelerator.is_main_process:
                    (out / "state" / "progress.json").write_text(json.dumps([step, epoch]))


def trainer_class(base: type) -> type:
    class LoggingTrainer(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any,
                         **kwargs: Any) -> Any:
            rid = inputs.pop("rid")
            if model.training:  # evaluation computes the loss too
                self.seen.append(rid.tolist())
            return super().compute_loss(model, inputs, *args, **kwargs)

    return LoggingTrainer


EVALS: list[list[int]] = []  # the record ids each evaluation's metric was given
EVAL_LOSSES: list[float] = []  # each evaluation's eval loss, in the order of EVALS


def record_eval_ids(prediction: Any) -> dict[str, float]:
    """compute_metrics: the ids of the eval records, from the gathered label "rid"."""
    _, rid = prediction.label_ids
    EVALS.append([int(i) for i in rid])
    return {"records": float(len(rid))}


def run_trainer(scenario: str, source: str, out: Path, workers: int, max_steps: int,
                resume_from: str | None, seen: list[list[int]],
                eval_sources: list[str] | None = None) -> None:
    from transformers import Trainer, TrainingArguments

    if scenario == "streamds-trainer":
        from streamds.integrations.transformers import StreamdsTrainer

        base: type = StreamdsTrainer
        dataset = StreamingJsonl(source, shuffle=True, seed=0, buffer_size=16)
    else:
        base = Trainer
        dataset = StreamingJsonl(source, shuffle=True, seed=0, buffer_size=16)

    evaluation: dict[str, Any] = {}
    if eval_sources:  # labels and the record ids reach compute_metrics, gathered over ranks
        evaluation = {"eval_strategy": "steps", "eval_steps": 5, "label_names": ["labels", "rid"],
                      "per_device_eval_batch_size": BATCH, "eval_on_start": True}
    args = TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=BATCH, num_train_epochs=2,
        dataloader_num_workers=workers, save_strategy="steps", save_steps=5, report_to=[],
        logging_strategy="no", remove_unused_columns=False, use_cpu=True, seed=0,
        disable_tqdm=True, max_steps=max_steps, **evaluation,
    )
    eval_sets = {f"set{index}": StreamingJsonl(path)
                 for index, path in enumerate(eval_sources or [])}
    trainer = trainer_class(base)(
        model=tiny_model(), args=args, train_dataset=dataset, data_collator=collate,
        eval_dataset=eval_sets or None,
        compute_metrics=record_eval_ids if eval_sets else None)
    trainer.seen = seen
    trainer.train(resume_from_checkpoint=resume_from)
    EVAL_LOSSES.extend(value for entry in trainer.state.log_history
                       for key, value in entry.items()
                       if key.startswith("eval_") and key.endswith("_loss"))


EPOCHS: list[int] = []  # lightning: the epoch of each step in `seen`


def run_lightning(source: str, out: Path, workers: int, resume_from: str | None,
                  seen: list[list[int]], even_ranks: str | None = None) -> None:
    import lightning.pytorch as pl

    from streamds.integrations.lightning import StreamdsCallback, StreamdsLoader

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(SEQ, 1)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            seen.append(batch["rid"].tolist())
            EPOCHS.append(self.current_epoch)
            return self.layer(batch["input_ids"].float()).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    dataset = StreamingJsonl(source, shuffle=True, seed=0, buffer_size=16, even_ranks=even_ranks)
    loader = StreamdsLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=collate)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=5,
                                               save_top_k=-1, filename="{step}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                         max_epochs=2, callbacks=[StreamdsCallback(), checkpoints],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(Module(), train_dataloaders=loader, ckpt_path=resume_from)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario",
                        choices=["accelerate", "streamds-accelerate", "trainer",
                                 "streamds-trainer", "lightning"])
    parser.add_argument("source")
    parser.add_argument("out", type=Path)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--even-ranks", choices=["drop", "pad"], default=None,
                        help="lightning: StreamingJsonl(even_ranks=...)")
    parser.add_argument("--eval", nargs="+", default=None,
                        help="trainers: eval sets, one evaluation of each every 5 steps")
    parser.add_argument("--one-rank", action="store_true",
                        help="accelerate: StreamingJsonl(rank=0, world_size=1)")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    seen: list[list[int]] = []
    report: dict[str, Any] = {"steps": seen, "epochs": EPOCHS, "evals": EVALS,
                              "eval_losses": EVAL_LOSSES, "error": None}
    try:
        if args.scenario == "accelerate":
            run_accelerate(args.source, args.workers, args.one_rank, seen)
        elif args.scenario == "streamds-accelerate":
            run_streamds_accelerate(args.source, args.out, args.workers, args.resume_from, seen)
        elif args.scenario == "lightning":
            run_lightning(args.source, args.out, args.workers, args.resume_from, seen,
                          args.even_ranks)
        else:
            run_trainer(args.scenario, args.source, args.out, args.workers, args.max_steps,
                        args.resume_from, seen, args.eval)
    except Exception as err:
        report["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        name = f"rank-{rank}{'-resumed' if args.resume_from else ''}.json"
        (args.out / name).write_text(json.dumps(report))
    # tear gloo down before the interpreter does: its threads destroyed at exit can abort the
    # process ("terminate called without an active exception") after a run that went well
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
