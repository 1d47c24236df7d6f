"""Storage: shards, the plan of blocks, reading bytes (ranges, read-ahead, cache, mounts)."""
