"""``python -m traincore.registry``: promote, list and resolve versions in a model registry. The command
lives in ``traincore.artifacts.registry``."""

import sys

from traincore.exitcodes import interrupted_while_starting

if __name__ == "__main__":
    try:  # importing the command imports torch: seconds in which a Ctrl-C is still one line
        from traincore.artifacts.registry import main
    except KeyboardInterrupt:
        sys.exit(interrupted_while_starting("traincore.registry"))
    sys.exit(main())
