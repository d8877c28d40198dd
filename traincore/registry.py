"""``python -m traincore.registry``: promote, list and resolve versions in a model registry. The command
lives in ``traincore.artifacts.registry``."""

import sys

from traincore.artifacts.registry import main

if __name__ == "__main__":
    sys.exit(main())
