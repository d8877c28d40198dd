"""``python -m traincore.evaluate``: an exported model on one split of a staged dataset. The command lives in
``traincore.artifacts.evaluate``."""

import sys

from traincore.exitcodes import interrupted_while_starting

if __name__ == "__main__":
    try:  # importing the command imports torch: seconds in which a Ctrl-C is still one line
        from traincore.artifacts.evaluate import main
    except KeyboardInterrupt:
        sys.exit(interrupted_while_starting("traincore.evaluate"))
    sys.exit(main())
