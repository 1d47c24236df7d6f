"""Thin integrations with the training frameworks; each module imports its framework lazily.

- `streamds.integrations.transformers`: `StreamdsTrainer`, a Hugging Face `Trainer` whose train
  and eval loaders streamds splits by rank (accelerate never splits them again); its eval
  loader is `streamds.integrations.eval_loader.EvalLoader` (equal eval steps on every rank,
  every eval record counted once).
- `streamds.integrations.accelerate`: `prepare_loader`, a loader to use beside
  `Accelerator.prepare` without being split by it.
- `streamds.integrations.lightning`: `StreamdsCallback`, set_epoch at every epoch and every
  rank's loader state in the checkpoint.

`import streamds` never imports a framework; importing one of these modules without its
framework installed raises an ImportError naming the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str = "frameworks") -> ModuleType:
    """Import `module`, or raise an ImportError naming the pip extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"this streamds integration needs {module.split('.')[0]!r}, which is not installed; "
            f"pip install 'streamds[{extra}]' (or pip install {module.split('.')[0]})"
        ) from err
