"""Import a callable a setting names as ``"<module>:<callable>"`` (a model factory, a dataset factory)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

WHERE_CODE_GOES = ("put it on PYTHONPATH (a package inside the project tree travels with fast registration "
                   "once .dockerignore lets it in) or install it in the image (docs/own-model.md)")


def import_callable(path: str, setting: str, error: type[Exception]) -> Callable[..., Any]:
    """The callable ``path`` (``"<module>:<callable>"``; the part after the colon may be dotted,
    ``pkg.zoo:Models.small``) names; ``error`` names ``setting`` (``"model.name='pkg:build'"``) and the fix
    when the module does not import, lacks the name, or the name is not callable."""
    module_name, _, attribute = path.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import runs the module's code, which may raise anything
        raise error(f"{setting}: module {module_name} cannot be imported ({type(exc).__name__}: {exc}): "
                    f"{WHERE_CODE_GOES}") from exc
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise error(f"{setting}: module {module_name} has no {attribute}: name a callable defined in "
                        f"{getattr(found, '__file__', module_name)}")
        found = getattr(found, part)
    if not callable(found):
        raise error(f"{setting}: {attribute} is a {type(found).__name__}, not a callable: name a function or "
                    "a class")
    return found
