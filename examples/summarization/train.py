"""Train a small abstractive summariser on PubMed-style articles streamed with streamds.

    python examples/summarization/train.py                    # synthetic corpus, ~3 min on 2 cores
    python examples/summarization/train.py --data pubmed-dataset --steps 20000 --num-workers 4
    python examples/summarization/train.py --resume           # continue exactly where it stopped
    python examples/summarization/train.py --mix pubmed:0.7,arxiv:0.3   # both corpora, mixed

The pipeline (see README.md beside this file):

    StreamingJsonl(train, shuffle=True)      raw records, shuffled by block and buffer
      .map(Featurize(tokenizer))             -> article_id, input_ids, labels (in the workers)
    Mix([...], weights)                      (--mix) records of each corpus in its proportion
    .batch(LengthBuckets(batch_size), collate=PadCollate)   -> padded LongTensors, records of
                                             similar length together (in the workers)
    StatefulDataLoader(batch_size=None)      -> the batches, as made
    DevicePrefetcher(loader, device)         -> the next batch copied to the GPU during the step
    StallMeter(...)                          -> how long each step waited for data

Every `--ckpt-every` steps the model, optimizer, schedule, RNG states and the loader's
position go into ``OUT/checkpoint.pt``; ``--resume`` loads them and the run continues with
exactly the batches the uninterrupted run would have seen (``--log-ids`` records them). A run
refuses to start over an earlier one in OUT unless ``--resume`` or ``--overwrite`` says which.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shlex
import sys
import time
from collections.abc import Sequence
from itertools import islice
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we fork DataLoader workers

import torch
from tokenizers import Tokenizer

from examples.summarization import corpus, rouge
from examples.summarization.model import PointerGenerator
from streamds import (
    DevicePrefetcher,
    LengthBuckets,
    Mix,
    PadCollate,
    StallMeter,
    StreamingJsonl,
    TokenBudget,
    as_list,
    cpu_quota,
    padding_of,
    stateful_loader,
)

CHECKPOINT = "checkpoint.pt"
RESULTS = "results.json"
EARLIER_RUN = (CHECKPOINT, RESULTS)  # files in OUT that mark an earlier run
ONE_RUN_ONLY = ("--resume", "--overwrite")  # flags a command to run again leaves out

# Defaults sized for ~3 minutes on 2 CPU cores; --tiny for tests (seconds).
DEFAULTS: dict[str, Any] = {
    "train_records": 3000, "val_records": 100, "test_records": 100, "record_chars": 1500,
    "vocab_size": 4000, "tokenizer_records": 3000, "max_source": 400, "max_target": 48,
    "d_model": 128, "heads": 4, "layers": 2, "ff": 256, "dropout": 0.0, "batch_size": 16,
    "steps": 300,
    "warmup": 50, "lr": 1.5e-3, "ckpt_every": 100, "log_every": 25, "eval_records": 100,
    "bucket_buffer": 256, "shuffle_buffer": 256, "num_workers": 1, "threads": 0,
}  # num_workers: at most this many, and fewer than the CPUs (one is the model's)
TINY: dict[str, Any] = {
    "train_records": 96, "val_records": 8, "test_records": 8, "record_chars": 400,
    "vocab_size": 400, "tokenizer_records": 96, "max_source": 96, "max_target": 24,
    "d_model": 32, "heads": 2, "layers": 1, "ff": 64, "dropout": 0.1, "batch_size": 4,
    "steps": 12,
    "warmup": 2, "lr": 3e-3, "ckpt_every": 4, "log_every": 4, "eval_records": 8,
    "bucket_buffer": 16, "shuffle_buffer": 16, "num_workers": 0, "threads": 1,
}
# Arguments that must match for --resume to continue the same run
RUN_IDENTITY = ("data", "mix", "mix_stop", "seed", "batching", "batch_size", "max_tokens",
                "bucket_buffer", "shuffle_buffer", "num_workers", "max_source", "max_target",
                "vocab_size", "d_model", "heads", "layers", "ff", "dropout", "train_records",
                "record_chars")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None,
                   help="folder with train.txt/val.txt/test.txt (PubMed/arXiv release) or "
                   "train/ val/ test/ shard folders; default: generate a synthetic corpus")
    p.add_argument("--out", default="data/summarization", help="corpus, tokenizer, checkpoint")
    p.add_argument("--mix", default=None, metavar="NAME:W,...",
                   help="train on several corpora in these proportions, e.g. "
                   "pubmed:0.7,arxiv:0.3; each NAME is a folder under --data (default: "
                   "synthetic pubmed and arxiv corpora); evaluation uses the first")
    p.add_argument("--mix-stop", choices=("first", "all", "cycle"), default="cycle",
                   help="when a mixed epoch ends: with the first corpus to run out, with the "
                   "last, or (cycle) once each has run out, the others restarting meanwhile")
    p.add_argument("--tiny", action="store_true", help="tiny corpus and model (for tests)")
    p.add_argument("--steps", type=int, help="optimizer steps in all")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an OUT that holds an earlier run (its checkpoint and "
                   "results are deleted)")
    p.add_argument("--stop-after", type=int, default=None, metavar="K",
                   help="checkpoint and exit after step K (simulates an interruption)")
    p.add_argument("--log-ids", default=None, metavar="PATH",
                   help="write {step, ids, loss, data_wait_ms} per step to this JSON-lines file")
    p.add_argument("--ckpt-every", type=int)
    p.add_argument("--log-every", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--num-workers", type=int,
                   help="DataLoader workers (default: 1 where there are 2 CPUs or more, else "
                   "0; never more than the CPUs this process may use)")
    p.add_argument("--batching", choices=("bucket", "tokens", "plain"), default="bucket",
                   help="bucket: similar lengths per batch; tokens: --max-tokens per batch; "
                   "plain: arrival order")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="padded source tokens per batch for --batching tokens "
                   "(default batch size x max source / 2)")
    p.add_argument("--bucket-buffer", type=int, help="records sorted together by length")
    p.add_argument("--shuffle-buffer", type=int, help="StreamingJsonl buffer_size")
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int)
    p.add_argument("--d-model", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--ff", type=int)
    p.add_argument("--dropout", type=float)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--tokenizer-records", type=int)
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="use this tokenizer.json instead of training one (the tokenizers "
                   "trainer breaks ties differently from run to run)")
    p.add_argument("--max-source", type=int, help="article tokens kept")
    p.add_argument("--max-target", type=int, help="summary tokens (with [EOS])")
    p.add_argument("--train-records", type=int, help="synthetic corpus size")
    p.add_argument("--val-records", type=int)
    p.add_argument("--test-records", type=int)
    p.add_argument("--record-chars", type=int, help="synthetic article length")
    p.add_argument("--eval-records", type=int, help="held-out articles scored with ROUGE")
    p.add_argument("--eval-split", choices=("val", "test"), default="val")
    p.add_argument("--no-amp", action="store_true", help="full precision on the GPU")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (default: the cores not taken by loader workers)")
    p.add_argument("--throttle", type=float, default=0.0, metavar="SECONDS",
                   help="sleep this long after each step: a stand-in for a slower model "
                   "(tests use it to kill a run mid-way)")
    p.add_argument("--quiet", action="store_true", help="only the final report")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options, defaults filled in; the worker count fitted to this machine's CPUs."""
    args = build_parser().parse_args(argv)
    asked_workers = args.num_workers is not None
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_tokens is None:
        args.max_tokens = args.batch_size * args.max_source // 2
    if args.mix is not None:
        try:
            args.mix = corpus.parse_mix(args.mix)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        unknown = [name for name, _ in args.mix if name not in corpus.LAYOUTS]
        if args.data is None and unknown:
            raise SystemExit(f"--mix: no synthetic corpus named {unknown}; the generator makes "
                             f"{list(corpus.LAYOUTS)}, or pass --data with a folder per name")
    for key in ("steps", "batch_size", "ckpt_every", "log_every", "max_source", "max_target"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1")
    if args.num_workers < 0:
        raise SystemExit("--num-workers must be >= 0 (0 loads in the main process)")
    if args.resume and args.overwrite:
        raise SystemExit("--resume continues the run in --out and --overwrite replaces it: "
                         "pass one of them")
    args.asked_workers = args.num_workers
    args.num_workers = fit_workers(args.num_workers, usable_cpus(), asked=asked_workers)
    return args


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity set), fewer where its cgroup's CPU
    quota is lower (a container's ``--cpus``)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    quota = cpu_quota()
    return max(1, min(cpus, math.floor(quota))) if quota is not None else cpus


def fit_workers(workers: int, cpus: int, *, asked: bool) -> int:
    """Loader workers for a machine with `cpus`: an asked-for count up to `cpus` (torch warns
    beyond, and the processes would only take turns), the default up to ``cpus - 1`` (the
    model trains on the CPU that is left)."""
    return min(workers, cpus if asked else cpus - 1)


class Log:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(message, flush=True)


# -- pieces ---------------------------------------------------------------------------------


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def prepare_data(args: argparse.Namespace, out: Path) -> dict[str, dict[str, str]]:
    """Corpus name -> split -> source: the one corpus, or each corpus of --mix."""
    names = [name for name, _ in args.mix] if args.mix else [None]
    found = {}
    for name in names:
        if args.data is not None:
            found[name or "data"] = corpus.find_splits(Path(args.data) / (name or ""))
            continue
        where = out / "corpus" if name is None else out / "corpus" / name
        found[name or "pubmed"] = corpus.generate_splits(
            where, train=args.train_records, val=args.val_records, test=args.test_records,
            seed=args.seed, record_chars=args.record_chars, layout=name or "pubmed")
    return found


def make_batcher(args: argparse.Namespace, corpora: dict[str, dict[str, str]],
                 featurize: corpus.Featurize):
    sources = []
    for name, splits in corpora.items():
        # -> raw records: blocks in a seeded order, records through a shuffle buffer
        records = StreamingJsonl(splits["train"], shuffle=True, seed=args.seed,
                                 buffer_size=args.shuffle_buffer)
        # -> {"article_id", "input_ids", "labels"(, "corpus")}, tokenized in the workers
        tag = name if args.mix else None
        sources.append(records.map(corpus.Featurize(featurize.tokenizer_path,
                                                    max_source=args.max_source,
                                                    max_target=args.max_target, corpus=tag)))
    # -> one stream: each record from corpus i with probability weight i (--mix)
    features = sources[0] if not args.mix else Mix(
        sources, [weight for _, weight in args.mix], seed=args.seed, stop=args.mix_stop)
    # -> padded batches, similar source lengths together (records cut by the rule, then
    # padded by PadCollate where they were read)
    collate = PadCollate(pad_id=corpus.PAD_ID, keys=("input_ids", "labels"))
    return features.batch(batch_rule(args) or args.batch_size, collate=collate)


def batch_rule(args: argparse.Namespace) -> LengthBuckets | TokenBudget | None:
    """The --batching rule: LengthBuckets, a TokenBudget, or None for plain batches."""
    if args.batching == "bucket":
        return LengthBuckets(args.batch_size, buffer_size=args.bucket_buffer)
    if args.batching == "tokens":
        return TokenBudget(args.max_tokens, buffer_size=args.bucket_buffer)
    return None


def cut_batches(records: list[dict[str, Any]], rule: LengthBuckets | TokenBudget | None,
                size: int, seed: int) -> list[list[dict[str, Any]]]:
    """`records` (a list in memory) in batches: `rule` cuts each pool, None cuts by `size`."""
    if rule is None:
        return [records[start : start + size] for start in range(0, len(records), size)]
    rng = random.Random(seed)
    batches = []
    for start in range(0, len(records), rule.pool_size):
        pool = records[start : start + rule.pool_size]
        cut = rule.cut([rule.length(record) for record in pool], rng)
        batches += [[pool[i] for i in indices] for indices in cut]
    return batches


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth (a multiplier of --lr)."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def seq2seq_loss(model: PointerGenerator, batch: dict[str, Any]) -> torch.Tensor:
    src, src_mask = batch["input_ids"], batch["attention_mask"]
    labels, label_mask = batch["labels"], batch["labels_mask"]
    bos = torch.full_like(labels[:, :1], corpus.BOS_ID)
    tgt_in = torch.cat([bos, labels[:, :-1]], dim=1)  # teacher forcing
    logp = model(src, src_mask, tgt_in)
    nll = -logp.gather(2, labels.unsqueeze(2)).squeeze(2)
    mask = label_mask.to(nll.dtype)
    return (nll * mask).sum() / mask.sum()


def padding_comparison(args: argparse.Namespace, train: str | list[str],
                       featurize: corpus.Featurize,
                       sample: int = 1024) -> dict[str, float]:
    """Pad share of source tokens: plain batches vs the chosen batching, same records."""
    stream = StreamingJsonl(train, shuffle=True, seed=args.seed, buffer_size=args.shuffle_buffer)
    records = list(islice(stream.map(featurize), sample))
    plain = padding_of(cut_batches(records, None, args.batch_size, args.seed), "input_ids")
    rule = batch_rule(args) or LengthBuckets(args.batch_size, buffer_size=args.bucket_buffer)
    bucketed = padding_of(cut_batches(records, rule, args.batch_size, args.seed), "input_ids")
    return {"records": len(records), "plain_pad_fraction": plain.pad_fraction,
            "bucketed_pad_fraction": bucketed.pad_fraction,
            "tokens_saved_fraction": 1 - bucketed.padded / plain.padded if plain.padded else 0.0}


def evaluate(model: PointerGenerator, tokenizer: Tokenizer, source: str,
             args: argparse.Namespace, tokenizer_path: Path, device: torch.device
             ) -> dict[str, Any]:
    """ROUGE of greedy summaries and of lead-3 against the reference abstracts."""
    featurize = corpus.Featurize(tokenizer_path, max_source=args.max_source,
                                 max_target=args.max_target, keep_text=True)
    records = list(islice(StreamingJsonl(source).map(featurize), args.eval_records))
    collate = PadCollate(pad_id=corpus.PAD_ID, keys=("input_ids",))
    batches = cut_batches(records, LengthBuckets(32, buffer_size=max(1, len(records))), 32,
                          args.seed)
    model.eval()
    pairs, leads, examples = [], [], []
    for group in batches:
        batch = collate(group)
        ids = model.generate(batch["input_ids"].to(device), batch["attention_mask"].to(device),
                             bos_id=corpus.BOS_ID, eos_id=corpus.EOS_ID,
                             max_len=args.max_target,
                             banned=(corpus.PAD_ID, corpus.UNK_ID, corpus.BOS_ID))
        for record, summary_ids in zip(group, ids, strict=True):
            summary = tokenizer.decode(summary_ids)
            pairs.append((summary, record["reference"]))
            leads.append((record["lead3"], record["reference"]))
            examples.append((record["article_id"], summary, record["reference"]))
    model.train()
    examples.sort()
    return {"records": len(pairs), "model": rouge.corpus_rouge(pairs),
            "lead3": rouge.corpus_rouge(leads), "example": examples[0] if examples else None}


# -- checkpoints ----------------------------------------------------------------------------


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-save leaves the previous checkpoint intact


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trim_id_log(path: Path, last_step: int) -> None:
    """Keep the entries of steps <= last_step: later ones are redone after a resume."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line cut short when the run was killed
            break
        if entry["step"] > last_step:
            break
        kept.append(line + "\n")
    path.write_text("".join(kept))


def identity(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, key) for key in RUN_IDENTITY}


def shown(path: str | os.PathLike[str]) -> str:
    """`path` as a user would type it here: relative to the current folder when inside it."""
    path = os.path.abspath(path)
    inside = os.path.relpath(path)
    return path if inside.startswith("..") else inside


def this_command(argv: Sequence[str] | None) -> list[str]:
    """The command line that runs this script again with `argv`."""
    given = sys.argv[1:] if argv is None else list(argv)
    return [shown(sys.executable), shown(__file__), *given]


def again(command: Sequence[str], flag: str) -> str:
    """`command` to run again with `flag` (--resume or --overwrite), as one shell line: the
    other of the two and --stop-after (a one-off interruption) are left out."""
    kept, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg in ONE_RUN_ONLY or arg.startswith("--stop-after="):
            continue
        elif arg == "--stop-after":
            skip = True  # and its value
        else:
            kept.append(arg)
    return shlex.join([*kept, flag])


def check_out(out: Path, args: argparse.Namespace, command: Sequence[str]) -> None:
    """Refuse to start over an earlier run in `out` unless --resume or --overwrite says what
    to do with it; with --overwrite, delete its checkpoint and results first (a checkpoint
    left behind would pair the old model with the new run's tokenizer on a later --resume)."""
    found = [name for name in EARLIER_RUN if (out / name).exists()]
    if not found or args.resume:
        return
    if not args.overwrite:
        raise SystemExit(
            f"{shown(out)} holds an earlier run ({', '.join(found)}); to continue it from its "
            f"last checkpoint run\n  {again(command, '--resume')}\nor to start afresh, "
            f"replacing it,\n  {again(command, '--overwrite')}\n(or choose another folder "
            "with --out)")
    for name in (*EARLIER_RUN, CHECKPOINT + ".tmp"):
        (out / name).unlink(missing_ok=True)


# -- the run --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, *,
         command: Sequence[str] | None = None) -> dict[str, Any]:
    """Train and evaluate; returns the summary. `command`: the command line that runs this
    run again (messages add --resume or --overwrite to it); default, this script with `argv`.
    The heap frozen while training (`gc.freeze()` in `_train`) is unfrozen on the way out,
    error or not, unless the caller had frozen it."""
    frozen_before = gc.get_freeze_count() > 0
    command = this_command(argv) if command is None else list(command)
    try:
        return _train(argv, command)
    except KeyboardInterrupt:
        print(f"\n{interrupted(argv, command)}", file=sys.stderr, flush=True)
        raise
    finally:
        if not frozen_before:
            gc.unfreeze()


def interrupted(argv: Sequence[str] | None, command: list[str]) -> str:
    """What to say after Ctrl-C: how to continue from the checkpoint, or, where none was
    saved yet, that a run with --resume starts at step 0 again (reusing the corpus made)."""
    checkpoint = Path(parse_args(argv).out) / CHECKPOINT
    if checkpoint.exists():
        return (f"interrupted; to continue from the last checkpoint ({shown(checkpoint)}), "
                f"run: {again(command, '--resume')}")
    return (f"interrupted before the first checkpoint was saved; {again(command, '--resume')} "
            "starts again at step 0 with the corpus and tokenizer already made")


def _train(argv: Sequence[str] | None, command: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    log = Log(args.quiet)
    started = time.perf_counter()
    out = Path(args.out)
    check_out(out, args, command)
    out.mkdir(parents=True, exist_ok=True)
    log(f"output folder: {shown(out)}{os.sep} (corpus{os.sep}, tokenizer.json, {CHECKPOINT} "
        f"every {args.ckpt_every} steps, {RESULTS})")
    log(f"stop it at any time (Ctrl-C or kill); once a checkpoint is saved, this continues "
        f"from it: {again(command, '--resume')}")
    if args.num_workers != args.asked_workers:
        log(f"{args.num_workers} loader worker(s) instead of {args.asked_workers}: this "
            f"process may use {usable_cpus()} CPU(s)")
    device = pick_device(args.device)
    if device.type == "cpu":
        # one core per DataLoader worker, the rest for the model: oversubscribed OpenMP
        # threads spin against each other and can slow a step down several times
        torch.set_num_threads(args.threads or max(1, usable_cpus() - args.num_workers))
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    cuda = device.type == "cuda"

    checkpoint_path = out / CHECKPOINT
    checkpoint = None
    if args.resume and checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
        if checkpoint["identity"] != identity(args):
            changed = sorted(k for k in RUN_IDENTITY
                             if checkpoint["identity"].get(k) != getattr(args, k))
            raise SystemExit(f"--resume: these arguments differ from the checkpoint's run: "
                             f"{changed}; pass the same ones, or --overwrite (instead of "
                             f"--resume) to start afresh, or a new --out")
    elif args.resume:
        log(f"no checkpoint in {out}; starting from scratch")

    # -- data and tokenizer
    corpora = prepare_data(args, out)
    splits = next(iter(corpora.values()))  # evaluation uses the first corpus
    trains = [found["train"] for found in corpora.values()]
    train = trains[0] if len(trains) == 1 else trains
    tokenizer_path = out / "tokenizer.json"
    if checkpoint is not None and tokenizer_path.exists():
        tokenizer = Tokenizer.from_file(str(tokenizer_path))  # the one the run started with
    elif args.tokenizer is not None:
        tokenizer = Tokenizer.from_file(args.tokenizer)
        tokenizer.save(str(tokenizer_path))
    else:
        t0 = time.perf_counter()
        tokenizer = corpus.train_tokenizer(train, tokenizer_path,
                                           vocab_size=args.vocab_size,
                                           records=args.tokenizer_records)
        log(f"tokenizer: WordPiece, {tokenizer.get_vocab_size()} tokens, learned from "
            f"{args.tokenizer_records} streamed records in {time.perf_counter() - t0:.1f} s")
    featurize = corpus.Featurize(tokenizer_path, max_source=args.max_source,
                                 max_target=args.max_target)
    batcher = make_batcher(args, corpora, featurize)
    loader = stateful_loader(
        batcher,
        batch_size=None,  # the dataset yields whole batches, padded by its collate
        num_workers=args.num_workers,
        collate_fn=as_list,  # hand them over as made (no walk through their values)
        pin_memory=cuda,
        generator=torch.Generator().manual_seed(args.seed),  # leave the global RNG alone
    )
    prefetcher = DevicePrefetcher(loader, device)
    meter = StallMeter(prefetcher, window=args.log_every)

    # -- model and optimizer
    model = PointerGenerator(tokenizer.get_vocab_size(), d_model=args.d_model,
                             heads=args.heads, layers=args.layers, ff=args.ff,
                             dropout=args.dropout,
                             max_len=max(args.max_source, args.max_target) + 1,
                             pad_id=corpus.PAD_ID).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                                  weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, args))
    amp_dtype = None
    if cuda and not args.no_amp:
        amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)

    # everything made so far (torch's modules, the model, the tokenizer) lives to the end:
    # take it out of the cyclic collector's way, so that no full collection scans it while the
    # loader starts (README: "The first batch in a fresh process") and the forked workers'
    # collections do not write to the pages they share with this process
    gc.freeze()
    step, epoch, history, records_seen = 0, 0, [], 0
    real_tokens = padded_tokens = 0
    mix_counts = dict.fromkeys(corpora, 0) if args.mix else {}  # records per corpus
    window_loss, window_steps = 0.0, 0  # losses since the last log line
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        schedule.load_state_dict(checkpoint["schedule"])
        scaler.load_state_dict(checkpoint["scaler"])
        step, epoch, history = checkpoint["step"], checkpoint["epoch"], checkpoint["history"]
        records_seen = checkpoint["records_seen"]
        real_tokens, padded_tokens = checkpoint["real_tokens"], checkpoint["padded_tokens"]
        mix_counts = checkpoint["mix_counts"]
        window_loss, window_steps = checkpoint["window"]
        prefetcher.load_state_dict(checkpoint["loader"])
        set_rng_state(checkpoint["rng"])
        log(f"resumed from {checkpoint_path} at step {step} (epoch {epoch})")
    id_log = Path(args.log_ids) if args.log_ids else None
    if id_log is not None:
        if checkpoint is not None:
            trim_id_log(id_log, step)
        elif id_log.exists():
            id_log.unlink()

    params = sum(p.numel() for p in model.parameters())
    log(f"model: pointer-generator transformer, {params / 1e6:.2f} M parameters, on {device}"
        f"{' with ' + str(amp_dtype).split('.')[-1] + ' autocast' if amp_dtype else ''}; "
        f"batching: {args.batching}, {args.num_workers} loader worker(s), "
        f"{torch.get_num_threads()} torch thread(s)")

    def checkpoint_now() -> None:
        save_checkpoint(checkpoint_path, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
            "step": step, "epoch": epoch, "history": history, "records_seen": records_seen,
            "real_tokens": real_tokens, "padded_tokens": padded_tokens, "mix_counts": mix_counts,
            "window": [window_loss, window_steps], "loader": prefetcher.state_dict(),
            "rng": rng_state(), "identity": identity(args),
        })

    # -- training
    model.train()
    train_started = time.perf_counter()
    start_records = records_seen
    stopped = False
    while step < args.steps and not stopped:
        batcher.set_epoch(epoch)
        for batch in meter:
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                                enabled=amp_dtype is not None):
                loss = seq2seq_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
            step += 1
            value = loss.item()  # also syncs the GPU, so StallMeter sees the real step time
            window_loss, window_steps = window_loss + value, window_steps + 1
            records_seen += len(batch["article_id"])
            for name in batch.get("corpus", ()):
                mix_counts[name] += 1
            real_tokens += int(batch["attention_mask"].sum())
            padded_tokens += batch["attention_mask"].numel()
            if id_log is not None:
                with id_log.open("a") as f:
                    f.write(json.dumps({"step": step, "ids": batch["article_id"], "loss": value,
                                        "data_wait_ms": 1000 * meter.last_wait_s}) + "\n")
            if step % args.log_every == 0 or step == args.steps:
                history.append([step, window_loss / window_steps])
                rate = (records_seen - start_records) / (time.perf_counter() - train_started)
                log(f"step {step:5d}  loss {window_loss / window_steps:7.3f}  "
                    f"lr {schedule.get_last_lr()[0]:.2e}  data wait "
                    f"{100 * meter.recent_wait_fraction:4.1f}% (last {window_steps})  "
                    f"{rate:6.1f} rec/s")
                window_loss, window_steps = 0.0, 0
            if args.throttle:
                time.sleep(args.throttle)
            if step % args.ckpt_every == 0 or step == args.stop_after or step == args.steps:
                checkpoint_now()
            if step == args.stop_after:
                log(f"stopping after step {step} as asked (--stop-after); to continue: "
                    f"{again(command, '--resume')}")
                stopped = True
                break
            if step >= args.steps:
                break
        else:
            epoch += 1
    train_seconds = time.perf_counter() - train_started

    summary: dict[str, Any] = {
        "steps": step,
        "epoch": epoch,
        "history": history,
        "stopped_early": stopped,
        "train_seconds": train_seconds,
        "records_per_s": (records_seen - start_records) / train_seconds if train_seconds else 0,
        "stall": meter.summary(),
        "pad_fraction_in_training": 1 - real_tokens / padded_tokens if padded_tokens else 0.0,
        "device": str(device),
    }
    if args.mix:
        total_weight = sum(weight for _, weight in args.mix)
        summary["mix"] = {"shares": {name: w / total_weight for name, w in args.mix},
                          "records": mix_counts}
    if not stopped:
        summary["padding"] = padding_comparison(args, train, featurize)
        eval_source = splits.get(args.eval_split) or splits.get("test") or splits["val"]
        t0 = time.perf_counter()
        summary["eval"] = evaluate(model, tokenizer, eval_source, args, tokenizer_path, device)
        summary["eval_seconds"] = time.perf_counter() - t0
    summary["seconds"] = time.perf_counter() - started
    (out / RESULTS).write_text(json.dumps(summary, indent=2))
    if not args.quiet:
        print(report(summary, args))
    return summary


def report(summary: dict[str, Any], args: argparse.Namespace) -> str:
    """The end-of-run report: loss curve, ROUGE next to lead-3, data wait, padding."""
    lines = ["", "== summary =="]
    curve = summary["history"]
    if curve:
        marks = curve if len(curve) <= 8 else [curve[round(i * (len(curve) - 1) / 7)]
                                              for i in range(8)]
        lines.append("loss: " + " -> ".join(f"{loss:.2f} (step {s})" for s, loss in marks))
    stall = summary["stall"]
    lines.append(
        f"data wait: {100 * stall['wait_fraction']:.1f}% of step time "
        f"(first batch after {stall['first_batch_s'] or 0:.2f} s); "
        f"{summary['records_per_s']:.1f} records/s over {summary['train_seconds']:.0f} s"
    )
    if "mix" in summary:
        counts = summary["mix"]["records"]
        total = sum(counts.values()) or 1
        lines.append("mix: " + ", ".join(
            f"{name} {100 * n / total:.1f}% of records (weight "
            f"{100 * summary['mix']['shares'][name]:.0f}%)" for name, n in counts.items()))
    if "padding" in summary:
        pad = summary["padding"]
        lines.append(
            f"padding (source tokens, {pad['records']} records): plain batches "
            f"{100 * pad['plain_pad_fraction']:.1f}% pad, {args.batching} batching "
            f"{100 * pad['bucketed_pad_fraction']:.1f}% pad -> "
            f"{100 * pad['tokens_saved_fraction']:.0f}% fewer tokens per epoch; in training: "
            f"{100 * summary['pad_fraction_in_training']:.1f}% pad"
        )
    if "eval" in summary:
        ev = summary["eval"]
        lines.append(f"ROUGE F1 on {ev['records']} held-out articles ({args.eval_split}):")
        lines.append(f"  {'':8}{'R-1':>7}{'R-2':>7}{'R-L':>7}")
        for name in ("model", "lead3"):
            r = ev[name]
            label = "model" if name == "model" else "lead-3"
            lines.append(f"  {label:8}{r['rouge1']:7.1f}{r['rouge2']:7.1f}{r['rougeL']:7.1f}")
        if ev["example"]:
            article_id, summary_text, reference = ev["example"]
            lines.append(f"example {article_id}:")
            lines.append(f"  model:     {summary_text}")
            lines.append(f"  reference: {reference}")
    out = Path(args.out)
    lines.append(f"total {summary['seconds']:.0f} s; checkpoint {shown(out / CHECKPOINT)}, "
                 f"results {shown(out / RESULTS)}")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)  # the message above says how to continue
