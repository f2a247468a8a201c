"""`python -m d9d.flows ...` is the `d9d` command."""

import sys

from d9d.flows.entry import main

if __name__ == "__main__":  # guarded: tools that walk the package import every module
    sys.exit(main())
