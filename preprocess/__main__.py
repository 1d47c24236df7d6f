"""``python -m streamds.preprocess INPUT... --output DIR``: the same as ``streamds convert``.

From a checkout, ``python -m preprocess`` runs this file too; it imports the converter by its
one name, `streamds.preprocess`, so that process executors and Dask workers import the same
modules (a second copy under the name `preprocess` would send them looking for a top-level
package that an installed streamds does not have).
"""

import sys

from streamds.preprocess.command import main

sys.exit(main())
