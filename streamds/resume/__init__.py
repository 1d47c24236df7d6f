"""Resuming: the reader state, elastic merge, plain-loader resume, replays, record counts."""
