"""``python -m traincore.stage``: a dataset source -> the staged, memory-mappable format. The command lives
in ``traincore.data.cli``."""

import sys

from traincore.exitcodes import interrupted_while_starting

if __name__ == "__main__":
    try:  # importing the command imports torch: seconds in which a Ctrl-C is still one line
        from traincore.data.cli import main
    except KeyboardInterrupt:
        sys.exit(interrupted_while_starting("traincore.stage"))
    sys.exit(main())
