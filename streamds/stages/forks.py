"""Quiet forks for Hugging Face `tokenizers`: DataLoader workers started by "fork" print no
"The current process just got forked, after parallelism has already been used" warning.

`tokenizers` registers a C-level fork handler that runs in the child before any Python code
(so a worker's init is too late): where its Rust thread pool was used before the fork and
`TOKENIZERS_PARALLELISM` is unset, it prints the warning and turns its parallelism off in the
child, since the pool's threads did not survive the fork. Here, a Python fork hook sets
`TOKENIZERS_PARALLELISM=false` just before a fork (only where `tokenizers` is imported and the
variable is unset) and removes it again in the parent, so the child starts with what
`tokenizers` would have chosen anyway, and says nothing. A variable the user set is never
touched; the main process keeps its threads.

The child keeps ``TOKENIZERS_PARALLELISM=false`` also where the parent never ran the pool (then
`tokenizers` would have let the child use threads): with several workers on few cores, one
thread per worker is the better share; set the variable to "true" to choose otherwise (only
safe where the main process did not tokenize in parallel before the workers started).
"""

from __future__ import annotations

import os
import sys

__all__ = ["ENV_VARIABLE", "quiet_tokenizers_forks"]

ENV_VARIABLE = "TOKENIZERS_PARALLELISM"

_set_for_fork = False  # whether the hook set the variable for the fork under way


def _before_fork() -> None:
    global _set_for_fork
    if ENV_VARIABLE not in os.environ and "tokenizers" in sys.modules:
        os.environ[ENV_VARIABLE] = "false"
        _set_for_fork = True


def _after_fork_in_parent() -> None:
    global _set_for_fork
    if _set_for_fork:
        os.environ.pop(ENV_VARIABLE, None)
        _set_for_fork = False


def _after_fork_in_child() -> None:
    global _set_for_fork
    _set_for_fork = False  # the child keeps "false": its copy of the pool is gone


_registered = False


def quiet_tokenizers_forks() -> None:
    """Register the fork hooks once per process (`os.register_at_fork`; nothing where the
    platform does not fork)."""
    global _registered
    if _registered or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
    _registered = True
