"""The guarantees over real servers on 127.0.0.1: HTTP with ranges (testbed.http) and S3 (moto).

One corpus, converted by `preprocess.convert` into seekable zstd shards plus one plain .jsonl
file, is published three ways: over HTTP named by a glob (one listing), over HTTP as a list of
file URLs, and in an S3 bucket named as a folder. Every guarantee test runs on each and compares
with the records written (order) or with the same loader over the local folder (shuffle,
workers, resume). Then, HTTP only, what only the HTTP server shows or does: the requests made
after the dataset is built, and faults (503, 429, connections dropped mid-body, 403) injected
per request.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from resume_contract import run_test_save_load_state
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import RetryPolicy, Storage, StreamingJsonl
from streamds.formats.manifest import MANIFEST_NAME
from streamds.preprocess.convert import convert
from streamds.tools.synthetic import write_pubmed, write_small_lines
from testbed.http import Faults, RangeServer, serve

pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

BLOCK = 64 << 10  # the smallest block: shards span several blocks, so readers split them
PLAIN = "plain.jsonl"  # sorts before "shard-*": read first


@dataclass(frozen=True)
class Corpus:
    root: Path  # the shards, manifest.json and PLAIN, as served
    records: list[dict[str, Any]]  # in file order, computed from the files written

    @property
    def keys(self) -> list[str]:
        return [key(record) for record in self.records]


def key(record: dict[str, Any]) -> str:
    """One name per record of the corpus (PubMed records have article ids, lines have ids)."""
    return record["article_id"] if "article_id" in record else f"line-{record['id']}"


def keys(batch: list[dict[str, Any]]) -> list[str]:
    """Collate to the records' keys (module level, so worker processes can pickle it)."""
    return [key(record) for record in batch]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    """~1500 PubMed-like records in 25 seekable shards (~7 frames, 2 blocks each; so many
    files that one pass makes more ranged GETs than any fault period below) and ~2000 short
    records in one plain file (7 blocks)."""
    work = tmp_path_factory.mktemp("source")
    root = tmp_path_factory.mktemp("corpus")
    write_pubmed(work / "pubmed.jsonl", target_bytes=2_400_000, record_chars=500)
    convert([work / "pubmed.jsonl"], root, shard_size=100_000, frame_size=16_000)
    write_small_lines(root / PLAIN, target_bytes=400_000, line_bytes=200)
    records = [
        orjson.loads(line)
        for path in (root / PLAIN, work / "pubmed.jsonl")  # PLAIN sorts first
        for line in path.read_bytes().splitlines()
    ]
    corpus = Corpus(root, records)
    assert len(set(corpus.keys)) == len(records) > 3000
    assert len(list(root.glob("shard-*.jsonl.zst"))) >= 21
    return corpus


# -- backends: where a folder is published and how a file disappears -------------------------


@dataclass(frozen=True)
class Remote:
    """A published folder: `source` for StreamingJsonl, with its storage options."""

    source: str | list[str]
    storage_options: dict[str, Any] | None = None

    def dataset(self, **kwargs: Any) -> StreamingJsonl:
        return StreamingJsonl(self.source, **kwargs,
                              storage=Storage(options=self.storage_options, block_size=BLOCK))


@dataclass
class HttpBackend:
    """One server over a folder `www`; each published folder is a subfolder of it, named by a
    glob (`by_url=False`: one listing) or by the URL of each record file (one HEAD each)."""

    server: RangeServer
    www: Path
    by_url: bool
    count: Iterator[int] = field(default_factory=itertools.count)

    def publish(self, root: Path) -> Remote:
        name = f"c{next(self.count)}"
        shutil.copytree(root, self.www / name)
        base = f"{self.server.url}/{name}"
        if not self.by_url:  # a glob: fsspec's HTTP filesystem takes any URL for a file
            return Remote(f"{base}/*.jsonl*")  # the record files, not manifest.json
        files = sorted(p.name for p in root.iterdir() if p.suffix != ".json")  # no manifest
        return Remote([f"{base}/{file}" for file in files])

    def delete(self, remote: Remote, filename: str) -> None:
        url = remote.source if isinstance(remote.source, str) else remote.source[0]
        folder = url.removeprefix(self.server.url + "/").split("/", 1)[0]
        (self.www / folder / filename).unlink()


@dataclass
class S3Backend:
    """moto's S3 server; each published folder is a bucket of its own."""

    endpoint_url: str
    storage_options: dict[str, Any]
    count: Iterator[int] = field(default_factory=itertools.count)

    def publish(self, root: Path) -> Remote:
        from testbed.s3 import upload_folder

        bucket = f"remote-corpus-{next(self.count)}"
        upload_folder(root, bucket, endpoint_url=self.endpoint_url)
        return Remote(f"s3://{bucket}/", self.storage_options)

    def delete(self, remote: Remote, filename: str) -> None:
        import boto3

        bucket = remote.source.removeprefix("s3://").rstrip("/")
        client = boto3.client("s3", endpoint_url=self.endpoint_url,
                              **_s3_credentials(self.storage_options))
        client.delete_object(Bucket=bucket, Key=filename)


def _s3_credentials(options: dict[str, Any]) -> dict[str, str]:
    return {"aws_access_key_id": options["key"], "aws_secret_access_key": options["secret"],
            "region_name": options["client_kwargs"]["region_name"]}


@pytest.fixture(scope="module", params=["http", "http-urls", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    if request.param.startswith("http"):
        www = tmp_path_factory.mktemp("www")
        with serve(www) as server:
            yield HttpBackend(server, www, by_url=request.param == "http-urls")
        return
    pytest.importorskip("moto", reason="S3 tests need moto[server] (the 'dev' extra)")
    pytest.importorskip("s3fs", reason="S3 tests need s3fs (the 'dev' extra)")
    from testbed.s3 import serve_s3

    with serve_s3() as (endpoint_url, storage_options):
        yield S3Backend(endpoint_url, storage_options)


@pytest.fixture(scope="module")
def remote(backend: HttpBackend | S3Backend, corpus: Corpus) -> Remote:
    return backend.publish(corpus.root)


def local(corpus: Corpus, **kwargs: Any) -> StreamingJsonl:
    return StreamingJsonl(corpus.root, storage=Storage(block_size=BLOCK), **kwargs)


def loader_keys(dataset: StreamingJsonl, num_workers: int) -> list[str]:
    """Every key one epoch yields through a DataLoader, in the order the loader yields them."""
    loader = DataLoader(dataset, batch_size=32, num_workers=num_workers, collate_fn=keys)
    return [k for batch in loader for k in batch]


def assert_exactly_once(got: list[str], corpus: Corpus) -> None:
    repeated = [k for k, n in Counter(got).items() if n > 1]
    missing = set(corpus.keys) - set(got)
    assert not repeated and not missing and len(got) == len(corpus.records), (
        f"{len(got)} records for a corpus of {len(corpus.records)}: repeated {repeated[:5]}, "
        f"missing {sorted(missing)[:5]} ({len(repeated)} repeated, {len(missing)} missing)"
    )


# -- the guarantees, on every backend ---------------------------------------------------------


def described(dataset: StreamingJsonl) -> list[tuple[Any, ...]]:
    """What the blocks, hence splitting and shuffling, depend on: name, size, codec, frames."""
    return [
        (shard.url.rsplit("/", 1)[1], shard.size, shard.codec, shard.frames, shard.frame_records)
        for shard in dataset.shards
    ]


def test_shards_are_described_as_locally(remote, corpus):
    """Same names, sizes and frames, hence the same blocks: what every comparison below needs."""
    assert described(remote.dataset()) == described(local(corpus))


def test_one_reader_yields_the_files_in_order(remote, corpus):
    assert list(local(corpus)) == corpus.records
    assert list(remote.dataset()) == corpus.records


@pytest.mark.parametrize(("world_size", "shuffle"), [(1, False), (2, False), (2, True)])
def test_every_record_once_across_workers_and_ranks(remote, corpus, world_size, shuffle):
    shares = [
        loader_keys(remote.dataset(shuffle=shuffle, seed=5, rank=rank, world_size=world_size),
                    num_workers=2)
        for rank in range(world_size)
    ]
    assert all(shares), f"a rank got no records: {[len(share) for share in shares]}"
    assert_exactly_once([k for share in shares for k in share], corpus)


def test_same_seed_gives_the_local_sequence(remote, corpus):
    sequences = []
    for epoch in (0, 1):
        remote_ds, local_ds = remote.dataset(shuffle=True, seed=11, buffer_size=200), local(
            corpus, shuffle=True, seed=11, buffer_size=200)
        remote_ds.set_epoch(epoch)
        local_ds.set_epoch(epoch)
        sequence = [key(record) for record in remote_ds]
        assert sequence == [key(record) for record in local_ds], f"epoch {epoch}"
        sequences.append(sequence)
    assert sequences[0] != sequences[1] != corpus.keys  # really shuffled, per epoch
    # through two workers as well: the loader interleaves the same per-worker sequences
    assert loader_keys(remote.dataset(shuffle=True, seed=11, buffer_size=200), 2) == loader_keys(
        local(corpus, shuffle=True, seed=11, buffer_size=200), 2)


def test_exact_resume_with_stateful_dataloader(remote, corpus):
    def make(dataset: StreamingJsonl) -> StatefulDataLoader:
        return StatefulDataLoader(dataset, batch_size=8, num_workers=2, collate_fn=keys)

    options = {"shuffle": True, "seed": 3, "buffer_size": 100}
    expected = list(make(local(corpus, **options)))  # the uninterrupted run, read locally
    assert len(expected) > 400
    run_test_save_load_state(lambda: make(remote.dataset(**options)), [5, len(expected) // 2],
                             expected=expected)


def test_file_deleted_after_construction_names_the_url(backend, tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    for name, start in (("a.jsonl", 0), ("b.jsonl", 100)):
        (folder / name).write_bytes(b"".join(
            orjson.dumps({"id": i}) + b"\n" for i in range(start, start + 50)))
    remote = backend.publish(folder)
    dataset = remote.dataset()
    url = next(shard.url for shard in dataset.shards if shard.url.endswith("/b.jsonl"))
    backend.delete(remote, "b.jsonl")
    began = time.monotonic()
    with pytest.raises(FileNotFoundError, match=re.escape(url)):
        list(dataset)
    assert time.monotonic() - began < 10, "a missing file is permanent: no retries"


# -- HTTP only: the requests made, and faults ------------------------------------------------


def record_files(corpus: Corpus) -> list[str]:
    return sorted(path.name for path in corpus.root.iterdir()
                  if not path.name.startswith(".") and path.name != MANIFEST_NAME)


def http_source(server: RangeServer, corpus: Corpus, named: str) -> str | list[str]:
    """The corpus on `server` by a glob (sizes unknown until read) or by URLs (one HEAD each)."""
    if named == "by url":
        return [f"{server.url}/{name}" for name in record_files(corpus)]
    return f"{server.url}/*.jsonl*"


NAMED = ["by glob", "by url"]


@pytest.mark.parametrize("named", NAMED)
def test_no_listing_or_metadata_requests_after_construction(corpus, named):
    shard_files = record_files(corpus)
    with serve(corpus.root) as server:
        dataset = StreamingJsonl(http_source(server, corpus, named),
                                 storage=Storage(block_size=BLOCK))
        data_end = {  # where each seekable shard's seek table begins
            shard.url.rsplit("/", 1)[1]: shard.frames[-1].compressed_offset
            + shard.frames[-1].compressed_size
            for shard in dataset.shards if shard.frames
        }
        server.reset_log()
        for epoch in (0, 1):
            dataset.set_epoch(epoch)
            assert_exactly_once(loader_keys(dataset, num_workers=2), corpus)
        log = server.log
    assert log, "no requests logged: the records came from somewhere else"
    wrong = [
        request for request in log
        if request.method != "GET" or request.range is None or request.status != 206
        or request.path.lstrip("/") not in shard_files
        or _range_start(request.range) >= data_end.get(request.path.lstrip("/"), 1 << 62)
    ]
    assert not wrong, (
        f"{len(wrong)} of {len(log)} requests after construction are not ranged GETs of shard "
        f"data answered 206 (listings, HEADs, manifest or seek-table reads repeat work done "
        f"at construction): {wrong[:8]}"
    )


def _range_start(header: str) -> int:
    match = re.fullmatch(r"bytes=(\d+)-\d*", header)
    assert match is not None, f"unexpected Range header {header!r}"
    return int(match.group(1))


FAULTS = {
    "503 every 20th": (Faults(fail_every=20), 20),
    "dropped every 15th": (Faults(drop_every=15), 15),
    "429 every 10th": (Faults(throttle_every=10), 10),
}


@pytest.mark.parametrize("named", NAMED)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_transient_faults_lose_and_repeat_nothing(corpus, fault, num_workers, named):
    faults, every = FAULTS[fault]
    retry = RetryPolicy(attempts=8, backoff=0.01, max_backoff=0.05)
    with serve(corpus.root) as server:
        dataset = StreamingJsonl(http_source(server, corpus, named),
                                 storage=Storage(block_size=BLOCK, retry=retry))
        clean = loader_keys(dataset, num_workers)  # over the same server, before any fault
        server.faults = dataclasses.replace(faults)
        server.reset_log()  # count ranged GETs from here: the first fault is the `every`th
        got = loader_keys(dataset, num_workers)
        ranged = [request for request in server.log if request.range is not None]
    assert len(ranged) > every, f"only {len(ranged)} ranged GETs: the fault never fired"
    assert got == clean
    assert_exactly_once(got, corpus)


@pytest.mark.parametrize("when", ["construction", "reading"])
def test_forbidden_shard_fails_at_once_naming_the_url(corpus, when):
    name = "shard-000003.jsonl.zst"
    with serve(corpus.root) as server:
        url = f"{server.url}/{name}"
        began = time.monotonic()
        if when == "construction":
            server.faults.status_for[f"/{name}"] = 403
        with pytest.raises(OSError, match=re.escape(url)):
            dataset = StreamingJsonl(f"{server.url}/*.jsonl*",
                                     storage=Storage(block_size=BLOCK,
                                                     retry=RetryPolicy(attempts=2, backoff=30)))
            server.faults.status_for[f"/{name}"] = 403
            list(dataset)
        elapsed = time.monotonic() - began
    assert elapsed < 10, f"403 is permanent, but the error came after {elapsed:.0f} s of retries"
