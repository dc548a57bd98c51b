"""``python -m cuflash``: see :mod:`cuflash.tools.cli` for the subcommands."""
import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
