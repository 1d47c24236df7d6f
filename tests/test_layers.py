"""Folders are layers: the package reads top to bottom, and no folder imports one above it.

The stack, bottom first (each layer may import itself and the layers below it, never above):

    core          streamds/*.py       errors, redact, checks, units, retry, seeds, world,
                                      spec: small rules every layer needs (the package's
                                      ``__init__`` is here too; it names the public API
                                      lazily, by strings, and imports nothing at run time)
    formats       streamds/formats/   bytes on disk: the format registry and one module
                                      per format (jsonl, jsonl_zst, json_file, tar), codecs,
                                      seekable zstd, manifest, file names, trees, documents,
                                      values, samples
    storage       streamds/storage/   shards, plan (blocks of shards), read, readahead,
                                      ranges, cache, mounts
    handover      streamds/handover/  shm_ring, shm_tensors: how batches cross processes
    stages        streamds/stages/    the reader chain and its state: chunks, lines, parse,
                                      transform, balance, records, shuffle, batch, buckets,
                                      parse_later, ahead, pipeline (the builder), numbers,
                                      cpus, timing, state;
                                      and the stages beside the reader: mixing, packing,
                                      pools, rebatch
    resume        streamds/resume/    merge, plain_loader, identity, counts, totals, replay:
                                      resuming from a state
    train         streamds/train/     what a loader does with batches: loader (ds.loader),
                                      rebatch (names the stage), collate, prefetch, stall,
                                      loader_state (torchdata's keys, the public merge_states)
    datasets      streamds/datasets/  what a user builds: dataset (StreamingJsonl), mix,
                                      pack, batching (.batch of a mix or packed data), callers
    integrations  streamds/integrations/  Lightning, Accelerate, transformers
    preprocess    preprocess/         the converter (the writing side), installed as
                                      `streamds.preprocess`
    tools         streamds/tools/     the command line (cli) and bench

Only the command line (`streamds.tools.cli`) imports the converter, `streamds.preprocess`, and only
inside a function. The import graph is the one `test_import_cycles` reads from the source
(function-level imports count: a function that imports upward still ties the layers).
"""

from __future__ import annotations

import pytest
from test_import_cycles import PACKAGES, REPO, Edge, find_cycles, import_edges, walk_modules

# bottom first: (layer, folder)
LAYERS: tuple[tuple[str, str], ...] = (
    ("core", "streamds"),
    ("formats", "streamds.formats"),
    ("storage", "streamds.storage"),
    ("handover", "streamds.handover"),
    ("stages", "streamds.stages"),
    ("resume", "streamds.resume"),
    ("train", "streamds.train"),
    ("datasets", "streamds.datasets"),
    ("integrations", "streamds.integrations"),
    ("preprocess", "streamds.preprocess"),
    ("tools", "streamds.tools"),
)
RANK = {folder: rank for rank, (_, folder) in enumerate(LAYERS)}
CONVERTER = "streamds.preprocess"
COMMAND_LINE = "streamds.tools.cli"


def folder_of(module: str, packages: set[str]) -> str:
    """The folder (package) a module lies in: a package is its own folder."""
    return module if module in packages else module.rpartition(".")[0]


def layer_problems(edges: list[Edge], packages: set[str]) -> list[str]:
    """Every import that breaks the layer order, and every converter import but the CLI's."""
    problems = []
    for edge in edges:
        source, target = folder_of(edge.source, packages), folder_of(edge.target, packages)
        if source not in RANK or target not in RANK:
            problems.append(f"{edge}: a folder outside LAYERS ({source} or {target})")
        elif RANK[target] > RANK[source]:
            problems.append(f"{edge}: imports upward, {source} -> {target}")
        if target == CONVERTER and source != CONVERTER and edge.source != COMMAND_LINE:
            problems.append(f"{edge}: only {COMMAND_LINE} may import the converter")
    return problems


@pytest.fixture(scope="module")
def project() -> tuple[list[Edge], set[str]]:
    modules = walk_modules(REPO, PACKAGES)
    packages = {name for name, (_, is_package) in modules.items() if is_package}
    return import_edges(REPO, PACKAGES), packages


def test_every_folder_is_a_layer(project: tuple[list[Edge], set[str]]) -> None:
    _, packages = project
    assert packages == set(RANK), "each folder of the package is one row of LAYERS"


def test_imports_follow_the_layer_order(project: tuple[list[Edge], set[str]]) -> None:
    edges, packages = project
    problems = layer_problems(edges, packages)
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_folders_import_each_other_without_a_cycle(
    project: tuple[list[Edge], set[str]],
) -> None:
    edges, packages = project
    graph: dict[str, set[str]] = {}
    for edge in edges:
        source, target = folder_of(edge.source, packages), folder_of(edge.target, packages)
        if source != target:
            graph.setdefault(source, set()).add(target)
    assert find_cycles(graph) == []


def test_the_check_sees_an_upward_import_and_a_converter_import() -> None:
    packages = {
        "streamds", "streamds.storage", "streamds.stages", "streamds.tools", "streamds.preprocess"
    }
    here = REPO / "x.py"
    edges = [
        Edge("streamds.storage.read", "streamds.stages.parse", here, 1, False),  # upward
        Edge("streamds.stages.parse", "streamds.storage.read", here, 2, True),  # downward
        Edge("streamds.tools.bench", "streamds.preprocess.command", here, 3, False),  # not the CLI
        Edge("streamds.tools.cli", "streamds.preprocess.command", here, 4, False),  # allowed
        Edge("streamds.preprocess.job", "streamds.errors", here, 5, True),
    ]
    problems = layer_problems(edges, packages)
    assert len(problems) == 2
    assert "streamds.storage -> streamds.stages" in problems[0]
    assert "streamds.tools.bench -> streamds.preprocess.command" in problems[1]
