"""``python -m pykvcache.tools.calibrate``: the same as ``pykvcache calibrate``."""

import sys

from .cli import main

sys.exit(main())
