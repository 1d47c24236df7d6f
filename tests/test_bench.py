"""streamds bench: JSON report shape and values, table, diagnosis of a slow transform, errors.

The stage-by-stage timing of the real pipeline (the timing seam) is tested in
tests/test_bench_stages.py.
"""

from __future__ import annotations

import gzip
import json
import textwrap

import orjson
import pytest

from streamds import StreamingJsonl
from streamds.tools import bench

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

RECORDS = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bench") / "train.jsonl"
    with path.open("wb") as f:
        for i in range(RECORDS):
            f.write(orjson.dumps({"id": i, "text": f"record {i} " * 20}) + b"\n")
    return str(path)


@pytest.fixture
def slow_module(tmp_path, monkeypatch) -> str:
    """A user module whose transform does deliberate busy work (about 1 ms per record)."""
    (tmp_path / "slowprep.py").write_text(textwrap.dedent("""
        def busy(record):
            total = 0
            for i in range(30_000):
                total += i
            record["busy"] = total
            return record

        def keep_even(record):
            return record if record["id"] % 2 == 0 else None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "slowprep"


def run_json(capsys, *argv: str) -> dict:
    assert bench.main([*argv, "--json", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # --quiet: no progress bars
    return json.loads(captured.out)


def test_json_report_keys_and_values(corpus, capsys):
    report = run_json(capsys, corpus, "--num-workers", "0,1", "--records", "200",
                      "--batch-size", "16")
    assert report["source"] == corpus
    assert report["shards"] == 1 and report["codecs"] == ["none"]
    assert report["compressed"] is False and report["remote"] is False
    assert report["batch_size"] == 16 and report["transform"] is None
    assert report["shuffle"] is False and report["state_every_batch"] is True
    assert report["records"] == 208 and report["batches"] == 13  # stops after the batch >= 200
    assert tuple(report["stages"]) == bench.ROWS
    for name in ("read", "parse", "emit", "state", "other"):
        assert report["stages"][name]["seconds"] > 0, name
    for stage in report["stages"].values():
        assert 0 <= stage["share"] <= 1
        assert stage["us_per_record"] == pytest.approx(1e6 * stage["seconds"] / 208)
    assert sum(s["share"] for s in report["stages"].values()) == pytest.approx(1)
    assert sum(s["seconds"] for s in report["stages"].values()) == pytest.approx(
        report["seconds"])
    assert report["records_per_s"] == pytest.approx(208 / report["seconds"])
    assert 0 < report["cpu_share"] <= 1
    # every way users load, with each worker count
    assert [(run["way"], run["num_workers"]) for run in report["loader"]] == [
        (way, n) for n in (0, 1) for way in bench.WAYS]
    for run in report["loader"]:
        assert 200 <= run["records"] <= 200 + 16 or (  # ds.loader: whole batches of 16 too
            run["way"] == "ds.loader" and 200 <= run["records"] <= RECORDS)
        assert run["records_per_s"] > 0 and run["time_to_first_batch_s"] > 0
    fastest = max(run["records_per_s"] for run in report["loader"])
    assert report["best"] in report["loader"]
    assert report["best"]["records_per_s"] >= bench.NEAR_BEST * fastest
    assert report["best_num_workers"] == report["best"]["num_workers"]
    assert 100 < report["bytes_per_record"] < 400
    assert report["costliest"] in bench.ROWS
    advised = bench.code_of(report["best"]["way"], report["best"]["num_workers"], 16)
    assert sum(note.startswith(f"use {advised}: ") for note in report["recommendations"]) == 1


def test_slow_transform_is_diagnosed_as_the_bottleneck(corpus, slow_module, capsys):
    report = run_json(capsys, corpus, "--num-workers", "0", "--records", "100",
                      "--transform", f"{slow_module}:busy")
    assert report["transform"] == f"{slow_module}:busy"
    assert report["bottleneck"] == report["costliest"] == "transform"
    assert report["stages"]["transform"]["share"] > 0.5
    assert report["recommendations"][0].startswith("your transform is the bottleneck")
    assert "add workers" in report["recommendations"][0]
    assert "ds.cache(directory, key=...)" in report["recommendations"][0]  # tokenize once


def test_fast_pipeline_is_not_blamed_on_the_transform(corpus, slow_module, capsys):
    report = run_json(capsys, corpus, "--num-workers", "0", "--records", "1000",
                      "--transform", f"{slow_module}:keep_even")
    assert report["bottleneck"] != "transform"
    assert report["records"] == RECORDS // 2  # the filter-like transform dropped half...
    assert report["counts"]["dropped"] == RECORDS // 2  # ...and the pipeline counted them
    assert not any("transform is the bottleneck" in n for n in report["recommendations"])


def test_table_output_and_progress(corpus, capsys):
    assert bench.main([corpus, "--num-workers", "0", "--records", "50"]) == 0
    captured = capsys.readouterr()
    rows = [line.split()[0] for line in captured.out.splitlines() if line.strip()]
    for row in ("read", "parse", "transform", "even_ranks", "emit", "state", "collate/other",
                "total"):
        assert row in rows, row
    for way in bench.WAYS:  # a row per way, and a progress bar per run on stderr
        assert any(line.split()[:2] == [way, "0"] for line in captured.out.splitlines()), way
        assert f"{way} num_workers=0" in captured.err
    assert captured.out.count("<- advised") == 1 and "\n- use " in captured.out
    assert "pipeline, 1 process" in captured.err  # tqdm progress goes to stderr


def test_compressed_source_is_reported(tmp_path, capsys):
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"".join(orjson.dumps({"i": i}) + b"\n" for i in range(50)))
    report = run_json(capsys, str(path), "--num-workers", "0", "--records", "50")
    assert report["codecs"] == ["gz"] and report["compressed"] is True
    assert report["records"] == 50


def stage(share: float) -> dict:
    return {"share": share, "us_per_record": 10.0}


def stages(**shares: float) -> dict:
    return {name: stage(shares.get(name, 0.0)) for name in bench.ROWS}


@pytest.mark.parametrize(
    ("shares", "facts", "expected", "fix"),
    [
        ({"read": 0.8, "parse": 0.2}, {"compressed": True}, "decompression is the bottleneck",
         "lower --level"),
        ({"read": 0.8, "parse": 0.2}, {"compressed": True, "cpu_share": 0.2},
         "reading (storage) is the bottleneck", "off the CPU 80%"),
        ({"read": 0.8, "parse": 0.2}, {"remote": True}, "reading (network) is the bottleneck",
         ".jsonl.zst shards"),
        ({"read": 0.8, "parse": 0.2}, {}, "reading (splitting lines) is the bottleneck",
         "add workers"),
        ({"read": 0.2, "parse": 0.7, "transform": 0.1}, {}, "JSON parsing is the bottleneck",
         "add workers"),
        ({"transform": 0.9, "parse": 0.1}, {}, "your transform is the bottleneck",
         "add workers"),
        ({"emit": 0.6, "parse": 0.4}, {"shuffle": True}, "the shuffle buffer is the bottleneck",
         "smaller buffer_size"),
        ({"emit": 0.6, "parse": 0.4}, {}, "handing out records is the bottleneck",
         "add workers"),
        ({"state": 0.6, "parse": 0.4}, {}, "taking the state after every batch is the bottleneck",
         "snapshot_every_n_steps"),
        ({"other": 0.6, "parse": 0.4}, {}, "collate and the loop", "collate_fn cheaper"),
        ({"read": 0.4, "parse": 0.3, "transform": 0.3}, {},
         "no single stage dominates; the costliest is reading", "add workers"),
    ],
)
def test_recommendations_name_the_costliest_stage(shares, facts, expected, fix):
    loader = [run("DataLoader", 0, 100.0), run("DataLoader", 2, 300.0)]
    report = {"stages": stages(**shares), "compressed": False, "remote": False,
              "shuffle": False, "cpu_share": 1.0, "loader": loader, "best": loader[1],
              "batch_size": 32, **facts}
    costliest, bottleneck, notes = bench._recommend(report)
    assert costliest == max(shares, key=shares.__getitem__)
    assert bottleneck == (costliest if max(shares.values()) >= bench.DOMINANT else None)
    assert notes[0].startswith(expected) and fix in notes[0]
    assert notes[1].startswith(
        "use DataLoader(ds, batch_size=32, num_workers=2, collate_fn=as_list): 300 records/s")
    assert "3.00x a plain DataLoader with no workers" in notes[1]
    assert "try more than 2" in notes[2]


def run(way: str, workers: int, rate: float, first: float = 0.1) -> dict:
    return {"way": way, "num_workers": workers, "records_per_s": rate, "records": 1000,
            "time_to_first_batch_s": first}


@pytest.mark.parametrize("name", ["transform", "parse", "read", "emit", "other"])
def test_no_workers_suggested_where_workers_did_not_pay_off(name):
    loader = [run(way, n, 300.0 if n == 0 else 100.0) for n in (0, 2) for way in bench.WAYS]
    report = {"stages": stages(**{name: 0.9, "state": 0.1}), "compressed": False,
              "remote": False, "shuffle": True, "cpu_share": 1.0, "loader": loader,
              "best": bench.best_run(loader), "batch_size": 32}
    costliest, _, notes = bench._recommend(report)
    assert costliest == name
    assert "workers" not in notes[0]
    assert notes[1].startswith("use ds.loader(32, num_workers=0): ")  # first of equals
    assert any("worker processes did not pay off in any way measured" in n for n in notes)


def test_one_voice_when_only_another_way_pays_off_with_workers():
    """A plain DataLoader gains nothing from workers but ds.loader does: the advice is
    ds.loader with workers, and nothing says that workers do not pay off."""
    loader = [run("DataLoader", 0, 300.0), run(".batch", 0, 310.0), run("ds.loader", 0, 320.0),
              run("DataLoader", 2, 250.0), run(".batch", 2, 420.0), run("ds.loader", 2, 470.0)]
    report = {"stages": stages(transform=0.9, parse=0.1), "compressed": False,
              "remote": False, "shuffle": True, "cpu_share": 1.0, "loader": loader,
              "best": bench.best_run(loader), "batch_size": 16, "transform": "prep:tok"}
    _, _, notes = bench._recommend(report)
    assert notes[1].startswith("use ds.loader(16, num_workers=2): 470 records/s")
    assert "1.57x a plain DataLoader with no workers" in notes[1]
    assert "add workers" in notes[0]
    assert not any("did not pay off" in note or "num_workers=0" in note for note in notes)


def test_no_time_measured_names_no_stage():
    report = {"stages": stages(), "loader": [], "best": None}
    assert bench._recommend(report) == (None, None, [])


def test_best_run_prefers_fewer_workers_then_the_way_named_first_when_close():
    runs = [run("DataLoader", n, r) for n, r in ((0, 100.0), (1, 190.0), (2, 196.0), (4, 199.0))]
    assert bench.best_run(runs)["num_workers"] == 1
    runs.append(run("ds.loader", 1, 195.0))
    assert bench.best_run(runs)["way"] == "ds.loader"


def test_errors_exit_non_zero(tmp_path, corpus, capsys):
    assert bench.main([str(tmp_path / "missing.jsonl"), "--quiet"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert bench.main([corpus, "--quiet", "--transform", "nocolon"]) == 1
    assert "module:function" in capsys.readouterr().err
    assert bench.main([corpus, "--quiet", "--transform", "no_such_module_xyz:f"]) == 1
    with pytest.raises(SystemExit):
        bench.main([corpus, "--num-workers", "a,b"])
    with pytest.raises(SystemExit):
        bench.main([corpus, "--num-workers", "-1"])
    with pytest.raises(SystemExit):
        bench.main([corpus, "--batch-size", "0"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"batch_size": True}, "batch_size must be an integer >= 1, got True"),
        ({"records": 2.5}, "records must be an integer >= 1, got 2.5"),
        ({"buffer_size": 0}, "buffer_size must be an integer >= 1, got 0"),
        ({"num_workers": [0, -1]}, "num_workers must be an integer >= 0, got -1"),
        ({"num_workers": []}, "num_workers must name at least one worker count"),
    ],
)
def test_run_bench_checks_its_arguments(corpus, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        bench.run_bench(corpus, **kwargs)


@pytest.mark.parametrize("argv", [["0", "2"], ["0,2"], ["0", "2,"]])
def test_num_workers_as_separate_or_comma_separated_values(corpus, monkeypatch, argv):
    seen = {}

    def fake_run_bench(source, **kwargs):
        seen.update(kwargs, source=source)
        raise ValueError("stop here")  # the options are all this test needs

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    assert bench.main([corpus, "--num-workers", *argv, "--quiet"]) == 1
    assert seen["source"] == corpus and seen["num_workers"] == [0, 2]
    assert seen["state_every_batch"] is True  # on unless --no-state-every-batch


# --- a shuffle buffer filled through an expensive map --------------------------------------


def filled_then_drained(workers: int, fill: float) -> dict:
    """A loader run over 10,000 records behind a 10,000-record shuffle buffer: `fill` seconds
    of a ~480 records/s map before the first batch, then the buffer drains in 0.15 s."""
    return bench.LoaderRun("DataLoader", workers, records=10_000, batches=313,
                           seconds=fill + 0.15, first_batch_s=fill, warm_at=fill,
                           warm_records=32).report()


def test_whole_run_rates_advise_workers_for_a_map_behind_a_shuffle_buffer():
    # one process maps the whole corpus into its buffer; two workers each map half of it
    runs = [filled_then_drained(0, 20.8), filled_then_drained(2, 10.4)]
    zero, two = runs
    assert zero["records_per_s"] == pytest.approx(10_000 / 20.95)  # the fill included
    assert zero["time_to_first_batch_s"] == 20.8
    # counted from the first batch, one process looked fastest: that was the old advice
    assert zero["records_per_s_after_first_batch"] > two["records_per_s_after_first_batch"]
    assert bench.best_run(runs) is two
    report = {"stages": stages(transform=0.95, parse=0.05), "compressed": False,
              "remote": False, "shuffle": True, "buffer_size": 10_000,
              "transform": "prep:tokenize", "cpu_share": 1.0, "loader": runs,
              "best": two, "batch_size": 32,
              "first_batch_s": 20.5, "first_batch_stages": {"transform": 20.0, "parse": 0.5}}
    _, bottleneck, notes = bench._recommend(report)
    assert bottleneck == "transform"
    assert notes[0].startswith("your transform is the bottleneck")
    assert "add workers (it runs in them)" in notes[0]
    assert notes[1] == ("use DataLoader(ds, batch_size=32, num_workers=2, collate_fn=as_list): "
                        "948 records/s over the whole run, the first batch after 10.40 s (the "
                        "fastest way measured, 1.99x a plain DataLoader with no workers)")
    first = [note for note in notes if note.startswith("the first batch takes 10.4 s")]
    assert len(first) == 1, notes
    assert ("20.0 s of the 20.5 s that the pass in one process waited for its first batch "
            "went to your transform") in first[0]
    assert "ds.cache(directory, key=...)" in first[0] and "even_ranks" in first[0]
    assert "persistent_workers" not in first[0]  # set_epoch would not reach such workers


@pytest.mark.parametrize(
    ("facts", "says", "not_says"),
    [
        ({"first_batch_stages": {"transform": 0.5, "parse": 9.5}}, "smaller buffer_size",
         "your transform"),  # a buffer of raw records: the map is not what it waits for
        ({"transform": None, "first_batch_stages": {"parse": 10.0}}, "smaller buffer_size",
         "your transform"),
        ({"shuffle": False}, "persistent_workers=True", "buffer"),
    ],
)
def test_a_slow_first_batch_is_explained_by_what_it_waited_for(facts, says, not_says):
    report = {"shuffle": True, "buffer_size": 10_000, "transform": "prep:tokenize",
              "first_batch_s": 10.0, "first_batch_stages": {"transform": 9.0}, **facts}
    [note] = bench._first_batch_note(report, 12.0)
    assert note.startswith("the first batch takes 12.0 s") and says in note
    assert not_says not in note
    assert bench._first_batch_note(report, bench.SLOW_FIRST_BATCH) == []  # not slow


def test_bench_of_a_map_behind_a_shuffle_buffer_reports_the_whole_run(tmp_path, slow_module):
    """End to end: a busy-loop map (fixed CPU per record) and a buffer larger than the corpus.
    The map runs as records leave the buffer, so the first batch waits for the buffer to be
    read, not mapped; the rates still count from the start."""
    for part in range(4):
        (tmp_path / f"part{part}.jsonl").write_bytes(b"".join(
            orjson.dumps({"id": part * 60 + i}) + b"\n" for i in range(60)))
    report = bench.run_bench(str(tmp_path), num_workers=(0, 2), batch_size=16, records=1000,
                             seconds=1.0, transform=f"{slow_module}:busy", shuffle=True,
                             buffer_size=1000)
    assert report["records"] == 240
    # the in-process pass did not wait for the whole corpus to go through the map
    assert report["first_batch_s"] < 0.5 * report["seconds"]
    for run in report["loader"]:
        assert run["records"] == 240
        assert run["records_per_s"] == pytest.approx(240 / run["seconds"])
        assert 0 < run["time_to_first_batch_s"] <= run["seconds"]
    zero = report["loader"][0]
    # the wait is in the rate: after it, the buffer only drained
    assert zero["records_per_s"] < zero["records_per_s_after_first_batch"]
    table = bench.format_report(report)
    assert f"the first batch after {report['first_batch_s']:.2f} s" in table
    assert "records/s: over the whole run, the wait for the first batch included" in table
    assert any(line.split()[:2] == ["ds.loader", "2"]
               and line.removesuffix("  <- advised").endswith(" s")
               for line in table.splitlines())


def test_the_time_limit_counts_from_the_first_batch(tmp_path, slow_module):
    """A fill longer than --seconds still leaves --seconds of batches after it."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": i}) + b"\n" for i in range(240)))
    # under even_ranks the map runs before the buffer: the fill maps 200 records
    dataset = StreamingJsonl(str(path), shuffle=True, buffer_size=200, even_ranks="pad").map(
        bench.load_function(f"{slow_module}:busy"))
    limit = 0.05  # well under the fill: 200 records through a ~1 ms map
    report = bench.measure_pipeline(dataset, batch_size=16, records=1000, seconds=limit,
                                    state_every_batch=False, progress=False)
    assert report["first_batch_s"] > limit and report["batches"] >= 2
    run = bench.measure_loader(dataset, num_workers=0, batch_size=16, records=1000,
                               seconds=limit, progress=False)
    assert run["time_to_first_batch_s"] > limit and run["batches"] >= 2
