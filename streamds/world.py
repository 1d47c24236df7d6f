"""Who is reading: (rank, world_size, worker, num_workers), detected in one place.

Everything downstream takes a `World` value, so splitting work is a pure function that tests
can call for any world without processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["World", "detect_world"]


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(
                f"worker must be in [0, num_workers={self.num_workers}), got {self.worker}"
            )

    @property
    def readers(self) -> int:
        """Number of independent readers: every worker of every rank."""
        return self.world_size * self.num_workers

    @property
    def reader(self) -> int:
        """This reader's index in [0, readers): rank-major, so a rank's workers are adjacent."""
        return self.rank * self.num_workers + self.worker


def _distributed_rank() -> tuple[int, int] | None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch always ships it, but builds can strip it
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _env_rank() -> tuple[int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def detect_world(rank: int | None = None, world_size: int | None = None) -> World:
    """The world of the calling process.

    Worker from torch's data worker info; rank and world size from the arguments when given,
    else an initialised torch.distributed group, else the RANK / WORLD_SIZE environment
    variables that torchrun sets, else a single process.
    """
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    if rank is None or world_size is None:
        detected = _distributed_rank() or _env_rank() or (0, 1)
        rank = detected[0] if rank is None else rank
        world_size = detected[1] if world_size is None else world_size
    return World(rank=rank, world_size=world_size, worker=worker, num_workers=num_workers)
