"""`python -m pax_patch <Pax flags> --mtc_...`: the same as `python -m pax_patch.main`."""

import sys

from pax_patch.main import main

if __name__ == "__main__":
  sys.exit(main())
