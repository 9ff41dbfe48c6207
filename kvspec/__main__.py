"""``python -m kvspec``: the ``kvspec`` command line."""

import sys

from kvspec.cli import main

sys.exit(main())
