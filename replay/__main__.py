"""Entry point of ``python -m replay``."""

import sys

from replay.cli import main

sys.exit(main())
