"""``python -m traincore.evaluate``: an exported model on one split of a staged dataset. The command lives in
``traincore.artifacts.evaluate``."""

import sys

from traincore.artifacts.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
