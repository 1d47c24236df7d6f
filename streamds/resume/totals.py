"""`counts_of`: what the readers behind a state skipped or dropped, summed over all of them.

Each reader counts lines without a record in its own process (a DataLoader worker, a rank),
so `ds.counts` in the main process of a loader with workers is empty. The counts travel in
the state instead: every reader state nests its stages' counters, and a StatefulDataLoader's
`state_dict()` nests every worker's reader state. `counts_of` finds them all.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .merge import COUNTERS, MERGED_FORMAT, _stage_counts
from .state import STATE_FORMAT

__all__ = ["counts_of"]


def counts_of(state: Any) -> dict[str, int]:
    """The counters of every reader state found in `state`, summed.

    `state` is anything holding reader states: a dataset's or a batcher's `state_dict()`, a
    StatefulDataLoader's (one reader per worker), a list of every rank's, or a merged state.
    Keys: "bad" (malformed lines skipped under on_error="skip"), "corrupt_blocks" (damaged
    blocks skipped), "blank" (blank lines) and "dropped" (records a map or filter removed).

    A state taken at the end of an epoch counts the whole epoch. One taken in the middle
    counts up to where it would resume: the start of the current read (about 256 KiB), or,
    with shuffle=True, up to a buffer's worth of records earlier. A StatefulDataLoader with
    workers keeps each worker's state as of the last batch that worker delivered, so lines
    after it (all of them, when a filter drops every record) show only in that worker's
    end-of-epoch log line.

    Example::

        for batch in loader: ...
        print(streamds.counts_of(loader.state_dict()))  # {"bad": 3, "blank": 0, ...}
    """
    totals: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
    _add(state, totals)
    return dict(totals)


def _add(found: Any, totals: Counter[str]) -> None:
    if isinstance(found, dict):
        kind = found.get("format")
        if kind == STATE_FORMAT:
            totals.update(found["carried"])
            if found["pipeline"] is not None:
                totals.update(_stage_counts(found["pipeline"]))
            return
        if kind == MERGED_FORMAT:
            totals.update(found["counts"])
            return
        for value in found.values():
            _add(value, totals)
    elif isinstance(found, (list, tuple)):
        for value in found:
            _add(value, totals)
