"""Tests for streamds.tools.synthetic: layout, determinism, relatedness, sizes, codecs, CLI."""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import zstandard

from streamds.tools import synthetic
from streamds.tools.synthetic import (
    arxiv_record,
    main,
    pubmed_record,
    write_arxiv_splits,
    write_pubmed,
    write_pubmed_splits,
    write_small_files,
    write_small_lines,
)

KEYS = ["article_id", "article_text", "abstract_text", "labels", "section_names", "sections"]
REPO = Path(__file__).resolve().parents[1]


def records(n: int, seed: int = 0, chars: int = 4000) -> list[dict]:
    rng = random.Random(seed)
    return [pubmed_record(rng, i, target_chars=chars) for i in range(n)]


def words(sentences: list[str]) -> set[str]:
    return set(" ".join(sentences).split())


def abstract_words(record: dict) -> list[str]:
    return [w for s in record["abstract_text"] for w in s.split()[1:-1]]


# --- record layout ---------------------------------------------------------------------------


def test_record_matches_released_layout():
    for r in records(20):
        assert list(r) == KEYS  # key order of the released train.txt lines
        assert isinstance(r["article_id"], str)
        assert r["labels"] is None
        assert all(isinstance(n, str) and n for n in r["section_names"])
        assert len(r["sections"]) == len(r["section_names"]) >= 3
        assert all(isinstance(s, list) and s for s in r["sections"])
        assert r["article_text"] == [s for section in r["sections"] for s in section]
        for sentence in r["article_text"]:
            assert isinstance(sentence, str)
            assert sentence == sentence.lower() and sentence.endswith(" .")
            assert "\n" not in sentence
        assert len(r["abstract_text"]) >= 3
        for s in r["abstract_text"]:
            assert s.startswith("<S> ") and s.endswith(" . </S>")


def test_article_id_uses_index():
    r = pubmed_record(random.Random(0), 42, target_chars=1000, id_prefix="arXiv")
    assert r["article_id"] == "arXiv0000042"


@pytest.mark.parametrize("target", [2000, 4000, 20_000])
def test_article_text_length_near_target(target):
    for r in records(10, chars=target):
        total = sum(map(len, r["article_text"]))
        assert target <= total <= target * 1.1


def test_target_chars_below_minimum_is_refused():
    with pytest.raises(ValueError, match="target_chars must be >= 100, got 50"):
        pubmed_record(random.Random(0), 0, target_chars=50)


# --- relatedness ------------------------------------------------------------------------------


def test_abstract_is_drawn_from_its_own_article():
    recs = records(60)
    own, other = [], []
    for j, r in enumerate(recs):
        abstract = abstract_words(r)
        own_words = words(r["article_text"])
        other_words = words(recs[j - 1]["article_text"])
        own.append(sum(w in own_words for w in abstract) / len(abstract))
        other.append(sum(w in other_words for w in abstract) / len(abstract))
    mean_own, mean_other = sum(own) / len(own), sum(other) / len(other)
    assert mean_own >= 0.85  # a copy mechanism can produce most of the abstract
    assert mean_own - mean_other >= 0.25  # and the words are this article's, not any article's


def test_lead3_overlaps_abstract_but_salient_sentences_cover_more():
    lead, oracle, in_lead = [], [], 0
    recs = records(40)
    for r in recs:
        target = set(abstract_words(r))
        sentence_words = [set(s.split()) for s in r["article_text"]]
        best: set[str] = set()
        for s in r["abstract_text"]:
            sw = set(s.split()[1:-1])
            k = max(range(len(sentence_words)), key=lambda k: len(sw & sentence_words[k]))
            best |= sentence_words[k]
            in_lead += k < 3
        lead.append(len(target & words(r["article_text"][:3])) / len(target))
        oracle.append(len(target & best) / len(target))
    assert sum(lead) / len(lead) >= 0.2  # lead-3 is a real baseline ...
    assert sum(oracle) / len(oracle) >= sum(lead) / len(lead) + 0.3  # ... that can be beaten
    assert in_lead < 0.1 * sum(len(r["abstract_text"]) for r in recs)


def test_vocabulary_is_modest():
    types = set()
    for r in records(200, chars=2000):
        types |= words(r["article_text"]) | set(abstract_words(r))
        types |= set(" ".join(r["section_names"]).split())
    assert 1000 < len(types) < 5000


# --- determinism ----------------------------------------------------------------------------


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_pubmed(a, target_bytes=50_000, seed=3, record_chars=2000)
    write_pubmed(b, target_bytes=50_000, seed=3, record_chars=2000)
    write_pubmed(c, target_bytes=50_000, seed=4, record_chars=2000)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_output_does_not_depend_on_hash_seed():
    code = (
        "import hashlib, random, orjson; from streamds.tools.synthetic import pubmed_record; "
        "rng = random.Random(7); "
        "print(hashlib.sha256(b''.join(orjson.dumps(pubmed_record(rng, i, target_chars=2000)) "
        "for i in range(5))).hexdigest())"
    )
    rng = random.Random(7)
    expected = hashlib.sha256(
        b"".join(orjson.dumps(pubmed_record(rng, i, target_chars=2000)) for i in range(5))
    ).hexdigest()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected


# --- write_pubmed ------------------------------------------------------------------------------


def test_write_pubmed_stops_within_one_record_of_target(tmp_path):
    path = tmp_path / "train.jsonl"
    n = write_pubmed(path, target_bytes=100_000, record_chars=2000, id_prefix="X")
    data = path.read_bytes()
    lines = data.split(b"\n")
    assert lines[-1] == b""  # every line is "\n"-terminated
    lines = lines[:-1]
    assert len(lines) == n
    assert len(data) >= 100_000
    assert len(data) - len(lines[-1]) - 1 < 100_000
    assert [orjson.loads(line)["article_id"] for line in lines] == [f"X{i:07d}" for i in range(n)]


def test_write_pubmed_zero_target_writes_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    assert write_pubmed(path, target_bytes=0) == 0
    assert path.read_bytes() == b""


@pytest.mark.parametrize(
    ("suffix", "decompress"),
    [(".zst", lambda b: zstandard.ZstdDecompressor().decompressobj().decompress(b)),
     (".gz", gzip.decompress)],
)  # fmt: skip
def test_compressed_outputs_decompress_to_the_plain_bytes(
    tmp_path, monkeypatch, suffix, decompress
):
    plain = tmp_path / "plain.jsonl"
    packed = tmp_path / f"packed.jsonl{suffix}"
    again = tmp_path / f"again.jsonl{suffix}"
    n = write_pubmed(plain, target_bytes=60_000, seed=1, record_chars=2000)
    assert write_pubmed(packed, target_bytes=60_000, seed=1, record_chars=2000) == n
    with monkeypatch.context() as m:  # a later clock must not change the bytes
        m.setattr(time, "time", lambda: 2_000_000_000.0)
        write_pubmed(again, target_bytes=60_000, seed=1, record_chars=2000)
    assert packed.read_bytes() != plain.read_bytes()  # really compressed
    assert decompress(packed.read_bytes()) == plain.read_bytes()
    assert again.read_bytes() == packed.read_bytes()  # no timestamps in headers


def test_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    calls = 0

    def failing_record(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("disk on fire")
        return {"article_id": "x"}

    monkeypatch.setattr(synthetic, "pubmed_record", failing_record)
    path = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_pubmed(path, target_bytes=10_000)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"target_bytes": -1}, "target_bytes must be >= 0, got -1"),
     ({"target_bytes": 10, "record_chars": 10}, "record_chars must be >= 100, got 10")],
)  # fmt: skip
def test_write_pubmed_refuses_bad_sizes(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_pubmed(tmp_path / "x.jsonl", **kwargs)
    assert not (tmp_path / "x.jsonl").exists()


# --- splits and small files --------------------------------------------------------------------


def test_splits_have_disjoint_ids_and_content(tmp_path):
    paths = write_pubmed_splits(
        tmp_path, train_records=6, val_records=2, test_records=3, record_chars=1000
    )
    assert paths == {s: tmp_path / f"{s}.txt" for s in ("train", "val", "test")}
    loaded = {
        s: [json.loads(line) for line in p.read_text().splitlines()] for s, p in paths.items()
    }
    assert {s: len(r) for s, r in loaded.items()} == {"train": 6, "val": 2, "test": 3}
    ids = [r["article_id"] for split in loaded.values() for r in split]
    assert len(set(ids)) == 11
    texts = [r["article_text"][0] for split in loaded.values() for r in split]
    assert loaded["val"][0]["article_text"] != loaded["train"][0]["article_text"]
    assert len(set(texts)) == 11
    assert all(list(r) == KEYS for split in loaded.values() for r in split)


def test_small_files_are_split_into_folders(tmp_path):
    assert write_small_files(tmp_path, records=7, per_folder=3, seed=5, record_chars=500) == 7
    layout = {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(tmp_path.iterdir())}
    assert layout == {
        "part_000": ["00000000.json", "00000001.json", "00000002.json"],
        "part_001": ["00000003.json", "00000004.json", "00000005.json"],
        "part_002": ["00000006.json"],
    }
    rng = random.Random(5)
    for i in range(7):
        data = (tmp_path / f"part_{i // 3:03d}" / f"{i:08d}.json").read_bytes()
        assert data.count(b"\n") == 1 and data.endswith(b"\n")
        assert orjson.loads(data) == pubmed_record(rng, i, target_chars=500)


# --- small lines ---------------------------------------------------------------------------


def test_small_lines_sizes_types_and_target(tmp_path):
    path = tmp_path / "lines.jsonl"
    n = write_small_lines(path, target_bytes=60_000, seed=2, line_bytes=300)
    lines = path.read_bytes().split(b"\n")[:-1]
    assert len(lines) == n
    assert sum(len(line) + 1 for line in lines) >= 60_000
    assert sum(len(line) + 1 for line in lines[:-1]) < 60_000
    for i, line in enumerate(lines):
        assert 270 <= len(line) + 1 <= 300
        rec = orjson.loads(line)
        assert list(rec) == ["id", "text", "label"]
        assert rec["id"] == i and isinstance(rec["text"], str) and isinstance(rec["label"], int)


def test_small_line_labels_are_learnable_from_words(tmp_path):
    path = tmp_path / "lines.jsonl"
    write_small_lines(path, target_bytes=300_000, seed=0)
    recs = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    train, test = recs[: len(recs) // 2], recs[len(recs) // 2 :]
    votes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in train:
        for w in set(r["text"].split()):
            votes[w][r["label"]] += 1
    # keep the words that (nearly) always come with one label
    cues = {}
    for w, counts in votes.items():
        label, count = counts.most_common(1)[0]
        if count >= 2 and count >= 0.9 * sum(counts.values()):
            cues[w] = label
    correct = 0
    for r in test:
        tally = collections.Counter(cues[w] for w in r["text"].split() if w in cues)
        correct += bool(tally) and tally.most_common(1)[0][0] == r["label"]
    assert len({r["label"] for r in recs}) > 1
    assert correct / len(test) > 0.9


def test_small_lines_compress_like_pubmed(tmp_path):
    plain, packed = tmp_path / "a.jsonl", tmp_path / "a.jsonl.zst"
    write_small_lines(plain, target_bytes=20_000)
    write_small_lines(packed, target_bytes=20_000)
    out = zstandard.ZstdDecompressor().decompressobj().decompress(packed.read_bytes())
    assert out == plain.read_bytes()


# --- CLI -------------------------------------------------------------------------------


def test_cli_writes_pubmed(tmp_path, capsys):
    out = tmp_path / "cli.jsonl.gz"
    args = ["pubmed", str(out), "--bytes", "20KB", "--record-chars", "1000", "--seed", "9"]
    assert main(args) == 0
    expected = tmp_path / "api.jsonl"
    write_pubmed(expected, target_bytes=20_000, seed=9, record_chars=1000)
    assert gzip.decompress(out.read_bytes()) == expected.read_bytes()
    assert "records" in capsys.readouterr().err


def test_cli_runs_as_module(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-m", "streamds.tools.synthetic", "small-files", str(tmp_path / "f"),
         "--records", "4", "--per-folder", "2"],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["part_000", "part_001"]


def test_cli_rejects_bad_size(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["small-lines", "x.jsonl", "--bytes", "lots"])
    assert exc.value.code == 2
    assert "cannot parse size 'lots'" in capsys.readouterr().err


def test_the_generator_is_a_streamds_command(tmp_path):
    """`streamds synthetic` ships with the package: a README reader makes its sample data
    after `pip install streamds`, with no clone on the path."""
    from streamds.tools.cli import main as streamds_main

    out = tmp_path / "train.txt"
    assert streamds_main(["synthetic", "pubmed", str(out), "--bytes", "40KB"]) == 0
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert records and records[0]["article_id"].startswith("PMC")


# --- arXiv layout ------------------------------------------------------------------------------


def test_arxiv_records_have_the_arxiv_layout():
    record = arxiv_record(random.Random(3), 10_042, target_chars=3000)
    assert list(record) == KEYS
    assert record["article_id"] == "1002.0042"
    assert record["labels"] is None
    assert record["section_names"][0] == "introduction"
    assert all(name == name.lower() for name in record["section_names"])
    text = " ".join(record["article_text"])
    assert "@xmath0" in text and "@xcite" in text
    assert not any(word.isdigit() for word in text.split())  # numbers are math placeholders
    assert record["article_text"] == [s for section in record["sections"] for s in section]
    assert all(s.startswith("<S> ") and s.endswith(" </S>") for s in record["abstract_text"])
    assert record == arxiv_record(random.Random(3), 10_042, target_chars=3000)


def test_arxiv_splits_differ_from_pubmed_splits(tmp_path):
    arxiv = write_arxiv_splits(tmp_path / "arxiv", train_records=4, val_records=1,
                               test_records=1, record_chars=600)
    pubmed = write_pubmed_splits(tmp_path / "pubmed", train_records=4, val_records=1,
                                 test_records=1, record_chars=600)
    first = [json.loads(line) for line in arxiv["train"].read_text().splitlines()]
    assert [r["article_id"] for r in first] == ["1001.0000", "1001.0001", "1001.0002",
                                               "1001.0003"]
    assert arxiv["train"].read_bytes() != pubmed["train"].read_bytes()
    assert json.loads(arxiv["val"].read_text())["article_id"] == "1001.0004"
    assert main(["splits", str(tmp_path / "cli"), "--layout", "arxiv", "--train", "4", "--val",
                 "1", "--test", "1", "--record-chars", "600"]) == 0
    assert (tmp_path / "cli" / "train.txt").read_bytes() == arxiv["train"].read_bytes()
