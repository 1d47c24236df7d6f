"""Command-line tools and their helpers: the CLI, bench, spec and size parsing."""
