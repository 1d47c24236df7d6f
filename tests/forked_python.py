"""Run Python scripts as `python SCRIPT` would, each in a fork of one process that imported
torch once: what test_docs_blocks.py runs its blocks with.

A fresh interpreter pays about 2 s of CPU to import torch and to tear it down at exit; the
docs have some 30 blocks that each import it. Here one launcher process imports torch (and
nothing of streamds), then forks a child per script: the child takes the script's folder, argv,
`__main__` and output files, runs it in a namespace of its own, and exits with its status,
so a block still sees nothing another block did. Where `os.pidfd_open` is missing (not
Linux), `run` starts a fresh interpreter per script instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as WaitedTooLong
from pathlib import Path

# The launcher: reads one request a line on stdin ([key, script, cwd, out, err]), forks, and
# writes [key, "pid", pid] at the fork and [key, "exit", status] when the child ended to the
# fd in argv[1]. It waits on stdin and the children's pidfds at once: no polling.
_LAUNCHER = r'''
import json, os, runpy, selectors, sys, traceback
import torch  # noqa: F401  what the scripts import; every fork shares it

results = os.fdopen(int(sys.argv[1]), "w", buffering=1)
selector = selectors.DefaultSelector()
selector.register(0, selectors.EVENT_READ)
pending = b""

def child(script, cwd, out, err):
    os.setpgid(0, 0)  # a group of its own: a timeout ends it and its DataLoader workers
    selector.close()
    os.close(results.fileno())
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(cwd)
    sys.argv = [script]
    sys.path[0] = os.path.dirname(script)
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:  # as the interpreter's exit would: threads, then atexit (it ends workers)
        import atexit, threading
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

while selector.get_map():
    for key, _ in selector.select():
        if key.fd == 0:
            data = os.read(0, 1 << 16)
            if not data:
                selector.unregister(0)
                continue
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                name, script, cwd, out, err = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(script, cwd, out, err)
                results.write(json.dumps([name, "pid", pid]) + "\n")
                selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (name, pid))
        else:
            name, pid = key.data
            selector.unregister(key.fd)
            os.close(key.fd)
            _, status = os.waitpid(pid, 0)
            results.write(json.dumps([name, "exit", os.waitstatus_to_exitcode(status)]) + "\n")
'''


class ForkedPython:
    """A launcher process started in `cwd` with `env`; `run(script, where)` returns the
    script's status and output (kept in `outputs` while it runs)."""

    def __init__(self, env: dict[str, str], cwd: Path, outputs: Path) -> None:
        self.env = env
        self.outputs = outputs
        self._exits: dict[str, Future[int]] = {}
        self._pids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._count = 0
        self._process: subprocess.Popen[bytes] | None = None
        if not hasattr(os, "pidfd_open"):
            return
        read, write = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(write)], stdin=subprocess.PIPE, env=env,
            cwd=cwd, pass_fds=(write,))
        os.close(write)
        self._results = os.fdopen(read)
        threading.Thread(target=self._read_results, daemon=True).start()

    def _read_results(self) -> None:
        for line in self._results:
            name, what, value = json.loads(line)
            with self._lock:
                if what == "pid":
                    self._pids[name] = value
                else:
                    self._exits[name].set_result(value)
        with self._lock:  # the launcher is gone: nothing more will end
            for future in self._exits.values():
                if not future.done():
                    future.set_exception(RuntimeError("the launcher process ended"))

    def run(self, script: Path, cwd: Path, timeout: float) -> tuple[int, str, str]:
        """Run `script` in `cwd` as `python script` would; its status and output."""
        if self._process is None:  # no pidfds: a fresh interpreter
            done = subprocess.run([sys.executable, str(script)], cwd=cwd, env=self.env,
                                  capture_output=True, text=True, timeout=timeout)
            return done.returncode, done.stdout, done.stderr
        with self._lock:
            self._count += 1
            name = f"{self._count}"
            exit_code: Future[int] = Future()
            self._exits[name] = exit_code
        out, err = self.outputs / f"{name}.out", self.outputs / f"{name}.err"
        request = [name, str(script), str(cwd), str(out), str(err)]
        with self._lock:
            assert self._process.stdin is not None
            self._process.stdin.write(json.dumps(request).encode() + b"\n")
            self._process.stdin.flush()
        try:
            status = exit_code.result(timeout=timeout)
        except WaitedTooLong:  # the builtin TimeoutError from Python 3.11 on
            with self._lock:
                pid = self._pids.get(name)
            if pid is not None:
                os.killpg(pid, 9)
            raise subprocess.TimeoutExpired(str(script), timeout) from None
        texts = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        return status, *texts

    def close(self) -> None:
        if self._process is not None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            self._process.wait(timeout=60)
