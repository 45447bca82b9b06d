"""`python -m orbax_mtc ...` is the `orbax-mtc` command."""

import sys

from orbax_mtc.tools.cli import main

if __name__ == "__main__":
  sys.exit(main())
