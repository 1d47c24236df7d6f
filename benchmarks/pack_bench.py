"""Packing against padding (issue 13, item 5): the same tokenized corpus fed as PackTokens
sequences and as padded batches (`.batch(LengthBuckets(...))`, and arrival-order `.batch(n)`
as the baseline).

    python benchmarks/pack_bench.py            # ~30 MB of PubMed-layout records, ~3 min
    python benchmarks/pack_bench.py --quick    # ~4 MB, under a minute

Documents have a broad spread of lengths: document i is the first 1 + (i * 7919) % 40
sentences of synthetic article i (about 20 to 900 tokens, roughly uniform), tokenized in the
DataLoader workers by one WordPiece tokenizer (tokenize_bench's, trained once on the corpus,
truncating at 512 tokens). Every pipeline reads the same 8 JSONL shards:

- packed: ``StreamingJsonl(...).map(tokenize).pack(PackTokens(512, eos))``, batches of 8
  sequences;
- bucketed: ``StreamingJsonl(...).map(tokenize).batch(LengthBuckets(16, buffer_size=1024),
  collate=PadCollate(...))``;
- plain: ``....batch(16, collate=PadCollate(...))`` (arrival order, no bucketing).

Per epoch it measures document tokens per second (the corpus's tokens, the same numerator for
every pipeline), tensor tokens per second (what the model computes on) and the padding
fraction of the tensors; for the padded pipelines `streamds.padding_of` over a single-process
epoch gives the same fraction. Each round runs every (workers, pipeline) pair once, the order
rotating; the table has medians. Writes benchmarks/results/pack_bench.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import command_line, machine, own_cpu, pubmed_corpus
from tokenize_bench import MAX_TOKENS, Tokenize, jsonl_shards, train_tokenizer
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from streamds import LengthBuckets, PackTokens, PadCollate, StreamingJsonl, padding_of

SEQ_LEN = MAX_TOKENS  # packed sequences as long as the longest padded record can be
PACKED_BATCH = 8  # sequences per packed batch
BATCH = 16  # records per padded batch
BUCKET_BUFFER = 1024
PIPELINES = ("packed", "bucketed", "plain")
RESULTS = Path(__file__).resolve().parent / "results" / "pack_bench.md"


class Document(Tokenize):
    """record -> {"input_ids"} of its first 1 + (index * 7919) % 40 sentences."""

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        index = int(record["article_id"][3:])
        sentences = record["article_text"][: 1 + (index * 7919) % 40]
        return super().__call__({"article_text": sentences})


def records(files: list[Path], document: Document) -> StreamingJsonl:
    return StreamingJsonl([str(f) for f in files]).map(document)


def make_loader(pipeline: str, files: list[Path], document: Document, eos: int,
                workers: int) -> DataLoader:
    tokens = records(files, document)  # {"input_ids": [...]}, tokenized in the workers
    if pipeline == "packed":
        # -> {"input_ids", "position_ids", "document_ids"} of SEQ_LEN tokens each
        return DataLoader(tokens.pack(PackTokens(SEQ_LEN, eos)), batch_size=PACKED_BATCH,
                          num_workers=workers)
    collate = PadCollate(0, keys=("input_ids",))  # -> input_ids, attention_mask (padded)
    size = LengthBuckets(BATCH, buffer_size=BUCKET_BUFFER) if pipeline == "bucketed" else BATCH
    return DataLoader(tokens.batch(size, collate=collate), batch_size=None,
                      num_workers=workers)


def run_once(loader: DataLoader) -> tuple[int, int, float, float]:
    """(real tokens, tensor tokens, wall seconds, CPU seconds) of one epoch."""
    cpu, start = own_cpu(), time.perf_counter()
    real = tensor = 0
    for batch in loader:
        tensor += batch["input_ids"].numel()
        if "document_ids" in batch:
            real += int((batch["document_ids"] >= 0).sum())
        else:
            real += int(batch["attention_mask"].sum())
    return real, tensor, time.perf_counter() - start, own_cpu() - cpu


def table(results: dict[tuple[str, int], list[tuple[float, float, float]]],
          pads: dict[tuple[str, int], float], documents: int, workers: list[int]) -> str:
    base = statistics.median(r for r, _, _ in results[("bucketed", workers[0])])
    lines = [
        f"| pipeline | num_workers | document tokens/s | x bucketed {workers[0]} workers "
        "| tensor tokens/s | padding fraction | tensor tokens per document token "
        "| CPU (cores busy) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for pipeline in PIPELINES:
        for n in workers:
            runs = results[(pipeline, n)]
            rate = statistics.median(r for r, _, _ in runs)
            tensor_rate = statistics.median(t for _, t, _ in runs)
            busy = statistics.median(c for _, _, c in runs)
            lines.append(
                f"| {pipeline} | {n} | {rate:,.0f} | {rate / base:.2f} | {tensor_rate:,.0f} "
                f"| {100 * pads[(pipeline, n)]:.1f}% | {tensor_rate / rate:.3f} | {busy:.2f} |")
    separators = f"(packed: includes one separator per document, {documents:,} in all)"
    return "\n".join(lines) + f"\n\nDocument tokens exclude padding {separators}."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small corpus: under a minute")
    parser.add_argument("--mb", type=int, help="corpus size in MB (default 30; --quick 4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    mb = args.mb or (4 if args.quick else 30)
    warnings.filterwarnings("ignore", message=".*set_vital.*")

    corpus = pubmed_corpus(mb * 10**6, record_chars=3000)
    files = jsonl_shards(corpus)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = train_tokenizer(corpus.plain, Path(tmp))
        eos = Tokenizer.from_file(str(path)).get_vocab_size()  # a new id, as an added [EOS]
        document = Document(path)
        print(f"tokenizer trained in {time.perf_counter() - start:.1f}s")
        # padding of the padded pipelines, counted by streamds.padding_of (one process)
        bucket_pad = padding_of(records(files, document).batch(
            LengthBuckets(BATCH, buffer_size=BUCKET_BUFFER)), "input_ids")
        plain_pad = padding_of(records(files, document).batch(BATCH), "input_ids")
        print(f"padding_of: bucketed {100 * bucket_pad.pad_fraction:.1f}%, plain "
              f"{100 * plain_pad.pad_fraction:.1f}% ({bucket_pad.real:,} document tokens)")
        results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
        pads: dict[tuple[str, int], float] = {}
        for round_ in range(args.rounds):
            order = PIPELINES[round_ % 3:] + PIPELINES[: round_ % 3]
            for n in args.workers:
                for pipeline in order:
                    make: Callable[[], DataLoader] = lambda: make_loader(  # noqa: E731
                        pipeline, files, document, eos, n)  # noqa: B023
                    real, tensor, wall, cpu = run_once(make())
                    content = real - (corpus.records if pipeline == "packed" else 0)
                    if content != bucket_pad.real:
                        raise RuntimeError(f"{pipeline} with {n} workers delivered {content:,} "
                                           f"document tokens, the corpus has {bucket_pad.real:,}")
                    results.setdefault((pipeline, n), []).append(
                        (content / wall, tensor / wall, cpu / wall))
                    pads[(pipeline, n)] = 1 - real / tensor
                    print(f"round {round_ + 1}: {pipeline:8} {n} workers: "
                          f"{content / wall:10,.0f} document tokens/s, padding "
                          f"{100 * (1 - real / tensor):.1f}%", flush=True)
        single = pads.get(("bucketed", 0))  # one process: the very batches padding_of saw
        if single is not None and abs(single - bucket_pad.pad_fraction) > 1e-9:
            raise RuntimeError("padding_of and the loader disagree on the bucketed padding")
    body = table(results, pads, corpus.records, args.workers)
    report = (
        f"`{command_line()}`: {corpus.records:,} PubMed-layout documents of 1 to 40 sentences "
        f"({bucket_pad.real:,} tokens, WordPiece 8k, truncated at {MAX_TOKENS}), 8 JSONL "
        f"shards; packed: {PACKED_BATCH} x {SEQ_LEN} tokens per batch; padded: {BATCH} "
        f"records per batch; medians of {args.rounds} interleaved rounds; {machine()}.\n\n"
        f"{body}\n"
    )
    print("\n" + report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(report)


if __name__ == "__main__":
    main()
