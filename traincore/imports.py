"""Import a callable a setting names as ``"<module>:<callable>"`` (a model factory, a dataset factory), and
run the user's code so that a ``sys.exit()`` inside it is an error naming it, not a quiet end of the run."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

WHERE_CODE_GOES = ("put it on PYTHONPATH (a package inside the project tree travels with fast registration "
                   "once .dockerignore lets it in) or install it in the image (docs/own-model.md)")
SCRIPT_GUARD = ("a module's script part belongs under `if __name__ == \"__main__\":`, and a factory returns "
                "its result or raises, it never exits")


@contextmanager
def no_exit(what: str, error: type[Exception]) -> Iterator[None]:
    """Run the user's code (``what`` names it) turning a SystemExit into ``error``: uncaught, a
    ``sys.exit(0)`` in a module's script part (a missing ``if __name__ == "__main__":``) ends the whole
    run with exit code 0, no message and nothing written. KeyboardInterrupt passes."""
    try:
        yield
    except SystemExit as exc:
        raise error(f"{what} called sys.exit({exc.code!r}): {SCRIPT_GUARD}") from exc


def import_module(module_name: str, setting: str, error: type[Exception]) -> ModuleType:
    """The user's module ``module_name``; ``error`` names ``setting`` and the fix when importing it raises
    or exits."""
    try:
        with no_exit(f"{setting}: importing module {module_name}", error):
            return importlib.import_module(module_name)
    except error:
        raise
    except Exception as exc:  # an import runs the module's code, which may raise anything
        raise error(f"{setting}: module {module_name} cannot be imported ({type(exc).__name__}: {exc}): "
                    f"{WHERE_CODE_GOES}") from exc


def import_callable(path: str, setting: str, error: type[Exception]) -> Callable[..., Any]:
    """The callable ``path`` (``"<module>:<callable>"``; the part after the colon may be dotted,
    ``pkg.zoo:Models.small``) names; ``error`` names ``setting`` (``"model.name='pkg:build'"``) and the fix
    when the module does not import, lacks the name, or the name is not callable.

    Calling it runs under :func:`no_exit`: a ``sys.exit()`` inside raises ``error`` naming ``path``. Its
    signature is the callable's own (``inspect.signature`` sees through the guard)."""
    module_name, _, attribute = path.partition(":")
    found: Any = import_module(module_name, setting, error)
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise error(f"{setting}: module {module_name} has no {attribute}: name a callable defined in "
                        f"{getattr(found, '__file__', module_name)}")
        found = getattr(found, part)
    if not callable(found):
        raise error(f"{setting}: {attribute} is a {type(found).__name__}, not a callable: name a function or "
                    "a class")
    target = found

    @functools.wraps(target, updated=())  # a class's __dict__ is not the guard's
    def guarded(*args: Any, **kwargs: Any) -> Any:
        with no_exit(f"{setting}: {path}()", error):
            return target(*args, **kwargs)

    return guarded
