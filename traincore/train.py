"""``python -m traincore.train``: the Trainer over a staged dataset, on 1..N ranks. The command lives in
``traincore.run.cli``."""

import sys

from traincore.run.cli import main

if __name__ == "__main__":
    sys.exit(main())
