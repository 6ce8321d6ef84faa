"""`python -m fx_engine COMMAND ...`: the same command line as `fx-engine` (fx_engine/cli.py),
for an environment whose scripts folder is not on the PATH."""

import sys

from fx_engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
