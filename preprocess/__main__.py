"""``python -m preprocess INPUT... --output DIR``: the same as ``streamds convert``."""

import sys

from .cli import main

sys.exit(main())
