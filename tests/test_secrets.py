"""Credentials never leave the URL they came in (DESIGN.md): no message, log record, repr,
state or file written to disk holds a URL's password or signature.

Each test reads or converts through the loopback HTTP server with a URL whose userinfo and
query carry marker strings, then scans everything the user could see or keep: exception
texts with their whole traceback chain, every log record (streamds' at DEBUG, any library's
at INFO and above), reprs, `state_dict()` and merged states, and every file name and byte the
converter or the cache wrote.
"""

from __future__ import annotations

import errno
import logging
import traceback
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from streamds import Storage, StreamingJsonl, merge_states
from streamds.preprocess.command import main as convert_main
from streamds.preprocess.convert import convert
from streamds.redact import describe_error, redact, safe_cause, scrubbed
from streamds.retry import GaveUpError, RetryPolicy, retrying
from streamds.tools.cli import main as streamds_main
from testbed.http import Faults, RangeServer, serve

pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")

# the password holds a quote, which ends a quoted URL in a message: everything after it is
# the marker the checks look for (a redaction that stopped at the quote would show it)
PASSWORD, SIGNATURE, CREDENTIAL, TOKEN = "p'PWsecret1", "SIGsecret2", "CREDsecret3", "TOKsecret4"
SECRETS = ("PWsecret1", SIGNATURE, CREDENTIAL, TOKEN)
RECORDS = [{"id": i, "text": "word " * (i % 30)} for i in range(3000)]
FAST = RetryPolicy(attempts=3, backoff=0.001, jitter=0.0)


def secret_url(server: RangeServer, name: str, signature: str = SIGNATURE) -> str:
    """A URL as a presigned one with a password: every secret where a user would put it."""
    base = server.url.replace("http://", f"http://reader:{PASSWORD}@")
    return (f"{base}/{name}?X-Amz-Credential={CREDENTIAL}&X-Amz-Signature={signature}"
            f"&X-Amz-Security-Token={TOKEN}&part=1")


def assert_clean(text: str, where: str) -> None:
    leaked = [secret for secret in SECRETS if secret in text]
    assert not leaked, f"{where} shows {leaked}: {text[:2000]}"


def assert_error_clean(err: BaseException) -> None:
    """The error's text and its whole printed traceback (every chained cause)."""
    assert_clean("".join(traceback.format_exception(err)), f"{type(err).__name__} traceback")


def assert_logs_clean(caplog: pytest.LogCaptureFixture) -> None:
    formatter = logging.Formatter()
    for record in caplog.records:  # every logger's, fsspec's DEBUG lines with URLs included
        assert_clean(formatter.format(record), f"log record of {record.name}")


def assert_tree_clean(root: Path) -> None:
    files = [path for path in root.rglob("*") if path.is_file()]
    assert files, f"nothing written under {root}"
    for path in files:
        assert_clean(str(path.relative_to(root)), "a file name")
        data = path.read_bytes()
        leaked = [secret for secret in SECRETS if secret.encode() in data]
        assert not leaked, f"{path} holds {leaked}"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[RangeServer]:
    root = tmp_path_factory.mktemp("www")
    (root / "a.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in RECORDS))
    (root / "bad.jsonl").write_bytes(b'{"id": 0}\n{"id": 1\n{"id": 2}\n')  # line 2 is cut
    with serve(root) as server:
        yield server


# -- the redaction rule ---------------------------------------------------------------------


@pytest.mark.parametrize("name", [
    "X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "sig", "signature",
    "Signature", "token", "access_token", "key", "api_key", "apikey", "password",
    "GoogleAccessId", "x-goog-signature", "client_secret", "AWSAccessKeyId",
])
def test_redact_hides_every_signing_or_token_parameter(name):
    url = f"https://host/a.jsonl?{name}=s3cr3t&part=2"
    assert redact(url) == f"https://host/a.jsonl?{name}=***&part=2"


@pytest.mark.parametrize(("text", "shown"), [
    ("http://user:pw@host:8/a.jsonl", "http://***@host:8/a.jsonl"),
    ("https://TOKEN@host/a", "https://***@host/a"),  # a token as the user name
    ("https://u:p@ss@host/a", "https://***@host/a"),  # an unescaped "@" in the password
    ("simplecache::s3://KEY:SECRET@bucket/k.jsonl", "simplecache::s3://***@bucket/k.jsonl"),
    ("source 'http://u:pw@h/x?sig=abc' failed: FileNotFoundError('http://u:pw@h/x')",
     "source 'http://***@h/x?sig=***' failed: FileNotFoundError('http://***@h/x')"),
])
def test_redact_hides_userinfo_in_urls_and_in_free_text(text, shown):
    assert redact(text) == shown


@pytest.mark.parametrize(("text", "shown"), [
    # a quote in the password: it ends the quoted URL in a message only after the "@"
    ("source 'http://u:p'SECRET@h/x' failed", "source 'http://***@h/x' failed"),
    ('source "http://u:p"SECRET@h/x" failed', 'source "http://***@h/x" failed'),
    ("http://u:p<>#?SECRET@h:8/x", "http://***@h:8/x"),
    # an unescaped "/" in the password (an S3 secret key often has one)
    ("s3://KEY:ab/SECRET@bucket/k.jsonl", "s3://***@bucket/k.jsonl"),
    ("http://u:p/SECRET@host/a@v1/x", "http://***@host/a@v1/x"),
])
def test_redact_hides_userinfo_with_any_characters(text, shown):
    assert redact(text) == shown


@pytest.mark.parametrize("query", [
    # a value of a signature-like name, however short
    "jwt=abc", "hmac=abc", "bearer=abc", "k=abc", "Policy=abc", "x-signed=abc",
    # a value that looks like a key or a signature, whatever its name
    "v=eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTYifQ.c2lnbmF0dXJl",  # a JWT
    "h=9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",  # a hex digest
    "id=AKIAIOSFODNN7EXAMPLE", "x=dGhpcyBpcyBhIHNlY3JldCB0b2tlbg%3D%3D",  # base64
])
def test_redact_hides_query_values_by_name_or_by_shape(query):
    name = query.partition("=")[0]
    assert redact(f"https://h/a.jsonl?part=1&{query}&n=2") == (
        f"https://h/a.jsonl?part=1&{name}=***&n=2")
    assert redact(f"'https://h/a.jsonl?{query}' is gone") == (
        f"'https://h/a.jsonl?{name}=***' is gone")
    assert redact(f"https://h/a.jsonl#{query}") == f"https://h/a.jsonl#{name}=***"


@pytest.mark.parametrize("text", [
    "/data/train.jsonl", "data/a@b.jsonl", "https://host/p@v1/a.jsonl?part=1&n=2",
    "bytes 0-100 of s3://bucket/key.jsonl", "options format=jsonl.zst shard_size=256",
    "hf://datasets/org/name@main/train.jsonl", "http://host:8080/a@b/c.jsonl",
    "http://[::1]:8080/a@b/c.jsonl",
    # ordinary query values stay readable: short ones, words, numbers, dates, file names
    "https://h/a.jsonl?split=train&revision=main&X-Amz-Date=20240101T000000Z"
    "&X-Amz-Expires=3600&file=train-00001-of-00010.jsonl&offset=123456789012345678",
])
def test_redact_leaves_text_without_credentials_as_it_is(text):
    assert redact(text) == text


def test_safe_cause_cuts_a_chain_that_shows_a_credential():
    try:
        try:
            raise FileNotFoundError("http://u:pw@h/x")
        except FileNotFoundError as inner:
            raise OSError("outer") from inner
    except OSError as err:
        assert safe_cause(err) is None
        assert "pw" not in describe_error(err.__cause__)
    clean = ValueError("no url here")
    assert safe_cause(clean) is clean


def _failing(times: int):
    """A storage call whose error text shows the URL it was given, `times` times."""
    calls = [0]

    def call() -> str:
        calls[0] += 1
        if calls[0] <= times:
            raise OSError(errno.EIO, f"http://reader:{PASSWORD}@h/a.jsonl?sig={SIGNATURE}: reset")
        return "data"

    return call


def test_retry_warnings_and_give_up_errors_hide_what_the_storage_error_shows(caplog):
    caplog.set_level(logging.DEBUG)
    what = f"http://reader:{PASSWORD}@h/a.jsonl (bytes 0-10)"
    assert retrying(_failing(1), FAST, what) == "data"
    with pytest.raises(GaveUpError) as caught:
        retrying(_failing(10), FAST, what)
    assert "a.jsonl" in str(caught.value)
    assert_error_clean(caught.value)
    assert len([r for r in caplog.records if r.name == "streamds.retry"]) >= 2
    assert_logs_clean(caplog)


def test_scrubbed_keeps_the_builtin_kind_and_redacts_the_text():
    class ClientOSError(ConnectionResetError):  # as aiohttp's, a subclass of a built-in
        pass

    for err, kind in [(FileNotFoundError(f"http://u:{PASSWORD}@h/x"), FileNotFoundError),
                      (ClientOSError(errno.ECONNRESET, f"reset: http://u:{PASSWORD}@h/x"),
                       ConnectionResetError),
                      (ValueError(f"bad http://h/x?sig={SIGNATURE}"), ValueError)]:
        clean = scrubbed(err)
        assert type(clean) is kind and "http" in str(clean)
        assert_error_clean(clean)


# -- reading ----------------------------------------------------------------------------------


def test_a_missing_url_is_named_without_its_credentials(served, caplog):
    caplog.set_level(logging.DEBUG)  # fsspec logs the failed HEAD with its traceback
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*does not exist") as caught:
        StreamingJsonl(secret_url(served, "nope.jsonl"))
    assert "http://***@" in str(caught.value)
    assert_error_clean(caught.value)
    assert any(record.exc_info for record in caplog.records)
    assert_logs_clean(caplog)


def test_reading_shows_no_credential_in_reprs_states_or_logs(served, caplog):
    caplog.set_level(logging.DEBUG)
    ds = StreamingJsonl(secret_url(served, "a.jsonl"), shuffle=True,
                        storage=Storage(block_size=64 << 10, retry=FAST))
    served.reset_log()
    served.faults = Faults(fail_every=3)  # every third ranged GET: 503, retried and logged
    try:
        states = []
        seen = []
        for record in ds:
            seen.append(record["id"])
            if len(seen) % 700 == 0:
                states.append(ds.state_dict())
    finally:
        served.faults = Faults()
    assert sorted(seen) == [r["id"] for r in RECORDS]
    assert any("retry" in r.getMessage() for r in caplog.records), "no retry was logged"
    for shown in (repr(ds), repr(ds.shards), ds.shards[0].url):
        assert_clean(shown, "a repr")
    assert ds.shards[0].url.startswith("http://***@")
    assert_clean(repr(states), "state_dict()")
    assert_clean(repr(merge_states([states[-1]])), "merge_states()")
    assert_logs_clean(caplog)


def test_a_percent_encoded_password_stays_out_of_the_storage_debug_log(served, caplog):
    """fsspec logs the URL decoded (%27 as a quote); the filter on its loggers also knows
    the source's literal secrets, so a record that shows one alone is redacted too."""
    caplog.set_level(logging.DEBUG)
    url = secret_url(served, "a.jsonl").replace(PASSWORD, "p%27PWsecret1")
    ds = StreamingJsonl(url, storage=Storage(retry=FAST))
    assert len(list(ds)) == len(RECORDS)
    logging.getLogger("fsspec.http").debug("auth for %s", PASSWORD)  # the password alone
    assert any(r.name.startswith("fsspec") for r in caplog.records), "fsspec logged nothing"
    assert_logs_clean(caplog)


@pytest.mark.parametrize("status", [403, 404])
def test_tokens_of_any_name_are_hidden_in_refused_reads(served, caplog, status):
    """A 403 or 404 names the URL; its tokens are hidden whatever the parameter is called."""
    caplog.set_level(logging.DEBUG)
    tokens = {"jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJKV1RzZWNyZXQ1In0.c2ln",
              "hmac": "HMACsecret6", "bearer": "BEARERsecret7", "k": "Ksecret8",
              "Policy": "eyJTdGF0ZW1lbnQiOlt7IlBPTElDWXNlY3JldDkiOjF9XX0",
              "t": "f3a9c1e07b5d42a8b6e19d0c7f4a2b31e8"}  # a value that looks like a key
    query = "&".join(f"{name}={value}" for name, value in tokens.items())
    served.faults = Faults(status_for={"/a.jsonl": status})
    try:
        with pytest.raises(OSError) as caught:
            StreamingJsonl(f"{served.url}/a.jsonl?{query}&part=1", storage=Storage(retry=FAST))
    finally:
        served.faults = Faults()
    text = "".join(traceback.format_exception(caught.value))
    shown = [value for value in tokens.values() if value in text]
    assert not shown, text
    assert "a.jsonl" in text and "part=1" in text  # the URL is still named
    records = "".join(logging.Formatter().format(r) for r in caplog.records)
    assert not [value for value in tokens.values() if value in records]


def test_a_stream_from_a_server_without_range_shows_no_credential(tmp_path, caplog):
    """A server that ignores Range is read as one stream (fsspec's stream file, whose errors
    show the URL as given): its records, and its 404, without the credentials."""
    caplog.set_level(logging.DEBUG)
    (tmp_path / "a.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in RECORDS))
    with serve(tmp_path, Faults(ignore_range=True)) as server:
        ds = StreamingJsonl(secret_url(server, "a.jsonl"),
                            storage=Storage(retry=FAST, block_size=64 << 10))
        assert not ds.shards[0].ranged
        assert list(ds) == RECORDS
        server.faults.status_for["/a.jsonl"] = 404
        with pytest.raises(FileNotFoundError) as caught:
            list(ds)
    assert "a.jsonl" in str(caught.value)
    assert_error_clean(caught.value)
    assert_logs_clean(caplog)


def test_a_state_resumes_under_a_url_signed_anew(served):
    """The state names no credential, so a checkpoint resumes with the URL signed again."""
    first = StreamingJsonl(secret_url(served, "a.jsonl"), shuffle=True, seed=4)
    records = iter(first)
    head = [next(records)["id"] for _ in range(500)]
    state = first.state_dict()
    again = StreamingJsonl(secret_url(served, "a.jsonl", signature="SIGother"), shuffle=True,
                           seed=4)
    again.load_state_dict(state)
    rest = [record["id"] for record in again]
    assert sorted(head + rest) == [r["id"] for r in RECORDS]


def test_a_read_that_gives_up_names_the_shard_without_credentials(served, caplog):
    caplog.set_level(logging.DEBUG)
    ds = StreamingJsonl(secret_url(served, "a.jsonl"), storage=Storage(retry=FAST))
    served.faults = Faults(fail_every=1)
    try:
        with pytest.raises(GaveUpError, match=r"a\.jsonl") as caught:
            list(ds)
    finally:
        served.faults = Faults()
    assert_error_clean(caught.value)
    assert_logs_clean(caplog)


def test_the_cache_holds_no_credential_in_its_file_names(served, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    cache = tmp_path / "cache"
    ds = StreamingJsonl(secret_url(served, "a.jsonl"), storage=Storage(cache_dir=cache))
    assert len(list(ds)) == len(RECORDS)
    _wait_for_copies()
    assert [p for p in cache.rglob("*") if p.name.endswith("a.jsonl")], "nothing was cached"
    assert_tree_clean(cache)
    assert_logs_clean(caplog)


def _wait_for_copies() -> None:
    import threading

    for thread in threading.enumerate():
        if thread.name == "streamds-cache":
            thread.join()


# -- converting -------------------------------------------------------------------------------


def test_convert_records_no_credential_and_reruns_with_a_new_signature(served, tmp_path,
                                                                        capsys, caplog):
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "out"
    assert convert_main([secret_url(served, "a.jsonl"), "--output", str(out), "--quiet",
                         "--shard-size", "40KB"]) == 0
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert manifest["inputs"] == [redact(secret_url(served, "a.jsonl"))]
    assert_tree_clean(out)
    # a rerun names the input again, freshly signed: the recorded input still matches
    assert convert_main([secret_url(served, "a.jsonl", signature="SIGother"), "--output",
                         str(out), "--quiet", "--shard-size", "40KB"]) == 0
    assert streamds_main(["inspect", str(out)]) == 0
    assert streamds_main(["verify", str(out)]) == 0
    printed = capsys.readouterr()
    assert "0 this run" in printed.out
    assert_clean(printed.out + printed.err, "the command line's output")
    assert_tree_clean(out)
    assert_logs_clean(caplog)


def test_inspect_of_a_url_prints_no_credential(served, capsys):
    assert streamds_main(["inspect", secret_url(served, "a.jsonl")]) == 0
    printed = capsys.readouterr()
    assert "a.jsonl" in printed.out
    assert_clean(printed.out + printed.err, "streamds inspect")


def test_convert_in_parts_records_no_credential(served, tmp_path):
    out = tmp_path / "parts"
    convert([secret_url(served, "a.jsonl")], out, parts=2, shard_size=40_000, progress=None)
    assert sorted(r["id"] for r in StreamingJsonl(out)) == [r["id"] for r in RECORDS]
    assert_tree_clean(out)


def test_a_bad_line_is_named_without_credentials_by_reader_and_converter(served, tmp_path,
                                                                         caplog):
    caplog.set_level(logging.DEBUG)
    url = secret_url(served, "bad.jsonl")
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 2") as caught:
        list(StreamingJsonl(url))
    assert_error_clean(caught.value)
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 2") as caught:
        convert([url], tmp_path / "out", progress=None)
    assert_error_clean(caught.value)
    convert([url], tmp_path / "skip", progress=None, on_error="skip")  # logs what it skips
    assert_logs_clean(caplog)


def test_convert_of_a_missing_url_prints_no_credential(served, tmp_path, capsys):
    code = convert_main([secret_url(served, "nope.jsonl"), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "nope.jsonl" in err and "does not exist" in err
    assert_clean(err, "the converter's error")


def test_the_command_line_redacts_a_journal_written_before_redaction(served, tmp_path, capsys):
    """An output converted by an older streamds holds the URL as given; the refusal to resume
    quotes the recorded inputs and `inspect` shows them: the command line prints them
    redacted."""
    out = tmp_path / "old"
    convert([secret_url(served, "a.jsonl")], out, progress=None)
    journal = out / ".streamds-convert.json"
    doc = orjson.loads(journal.read_bytes())
    doc["fingerprint"]["inputs"] = [secret_url(served, "a.jsonl")]
    journal.write_bytes(orjson.dumps(doc))
    code = convert_main([secret_url(served, "a.jsonl"), "--output", str(out), "--quiet",
                         "--shard-size", "40KB"])
    err = capsys.readouterr().err
    assert code == 2 and "inputs" in err
    assert_clean(err, "the converter's error")
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    manifest["inputs"] = [secret_url(served, "a.jsonl")]
    (out / "manifest.json").write_bytes(orjson.dumps(manifest))
    assert streamds_main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "inputs" in shown and "a.jsonl" in shown
    assert_clean(shown, "streamds inspect")


def test_storage_options_given_on_the_command_line_are_never_echoed(tmp_path, capsys):
    with pytest.raises(SystemExit):
        convert_main([str(tmp_path), "--output", str(tmp_path / "o"),
                      "--storage-options", f'{{"secret": "{PASSWORD}"'])
    assert_clean(capsys.readouterr().err, "the usage error")


def test_bench_reports_the_source_redacted(served):
    from streamds.tools.bench import run_bench

    report = run_bench(secret_url(served, "a.jsonl"), num_workers=[0], batch_size=64,
                       records=200, seconds=5.0, progress=False)
    assert_clean(orjson.dumps(report).decode(), "the bench report")
    assert "***" in str(report["source"])


# -- storage_options ------------------------------------------------------------------------


def test_s3_storage_options_never_reach_a_message_a_log_or_a_file(tmp_path, caplog, capsys):
    """The key, secret and session token given in storage_options (moto takes any)."""
    pytest.importorskip("s3fs")
    from testbed.s3 import serve_s3, upload_folder

    caplog.set_level(logging.DEBUG, logger="streamds")
    caplog.set_level(logging.INFO)
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "a.jsonl").write_bytes(
        b"".join(orjson.dumps(r) + b"\n" for r in RECORDS[:300]))
    with serve_s3() as (endpoint_url, options):
        upload_folder(tmp_path / "up", "secrets-corpus", endpoint_url=endpoint_url)
        options = {**options, "key": CREDENTIAL, "secret": PASSWORD, "token": TOKEN}
        ds = StreamingJsonl("s3://secrets-corpus/a.jsonl", storage=Storage(options=options))
        assert [r["id"] for r in ds] == list(range(300))
        assert_clean(repr(ds) + repr(ds.shards) + repr(ds.state_dict()), "a repr or state")
        with pytest.raises(FileNotFoundError) as caught:
            StreamingJsonl("s3://secrets-corpus/nope.jsonl", storage=Storage(options=options))
        assert_error_clean(caught.value)
        with pytest.raises(TypeError) as caught:
            StreamingJsonl("s3://secrets-corpus/a.jsonl",
                           storage=Storage(options={**options, "bogus_option": SIGNATURE}))
        assert_error_clean(caught.value)
        with pytest.raises(ValueError) as caught:
            StreamingJsonl("s3://secrets-corpus/a.jsonl",
                           storage=Storage(options=orjson.dumps(options)))
        assert_error_clean(caught.value)
        out = tmp_path / "out"
        convert(["s3://secrets-corpus/a.jsonl"], out, storage_options=options, progress=None)
        assert_tree_clean(out)
        assert streamds_main(["inspect", str(out)]) == 0
    assert_clean(capsys.readouterr().out, "streamds inspect")
    assert_logs_clean(caplog)



def test_a_signed_url_of_a_compressed_file_is_read_by_its_codec(tmp_path):
    # "a.jsonl.zst?sig=..." is a .zst file: the query neither hides the codec (which read the
    # compressed bytes as JSON lines) nor reaches a message
    import zstandard

    lines = b"".join(orjson.dumps(r) + b"\n" for r in RECORDS)
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    with serve(tmp_path) as server:
        dataset = StreamingJsonl(f"{server.url}/a.jsonl.zst?sig={SIGNATURE}")
        assert list(dataset) == RECORDS
        assert_clean(repr(dataset.shards), "the shards' repr")
