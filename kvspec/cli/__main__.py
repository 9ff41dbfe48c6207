"""``python -m kvspec.cli``: the ``kvspec`` command line (as ``python -m kvspec``)."""

import sys

from . import main

sys.exit(main())
