"""Loopback servers (HTTP with ranges and faults, S3 via moto) shared by tests and benchmarks."""
