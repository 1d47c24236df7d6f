"""Shard formats: the registry (`registry`, one module per format: `jsonl`, `jsonl_zst`,
`json_file`, `tar`, `parquet`, `arrow` over `columnar`), codecs, the seekable zstd format,
the manifest, record file names."""
