"""`counts_of`: what the readers behind a state skipped or dropped, summed over all of them.

Each reader counts lines without a record in its own process (a DataLoader worker, a rank),
so `ds.counts` in the main process of a loader with workers is empty. The counts travel in
the state instead: every reader state nests its stages' counters, and a StatefulDataLoader's
`state_dict()` nests every worker's reader state. `counts_of` finds them all.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..stages.mixing import MixStage
from ..stages.packing import PACK_COUNTERS, PackStage
from ..stages.state import (
    READER,
    ReaderState,
    expanded,
    refuse_other_version,
    stage_of,
)
from .merge import (
    COUNTERS,
    MERGED_MIX,
    MERGED_PACKED,
    MERGED_STATE,
    MIX,
    PACKED,
    _states_of,
    merged_counts,
)

__all__ = ["counts_of", "readers_ended", "source_counts", "token_counts"]


def counts_of(state: Any) -> dict[str, int]:
    """The counters of every reader state found in `state`, summed.

    `state` is anything holding reader states: a dataset's or a batcher's `state_dict()`, a
    StatefulDataLoader's (one reader per worker), a list of every rank's, or a merged state.
    Keys: "bad" (malformed lines skipped under on_error="skip"), "corrupt_blocks" (damaged
    blocks skipped), "blank" (blank lines) and "dropped" (records a map or filter removed).

    A state taken at the end of an epoch counts the whole epoch. One taken in the middle
    counts up to where it would resume: the start of the current read (about 256 KiB), or,
    with shuffle=True, up to a buffer's worth of records earlier; so do the sources of a
    `streamds.Mix` with stop="first" that had not run out when it ended. torchdata's own
    StatefulDataLoader with workers may keep a worker's state from its last batch after the
    epoch, before the lines after it; `streamds.counts_of` (`train.loader_state.counts_of`)
    refuses such a state, and the loaders streamds builds keep each worker's end.

    Refused (ValueError): a `streamds.Mix` with stop="cycle" whose sources started a new
    pass, since a source's state holds the counts of its current pass only.

    Example::

        for batch in loader: ...
        print(streamds.counts_of(loader.state_dict()))  # {"bad": 3, "blank": 0, ...}
    """
    totals: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
    _add(state, totals)
    return dict(totals)


def readers_ended(state: Any) -> bool:
    """Whether every reader in `state` has read all it reads this epoch, so its counts hold
    every line it read: its iterator ran out, or the mix it feeds had ended when the state was
    taken (a mix reads nothing more once it has ended: under stop="first" or "cycle" its other
    sources stay where they stand). True where `state` holds no reader state."""
    if isinstance(state, dict):
        state = expanded(state)
        kind = stage_of(state)
        if kind == READER:
            return ReaderState.finished_of(state)
        if kind == MIX and MixStage.ended_of(state):
            return True
        return all(readers_ended(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return all(readers_ended(value) for value in state)
    return True


def _refuse_restarted(mix: dict[str, Any]) -> None:
    """Refuse a mix node whose sources started new passes: the counts of their earlier passes
    are in no state (each pass reads its source afresh, from a state of its own)."""
    restarted = MixStage.restarted_of(mix)
    if restarted:
        raise ValueError(
            f"counts_of cannot count a streamds.Mix with stop='cycle' whose source(s) "
            f"{restarted} started a new pass: a source's state holds the counts of its current "
            "pass only, not of the passes before; each pass's reader logs its counts in an "
            "'epoch N done' line when it runs out"
        )


def _add(found: Any, totals: Counter[str]) -> None:
    if isinstance(found, dict):
        refuse_other_version(found)
        found = expanded(found)
        kind = stage_of(found)
        if kind == READER:
            totals.update(ReaderState.counts_of(found))
            return
        if kind == MERGED_STATE:
            totals.update(merged_counts(found))
            return
        if kind in (MIX, MERGED_MIX):
            _refuse_restarted(found)
        for value in found.values():
            _add(value, totals)
    elif isinstance(found, (list, tuple)):
        for value in found:
            _add(value, totals)


def source_counts(state: Any) -> list[int]:
    """Records each source of a `streamds.Mix` gave, summed over every mix state in `state`
    (a Mix's or a loader's `state_dict()`, a list of every rank's, or a merged state).

    Example::

        print(streamds.source_counts(loader.state_dict()))  # [7012, 2988]
    """
    totals: list[int] = []
    for found in (*_states_of(state, MIX), *_states_of(state, MERGED_MIX)):
        taken = MixStage.taken_of(found)
        if not totals:
            totals = [0] * len(taken)
        if len(taken) != len(totals):
            raise ValueError("source_counts: the states come from mixes of different sizes")
        totals = [a + b for a, b in zip(totals, taken, strict=True)]
    if not totals:
        raise ValueError("source_counts found no streamds.Mix state in its argument")
    return totals


def token_counts(state: Any) -> dict[str, int]:
    """Packing counts of every packed state in `state`, summed: documents, tokens (read, with
    separators), packed (tokens in sequences), padded, dropped, sequences. Tokens read but in
    no sequence yet are the leftover of a document cut at a sequence's end."""
    totals: Counter[str] = Counter(dict.fromkeys(PACK_COUNTERS, 0))
    found = [*_states_of(state, PACKED), *_states_of(state, MERGED_PACKED)]
    if not found:
        raise ValueError("token_counts found no packed state (ds.pack(...)) in its argument")
    for packed in found:
        totals.update(PackStage.counts_of(packed))
    return dict(totals)
