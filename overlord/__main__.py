"""``python -m overlord``: the ``overlord`` command."""

import sys

from overlord.ops.cli import main

if __name__ == "__main__":
    sys.exit(main())  # the command's exit status: nonzero when it failed
