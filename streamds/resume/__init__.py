"""Resuming: elastic merge, plain-loader resume, replays, record counts."""
