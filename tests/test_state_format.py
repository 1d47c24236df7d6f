"""One format version for the whole state tree: every state a user saves (a reader's, a merged
one, a mix's, a packed dataset's, a batcher's, a Rebatch's) carries `STATE_FORMAT` once, at
its top, and names its stage; a node nested in another's (a mix's sources) names its stage
only. A state of another streamds version is refused, by every loader and by `merge_states`,
as one ("a state from another version of streamds"), naming the format found and what to do.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import corpus
import pytest

from streamds import (
    LengthBuckets,
    Mix,
    PackTokens,
    Rebatch,
    StateMismatchError,
    StreamingJsonl,
    merge_states,
)
from streamds.stages.balance import EvenRanks
from streamds.stages.batch import Batch
from streamds.stages.buckets import PoolBatch
from streamds.stages.chunks import ChunkCursor, nodes
from streamds.stages.lines import Lines
from streamds.stages.parse import Parse
from streamds.stages.shuffle import Shuffle
from streamds.stages.state import FORMAT, STAGE, STATE_FORMAT
from streamds.stages.transform import AfterBuffer, Transform

EOS = 0


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("state_format")
    found = []
    for name, start in (("a", 0), ("b", 1000)):
        path = root / f"{name}.jsonl"
        corpus.write_plain(path, corpus.jsonl(corpus.make_records(12, start=start)))
        found.append(str(path))
    return found[0], found[1]


def tokens(record: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": [record["id"] + 1] * (1 + record["id"] % 3)}


def reader(paths: tuple[str, str]) -> StreamingJsonl:
    return StreamingJsonl(paths[0], shuffle=True, seed=1, buffer_size=4)


def mix(paths: tuple[str, str]) -> Mix:
    return Mix([StreamingJsonl(path, shuffle=True, seed=1, buffer_size=4) for path in paths],
               [0.5, 0.5], seed=2)


def packed(paths: tuple[str, str]) -> Any:
    return reader(paths).map(tokens).pack(PackTokens(seq_len=4, eos_id=EOS))


def batcher(paths: tuple[str, str]) -> Any:
    return mix(paths).batch(LengthBuckets(2, buffer_size=4, length="text"))


def rebatch(paths: tuple[str, str]) -> Rebatch:
    return Rebatch(_Loader(reader(paths).batch(5)), 2)


class _Loader:
    """The smallest stateful loader: the dataset itself, batch_size=None, one process."""

    def __init__(self, dataset: StreamingJsonl) -> None:
        self.dataset = dataset

    def __iter__(self) -> Any:
        return iter(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)


def taken(make: Callable[[tuple[str, str]], Any], paths: tuple[str, str]) -> dict[str, Any]:
    """The state of `make(paths)` after its first item."""
    made = make(paths)
    next(iter(made))
    return made.state_dict()


# (family, build, a format another streamds version wrote, its stage now)
FAMILIES = [
    ("reader", reader, "streamds.reader/3", "reader"),
    ("mix", mix, "streamds.mix/1", "mix"),
    ("packed", packed, "streamds/2", "packed"),
    ("batcher", batcher, "streamds.batches/2", "batches"),
    ("rebatch", rebatch, "streamds/3", "rebatch"),
]


def old(state: dict[str, Any], form: str) -> dict[str, Any]:
    """`state` as another version wrote it: another format, no stage key."""
    return {**{k: v for k, v in state.items() if k != STAGE}, FORMAT: form}


def refused(form: str) -> str:
    return (rf"a state from another version of streamds \(format '{form}'; this version reads "
            rf"'{STATE_FORMAT}'\): finish the epoch with the streamds version that took the "
            r"state, or start the epoch afresh")


@pytest.mark.parametrize(("family", "make", "form", "stage"), FAMILIES,
                         ids=[f[0] for f in FAMILIES])
def test_every_family_carries_the_one_format_and_names_its_stage(
    paths: tuple[str, str], family: str, make: Any, form: str, stage: str
) -> None:
    state = taken(make, paths)
    assert state[FORMAT] == STATE_FORMAT
    assert state[STAGE] == stage
    loaded = make(paths)
    loaded.load_state_dict(state)  # the current format loads


@pytest.mark.parametrize(("family", "make", "form", "stage"), FAMILIES,
                         ids=[f[0] for f in FAMILIES])
def test_a_state_of_another_version_is_refused(
    paths: tuple[str, str], family: str, make: Any, form: str, stage: str
) -> None:
    state = old(taken(make, paths), form)
    with pytest.raises(StateMismatchError, match=refused(form)):
        make(paths).load_state_dict(state)
    with pytest.raises(StateMismatchError, match=refused(form)):
        merge_states([state])


def test_nested_nodes_carry_no_format_of_their_own(paths: tuple[str, str]) -> None:
    state = taken(mix, paths)
    assert [source[STAGE] for source in state["sources"]] == ["reader", "reader"]
    assert all(FORMAT not in source for source in state["sources"])
    assert FORMAT not in taken(packed, paths)["source"]
    assert FORMAT not in taken(batcher, paths)["source"]


@pytest.mark.parametrize(
    ("make", "form"),
    [(reader, "streamds.merged/2"), (mix, "streamds.merged-mix/1"),
     (packed, "streamds.merged-packed/1")],
    ids=["reader", "mix", "packed"],
)
def test_a_merged_state_of_another_version_is_refused(
    paths: tuple[str, str], make: Any, form: str
) -> None:
    merged = merge_states([make(paths).state_dict()])
    with pytest.raises(StateMismatchError, match=refused(form)):
        make(paths).with_resume(old(merged, form))


def test_a_nested_old_state_is_refused_too(paths: tuple[str, str]) -> None:
    """An old reader state inside a current mix state (a hand-made mixture) is refused."""
    state = taken(mix, paths)
    state["sources"][0] = old(state["sources"][0], "streamds.reader/3")
    with pytest.raises(StateMismatchError, match=refused("streamds.reader/3")):
        mix(paths).load_state_dict(state)
    with pytest.raises(StateMismatchError, match=refused("streamds.reader/3")):
        merge_states([state])


def test_the_format_of_a_later_version_is_refused(paths: tuple[str, str]) -> None:
    state = {**taken(mix, paths), FORMAT: "streamds/9"}
    with pytest.raises(StateMismatchError, match=refused("streamds/9")):
        mix(paths).load_state_dict(state)


def test_a_format_that_is_no_streamds_one_is_refused_as_unknown(paths: tuple[str, str]) -> None:
    state = {**taken(mix, paths), FORMAT: "other/1"}
    with pytest.raises(StateMismatchError, match="unknown state format 'other/1'"):
        mix(paths).load_state_dict(state)


# -- each family a stage that owns its state ----------------------------------------------------

STAGE_KEYS = {  # keys that only the stage named owns; no module outside it may name them
    "streamds/stages/mixing.py": ("passes", "taken", "in_pass", "ran_out", "draws", "seat"),
    "streamds/stages/packing.py": ("leftover", "leftovers"),
    "streamds/stages/pools.py": ("emitted", "consumed"),
    "streamds/stages/rebatch.py": ("skip",),
}
READERS_OF_STATES = ("streamds/resume/merge.py", "streamds/resume/plain_loader.py",
                     "streamds/resume/totals.py", "streamds/datasets/mix.py",
                     "streamds/datasets/pack.py", "streamds/datasets/batching.py")


@pytest.mark.parametrize("module", READERS_OF_STATES)
def test_no_module_outside_a_stage_reads_its_keys(module: str) -> None:
    """merge_states, plain-loader resume, the counts and the datasets ask the stages (their
    merge, check_merge, taken_of, counts_of, load) instead of reading their dicts."""
    root = Path(__file__).resolve().parents[1]
    text = (root / module).read_text()
    for owner, keys in STAGE_KEYS.items():
        for key in keys:
            for quoted in (f'["{key}"]', f"['{key}']", f'.get("{key}"'):
                assert quoted not in text, f"{module} reads {owner}'s key {key!r} ({quoted})"
            # nor writes it into a dict literal
            assert not re.search(rf'[{{,]\s*"{key}":', text), f"{module} forges {key!r}"


# the reader's stages: their key constants, and the keys themselves as written in their states
READER_STAGES = (Lines, ChunkCursor, Parse, Transform, EvenRanks, Shuffle, AfterBuffer, Batch,
                 PoolBatch)
READER_KEYS = ("source", "counts", "item", "offset", "emitted", "cut", "positions", "round",
               "since", "draining", "rule", "pool", "next",
               # a reader's own node (`ReaderState`: read it with from_dict or counts_of)
               "pipeline", "carried", "prefill", "quota", "seat")
# modules that compute resumes, merges and counts from the reader's states; a key they own
# themselves is named beside them (the counts of merge.py's merged state and the quota of
# its tails, the next number of replay.py's number source)
READERS_OF_READER_STATES = {
    "streamds/resume/merge.py": ("counts", "quota"), "streamds/resume/plain_loader.py": (),
    "streamds/resume/replay.py": ("next",), "streamds/resume/totals.py": (),
    "streamds/resume/block_counts.py": (), "streamds/resume/start.py": (),
    "streamds/stages/pipeline.py": (),
}


def _key_constants() -> dict[str, set[str]]:
    """Stage class name -> its constants that name keys of its state."""
    found: dict[str, set[str]] = {}
    for stage in READER_STAGES:
        for name in dir(stage):
            value = getattr(stage, name)
            if name.isupper() and (isinstance(value, str) or (
                    isinstance(value, (tuple, frozenset)) and all(isinstance(v, str)
                                                                 for v in value))):
                found.setdefault(stage.__name__, set()).add(name)
    return found


def reader_key_reads(text: str, own: tuple[str, ...] = ()) -> list[str]:
    """Where `text` names a reader stage's key: a stage's key constant (``Shuffle.SOURCE``),
    or the key itself as a subscript, a ``.get``/``in`` probe or a dict literal's key."""
    constants = _key_constants()
    keys = set(READER_KEYS) - set(own)
    found = []
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.attr in constants.get(node.value.id, ())):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        named: list[ast.expr] = []
        if isinstance(node, ast.Subscript):
            named = [node.slice]
        elif isinstance(node, ast.Dict):
            named = [key for key in node.keys if key is not None]
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            named = [node.left]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "pop", "setdefault") and node.args):
            named = [node.args[0]]
        for key in named:
            if isinstance(key, ast.Constant) and key.value in keys:
                found.append(f"line {node.lineno}: {key.value!r}")
    return found


@pytest.mark.parametrize("module", sorted(READERS_OF_READER_STATES))
def test_no_module_outside_the_reader_stages_reads_their_keys(module: str) -> None:
    """Merges, plain-loader resumes, replays, counts and `Reader.position_at` use the reader
    stages' operations (`Lines.position_in`, `ChunkCursor.at`, `Shuffle.snapshot_of`,
    `EvenRanks.cut_of`, `PoolBatch.pool_of`, ...) instead of walking and forging their dicts."""
    root = Path(__file__).resolve().parents[1]
    found = reader_key_reads((root / module).read_text(), READERS_OF_READER_STATES[module])
    assert found == [], f"{module} reads or writes a reader stage's keys by hand: {found}"


@pytest.mark.parametrize("by_hand", [
    'lines = state["source"]', "item = position[ChunkCursor.ITEM]",
    'cut = node.get("cut")', "state[Shuffle.POSITIONS] = packed",
    'forged = {"item": 0, "offset": None}', 'if "item" in node: pass',
])
def test_the_reader_key_check_catches_a_read_by_hand(by_hand: str) -> None:
    assert reader_key_reads(by_hand)


@pytest.mark.parametrize(("make", "names"), [
    (lambda paths: reader(paths).map(tokens).batch(2),
     ["batch", "after_buffer", "shuffle", "cursor", "even_ranks", "transform", "parse", "lines"]),
    (lambda paths: StreamingJsonl(paths[0]),
     ["cursor", "even_ranks", "transform", "parse", "lines"]),
], ids=["shuffled-batched", "in-order"])
def test_every_node_of_a_reader_pipeline_names_its_stage(
    paths: tuple[str, str], make: Any, names: list[str]
) -> None:
    """A walk finds a stage by its name, not by probing for keys."""
    ds = make(paths)
    next(iter(ds))
    assert [node[STAGE] for node in nodes(ds.state_dict()["pipeline"])] == names


def test_a_node_of_another_stage_is_refused_by_name(paths: tuple[str, str]) -> None:
    ds = reader(paths)
    next(iter(ds))
    state = ds.state_dict()
    *_, lines = nodes(state["pipeline"])
    lines[STAGE] = "cache"
    fresh = reader(paths)
    with pytest.raises(StateMismatchError, match="the 'lines' stage was given the state of "
                                                 "'cache'"):
        fresh.load_state_dict(state)
        next(iter(fresh))


@pytest.mark.parametrize("make", [mix, batcher], ids=["mix", "batcher"])
def test_set_epoch_refuses_while_a_loaded_state_is_mid_epoch(
    paths: tuple[str, str], make: Any
) -> None:
    state = taken(make, paths)
    loaded = make(paths)
    loaded.load_state_dict(state)
    with pytest.raises(ValueError, match=r"set_epoch\(3\): the loaded state is in the middle "
                                         r"of epoch 0"):
        loaded.set_epoch(3)


@pytest.mark.parametrize(("make", "stage"), [(reader, "merged"), (mix, "merged-mix"),
                                             (packed, "merged-packed")],
                         ids=["reader", "mix", "packed"])
def test_merge_states_dispatches_by_stage(paths: tuple[str, str], make: Any, stage: str) -> None:
    merged = merge_states([taken(make, paths)])
    assert merged[FORMAT] == STATE_FORMAT
    assert merged[STAGE] == stage


@pytest.mark.parametrize(("make", "stage"), [(batcher, "batches"), (rebatch, "rebatch")],
                         ids=["batcher", "rebatch"])
def test_a_state_under_way_is_refused_by_the_stages_own_rule(
    paths: tuple[str, str], make: Any, stage: str
) -> None:
    state = taken(make, paths)  # one batch out of a pool / of a big batch
    assert state[STAGE] == stage
    with pytest.raises(ValueError, match="merge_states cannot carry over"):
        merge_states([state])


def test_states_of_two_kinds_of_dataset_are_not_merged_as_one(paths: tuple[str, str]) -> None:
    """A packed state and a mix state together: refused, not merged as whichever came first."""
    with pytest.raises(ValueError, match=r"states of one dataset.*\['mix', 'packed'\]"):
        merge_states([taken(mix, paths), taken(packed, paths)])


def formats_in(found: Any) -> int:
    """How many nodes of the tree carry a format key."""
    if isinstance(found, dict):
        return (FORMAT in found) + sum(formats_in(value) for value in found.values())
    if isinstance(found, (list, tuple)):
        return sum(formats_in(value) for value in found)
    return 0


@pytest.mark.parametrize("make", [reader, mix, packed, batcher], ids=["reader", "mix", "packed",
                                                                       "batcher"])
def test_the_format_is_carried_once_at_the_top(paths: tuple[str, str], make: Any) -> None:
    state = taken(make, paths)
    assert formats_in(state) == 1
    if make is not batcher:
        assert formats_in(merge_states([state])) == 1


def test_a_merge_over_readers_that_had_not_started_carries_the_format_once(
    paths: tuple[str, str]
) -> None:
    """Rank 0 started on its share of a merged state, rank 1 had not: the merged state nests
    the earlier one (for rank 1's share), without a format of its own."""
    merged = merge_states([taken(reader, paths)])
    ranks = [StreamingJsonl(paths[0], shuffle=True, seed=1, buffer_size=4, rank=rank,
                            world_size=2).with_resume(merged) for rank in range(2)]
    next(iter(ranks[0]))
    again = merge_states([ranks[0].state_dict(), ranks[1].state_dict()])
    assert formats_in(again) == 1


@pytest.mark.parametrize(("make", "into", "message"), [
    (mix, reader, r"state of a 'mix' stage, not of a reader"),
    (reader, mix, r"stage 'mix' expected, found 'reader'"),
    (packed, batcher, r"stage 'batches' expected, found 'packed'"),
    (batcher, rebatch, r"stage 'rebatch' expected, found 'batches'"),
], ids=["mix-into-reader", "reader-into-mix", "packed-into-batcher", "batcher-into-rebatch"])
def test_the_state_of_another_stage_is_refused_naming_both(
    paths: tuple[str, str], make: Any, into: Any, message: str
) -> None:
    with pytest.raises(StateMismatchError, match=message):
        into(paths).load_state_dict(taken(make, paths))
