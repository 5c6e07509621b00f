"""``python -m pykvcache.cli``: the ``pykvcache`` command (``pykvcache.tools.cli``).

Kept as a name only: the Makefile runs ``python -m pykvcache.cli``, and console
scripts installed before the tools moved to ``pykvcache.tools`` import
``pykvcache.cli:main``. Nothing in the product imports this module.
"""

from __future__ import annotations

import sys

from pykvcache.tools.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
