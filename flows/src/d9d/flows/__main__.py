"""`python -m d9d.flows ...` is the `d9d` command."""

import sys

from d9d.flows.entry import main

sys.exit(main())
