"""``python -m traincore.export``: a checkpoint -> one safetensors file and its config. The command lives in
``traincore.artifacts.export``."""

import sys

from traincore.exitcodes import interrupted_while_starting

if __name__ == "__main__":
    try:  # importing the command imports torch: seconds in which a Ctrl-C is still one line
        from traincore.artifacts.export import main
    except KeyboardInterrupt:
        sys.exit(interrupted_while_starting("traincore.export"))
    sys.exit(main())
