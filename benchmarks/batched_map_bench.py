"""Per-record against batched tokenizing (issue 36, part 3): ``ds.map(tokenize)`` against
``ds.map(tokenize_batch, batch_size=64)`` (one `encode_batch` call per list of records), the
rest as training jobs run it (``.batch(16, collate=PadCollate(...))`` in the workers, a plain
DataLoader with batch_size=None), at 0 and 2 workers, in one run.

    python benchmarks/batched_map_bench.py            # ~16 MB of PubMed-layout records
    python benchmarks/batched_map_bench.py --quick    # ~4 MB
    python benchmarks/batched_map_bench.py --mb 8 --record-chars 300   # short records

The WordPiece tokenizer is `tokenize_bench`'s (trained offline on a sample of the synthetic
corpus, loaded by path in each process). TOKENIZERS_PARALLELISM is left as the user left it
(unset here): at 0 workers `encode_batch` may use its Rust threads; in forked workers streamds
sets it to "false" (`streamds.stages.forks`). Each round runs every (workers, map) pair once,
the order rotating; the table has the medians, kept in
benchmarks/results/batched_map_bench-<record chars>.md (`--write-docs`: also in the
bench:batched-<record chars> section of docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

_USERS = os.environ.get("TOKENIZERS_PARALLELISM")
from tokenize_bench import (  # noqa: E402 (it sets TOKENIZERS_PARALLELISM: undone below)
    BATCH,
    MAX_TOKENS,
    Tokenize,
    _load,
    jsonl_shards,
    run_once,
    text_of,
    train_tokenizer,
)

if _USERS is None:
    os.environ.pop("TOKENIZERS_PARALLELISM", None)

from common import add_write_docs, command_line, machine, publish, pubmed_corpus  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from streamds import PadCollate, StreamingJsonl, as_list  # noqa: E402

LIST = 64  # records per encode_batch call


class TokenizeBatch(Tokenize):
    """records -> [{"input_ids": [...]}, ...]: one `encode_batch` call per list."""

    def __call__(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:  # type: ignore[override]
        encoded = _load(self.path).encode_batch([text_of(record) for record in records])
        return [{"input_ids": one.ids} for one in encoded]


def tokenizer_alone(plain: Path, path: Path, records: int, rounds: int) -> str:
    """Records a second of the tokenizer by itself on the corpus texts (no reading, no
    pipeline): `encode` per text against `encode_batch` per list of LIST texts."""
    import json

    with open(plain) as f:
        texts = [text_of(json.loads(line)) for _, line in zip(range(records), f, strict=False)]
    tokenizer = _load(str(path))
    rates: dict[str, list[float]] = {"encode": [], "encode_batch": []}
    for _ in range(rounds):
        start = time.perf_counter()
        for text in texts:
            tokenizer.encode(text)
        rates["encode"].append(len(texts) / (time.perf_counter() - start))
        start = time.perf_counter()
        for at in range(0, len(texts), LIST):
            tokenizer.encode_batch(texts[at:at + LIST])
        rates["encode_batch"].append(len(texts) / (time.perf_counter() - start))
    one, batched = (statistics.median(rates[k]) for k in ("encode", "encode_batch"))
    return (f"The tokenizer alone, in the main process on {len(texts):,} of the texts: "
            f"`encode` per text {one:,.0f} records/s, `encode_batch` per {LIST} texts "
            f"{batched:,.0f} records/s ({batched / one:.2f}x).")


def loader(files: list[Path], path: Path, batched: bool, workers: int) -> DataLoader:
    ds = StreamingJsonl([str(f) for f in files])
    ds = ds.map(TokenizeBatch(path), batch_size=LIST) if batched else ds.map(Tokenize(path))
    ds = ds.batch(BATCH, collate=PadCollate(0, keys=("input_ids",)))
    return DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=as_list)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small corpus")
    parser.add_argument("--mb", type=int, help="corpus size in MB (default 16; --quick 4)")
    parser.add_argument("--record-chars", type=int, default=3000,
                        help="article characters per record (~2.1x as many bytes of JSON)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    add_write_docs(parser, "batched-<record chars>")
    args = parser.parse_args()
    mb = args.mb or (4 if args.quick else 16)
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    corpus = pubmed_corpus(mb * 10**6, record_chars=args.record_chars)
    files = jsonl_shards(corpus)
    maps = {"per record": False, f"batched ({LIST})": True}
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = train_tokenizer(corpus.plain, Path(tmp))
        alone = tokenizer_alone(corpus.plain, path, min(corpus.records, 2000), args.rounds)
        print(alone, flush=True)
        for round_ in range(args.rounds):
            names = list(maps)[round_ % 2:] + list(maps)[: round_ % 2]
            for n in args.workers:
                for name in names:
                    _, records, wall, cpu = run_once(
                        lambda: loader(files, path, maps[name], n))  # noqa: B023
                    if records != corpus.records:
                        raise RuntimeError(f"{name}, {n} workers: {records} records, the corpus "
                                           f"has {corpus.records}")
                    results.setdefault((name, n), []).append((records / wall, cpu / wall))
                    print(f"round {round_ + 1}: {name:13} {n} workers: {records / wall:8.0f} "
                          f"records/s, CPU {cpu / wall:.2f} cores", flush=True)
    base = statistics.median(r for r, _ in results[("per record", args.workers[0])])
    lines = [f"| map | num_workers | records/s | x per record, {args.workers[0]} workers "
             "| CPU (cores busy) |", "|---|---:|---:|---:|---:|"]
    for n in args.workers:
        for name in maps:
            rate = statistics.median(r for r, _ in results[(name, n)])
            busy = statistics.median(c for _, c in results[(name, n)])
            lines.append(f"| {name} | {n} | {rate:,.0f} | {rate / base:.2f} | {busy:.2f} |")
    report = (
        f"`{command_line()}`: {corpus.records:,} PubMed-layout records "
        f"({corpus.decoded_bytes / 1e6:.0f} MB, 8 shards), WordPiece tokenizer (8k vocab, "
        f"truncated at {MAX_TOKENS}), batches of {BATCH} padded in the workers, medians of "
        f"{args.rounds} interleaved rounds; {machine()}.\n\n" + "\n".join(lines) + "\n\n"
        + alone + "\n")
    runs = {f"{name}, {n} workers": rates for (name, n), rates in results.items()}
    publish(f"batched_map_bench-{args.record_chars}", report, runs,
            f"batched-{args.record_chars}" if args.write_docs else None)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
