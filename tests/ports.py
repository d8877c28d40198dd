"""Local TCP ports for tests: one nothing listens on, and one that takes connections and answers nothing."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


def closed_port() -> int:
    """A free 127.0.0.1 port nothing listens on: bound once to get a number, then closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def listening() -> Iterator[int]:
    """A 127.0.0.1 port a socket listens on while the block runs (connections queue; nothing answers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]
