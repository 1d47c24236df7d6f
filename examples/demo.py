"""`make demo`: the summarisation example end to end, with its defaults.

Generates a synthetic PubMed-layout corpus, learns a WordPiece tokenizer from the streamed
text, trains a small pointer-generator transformer on batches streamed by StreamingJsonl
(tokenized in a DataLoader worker, bucketed by length, checkpointed with the loader's exact
position), then scores it with ROUGE next to the lead-3 baseline. A few minutes on 2 CPU
cores; everything goes to ``data/demo/``. It can be stopped at any time and continued with
``python examples/demo.py --resume``; a second run over the first one needs ``--resume`` or
``--overwrite``. Extra arguments go to examples/summarization/train.py, e.g.
``python examples/demo.py --steps 100`` (``make demo ARGS="--resume"`` through make).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.summarization.train import main, shown

OUT = "data/demo"


def demo(argv: Sequence[str] | None = None) -> int:
    """Run the example into OUT with `argv` (default: this script's arguments); the exit code."""
    given = sys.argv[1:] if argv is None else list(argv)
    print("streamds demo: summarising synthetic PubMed articles streamed with StreamingJsonl",
          flush=True)
    command = [shown(sys.executable), shown(__file__), *given]
    try:
        summary = main(["--out", OUT, *given], command=command)
    except KeyboardInterrupt:
        return 130  # main said how to continue
    return 0 if summary["steps"] > 0 else 1


if __name__ == "__main__":
    sys.exit(demo())
