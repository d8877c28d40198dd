"""``python -m traincore.export``: a checkpoint -> one safetensors file and its config. The command lives in
``traincore.artifacts.export``."""

import sys

from traincore.artifacts.export import main

if __name__ == "__main__":
    sys.exit(main())
