"""``python -m overlord``: the ``overlord`` command."""

from overlord.ops.cli import main

if __name__ == "__main__":
    main()
