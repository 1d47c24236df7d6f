"""`make demo` (examples/demo.py): it names its output folder and how to continue, refuses to
start over an earlier run unless told --resume or --overwrite, fits its loader workers to the
machine's CPUs, and builds its loader without a third-party deprecation warning."""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from pathlib import Path

import pytest

from examples.demo import OUT, demo
from examples.summarization import train
from examples.summarization.train import again, check_out, fit_workers, parse_args, shown

# a tiny run: seconds; data/demo goes under the test's own folder (the demo writes to ./data)
QUICK = ["--tiny", "--steps", "2", "--ckpt-every", "1", "--eval-records", "2"]


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refusal(excinfo: pytest.ExceptionInfo[SystemExit]) -> str:
    return str(excinfo.value.code)


def test_the_demo_names_its_folder_and_how_to_continue(here, capsys):
    assert demo(QUICK) == 0
    printed = capsys.readouterr().out
    assert f"output folder: {OUT}/" in printed
    assert "stop it at any time (Ctrl-C or kill)" in printed
    resume = printed.split("once a checkpoint is saved, this continues from it: ")[1]
    resume = resume.splitlines()[0]
    python, script, *rest = shlex.split(resume)
    assert python == shown(sys.executable)  # the interpreter that has torch, not "python"
    assert script == "examples/demo.py" or script.endswith("/examples/demo.py")
    assert rest == [*QUICK, "--resume"]
    assert f"checkpoint {OUT}/checkpoint.pt, results {OUT}/results.json" in printed
    assert (here / OUT / "checkpoint.pt").exists() and (here / OUT / "results.json").exists()
    # the command it printed continues that run
    assert demo(rest) == 0
    assert f"resumed from {OUT}/checkpoint.pt at step 2" in capsys.readouterr().out


def test_ctrl_c_names_the_checkpoint_only_once_one_exists(here):
    """Interrupted before the first checkpoint, the message does not promise one."""
    command = ["python", "examples/demo.py"]
    before = train.interrupted(["--out", OUT], command)
    assert "before the first checkpoint was saved" in before and "starts again at step 0" in before
    (here / OUT).mkdir(parents=True)
    (here / OUT / "checkpoint.pt").write_bytes(b"saved")
    after = train.interrupted(["--out", OUT], command)
    assert after.startswith(f"interrupted; to continue from the last checkpoint ({OUT}/")
    assert after.endswith("examples/demo.py --resume")


def test_a_second_run_is_refused_without_resume_or_overwrite(here, capsys):
    assert demo(QUICK) == 0
    results = (here / OUT / "results.json").read_text()
    with pytest.raises(SystemExit) as excinfo:
        demo(QUICK)
    message = refusal(excinfo)
    assert f"{OUT} holds an earlier run (checkpoint.pt, results.json)" in message
    lines = [line.strip() for line in message.splitlines()]
    assert any(line.endswith("examples/demo.py " + shlex.join([*QUICK, "--resume"]))
               for line in lines), message
    assert any(line.endswith("examples/demo.py " + shlex.join([*QUICK, "--overwrite"]))
               for line in lines), message
    assert (here / OUT / "results.json").read_text() == results  # nothing was touched
    capsys.readouterr()
    assert demo([*QUICK, "--overwrite"]) == 0
    assert "resumed" not in capsys.readouterr().out


def test_overwrite_deletes_the_earlier_checkpoint_before_it_starts(tmp_path):
    for name in ("checkpoint.pt", "checkpoint.pt.tmp", "results.json", "tokenizer.json"):
        (tmp_path / name).write_text("earlier")
    args = argparse.Namespace(resume=False, overwrite=True)
    check_out(tmp_path, args, ["python", "train.py", "--overwrite"])
    # a checkpoint left behind would pair the old model with the new tokenizer on --resume
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]


def test_resume_and_a_fresh_folder_pass_the_check(tmp_path):
    check_out(tmp_path / "new", argparse.Namespace(resume=False, overwrite=False), [])
    (tmp_path / "checkpoint.pt").write_text("earlier")
    check_out(tmp_path, argparse.Namespace(resume=True, overwrite=False), [])
    assert (tmp_path / "checkpoint.pt").read_text() == "earlier"
    with pytest.raises(SystemExit, match="pass one of them"):
        parse_args(["--tiny", "--resume", "--overwrite"])


def test_commands_to_run_again_drop_one_off_flags():
    command = ["py", "demo.py", "--steps", "9", "--stop-after", "3", "--overwrite", "--x=a b"]
    assert again(command, "--resume") == "py demo.py --steps 9 '--x=a b' --resume"
    assert again(["py", "t.py", "--stop-after=3", "--resume"], "--overwrite") == (
        "py t.py --overwrite")


def test_workers_fit_the_cpus(monkeypatch):
    assert fit_workers(1, 1, asked=False) == 0  # one CPU: the model's
    assert fit_workers(1, 2, asked=False) == 1
    assert fit_workers(1, 16, asked=False) == 1
    assert fit_workers(4, 2, asked=True) == 2  # torch warns beyond the CPUs
    assert fit_workers(0, 2, asked=True) == 0
    monkeypatch.setattr(train, "usable_cpus", lambda: 2)
    assert parse_args(["--num-workers", "64"]).num_workers == 2
    assert parse_args([]).num_workers == 1
    monkeypatch.setattr(train, "usable_cpus", lambda: 1)
    assert parse_args([]).num_workers == 0


def test_the_demo_warns_about_nothing_of_its_own(here, monkeypatch):
    monkeypatch.setattr(train, "usable_cpus", lambda: 1)  # even asked for more workers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert demo([*QUICK, "--quiet", "--num-workers", "3"]) == 0
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
