"""``python -m traincore.train``: the Trainer over a staged dataset, on 1..N ranks. The command lives in
``traincore.run.cli``."""

import sys

from traincore.exitcodes import interrupted_while_starting

if __name__ == "__main__":
    try:  # importing the command imports torch: seconds in which a Ctrl-C is still one line
        from traincore.run.cli import main
    except KeyboardInterrupt:
        sys.exit(interrupted_while_starting("traincore.train"))
    sys.exit(main())
