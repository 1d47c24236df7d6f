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


_ENV_FIX = "unset it, or launch with torchrun, which sets RANK and WORLD_SIZE"


def _env_int(name: str, minimum: int) -> int | None:
    """The integer in environment variable `name` (None: unset); refuses anything else."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name} must be an integer, got {name}={raw!r}; {_ENV_FIX}"
        ) from None
    if value < minimum:
        raise ValueError(f"environment variable {name} must be >= {minimum}, got "
                         f"{name}={raw!r}; {_ENV_FIX}")
    return value


def _env_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size: the arguments given, the rest from RANK / WORLD_SIZE.

    Refuses a world with only one of the two known: every process would read as the same
    rank, so the ranks' shares would be read twice or not at all.
    """
    if rank is not None and world_size is not None:
        return rank, world_size
    if world_size is not None:
        env_rank = _env_int("RANK", 0)
        if env_rank is None:
            raise ValueError(
                f"world_size={world_size} was given without rank, and neither a "
                "torch.distributed process group nor the RANK environment variable gives "
                "it; pass rank= as well (or neither)"
            )
        if env_rank >= world_size:
            raise ValueError(f"environment variable RANK must be < world_size={world_size}, "
                             f"got RANK={env_rank}; pass rank= as well")
        return env_rank, world_size
    if rank is not None:
        env_size = _env_int("WORLD_SIZE", 1)
        if env_size is None:
            raise ValueError(
                f"rank={rank} was given without world_size, and neither a torch.distributed "
                "process group nor the WORLD_SIZE environment variable gives it; pass "
                "world_size= as well (or neither)"
            )
        if rank >= env_size:
            raise ValueError(f"rank must be < WORLD_SIZE={env_size} (environment variable), "
                             f"got rank={rank}; pass world_size= as well")
        return rank, env_size
    env_rank, env_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if env_rank is None and env_size is None:
        return 0, 1
    if env_rank is None or env_size is None:
        have, lack = ("RANK", "WORLD_SIZE") if env_size is None else ("WORLD_SIZE", "RANK")
        raise ValueError(
            f"environment variable {have}={os.environ[have]!r} is set but {lack} is not, and "
            "no torch.distributed process group is initialised; set both, or pass rank= and "
            "world_size= to StreamingJsonl"
        )
    if env_rank >= env_size:
        raise ValueError(
            f"environment variable RANK must be < WORLD_SIZE, got RANK={env_rank} and "
            f"WORLD_SIZE={env_size}; ranks count from 0"
        )
    return env_rank, env_size


def detect_world(rank: int | None = None, world_size: int | None = None) -> World:
    """The world of the calling process.

    Worker from torch's data worker info; rank and world size from the arguments when given,
    else an initialised torch.distributed group, else the RANK / WORLD_SIZE environment
    variables that torchrun sets, else a single process. Only one of rank and world size
    known (from the arguments or the environment) is refused.
    """
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    if rank is None or world_size is None:
        detected = _distributed_rank()
        if detected is not None:
            rank = detected[0] if rank is None else rank
            world_size = detected[1] if world_size is None else world_size
        else:
            rank, world_size = _env_world(rank, world_size)
    return World(rank=rank, world_size=world_size, worker=worker, num_workers=num_workers)
