"""Command-line tools: the CLI (the only module that reaches the converter) and bench."""
