"""The realistic input pipeline (issue 11, part 3): parse JSONL, tokenize in the DataLoader
workers, batches of 16 padded int64 tensors; streamds against Hugging Face `datasets`
streaming and webdataset doing the same work, for 0, 1 and 2 workers, in one run.

    python benchmarks/tokenize_bench.py            # ~60 MB of PubMed-layout records, ~4 min
    python benchmarks/tokenize_bench.py --quick    # ~8 MB, one minute or two

Every reader gets the same records: streamds and `datasets` read the same 8 JSONL shards,
webdataset 8 tar shards of `.json` members holding the same lines. All three tokenize with one
WordPiece tokenizer (`tokenizers`, trained once on a sample of the corpus, saved to a temporary
directory and loaded in each worker by path) and pad with the same `PadCollate`. Each round
runs every (workers, reader) pair once, the reader order rotating between rounds; the table
has the medians. CPU is the process tree's (main process plus its reaped workers) over wall
time; at 0 workers torch's intra-op threads join in the padding, while DataLoader workers run
one thread each.
A second table isolates the hand-over: padded batches of the same shape replayed from memory
in the workers (nothing read or tokenized), sent as torch sends a dict of tensors (a /dev/shm
file and a descriptor per tensor) and as streamds sends them (`TensorBatch`: copied through the
worker's shared-memory ring).
Writes the tables to benchmarks/results/tokenize_bench.md (`--write-docs`: also into the
bench:tokenize section of docs/performance.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from common import (
    DATA_DIR,
    Corpus,
    add_write_docs,
    command_line,
    machine,
    own_cpu,
    publish,
    pubmed_corpus,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers fork after training
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from streamds import PadCollate, StreamingJsonl, as_list
from streamds.handover.shm_tensors import TensorBatch

BATCH = 16
MAX_TOKENS = 512
READERS = ("streamds", "datasets", "webdataset")


# -- the tokenizer: trained once, loaded by path in every process ----------------------------


def text_of(record: dict[str, Any]) -> str:
    return " ".join(record["article_text"])


def train_tokenizer(plain: Path, out: Path, *, sample: int = 500, vocab: int = 8000) -> Path:
    """A WordPiece tokenizer learnt from the first `sample` records, truncating at MAX_TOKENS."""
    def texts() -> Iterable[str]:
        with open(plain) as f:
            for _, line in zip(range(sample), f, strict=False):
                yield text_of(json.loads(line))

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=["[PAD]", "[UNK]"])
    tokenizer.train_from_iterator(texts(), trainer)
    tokenizer.enable_truncation(MAX_TOKENS)
    path = out / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@functools.cache
def _load(path: str) -> Tokenizer:
    return Tokenizer.from_file(path)


class Tokenize:
    """record -> {"input_ids": [...]}; pickles as its path, loads the tokenizer once per process."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        return {"input_ids": _load(self.path).encode(text_of(record)).ids}


class TokenizeSample(Tokenize):
    """webdataset sample (`{"__key__", "json": record}`) -> {"input_ids": [...]}."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        return super().__call__(sample["json"])


# -- the corpus, in the layouts the readers take ---------------------------------------------


def jsonl_shards(corpus: Corpus, shards: int = 8) -> list[Path]:
    """The corpus lines split into `shards` JSONL files in corpus order (as the tar shards)."""
    out = DATA_DIR / f"{corpus.name}.jsonl-{shards}"
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        per_shard = -(-corpus.records // shards)
        with open(corpus.plain, "rb") as f:
            for shard in range(shards):
                lines = [line for _, line in zip(range(per_shard), f, strict=False)]
                (tmp / f"shard-{shard:06d}.jsonl").write_bytes(b"".join(lines))
        tmp.rename(out)
    return sorted(out.glob("*.jsonl"))


# -- the three pipelines: each returns a DataLoader of padded-tensor batches -----------------


def streamds_loader(files: list[Path], tokenize: Tokenize, collate: PadCollate,
                    workers: int, worker_cpus: str = "auto") -> DataLoader:
    ds = StreamingJsonl([str(f) for f in files])  # records (dicts)
    ds = ds.map(tokenize)  # {"input_ids": [...]}
    # -> {"input_ids", "attention_mask"} int64 tensors
    ds = ds.batch(BATCH, collate=collate, worker_cpus=worker_cpus)
    return DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=as_list)


def datasets_loader(files: list[Path], tokenize: Tokenize, collate: PadCollate,
                    workers: int) -> DataLoader:
    from datasets import load_dataset

    with open(files[0]) as f:
        columns = list(json.loads(f.readline()))
    ds = load_dataset("json", data_files=[str(f) for f in files], streaming=True,
                      split="train")  # records (dicts), parsed by pyarrow in chunks
    ds = ds.map(tokenize, remove_columns=columns)  # {"input_ids": [...]}
    # batches of 16 collated in the workers into int64 tensors
    return DataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=collate)


def webdataset_loader(tars: list[Path], tokenize: Tokenize, collate: PadCollate,
                      workers: int) -> DataLoader:
    import webdataset as wds

    ds = wds.WebDataset([str(t) for t in tars], shardshuffle=False,
                        empty_check=False)  # {"__key__", "json": bytes}, shards split by worker
    ds = ds.decode()  # {"__key__", "json": record}
    ds = ds.map(TokenizeSample(tokenize.path))  # {"input_ids": [...]}
    ds = ds.batched(BATCH, collation_fn=collate)  # int64 tensors
    return DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=as_list)


# -- timing ------------------------------------------------------------------------------------


def run_once(make: Callable[[], DataLoader]) -> tuple[int, int, float, float]:
    """(batches, records, wall seconds, CPU seconds of the process tree) for one epoch."""
    cpu, start = own_cpu(), time.perf_counter()
    batches = records = 0
    for batch in make():
        batches += 1
        records += batch["input_ids"].shape[0]
    return batches, records, time.perf_counter() - start, own_cpu() - cpu


class ReplayPadded(IterableDataset):
    """`batches` padded batches ({"input_ids", "attention_mask"}, BATCH x MAX_TOKENS int64), each
    fresh memory as a collate makes it, split over the workers; as plain dicts (torch's way
    out of a worker) or as `TensorBatch` (streamds' way)."""

    def __init__(self, batches: int, ring: bool) -> None:
        self.batches, self.ring = batches, ring

    def __iter__(self) -> Iterable[dict[str, torch.Tensor]]:
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        ids = torch.randint(1, 8000, (BATCH, MAX_TOKENS))
        for _ in range(first, self.batches, step):
            batch = {"input_ids": ids.clone(), "attention_mask": torch.ones_like(ids)}
            yield TensorBatch(batch) if self.ring else batch


def crossing_table(workers: list[int], rounds: int, batches: int = 3000) -> str:
    """batches/s of the hand-over alone, torch's way against the ring, medians of `rounds`."""
    rates: dict[tuple[bool, int], list[float]] = {}
    for _ in range(rounds):
        for n in workers:
            for ring in (False, True):
                loader = DataLoader(ReplayPadded(batches, ring), batch_size=None, num_workers=n,
                                    collate_fn=as_list)
                start = time.perf_counter()
                got = sum(1 for _ in loader)
                assert got == batches, (got, batches)
                rates.setdefault((ring, n), []).append(got / (time.perf_counter() - start))
    lines = ["| num_workers | torch's way (a shared file per tensor) | streamds' ring "
             "| ring / torch |", "|---:|---:|---:|---:|"]
    for n in workers:
        torch_way, ring = (statistics.median(rates[(r, n)]) for r in (False, True))
        lines.append(f"| {n} | {torch_way:,.0f} | {ring:,.0f} | {ring / torch_way:.1f}x |")
    return "\n".join(lines)


def table(results: dict[tuple[str, int], list[tuple[float, float]]], workers: list[int],
          readers: list[str]) -> str:
    base = statistics.median(b for b, _ in results[(readers[0], workers[0])])
    lines = [
        f"| reader | num_workers | batches/s | x {readers[0]} {workers[0]} workers "
        "| CPU (cores busy) | CPU ms per batch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for reader in readers:
        for n in workers:
            rates = [b for b, _ in results[(reader, n)]]
            cores = [c for _, c in results[(reader, n)]]
            rate, busy = statistics.median(rates), statistics.median(cores)
            lines.append(f"| {reader} | {n} | {rate:,.1f} | {rate / base:.2f} | {busy:.2f} "
                         f"| {1000 * busy / rate:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small corpus: a minute or two")
    parser.add_argument("--mb", type=int, help="corpus size in MB (default 60; --quick 8)")
    parser.add_argument("--record-chars", type=int, default=3000,
                        help="article characters per record (~2.1x as many bytes of JSON)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--readers", nargs="+", choices=[*READERS, "streamds-all"],
                        default=list(READERS),
                        help="streamds-all: streamds with worker_cpus='all' (the OS places "
                        "the workers)")
    add_write_docs(parser, "tokenize")
    args = parser.parse_args()
    mb = args.mb or (8 if args.quick else 60)
    warnings.filterwarnings("ignore", message=".*set_vital.*")

    corpus = pubmed_corpus(mb * 10**6, record_chars=args.record_chars)
    files = jsonl_shards(corpus)
    collate = PadCollate(0, keys=("input_ids",))
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        tokenize = Tokenize(train_tokenizer(corpus.plain, Path(tmp)))
        print(f"tokenizer trained in {time.perf_counter() - start:.1f}s")
        makers = {
            "streamds": lambda n: streamds_loader(files, tokenize, collate, n),
            "streamds-all": lambda n: streamds_loader(files, tokenize, collate, n, "all"),
            "datasets": lambda n: datasets_loader(files, tokenize, collate, n),
            "webdataset": lambda n: webdataset_loader(corpus.tars, tokenize, collate, n),
        }
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for round_ in range(args.rounds):
            order = args.readers[round_ % len(args.readers):] + args.readers[
                : round_ % len(args.readers)]
            for n in args.workers:
                for reader in order:
                    batches, records, wall, cpu = run_once(lambda: makers[reader](n))  # noqa: B023
                    if records != corpus.records:
                        raise RuntimeError(f"{reader} with {n} workers yielded {records} records, "
                                           f"the corpus has {corpus.records}")
                    results.setdefault((reader, n), []).append((batches / wall, cpu / wall))
                    print(f"round {round_ + 1}: {reader:10} {n} workers: {batches / wall:8.1f} "
                          f"batches/s, CPU {cpu / wall:.2f} cores", flush=True)
    body = table(results, args.workers, args.readers)
    crossing = crossing_table([n for n in args.workers if n > 0], args.rounds)
    report = (
        f"`{command_line()}`: {corpus.records:,} PubMed-layout records "
        f"({corpus.decoded_bytes / 1e6:.0f} MB, 8 shards), WordPiece tokenizer (8k vocab, "
        f"truncated at {MAX_TOKENS}), batches of {BATCH} padded int64 tensors, medians of "
        f"{args.rounds} interleaved rounds; {machine()}.\n\n{body}\n\n"
        f"The hand-over alone: batches/s of padded batches of the same shape replayed from "
        f"memory in the workers, medians of {args.rounds} rounds.\n\n{crossing}\n"
    )
    runs = {f"{reader} {n}": rows for (reader, n), rows in results.items()}
    publish("tokenize_bench", report, runs, "tokenize" if args.write_docs else None)


if __name__ == "__main__":
    main()
