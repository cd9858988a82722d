import sys

from .cli import main

if __name__ == "__main__":  # not in spawned ranks, which re-import the main module
    sys.exit(main())
