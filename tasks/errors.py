"""Errors a task raises for the user to fix, shown by ``pyflyte run`` as their message alone.

For a task's exception, ``pyflyte run`` prints a rich traceback of every frame it passed through (some 60
lines for a bad image met while staging) before the message, except for a ``click.ClickException``, whose
message rich-click shows alone in an "Error" panel. An error whose message already names the problem and
the fix is therefore a click exception too. In a pod, or to a Python caller, it is a ValueError like any
other: its class, message and pickling are those of any exception.
"""

from __future__ import annotations

import click


class UserFacingError(click.ClickException, ValueError):
    """A task's error whose message names the problem and the fix: ``pyflyte run`` shows the message
    alone, not a traceback."""
