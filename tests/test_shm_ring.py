"""`streamds.handover.shm_ring`: batch payloads from a worker to the main process in shared
memory; every payload comes back once, in order, or goes the other way (None)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from streamds.handover import shm_ring
from streamds.handover.shm_ring import DATA, RingReader, RingWriter

SIZE = 4096


def payload(i: int, length: int) -> bytes:
    return bytes([i % 251]) * length


def test_every_payload_comes_back_once_in_order_around_the_ring(tmp_path: Path) -> None:
    writer = RingWriter(SIZE, shm_dir=str(tmp_path))
    reader = RingReader(writer.name, writer.pid, shm_dir=str(tmp_path))
    lengths = [1, 100, 700, 1500, 3, 2000, 64, 0, 1999] * 20  # crosses the end many times
    in_flight = []
    for i, length in enumerate(lengths):
        entry = writer.put(payload(i, length))
        assert entry is not None, (i, length)
        in_flight.append((entry, payload(i, length)))
        if len(in_flight) == 2 or i == len(lengths) - 1:  # two in flight, as with prefetch
            for entry, sent in in_flight:
                assert reader.take(entry, bytes) == sent
            in_flight = []
    assert writer.head > 10 * SIZE  # positions grew far past the ring: space was reused
    writer.close()
    reader.close()


def test_pieces_come_back_as_one_payload_around_the_ring(tmp_path: Path) -> None:
    writer = RingWriter(SIZE, shm_dir=str(tmp_path))
    reader = RingReader(writer.name, writer.pid, shm_dir=str(tmp_path))
    for i in range(60):  # 0 to 3 pieces of up to 600 bytes: crosses the end many times
        pieces = [payload(i + j, (i * 397 + j * 211) % 600) for j in range(i % 4)]
        entry = writer.put(*pieces, memoryview(b""))
        assert entry is not None and entry.length == sum(map(len, pieces))
        assert reader.take(entry, bytes) == b"".join(pieces)
    assert writer.head > 5 * SIZE
    writer.close()
    reader.close()


def test_memory_is_reserved_as_entries_reach_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 4 * shm_ring.RESERVE_STEP
    writer = RingWriter(size, shm_dir=str(tmp_path))
    reader = RingReader(writer.name, writer.pid, shm_dir=str(tmp_path))

    def backed() -> int:  # bytes of the file backed by memory
        return os.fstat(writer.fd).st_blocks * 512

    assert backed() < shm_ring.RESERVE_STEP  # a new ring costs next to nothing
    first = writer.put(payload(0, 1000))
    assert first is not None and writer.reserved == shm_ring.RESERVE_STEP
    assert reader.take(first, bytes) == payload(0, 1000)
    big = payload(1, shm_ring.RESERVE_STEP + 10)  # reaches into the second step
    entry = writer.put(big)
    assert entry is not None and writer.reserved == 2 * shm_ring.RESERVE_STEP
    assert reader.take(entry, bytes) == big
    assert backed() >= writer.reserved

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)  # /dev/shm filled up meanwhile
    assert writer.put(big) is None  # the pipe, not a SIGBUS
    small = writer.put(payload(2, 100))  # still fits in what is reserved
    assert small is not None and reader.take(small, bytes) == payload(2, 100)
    writer.close()
    reader.close()


def test_a_payload_that_does_not_fit_goes_the_other_way(tmp_path: Path) -> None:
    writer = RingWriter(SIZE, shm_dir=str(tmp_path))
    reader = RingReader(writer.name, writer.pid, shm_dir=str(tmp_path))
    assert writer.put(payload(0, SIZE // 2)) is None  # more than half the ring, with its header
    entries = []
    while (entry := writer.put(payload(len(entries), 1000))) is not None:
        entries.append(entry)
    assert len(entries) == SIZE // 1024  # full: nothing unread was overwritten
    assert reader.take(entries[0], bytes) == payload(0, 1000)
    late = writer.put(payload(9, 1000))  # the space of the entry read is free again
    assert late is not None
    for i, entry in enumerate([*entries[1:], late], start=1):
        assert reader.take(entry, bytes) == payload(9 if entry is late else i, 1000)
    writer.close()
    reader.close()


def test_an_entry_taken_twice_or_after_a_newer_one_raises(tmp_path: Path) -> None:
    writer = RingWriter(SIZE, shm_dir=str(tmp_path))
    reader = RingReader(writer.name, writer.pid, shm_dir=str(tmp_path))
    first, second, third = writer.put(b"one"), writer.put(b"two"), writer.put(b"three")
    assert first is not None and second is not None and third is not None
    assert reader.take(second, bytes) == b"two"  # the first was taken elsewhere, or never
    with pytest.raises(RuntimeError, match=r"batch 1 of .* arrived after batch 2"):
        reader.take(first, bytes)  # its space may have been reused since
    with pytest.raises(RuntimeError, match="read twice or out of order"):
        reader.take(second, bytes)
    # an entry whose header no longer matches (overwritten) is refused, not parsed
    forged = third._replace(length=2)
    with pytest.raises(RuntimeError, match="overwritten in shared memory"):
        reader.take(forged, bytes)
    assert reader.take(third, bytes) == b"three"
    writer.close()
    reader.close()


def test_the_writer_reads_its_own_entries_until_the_reader_passes_them(tmp_path: Path) -> None:
    writer = RingWriter(SIZE, shm_dir=str(tmp_path))
    reader = RingReader(writer.name, writer.pid, shm_dir=str(tmp_path))
    kept, sent = writer.put(b"kept in the worker"), writer.put(b"sent on")
    assert kept is not None and sent is not None
    assert writer.peek(kept, bytes) == b"kept in the worker"
    assert reader.take(sent, bytes) == b"sent on"  # the reader passed `kept`
    with pytest.raises(RuntimeError, match="space in shared memory may have been reused"):
        writer.peek(kept, bytes)
    writer.close()
    reader.close()


def test_the_reader_removes_the_file_it_maps(tmp_path: Path) -> None:
    writer = RingWriter(SIZE, shm_dir=str(tmp_path))
    assert (tmp_path / writer.name).stat().st_size == DATA + SIZE
    reader = RingReader(writer.name, writer.pid, shm_dir=str(tmp_path))
    assert not (tmp_path / writer.name).exists()  # both still map it
    entry = writer.put(b"after the unlink")
    assert entry is not None and reader.take(entry, bytes) == b"after the unlink"
    with pytest.raises(RuntimeError, match="is gone before its first batch was read"):
        RingReader(writer.name, writer.pid, shm_dir=str(tmp_path))
    writer.close()
    reader.close()


def _make_ring_and_exit(shm_dir: str, names: multiprocessing.Queue) -> None:
    shm_ring.SHM_DIR = shm_dir
    entry = shm_ring.put(b"never read")
    assert entry is not None
    names.put(entry.name)


def test_a_worker_removes_its_ring_at_exit_when_no_reader_took_it(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    names = context.Queue()
    worker = context.Process(target=_make_ring_and_exit, args=(str(tmp_path), names))
    worker.start()
    name = names.get(timeout=60)
    worker.join(timeout=60)
    assert worker.exitcode == 0
    assert name.startswith(f"streamds-{worker.pid}-")
    assert list(tmp_path.iterdir()) == []


def test_no_shared_memory_means_the_other_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm_ring, "SHM_DIR", str(tmp_path / "missing"))
    monkeypatch.setattr(shm_ring, "_writer_pid", 0)  # as in a fresh worker
    assert shm_ring.put(b"x" * 100) is None
    assert shm_ring.put(b"x" * 100) is None  # and it is not tried again in this process
    monkeypatch.setattr(shm_ring, "SHM_DIR", str(tmp_path))
    assert shm_ring.put(b"x" * 100) is None
    assert list(tmp_path.iterdir()) == []


def test_the_ring_is_sized_from_its_first_payload() -> None:
    assert shm_ring._ring_size(10) == shm_ring.MIN_SIZE
    assert shm_ring._ring_size(1_400_000) == 16 << 20  # 8 PubMed batches of 64 records
    assert shm_ring._ring_size(1 << 30) == shm_ring.MAX_SIZE
    # a share of the free space in /dev/shm at most (a container's 64 MB, 4 workers: 4 MB each)
    assert shm_ring._ring_size(1_400_000, budget=(64 << 20) // 16) == 4 << 20
    assert shm_ring._ring_size(1_400_000, budget=3 << 20) == 0  # not 2 batches: no ring
    assert shm_ring._ring_size(10, budget=100_000) == 65_536


def test_a_fork_starts_with_its_own_lock(tmp_path: Path) -> None:
    if not hasattr(os, "register_at_fork"):
        pytest.skip("no fork here")
    context = multiprocessing.get_context("fork")
    with shm_ring._lock:  # held by this thread while a DataLoader forks its workers
        child = context.Process(target=_make_ring_and_exit,
                                args=(str(tmp_path), context.Queue()))
        child.start()
        child.join(timeout=60)
    assert child.exitcode == 0  # it could take its own lock: no deadlock
