"""Writing side of streamds: tools that produce the JSONL corpora streamds reads."""
