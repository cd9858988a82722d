"""``python -m matrixfsdp.checkpoint``: the export/import CLI (see :func:`matrixfsdp.checkpoint.main`)."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
