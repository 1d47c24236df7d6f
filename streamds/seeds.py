"""Where every random seed is made: from (seed, epoch, rank, worker, ...) only.

Never from time, process ids or the environment, so the same inputs give the same order on
any machine.
"""

from __future__ import annotations

import hashlib
import random

__all__ = ["derive_seed", "rng_for", "shuffle_seed_parts"]


def derive_seed(*parts: int | str) -> int:
    """A 64-bit seed from the given parts; stable across Python versions and machines."""
    text = "/".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def rng_for(*parts: int | str) -> random.Random:
    """A private random generator seeded from `parts`."""
    return random.Random(derive_seed(*parts))


def shuffle_seed_parts(seed: int, epoch: int, rank: int, worker: int) -> tuple[int | str, ...]:
    """What one reader's shuffle buffer draws from: the one recipe, used by the reader and by
    every resume that replays it."""
    return ("buffer", seed, epoch, rank, worker)
