"""Pooled batches: records -> batches of records of similar length, cut one pool at a time.

A rule says how to cut a pool of records into batches, from their lengths alone:

- `LengthBuckets(batch_size, ...)`: sort the pool by length, cut it into `batch_size` runs.
- `TokenBudget(max_tokens, ...)`: sort the pool by length, grow each batch while
  ``records x longest <= max_tokens``.

`PoolBatch` is the pipeline stage that applies a rule in the reader (so in the DataLoader
workers), for `StreamingJsonl.batch(rule, collate=...)`; the wrappers of
`streamds.datasets.batching` apply the same rules to any iterable. One cutting rule for both.

The stage reads `rule.pool_size` records, cuts them and yields the batches in an order drawn
from (seed, epoch, rank, worker, pool number). Its state is where its source stood when the
current pool began plus how many of the pool's batches were handed out, so it is O(1) to take;
a resume re-reads that one pool (at most `pool_size` records) and skips those batches.

State: ``{"stage": "pool_batch", "source": <source state at the pool's start>, "rule":
[config], "pool": k, "emitted": j}``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from itertools import islice, pairwise
from typing import Any

from ..checks import check_bool, check_int, check_optional_int
from ..errors import StateMismatchError
from ..seeds import derive_seed
from .chunks import SOURCE, STAGE, Below, HandedOut, Rest, checked

__all__ = [
    "FieldLength",
    "LengthBuckets",
    "PoolBatch",
    "TokenBudget",
    "as_length",
    "is_pool_state",
    "pool_rng",
]

Length = Callable[[Any], int]


class FieldLength:
    """``len(record[key])``: a picklable length function for DataLoader workers."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, record: Any) -> int:
        return len(record[self.key])

    def __repr__(self) -> str:
        return f"FieldLength({self.key!r})"


def as_length(length: Length | str) -> Length:
    """A field name -> `FieldLength`; a callable stays as it is."""
    if isinstance(length, str):
        return FieldLength(length)
    if not callable(length):
        raise ValueError(
            f"length must be a field name or a callable record -> int, got {length!r}"
        )
    return length


def _name_of(length: Length) -> str:
    """How a state names the length function: the same in every process and run (a state
    must not hold the function, nor an address)."""
    if isinstance(length, FieldLength):
        return repr(length)
    named = length if hasattr(length, "__qualname__") else type(length)  # a callable object
    return f"{named.__module__}.{named.__qualname__}"


def _sorted_indices(lengths: Sequence[int], rng: random.Random) -> list[int]:
    """Pool indices by length, equal lengths in an order drawn from `rng`."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    order.sort(key=lengths.__getitem__)  # stable: ties keep the shuffled order
    return order


def _short_batch_start(ascending: list[int], size: int, short: int) -> int:
    """Where, in sorted order, the one short batch pads least.

    The pool is cut into contiguous runs of the sorted lengths; a run costs its size times
    its last (longest) length. Trying every place for the short run between the full ones
    finds the cheapest cut, which never pads more than any other grouping of the pool into
    the same batch sizes, plain arrival-order batching included.
    """
    full = len(ascending) // size
    before = [size * ascending[(i + 1) * size - 1] for i in range(full)]  # short run later
    after = [size * ascending[(i + 1) * size + short - 1] for i in range(full)]  # earlier
    best, best_cost = 0, None
    cost_before, cost_after = 0, sum(after)
    for j in range(full + 1):  # j full batches precede the short one
        cost = cost_before + short * ascending[j * size + short - 1] + cost_after
        if best_cost is None or cost < best_cost:
            best, best_cost = j, cost
        if j < full:
            cost_before += before[j]
            cost_after -= after[j]
    return best * size


class LengthBuckets:
    """Batches of `batch_size` records of similar length.

    Each pool of `buffer_size` records (rounded up to whole batches) is sorted by length and
    cut into batches, which come in a shuffled order. Padding falls roughly by the factor the
    pool is larger than a batch; so does the randomness of which records share a batch, so keep
    `buffer_size` well below the corpus and shuffle the source. A pool's short batch (only the
    last pool has one) goes where it pads least; `drop_last` drops it.

    Example::

        ds = StreamingJsonl("train.jsonl.zst", shuffle=True).map(tokenize)
        batches = ds.batch(LengthBuckets(32, buffer_size=2048), collate=PadCollate())
        loader = DataLoader(batches, batch_size=None, collate_fn=as_list, num_workers=4)
    """

    def __init__(
        self, batch_size: int, *, buffer_size: int = 1024, length: Length | str = "input_ids",
        drop_last: bool = False,
    ) -> None:
        check_int("batch_size", batch_size, 1, "the number of records per batch")
        check_int("buffer_size", buffer_size, 1, "records sorted together; try 64 batches")
        check_bool("drop_last", drop_last)
        self.batch_size = batch_size
        self.pool_size = -(-buffer_size // batch_size) * batch_size
        self.length = as_length(length)
        self.drop_last = drop_last

    def __repr__(self) -> str:
        return (f"LengthBuckets({self.batch_size}, buffer_size={self.pool_size}, "
                f"length={self.length!r}, drop_last={self.drop_last})")

    def config(self) -> list[Any]:
        return ["buckets", self.batch_size, self.pool_size, _name_of(self.length),
                self.drop_last]

    def cut(self, lengths: list[int], rng: random.Random) -> list[list[int]]:
        """Batches as lists of pool indices, in the order they are yielded."""
        order = _sorted_indices(lengths, rng)
        size = self.batch_size
        short = len(order) % size
        at = _short_batch_start(sorted(lengths), size, short) if short else len(order)
        cuts = [*range(0, at + 1, size), *range(at + short, len(order) + 1, size)]
        batches = [order[a:b] for a, b in pairwise(cuts) if b > a]
        if short and self.drop_last:
            batches = [batch for batch in batches if len(batch) == size]
        rng.shuffle(batches)
        return batches


class TokenBudget:
    """Batches holding at most `max_tokens` padded tokens (longest length x records).

    Each pool of `buffer_size` records is sorted by length and cut greedily: a batch grows
    while ``len(batch) * longest <= max_tokens`` (and `max_batch_size`, if given, allows). A
    record longer than `max_tokens` comes in a batch of its own, never dropped. Short records
    make big batches and long records small ones, so every step costs about the same.

    Example::

        batches = ds.batch(TokenBudget(16384, buffer_size=4096), collate=PadCollate())
    """

    def __init__(
        self, max_tokens: int, *, buffer_size: int = 1024, max_batch_size: int | None = None,
        length: Length | str = "input_ids",
    ) -> None:
        check_int("max_tokens", max_tokens, 1, "the padded tokens one batch may hold")
        check_int("buffer_size", buffer_size, 1, "records sorted together")
        check_optional_int("max_batch_size", max_batch_size, 1, "or None for no limit")
        self.max_tokens = max_tokens
        self.pool_size = buffer_size
        self.max_batch_size = max_batch_size
        self.length = as_length(length)

    def __repr__(self) -> str:
        return (f"TokenBudget({self.max_tokens}, buffer_size={self.pool_size}, "
                f"max_batch_size={self.max_batch_size}, length={self.length!r})")

    def config(self) -> list[Any]:
        return ["tokens", self.max_tokens, self.pool_size, self.max_batch_size,
                _name_of(self.length)]

    def cut(self, lengths: list[int], rng: random.Random) -> list[list[int]]:
        """Batches as lists of pool indices, in the order they are yielded."""
        budget, cap = self.max_tokens, self.max_batch_size
        batches: list[list[int]] = []
        batch: list[int] = []
        for index in _sorted_indices(lengths, rng):
            longest = lengths[index]  # ascending order: the newcomer is the longest
            if batch and ((len(batch) + 1) * longest > budget or len(batch) == cap):
                batches.append(batch)
                batch = []
            batch.append(index)
        if batch:
            batches.append(batch)
        rng.shuffle(batches)
        return batches


Rule = LengthBuckets | TokenBudget
RULES = (LengthBuckets, TokenBudget)


def pool_rng(seed_parts: Sequence[int | str], pool: int) -> random.Random:
    """The generator that cuts pool number `pool` of the reader with `seed_parts`."""
    return random.Random(derive_seed("pool", *seed_parts, pool))


def is_pool_state(state: Any) -> bool:
    """Whether a pipeline state is a `PoolBatch` stage's."""
    return isinstance(state, dict) and state.get(STAGE) == PoolBatch.STAGE


class PoolBatch:
    """Stage: records -> `collate(batch)` for each batch `rule` cuts from each pool of
    `rule.pool_size` records. `seed_parts`: the reader's (seed, epoch, rank, worker)."""

    STAGE = "pool_batch"
    SOURCE = SOURCE
    RULE = "rule"
    POOL = "pool"
    EMITTED = "emitted"

    # -- operations on a state, for resumes computed outside the stage --------------------

    @classmethod
    def state_over(cls, source: Any, rule: list[Any], pool: int, emitted: int
                   ) -> dict[str, Any]:
        """The state of pool number `pool`, cut by the rule of config `rule`, beginning where
        the source stands at `source`, `emitted` of its batches handed out."""
        return {STAGE: cls.STAGE, cls.SOURCE: source, cls.RULE: rule, cls.POOL: pool,
                cls.EMITTED: emitted}

    @classmethod
    def unfinished(cls, state: dict[str, Any], below: Below) -> Rest:
        """What a reader at `state` leaves: what its records stage left where the pool began,
        and the pool, if batches of it were handed out (its records are cut again from the
        buffer's draws, so they need a shuffle buffer below to be put back into)."""
        rest = below(cls.source_of(state))
        pool = cls.pool_of(state)
        if not cls.emitted_of(pool):
            return rest  # nothing handed out of this pool yet: its source says it all
        if rest.snapshot is None:
            raise ValueError(
                "merge_states cannot carry over the rest of a pool of batches cut by length "
                "with shuffle=False (a reader without a shuffle buffer has nowhere to put "
                "them); use shuffle=True with .batch(LengthBuckets/TokenBudget), or resume "
                "in the same world with load_state_dict()"
            )
        rest.pool = pool
        return rest

    def over(self, source: Any, handed: HandedOut) -> dict[str, Any]:
        """This stage's state once the reader has handed out `handed`: pool `handed.pool`
        beginning where its source stands at `source`, `handed.batches` of it handed out."""
        return self.state_over(source, self.rule.config(), handed.pool, handed.batches)

    @classmethod
    def source_of(cls, state: dict[str, Any]) -> Any:
        """The source's state where the state's pool began."""
        return state[cls.SOURCE]

    @classmethod
    def pool_of(cls, state: dict[str, Any]) -> dict[str, Any]:
        """The state without its source: which pool, cut by which rule, and how many of its
        batches were handed out (read with `rule_of`, `number_of`, `emitted_of`)."""
        return {key: state[key] for key in (cls.RULE, cls.POOL, cls.EMITTED)}

    @classmethod
    def rule_of(cls, pool: dict[str, Any]) -> list[Any]:
        """The config of the rule that cut the pool of a state or a `pool_of`."""
        return pool[cls.RULE]

    @classmethod
    def number_of(cls, pool: dict[str, Any]) -> int:
        """Which pool of the reader's stream (0, 1, ...), of a state or a `pool_of`."""
        return int(pool[cls.POOL])

    @classmethod
    def emitted_of(cls, pool: dict[str, Any]) -> int:
        """Batches of the pool handed out, of a state or a `pool_of`."""
        return int(pool[cls.EMITTED])

    def __init__(
        self, source: Any, rule: Rule, *, collate: Callable[[list[Any]], Any],
        seed_parts: Sequence[int | str],
    ) -> None:
        self.source = source
        self.rule = rule
        self.collate = collate
        self.seed_parts = tuple(seed_parts)
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        if state is not None and checked(state, self.STAGE)[self.RULE] != self.rule.config():
            raise StateMismatchError(
                f"the state was taken with batches cut by {state[self.RULE]} but this dataset "
                f"cuts them by {self.rule.config()}; build it with the same .batch() rule"
            )
        self.source.reset(None if state is None else state[self.SOURCE])
        self._start = None if state is None else state[self.SOURCE]  # source at pool start
        self._pool = 0 if state is None else state[self.POOL]
        self._emitted = 0 if state is None else state[self.EMITTED]
        self._count: int | None = None  # batches the current pool holds, once cut
        self._after: Any = None  # source state after the current pool
        self._ended = False

    def get_state(self) -> dict[str, Any]:
        """O(1): the source state where the pool began (or, once it is spent, ended)."""
        if self._count is not None and self._emitted >= self._count:
            return self.state_over(self._after, self.rule.config(), self._pool + 1, 0)
        start = self.source.get_state() if self._start is None else self._start
        return self.state_over(start, self.rule.config(), self._pool, self._emitted)

    @property
    def done(self) -> bool:
        """Whether the last batch has been handed out."""
        spent = self._count is not None and self._emitted >= self._count
        return self._ended or (spent and self.source.done)

    @property
    def counts(self) -> dict[str, int]:
        return self.source.counts

    def __iter__(self) -> Iterator[Any]:
        records = iter(self.source)
        rule, collate = self.rule, self.collate
        measure, size = rule.length, rule.pool_size
        while True:
            self._start = self.source.get_state()
            # -> the next pool of records, in arrival order
            pool = list(islice(records, size))
            if not pool:
                self._ended = True
                return
            self._after = self.source.get_state()
            # -> index lists, one per batch, in the order they are yielded
            batches = rule.cut([measure(record) for record in pool],
                               pool_rng(self.seed_parts, self._pool))
            self._count = len(batches)
            for number in range(self._emitted, len(batches)):
                made = collate([pool[i] for i in batches[number]])
                self._emitted = number + 1  # after the collate: one that raises is not counted
                yield made
            self._pool += 1
            self._emitted = 0
            self._count = None
