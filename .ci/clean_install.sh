#!/usr/bin/env bash
# Clean-install check: streamds as a user gets it, with its declared dependencies only.
#
# The Makefile's venv installs every extra, which can hide an import that pyproject.toml does
# not declare (it once hid `xxhash`, brought along by the bench extra's `datasets`). This
# script runs `pip install <checkout>` into a fresh venv that holds only torch (pinned, CPU
# wheel) and what `[project].dependencies` pulls in, and checks that the install left the
# checkout as it was (no build/, no *.egg-info) and put no top-level name into site-packages
# but `streamds` (the converter is `streamds.preprocess`: a generic `preprocess` would be
# shadowed by a user's own preprocess.py). Then, in a temp dir outside the repo that holds
# such a preprocess.py, it writes a tiny corpus and runs `streamds convert` (also in parts,
# in processes that import the converter by its name), `inspect`, `verify`, a
# `convert --format tar` that must name the optional 'tar' extra (webdataset), and a
# `StreamingJsonl` read that checks every record arrives exactly once.
#
# Usage: bash .ci/clean_install.sh   (PYTHON=python3.11 and TORCH_PIN=torch==X override)
# Writes nothing into the repo: the venv and the corpus live in one temp dir, removed on exit
# (KEEP_TMP=1 keeps it for a look after a failure).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}  # the Makefile's pin; unpinned torch pulls GBs of CUDA
WORK=$(mktemp -d "${TMPDIR:-/tmp}/streamds-clean-install.XXXXXX")
STEP="start"
START=$SECONDS

cleanup() {
    local status=$?
    if [[ $status -ne 0 ]]; then
        echo "CLEAN-INSTALL CHECK FAILED at step: $STEP (exit $status)" >&2
        echo "  the package, installed with its declared dependencies only, does not work;" >&2
        echo "  an import missing from [project].dependencies in pyproject.toml is the usual" >&2
        echo "  cause (the error above names it)" >&2
    fi
    if [[ -n "${KEEP_TMP:-}" ]]; then
        echo "clean-install: kept $WORK" >&2
    else
        rm -rf "$WORK"
    fi
    exit "$status"
}
trap cleanup EXIT

step() {
    STEP=$1
    echo "== clean-install: $1 ($((SECONDS - START)) s)"
}

# Nothing from the checkout or the caller's environment may leak into the fresh venv.
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP VIRTUAL_ENV PIP_REQUIRE_VIRTUALENV
export PIP_DISABLE_PIP_VERSION_CHECK=1

checkout_files() {  # every file of the checkout, ignored ones included, as git sees them
    git -C "$REPO" status --porcelain --ignored --untracked-files=all | sort
}

step "install $TORCH_PIN, then the checkout with its declared dependencies (no extras)"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
echo "$TORCH_PIN" > "$WORK/constraints.txt"  # keeps the resolver from replacing torch
# --no-compile: byte-compiling all of torch doubles the install time; the modules the checks
# import are compiled (and cached in the venv) on first use instead
"$VPY" -m pip install --quiet --no-compile "$TORCH_PIN"
checkout_files > "$WORK/checkout-before.txt"
"$VPY" -m pip install --quiet --no-compile -c "$WORK/constraints.txt" "$REPO"
"$VPY" -m pip check
echo "installed: $("$VPY" -m pip list --format=freeze | tr '\n' ' ')"

step "the install left the checkout as it was (no build/, no *.egg-info)"
checkout_files > "$WORK/checkout-after.txt"
if ! diff "$WORK/checkout-before.txt" "$WORK/checkout-after.txt" >&2; then
    echo "pip install wrote the files above into $REPO (see pyproject.toml's build backend)" >&2
    exit 1
fi

step "no top-level name in site-packages but streamds"
(cd "$WORK" && "$VPY" -) <<'EOF'
from importlib.metadata import distribution

files = distribution("streamds").files
tops = {f.parts[0] for f in files if f.parts[0] != ".." and not f.parts[0].endswith(".dist-info")}
assert tops == {"streamds"}, f"the install puts {sorted(tops)} into site-packages, not streamds only"
assert any(f.as_posix() == "streamds/preprocess/convert.py" for f in files), "no streamds.preprocess"
print(f"site-packages: {sorted(tops)} ({len(files)} files)")
EOF

mkdir -p "$WORK/run"
cd "$WORK/run"  # outside the repo: `import streamds` must find the installed copy only
export PATH="$WORK/venv/bin:$PATH"

# a user's own module named like the converter's folder: it must not shadow the converter
echo "raise ImportError('the user preprocess.py was imported instead of streamds.preprocess')" \
    > preprocess.py

step "import from the venv, not the checkout"
python - "$WORK/venv" <<'EOF'
import sys
from pathlib import Path

import streamds
import streamds.preprocess.command

venv = Path(sys.argv[1]).resolve()
for module in (streamds, streamds.preprocess.command):
    where = Path(module.__file__).resolve()
    assert venv in where.parents, f"{module.__name__} imported from {where}, not from {venv}"
print(f"streamds {streamds.__file__}")
EOF

step "write a tiny corpus"
python - <<'EOF'
import json
import os

os.makedirs("corpus/docs/nested", exist_ok=True)
with open("corpus/lines.jsonl", "w") as f:  # JSON lines, some with non-ASCII text
    for i in range(12):
        f.write(json.dumps({"id": f"line-{i}", "text": f"record {i} " + "é" * (i % 3)}) + "\n")
docs = ["corpus/docs/a.json", "corpus/docs/b.json", "corpus/docs/nested/c.json"]
for i, path in enumerate(docs):  # small .json files, one document each
    with open(path, "w") as f:
        json.dump({"id": f"doc-{i}", "article": "words " * 20, "abstract": "short"}, f,
                  indent=2 if i == 0 else None)  # one pretty-printed, as json.dump(indent=2)
EOF

step "streamds convert"
streamds convert corpus/lines.jsonl corpus/docs --output shards \
    --shard-size 400 --frame-size 150 --quiet  # several shards of several frames

step "python -m streamds.preprocess, in parts, in processes (beside the user's preprocess.py)"
python -m streamds.preprocess corpus/lines.jsonl corpus/docs --output shards-in-parts \
    --shard-size 400 --frame-size 150 --parts 2 --executor process:2 --quiet
streamds verify --quiet shards-in-parts | grep -Eq "OK, .*\b15 records" \
    || { echo "the conversion in parts does not hold 15 records" >&2; exit 1; }

step "streamds inspect"
streamds inspect --quiet shards | tee inspect.txt
grep -Eq "^ +records +15$" inspect.txt || { echo "inspect does not report 15 records" >&2; exit 1; }

step "streamds verify"
streamds verify --quiet shards | tee verify.txt
grep -Eq "OK, .*\b15 records" verify.txt || { echo "verify does not report 15 records" >&2; exit 1; }

step "streamds convert --format tar names the 'tar' extra (webdataset is not a dependency)"
if python -c "import webdataset" 2>/dev/null; then
    echo "webdataset came with the declared dependencies: the 'tar' extra is not optional" >&2
    exit 1
fi
if streamds convert corpus/lines.jsonl --output tar-shards --format tar --quiet 2>tar.err; then
    echo "convert --format tar succeeded without webdataset" >&2; exit 1
fi
grep -qF "pip install 'streamds[tar]'" tar.err || { cat tar.err >&2; exit 1; }
[[ ! -e tar-shards ]] || { echo "convert --format tar made tar-shards before refusing" >&2; exit 1; }

step "StreamingJsonl reads every record exactly once"
python - <<'EOF'
from collections import Counter

from torch.utils.data import DataLoader

from streamds import StreamingJsonl

expected = Counter([f"line-{i}" for i in range(12)] + [f"doc-{i}" for i in range(3)])
seen = Counter(record["id"] for record in StreamingJsonl("shards"))
assert seen == expected, f"in one process: {seen} != {expected}"
loader = DataLoader(StreamingJsonl("shards"), batch_size=None, num_workers=2)
seen = Counter(record["id"] for record in loader)
assert seen == expected, f"with 2 workers: {seen} != {expected}"
lines = Counter(record["id"] for record in StreamingJsonl("corpus/lines.jsonl", shuffle=True))
assert lines == Counter(f"line-{i}" for i in range(12)), lines
print(f"StreamingJsonl: {sum(expected.values())} records, each once (0 and 2 workers)")
EOF

step "ds.loader (the README's first example) with the declared dependencies only"
python - <<'EOF'
from streamds import StreamingJsonl

loader = StreamingJsonl("shards", shuffle=True).loader(4, num_workers=2)
first = next(iter(loader))
state = loader.state_dict()
again = StreamingJsonl("shards", shuffle=True).loader(4, num_workers=2)
again.load_state_dict(state)
ids = [r["id"] for batch in [first, *again] for r in batch]
assert sorted(ids) == sorted([f"line-{i}" for i in range(12)] + [f"doc-{i}" for i in range(3)]), ids
print(f"ds.loader: {len(ids)} records, each once across a resume")
EOF

step "the README's examples as written, with the declared dependencies (plus pytest to run them)"
"$VPY" -m pip install --quiet --no-compile pytest
(cd "$REPO" && "$VPY" -m pytest -q -p no:cacheprovider --noconftest tests/test_docs_blocks.py \
    -k readme_runs_in_order)  # --noconftest: the suite's fixtures need the dev extras

step "done"
echo "clean-install check passed in $((SECONDS - START)) s"
