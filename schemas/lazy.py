"""Names a package hands on from its modules, each module imported when one of its names is first
used (PEP 562): a process that never names them never pays for them (``ckptd verify`` skips the
HTTP bodies, a catalog-only tool skips torch). One helper for every package of the project.

Call order: a package's ``__init__`` lists ``{name: ".module"}`` and sets
``__getattr__ = lazy_exports(__name__, that_dict, globals())``; the first use of a name imports
its module and stores the value in the package, so later uses do not come back here.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, where: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``where`` maps each lazy name to its module, relative to the
    package (``".api"``); ``namespace`` is the package's ``globals()``."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module, package), name)
        namespace[name] = value
        return value

    return __getattr__
