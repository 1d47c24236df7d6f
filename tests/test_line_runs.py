"""`streamds.stages.line_runs`: a worker's in-order batch of JSON lines is kept as slices of
its read buffers and written into the payload from them; the main process parses the same
records, in the same order, as a reader without workers, whatever the lines hold (blank and
whitespace-only lines, a byte-order mark, CRLF, big integers, no newline at the end, long and
short lines in one file, batches across buffers and blocks)."""

from __future__ import annotations

import random
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch.utils.data._utils.worker as torch_worker

from streamds import RecordBatch, Storage, StreamingJsonl
from streamds.handover import shm_ring
from streamds.stages.chunks import Chunk
from streamds.stages.line_runs import LineRuns
from streamds.stages.parse_later import LineBatch, payload_pieces


@pytest.fixture()
def in_a_worker(monkeypatch: pytest.MonkeyPatch) -> Any:
    """This process as a DataLoader worker (a batch pickles into its own shared-memory ring
    and unpickles from it), the ring closed and forgotten afterwards."""
    monkeypatch.setattr(shm_ring, "_writer", None)
    monkeypatch.setattr(shm_ring, "_writer_pid", 0)

    def as_worker(dataset: Any) -> None:
        info = torch_worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=dataset)
        monkeypatch.setattr(torch_worker, "_worker_info", info)

    yield as_worker
    writer = shm_ring._writer
    if writer is not None:
        writer.close()
        shm_ring._unlink_quietly(str(Path(shm_ring.SHM_DIR) / writer.name))


def handed_over(batches: Any) -> list[Any]:
    """The records of each batch as the main process gets them: pickled into the ring and
    parsed from it; the ring's space freed as the main process frees it."""
    out = []
    for batch in batches:
        assert isinstance(batch, LineBatch)
        arrived = ForkingPickler.loads(ForkingPickler.dumps(batch))
        assert isinstance(arrived, RecordBatch), arrived
        writer = shm_ring._writer
        shm_ring._CONSUMED.pack_into(writer.map, 0, writer.head)
        out.append(list(arrived))
    return out


def messy_lines(seed: int) -> tuple[bytes, int]:
    """A file of long and short records mixed with everything a line may be, and how many
    records it holds."""
    rng = random.Random(seed)
    lines: list[bytes] = []
    records = 0
    for i in range(rng.randint(150, 400)):
        kind = rng.random()
        if kind < 0.06:
            lines.append(rng.choice([b"", b"  ", b"\t\r", b"\r"]))  # blank: no record
            continue
        text = "x" * rng.choice([10, 300, 3_000, 12_000, 40_000]) + rng.choice(["", "é数"])
        line = orjson.dumps({"i": i, "text": text})
        if kind < 0.1:  # an integer beyond 64 bits, read exactly
            line = b'{"i": %d, "big": 123456789012345678901234567890, "text": "%s"}' % (
                i, text.encode())
        if kind < 0.14:
            line = b"  " + line  # a record after whitespace
        if kind > 0.9:
            line += b"\r"  # CRLF
        lines.append(line)
        records += 1
    data = b"\n".join(lines)
    if seed % 2:
        data = b"\xef\xbb\xbf" + data  # a byte-order mark before the first line
    if seed % 3:
        data += b"\n"  # (else the last line has no newline)
    return data, records


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bounded", [False, True], ids=["by count", "by bytes"])
def test_batches_from_read_buffers_parse_as_a_reader_without_workers(
    tmp_path: Path, in_a_worker: Any, seed: int, bounded: bool
) -> None:
    data, count = messy_lines(seed)
    path = tmp_path / "messy.jsonl"
    path.write_bytes(data)
    storage = Storage(block_size=256 << 10)  # blocks that begin and end inside lines
    expected = list(StreamingJsonl(str(path), storage=storage))
    assert len(expected) == count
    size = random.Random(seed).choice([1, 3, 16, 64])
    ds = StreamingJsonl(str(path), storage=storage).batch(
        size, max_bytes=50_000 if bounded else None)
    in_a_worker(ds)
    batches = handed_over(iter(ds))
    assert [record for batch in batches for record in batch] == expected
    if not bounded:
        assert all(len(batch) == size for batch in batches[:-1])


def test_lines_in_order_are_slices_of_their_read_buffer(tmp_path: Path, in_a_worker: Any
                                                         ) -> None:
    """Long lines read in order are not cut out: a batch holds slices of the buffers they
    were read into, and the payload is made of views of those slices."""
    records = [{"i": i, "text": "y" * 20_000} for i in range(100)]
    path = tmp_path / "long.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    ds = StreamingJsonl(str(path)).batch(8)
    in_a_worker(ds)
    batches = list(ds)
    for batch in batches:
        runs = batch.lines.runs
        assert all(isinstance(run, tuple) for run in runs)  # no line cut out
        assert len({id(run[0]) for run in runs}) == len(runs)  # one slice of each buffer
    pieces = payload_pieces(batches[0].lines, batches[0].blocks, batches[0].offsets, {0: "x"})
    assert all(isinstance(piece, memoryview) for piece in pieces[2::2])
    assert [r for batch in handed_over(batches) for r in batch] == records


def test_runs_are_the_lines_they_stand_for() -> None:
    buffer = b'{"a": 1}\n{"b": 22}\n{"c": 333}\n{"d": 4'
    offsets = [100, 109, 119, 130, 137]  # the buffer begins at offset 100 of its file
    chunk = Chunk(0, 0, offsets, [b""] * 4, True, data=buffer)
    runs = LineRuns()
    runs.add_chunk(chunk, 0, 2)
    runs.add_chunk(chunk, 2, 3)  # continues the first slice
    runs += [b'{"e": 5}', b'{"f": 6}']
    runs.add_chunk(Chunk(0, 1, [0, 5], [b""], True, data=b'{"g"}'), 0, 1)
    lines = [b'{"a": 1}', b'{"b": 22}', b'{"c": 333}', b'{"e": 5}', b'{"f": 6}', b'{"g"}']
    assert len(runs.runs) == 3 and runs.runs[0] == (buffer, 0, 29, 3)
    assert runs == lines and len(runs) == 6 and runs.nbytes == sum(map(len, lines))
    pieces, ends = runs.pieces([100, 109, 119, 0, 0, 0])
    joined = b"".join(pieces)
    assert joined == b"\n".join(lines)
    assert ends.tolist() == (np.cumsum([len(line) + 1 for line in lines]) - 1).tolist()
