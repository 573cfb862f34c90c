"""``python -m sparsecomm``: the ``sparsecomm`` command, for environments without the console script."""

import sys

from .tools.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
