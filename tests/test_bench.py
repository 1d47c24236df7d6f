"""streamds bench: JSON report shape and values, table, diagnosis of a slow transform, errors."""

from __future__ import annotations

import gzip
import json
import textwrap

import orjson
import pytest

from streamds import bench

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
    assert report["compressed"] is False
    assert report["batch_size"] == 16 and report["transform"] is None
    assert 200 <= report["records"] <= RECORDS  # whole chunks: may pass the limit a little
    assert report["bytes"] > 0 and report["mean_record_bytes"] > 100
    assert set(report["stages"]) == {"read", "parse"}  # no transform given
    for stage in report["stages"].values():
        assert stage["seconds"] > 0 and stage["records_per_s"] > 0 and stage["mb_per_s"] > 0
        assert 0 <= stage["share"] <= 1
    assert sum(s["share"] for s in report["stages"].values()) == pytest.approx(1)
    assert 0 <= report["stages"]["read"]["cpu_share"] <= 1
    assert [run["num_workers"] for run in report["loader"]] == [0, 1]
    for run in report["loader"]:
        assert 200 <= run["records"] <= 200 + 16
        assert run["records_per_s"] > 0 and run["time_to_first_batch_s"] > 0
        assert run["mb_per_s"] == pytest.approx(
            run["records_per_s"] * report["mean_record_bytes"] / 1e6)
    assert report["best_num_workers"] in (0, 1)
    assert any(f"num_workers={report['best_num_workers']}" in n
               for n in report["recommendations"])


def test_slow_transform_is_diagnosed_as_the_bottleneck(corpus, slow_module, capsys):
    report = run_json(capsys, corpus, "--num-workers", "0", "--records", "100",
                      "--transform", f"{slow_module}:busy")
    assert report["transform"] == f"{slow_module}:busy"
    assert report["bottleneck"] == "transform"
    assert report["stages"]["transform"]["share"] > 0.5
    assert report["recommendations"][0].startswith("your transform is the bottleneck")


def test_fast_pipeline_is_not_blamed_on_the_transform(corpus, slow_module, capsys):
    report = run_json(capsys, corpus, "--num-workers", "0", "--records", "100",
                      "--transform", f"{slow_module}:keep_even")
    assert report["bottleneck"] != "transform"
    assert report["kept"] == report["records"] // 2  # the filter-like transform dropped half
    assert not any("transform is the bottleneck" in n for n in report["recommendations"])


def test_table_output_and_progress(corpus, capsys):
    assert bench.main([corpus, "--num-workers", "0", "--records", "50"]) == 0
    captured = capsys.readouterr()
    assert "stage (1 core)" in captured.out and "num_workers=0" in captured.out
    assert "<- best" in captured.out and "- use num_workers=0" in captured.out
    assert "loader num_workers=0" in captured.err  # tqdm progress goes to stderr


def test_compressed_source_is_reported(tmp_path, capsys):
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"".join(orjson.dumps({"i": i}) + b"\n" for i in range(50)))
    report = run_json(capsys, str(path), "--num-workers", "0", "--records", "50")
    assert report["codecs"] == ["gz"] and report["compressed"] is True
    assert report["records"] == 50


def stage(share: float, cpu_share: float = 1.0) -> dict:
    return {"share": share, "us_per_record": 10.0, "cpu_share": cpu_share}


@pytest.mark.parametrize(
    ("stages", "compressed", "expected"),
    [
        ({"read": stage(0.8), "parse": stage(0.2)}, True, "decompression is the bottleneck"),
        ({"read": stage(0.8, 0.2), "parse": stage(0.2)}, True, "storage I/O is the bottleneck"),
        ({"read": stage(0.8), "parse": stage(0.2)}, False, "reading (splitting lines"),
        ({"read": stage(0.2), "parse": stage(0.7), "transform": stage(0.1)}, False,
         "JSON parsing is the bottleneck"),
        ({"read": stage(0.4), "parse": stage(0.3), "transform": stage(0.3)}, False,
         "no single stage dominates"),
    ],
)
def test_recommendations_name_the_dominant_stage(stages, compressed, expected):
    loader = [
        {"num_workers": 0, "records_per_s": 100.0, "time_to_first_batch_s": 0.1},
        {"num_workers": 2, "records_per_s": 300.0, "time_to_first_batch_s": 0.2},
    ]
    report = {"stages": stages, "compressed": compressed, "mean_record_bytes": 5000,
              "loader": loader, "best_num_workers": 2}
    _, notes = bench._recommend(report)
    assert notes[0].startswith(expected)
    assert "use num_workers=2" in notes[1]
    assert "try more than 2" in notes[2]


def test_best_workers_prefers_fewer_when_close():
    runs = [{"num_workers": n, "records_per_s": r, "records": 10}
            for n, r in ((0, 100.0), (1, 190.0), (2, 196.0), (4, 199.0))]
    assert bench._best_workers(runs) == 1


def test_errors_exit_non_zero(tmp_path, corpus, capsys):
    assert bench.main([str(tmp_path / "missing.jsonl"), "--quiet"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert bench.main([corpus, "--quiet", "--transform", "nocolon"]) == 1
    assert "module:function" in capsys.readouterr().err
    assert bench.main([corpus, "--quiet", "--transform", "no_such_module_xyz:f"]) == 1
    with pytest.raises(SystemExit):
        bench.main([corpus, "--num-workers", "a,b"])
