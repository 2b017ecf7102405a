"""`python -m ecosystem.cli`: the `fleet` command where the script is not on PATH."""

import sys

from ecosystem.cli import main

if __name__ == "__main__":
    main()
    sys.exit(0)
