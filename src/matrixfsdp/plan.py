"""``python -m matrixfsdp.plan``: the planner's command line (kept at this path for users;
the implementation is :mod:`matrixfsdp.planner.cli`)."""

import sys

from .planner.cli import build_parser, main

__all__ = ["main", "build_parser"]

if __name__ == "__main__":
    sys.exit(main())
