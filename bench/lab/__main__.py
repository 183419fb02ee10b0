"""``python -m bench.lab``: see :mod:`bench.lab.run`."""

import sys

from bench.lab.run import main

sys.exit(main())
