"""What a checkpoint operation raises: every message names the file or directory and the fix."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or does not fit this run; the message says which and what to do."""


class CorruptCheckpointError(CheckpointError):
    """A file of a complete checkpoint (its marker included) is missing, truncated, fails its checksum or
    cannot be parsed."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint file failed (no space left, an I/O error); an OSError too, with its errno.

    Picklable, so a failure on one rank reaches rank 0 through DCP's gather intact.
    """

    def __init__(self, message: str, error: int | None = None, filename: str | None = None):
        super().__init__(message)
        self.errno, self.strerror, self.filename = error, message, filename

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self) -> tuple:
        return type(self), (self.args[0], self.errno, self.filename)


def write_error(exc: OSError, path: str | Path) -> CheckpointWriteError:
    """The CheckpointWriteError for ``exc``, raised while writing ``path``."""
    if isinstance(exc, CheckpointWriteError):
        return exc
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        message = (f"no space left on device while writing {path}: free space or choose another checkpoint "
                   "root")
    else:
        message = (f"writing checkpoint file {path} failed: {exc.strerror or exc}: check that disk and its "
                   "permissions, or choose another checkpoint root")
    return CheckpointWriteError(message, exc.errno, str(path))


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Turn an OSError raised inside into a CheckpointWriteError naming ``path``."""
    try:
        yield
    except OSError as exc:
        raise write_error(exc, path) from exc

