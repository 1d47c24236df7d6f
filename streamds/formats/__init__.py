"""Shard formats: codecs, the seekable zstd format, the manifest, record file names."""
