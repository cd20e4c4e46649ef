"""``python -m xpnn``: see xpnn.cli."""

import sys

from xpnn.cli import main

sys.exit(main())
