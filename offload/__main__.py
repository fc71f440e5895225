"""``python -m offload ...`` is the ``offload`` command (where the console script is not installed)."""

import sys

from .cli import main

sys.exit(main())
